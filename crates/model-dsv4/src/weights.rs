//! Every tensor of a deepseek_v4 CMF, bound by canonical name (docs/convert.md) with the shape
//! the config implies, before anything runs.
//!
//! Binding goes through model-core's [`Binder`]: matrices stay in their stored dtype as named
//! [`Mat`]s (every profile, FP4 experts included, goes through quant-codecs' CPU kernels); the
//! routed experts of each layer are a model-core [`RoutedExperts`]; small vectors (norm weights, mHC base/scale, sinks,
//! compressor position biases, router biases) are decoded to f32 once, and `tid2eid` to expert
//! ids. The grouped output projection `o_a_proj` is cut into one row block per group (a copy of
//! its stored bytes, still encoded). A missing tensor or a wrong shape is a [`WeightError`]
//! naming the tensor.

use cmf_format::Cmf;
use model_core::{Activation, BindError, Binder, Expert, Mat, RoutedExperts, Vector};
use quant_codecs::{DType, MatRef};

use crate::config::{AttnKind, ConfigError, DeepseekV4Config};

/// Why the weights cannot be bound.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    /// The CMF is not a deepseek_v4 model.
    #[error("not a deepseek_v4 model: the CMF architecture is `{0}`")]
    Architecture(String),
    /// The header's config is unusable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A tensor is missing, has the wrong shape, or does not decode.
    #[error(transparent)]
    Bind(#[from] BindError),
}

/// Where bound tensors come from: a CMF ([`Binder`]) or weights made in memory (the
/// benchmarks' synthetic release geometry, [`crate::synthetic`]). A missing tensor or a wrong
/// shape is a [`BindError`] naming the tensor, whatever the source.
pub trait Source<'a> {
    /// The matrix `name`, `[rows, cols]`, in its stored dtype.
    fn mat(&self, name: &str, rows: usize, cols: usize) -> Result<Mat<'a>, BindError>;
    /// The vector `name` of `shape`, decoded to f32.
    fn vector(&self, name: &str, shape: &[usize]) -> Result<Vector, BindError>;
    /// The integer tensor `name` of `shape` (`tid2eid`).
    fn integers(&self, name: &str, shape: &[usize]) -> Result<Vec<i64>, BindError>;
}

impl<'a> Source<'a> for Binder<'a> {
    fn mat(&self, name: &str, rows: usize, cols: usize) -> Result<Mat<'a>, BindError> {
        Binder::mat(self, name, rows, cols)
    }

    fn vector(&self, name: &str, shape: &[usize]) -> Result<Vector, BindError> {
        Binder::vector(self, name, shape)
    }

    fn integers(&self, name: &str, shape: &[usize]) -> Result<Vec<i64>, BindError> {
        Binder::integers(self, name, shape)
    }
}

/// A `[groups * rows, cols]` matrix cut into `groups` row blocks (`o_a_proj`).
pub(crate) fn grouped<'a>(
    b: &(impl Source<'a> + ?Sized),
    name: &str,
    groups: usize,
    rows: usize,
    cols: usize,
) -> Result<GroupedMat, BindError> {
    let whole = b.mat(name, groups * rows, cols)?;
    let (id, v) = (whole.id(), whole.mat());
    let codec = |source| BindError::Codec {
        name: name.to_string(),
        source,
    };
    let parts = (0..groups)
        .map(|g| {
            quant_codecs::slice_rows(
                v.dtype(),
                groups * rows,
                cols,
                v.bytes(),
                g * rows,
                (g + 1) * rows,
            )
            .map_err(codec)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let m = GroupedMat {
        name: name.to_string(),
        id,
        dtype: v.dtype(),
        rows,
        cols,
        parts,
    };
    for p in &m.parts {
        MatRef::new(m.dtype, rows, cols, p).map_err(codec)?;
    }
    Ok(m)
}

/// A `[groups * rows, cols]` matrix kept as one encoded row block per group.
pub struct GroupedMat {
    name: String,
    id: usize,
    dtype: DType,
    rows: usize,
    cols: usize,
    parts: Vec<Vec<u8>>,
}

impl GroupedMat {
    /// Group `g`'s `[rows, cols]` block.
    pub fn group(&self, g: usize) -> MatRef<'_> {
        MatRef::new(self.dtype, self.rows, self.cols, &self.parts[g]).expect("checked at bind time")
    }

    /// Number of groups.
    pub fn groups(&self) -> usize {
        self.parts.len()
    }

    /// The canonical tensor name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tensor's index in the CMF tensor table.
    pub fn id(&self) -> usize {
        self.id
    }
}

/// One mHC site (`DeepseekV4HyperConnection`: `attn_hc` / `ffn_hc`).
pub struct HcWeights<'a> {
    /// `fn` `[(2+N)*N, N*D]`.
    pub fn_: Mat<'a>,
    /// `base` `[(2+N)*N]`.
    pub base: Vector,
    /// `scale` `[3]` (pre, post, comb).
    pub scale: Vector,
}

/// The final stream collapse (`DeepseekV4HyperHead`, `model.hc_head`).
pub struct HeadHcWeights<'a> {
    /// `hc_fn` `[N, N*D]`.
    pub fn_: Mat<'a>,
    /// `hc_base` `[N]`.
    pub base: Vector,
    /// `hc_scale` `[1]`.
    pub scale: f32,
}

/// A compressor (the CSA/HCA one, or the indexer's own).
pub struct CompressorWeights<'a> {
    /// `kv_proj` `[W, D]` (W = head dim for HCA, 2x for the overlapping CSA series).
    pub kv: Mat<'a>,
    /// `gate_proj` `[W, D]`.
    pub gate: Mat<'a>,
    /// `position_bias` `[rate, W]`.
    pub position_bias: Vector,
    /// `kv_norm.weight` `[head dim]`.
    pub norm: Vector,
}

/// The lightning indexer of a CSA layer (`self_attn.compressor.indexer`).
pub struct IndexerWeights<'a> {
    /// Its compressor at `index_head_dim`.
    pub comp: CompressorWeights<'a>,
    /// `q_b_proj` `[nI*dI, q_lora_rank]`.
    pub q_b: Mat<'a>,
    /// `scorer.weights_proj` `[nI, D]`.
    pub weights_proj: Mat<'a>,
}

/// Attention (`self_attn.*`).
pub struct AttnWeights<'a> {
    /// `q_a_proj` `[q_lora_rank, D]`.
    pub q_a: Mat<'a>,
    /// `q_a_norm.weight` `[q_lora_rank]`.
    pub q_a_norm: Vector,
    /// `q_b_proj` `[H*Dh, q_lora_rank]`.
    pub q_b: Mat<'a>,
    /// `kv_proj` `[Dh, D]`.
    pub kv: Mat<'a>,
    /// `kv_norm.weight` `[Dh]`.
    pub kv_norm: Vector,
    /// `o_a_proj` `[G*R, H*Dh/G]`, one `[R, H*Dh/G]` block per group.
    pub o_a: GroupedMat,
    /// `o_b_proj` `[D, G*R]`.
    pub o_b: Mat<'a>,
    /// `sinks` `[H]`.
    pub sinks: Vector,
    /// CSA/HCA compressor.
    pub compressor: Option<CompressorWeights<'a>>,
    /// CSA lightning indexer.
    pub indexer: Option<IndexerWeights<'a>>,
}

/// How a MoE layer picks its experts.
pub enum Routing {
    /// `hash_moe`: `tid2eid` `[V, k]` (validated expert ids).
    Hash(Vec<u32>),
    /// `moe`: top-k of `score + e_score_correction_bias` `[E]`.
    Scored(Vector),
}

/// Sparse MoE block (`mlp.*`).
pub struct MoeWeights<'a> {
    /// Router `gate.weight` `[E, D]`.
    pub gate: Mat<'a>,
    /// Hash table or selection bias.
    pub routing: Routing,
    /// The routed experts (`experts.{x}.gate_up_proj` `[2I, D]`, gate rows then up rows, and
    /// `experts.{x}.down_proj` `[D, I]`; SwiGLU clamped at `swiglu_limit`), run by model-core's
    /// executor.
    pub routed: RoutedExperts<'a>,
    /// `shared_experts.gate_proj` `[I, D]`.
    pub sh_gate: Mat<'a>,
    /// `shared_experts.up_proj` `[I, D]`.
    pub sh_up: Mat<'a>,
    /// `shared_experts.down_proj` `[D, I]`.
    pub sh_down: Mat<'a>,
}

/// One decoder layer.
pub struct LayerWeights<'a> {
    /// mHC before attention.
    pub attn_hc: HcWeights<'a>,
    /// `input_layernorm.weight` `[D]`.
    pub input_layernorm: Vector,
    /// Attention.
    pub attn: AttnWeights<'a>,
    /// mHC before the MoE.
    pub ffn_hc: HcWeights<'a>,
    /// `post_attention_layernorm.weight` `[D]`.
    pub post_attention_layernorm: Vector,
    /// MoE.
    pub moe: MoeWeights<'a>,
}

/// All weights of the model.
pub struct Weights<'a> {
    /// `model.embed_tokens.weight` `[V, D]`.
    pub embed_tokens: Mat<'a>,
    /// Decoder layers.
    pub layers: Vec<LayerWeights<'a>>,
    /// `model.hc_head.*`.
    pub hc_head: HeadHcWeights<'a>,
    /// `model.norm.weight` `[D]`.
    pub norm: Vector,
    /// `lm_head.weight` `[V, D]`.
    pub lm_head: Mat<'a>,
}

fn hc<'a>(
    b: &(impl Source<'a> + ?Sized),
    p: &str,
    c: &DeepseekV4Config,
) -> Result<HcWeights<'a>, BindError> {
    hc_site(b, p, c.hc_mult, c.hidden_size)
}

/// An mHC site `p` (`{p}.fn`, `{p}.base`, `{p}.scale`) of `n` streams of width `d`.
pub(crate) fn hc_site<'a>(
    b: &(impl Source<'a> + ?Sized),
    p: &str,
    n: usize,
    d: usize,
) -> Result<HcWeights<'a>, BindError> {
    let m = (2 + n) * n;
    Ok(HcWeights {
        fn_: b.mat(&format!("{p}.fn"), m, n * d)?,
        base: b.vector(&format!("{p}.base"), &[m])?,
        scale: b.vector(&format!("{p}.scale"), &[3])?,
    })
}

fn compressor<'a>(
    b: &(impl Source<'a> + ?Sized),
    p: &str,
    c: &DeepseekV4Config,
    width: usize,
    head: usize,
    rate: usize,
) -> Result<CompressorWeights<'a>, WeightError> {
    Ok(CompressorWeights {
        kv: b.mat(&format!("{p}.kv_proj.weight"), width, c.hidden_size)?,
        gate: b.mat(&format!("{p}.gate_proj.weight"), width, c.hidden_size)?,
        position_bias: b.vector(&format!("{p}.position_bias"), &[rate, width])?,
        norm: b.vector(&format!("{p}.kv_norm.weight"), &[head])?,
    })
}

/// The geometry of an attention's projections.
pub(crate) struct AttnDims {
    pub hidden: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
}

/// The projections, norms and sinks of the attention `a` (`{a}.q_a_proj`, ...), with no
/// compressor or indexer (V4 and V4.1 name and shape them alike).
pub(crate) fn attn_projections<'a>(
    b: &(impl Source<'a> + ?Sized),
    a: &str,
    x: &AttnDims,
) -> Result<AttnWeights<'a>, BindError> {
    let (d, h, dh, qr) = (x.hidden, x.heads, x.head_dim, x.q_lora_rank);
    let (g, r) = (x.o_groups, x.o_lora_rank);
    Ok(AttnWeights {
        q_a: b.mat(&format!("{a}.q_a_proj.weight"), qr, d)?,
        q_a_norm: b.vector(&format!("{a}.q_a_norm.weight"), &[qr])?,
        q_b: b.mat(&format!("{a}.q_b_proj.weight"), h * dh, qr)?,
        kv: b.mat(&format!("{a}.kv_proj.weight"), dh, d)?,
        kv_norm: b.vector(&format!("{a}.kv_norm.weight"), &[dh])?,
        o_a: grouped(b, &format!("{a}.o_a_proj.weight"), g, r, h * dh / g)?,
        o_b: b.mat(&format!("{a}.o_b_proj.weight"), d, g * r)?,
        sinks: b.vector(&format!("{a}.sinks"), &[h])?,
        compressor: None,
        indexer: None,
    })
}

/// The MoE block `m` (`{m}.gate.weight`, `{m}.experts.{x}.*`, `{m}.shared_experts.*`) of `e`
/// experts of width `i` over hidden `d`, routed by `routing`, SwiGLU clamped at `limit`.
pub(crate) fn moe_block<'a>(
    b: &(impl Source<'a> + ?Sized),
    m: &str,
    routing: Routing,
    d: usize,
    e: usize,
    i: usize,
    limit: f32,
) -> Result<MoeWeights<'a>, BindError> {
    let mut experts = Vec::with_capacity(e);
    for x in 0..e {
        experts.push(Expert {
            gate_up: b.mat(&format!("{m}.experts.{x}.gate_up_proj.weight"), 2 * i, d)?,
            down: b.mat(&format!("{m}.experts.{x}.down_proj.weight"), d, i)?,
        });
    }
    Ok(MoeWeights {
        gate: b.mat(&format!("{m}.gate.weight"), e, d)?,
        routing,
        routed: RoutedExperts {
            experts,
            hidden: d,
            intermediate: i,
            activation: Activation::SwiGlu { limit: Some(limit) },
        },
        sh_gate: b.mat(&format!("{m}.shared_experts.gate_proj.weight"), i, d)?,
        sh_up: b.mat(&format!("{m}.shared_experts.up_proj.weight"), i, d)?,
        sh_down: b.mat(&format!("{m}.shared_experts.down_proj.weight"), d, i)?,
    })
}

impl Weights<'_> {
    /// Weight bytes one decoded token reads: every matrix of the layers (attention, its
    /// compressor and indexer, the mHC maps, the router, the shared expert), the head's mHC
    /// and the lm_head, and of the routed experts the `top_k` chosen per layer (an average
    /// expert's share); the embedding contributes one row, counted as nothing.
    pub fn bytes_per_token(&self, top_k: usize) -> u64 {
        let b = |m: &Mat<'_>| m.bytes().len() as u64;
        let comp = |c: &CompressorWeights<'_>| b(&c.kv) + b(&c.gate);
        let mut total = b(&self.hc_head.fn_) + b(&self.lm_head);
        for l in &self.layers {
            let a = &l.attn;
            let o_a: u64 = (0..a.o_a.groups())
                .map(|g| a.o_a.group(g).bytes().len() as u64)
                .sum();
            total += b(&l.attn_hc.fn_) + b(&l.ffn_hc.fn_);
            total += b(&a.q_a) + b(&a.q_b) + b(&a.kv) + o_a + b(&a.o_b);
            total += a.compressor.as_ref().map_or(0, comp);
            total += a
                .indexer
                .as_ref()
                .map_or(0, |i| comp(&i.comp) + b(&i.q_b) + b(&i.weights_proj));
            let m = &l.moe;
            total += b(&m.gate) + b(&m.sh_gate) + b(&m.sh_up) + b(&m.sh_down);
            let ex = &m.routed.experts;
            let all: u64 = ex.iter().map(|e| b(&e.gate_up) + b(&e.down)).sum();
            total += all * top_k.min(ex.len()) as u64 / ex.len().max(1) as u64;
        }
        total
    }
}

impl<'a> Weights<'a> {
    /// Reads the config from the header and binds every tensor.
    pub fn bind(cmf: &'a Cmf) -> Result<(DeepseekV4Config, Weights<'a>), WeightError> {
        let h = cmf.header();
        if h.architecture != "deepseek_v4" {
            return Err(WeightError::Architecture(h.architecture.clone()));
        }
        let c = DeepseekV4Config::from_json(&h.config)?;
        let w = Self::bind_with(cmf, &c)?;
        Ok((c, w))
    }

    /// Validates `c` and binds every tensor it requires.
    pub fn bind_with(cmf: &'a Cmf, c: &DeepseekV4Config) -> Result<Weights<'a>, WeightError> {
        Self::bind_from(&Binder::new(cmf), c)
    }

    /// Validates `c` and binds every tensor it requires from `b`.
    pub fn bind_from(
        b: &(impl Source<'a> + ?Sized),
        c: &DeepseekV4Config,
    ) -> Result<Weights<'a>, WeightError> {
        c.validate()?;
        let (d, n) = (c.hidden_size, c.hc_mult);
        let (h, dh, qr) = (c.num_attention_heads, c.head_dim, c.q_lora_rank);
        let (g, r) = (c.o_groups, c.o_lora_rank);
        let (e, i, k) = (
            c.n_routed_experts,
            c.moe_intermediate_size,
            c.num_experts_per_tok,
        );
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for il in 0..c.num_hidden_layers {
            let p = format!("model.layers.{il}");
            let a = format!("{p}.self_attn");
            let kind = c.attn_kind(il);
            let (compressor, indexer) = match kind {
                AttnKind::Sliding => (None, None),
                AttnKind::Hca => {
                    let rate = c.rate(kind).expect("validated");
                    let comp = compressor(b, &format!("{a}.compressor"), c, dh, dh, rate)?;
                    (Some(comp), None)
                }
                AttnKind::Csa => {
                    let rate = c.rate(kind).expect("validated");
                    let comp = compressor(b, &format!("{a}.compressor"), c, 2 * dh, dh, rate)?;
                    let (ni, di) = (c.index_n_heads, c.index_head_dim);
                    let x = format!("{a}.compressor.indexer");
                    let idx = IndexerWeights {
                        comp: compressor(b, &x, c, 2 * di, di, rate)?,
                        q_b: b.mat(&format!("{x}.q_b_proj.weight"), ni * di, qr)?,
                        weights_proj: b.mat(&format!("{x}.scorer.weights_proj.weight"), ni, d)?,
                    };
                    (Some(comp), Some(idx))
                }
            };
            let dims = AttnDims {
                hidden: d,
                heads: h,
                head_dim: dh,
                q_lora_rank: qr,
                o_groups: g,
                o_lora_rank: r,
            };
            let attn = AttnWeights {
                compressor,
                indexer,
                ..attn_projections(b, &a, &dims)?
            };
            let m = format!("{p}.mlp");
            let routing = if c.is_hash_layer(il) {
                let name = format!("{m}.gate.tid2eid");
                let ids = b.integers(&name, &[c.vocab_size, k])?;
                let ids = ids
                    .into_iter()
                    .map(|x| {
                        u32::try_from(x)
                            .ok()
                            .filter(|&x| (x as usize) < e)
                            .ok_or_else(|| BindError::Integer {
                                name: name.clone(),
                                detail: format!("expert id {x} is outside [0, {e})"),
                            })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Routing::Hash(ids)
            } else {
                Routing::Scored(b.vector(&format!("{m}.gate.e_score_correction_bias"), &[e])?)
            };
            let moe = moe_block(b, &m, routing, d, e, i, c.swiglu_limit as f32)?;
            layers.push(LayerWeights {
                attn_hc: hc(b, &format!("{p}.attn_hc"), c)?,
                input_layernorm: b.vector(&format!("{p}.input_layernorm.weight"), &[d])?,
                attn,
                ffn_hc: hc(b, &format!("{p}.ffn_hc"), c)?,
                post_attention_layernorm: b
                    .vector(&format!("{p}.post_attention_layernorm.weight"), &[d])?,
                moe,
            });
        }
        let scale = b.vector("model.hc_head.hc_scale", &[1])?;
        Ok(Weights {
            embed_tokens: b.mat("model.embed_tokens.weight", c.vocab_size, d)?,
            layers,
            hc_head: HeadHcWeights {
                fn_: b.mat("model.hc_head.hc_fn", n, n * d)?,
                base: b.vector("model.hc_head.hc_base", &[n])?,
                scale: scale[0],
            },
            norm: b.vector("model.norm.weight", &[d])?,
            lm_head: b.mat("lm_head.weight", c.vocab_size, d)?,
        })
    }
}
