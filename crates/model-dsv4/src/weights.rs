//! Every tensor of a deepseek_v4 CMF, bound by canonical name (docs/convert.md) with the shape
//! the config implies, before anything runs.
//!
//! Matrices stay in their stored dtype as [`MatRef`]s (every profile, FP4 experts included, goes
//! through quant-codecs' CPU kernels); small vectors (norm weights, mHC base/scale, sinks,
//! compressor position biases, router biases) are decoded to f32 once, and `tid2eid` to expert
//! ids. The grouped output projection `o_a_proj` is cut into one row block per group (a copy of
//! its stored bytes, still encoded). A missing tensor or a wrong shape is a [`WeightError`]
//! naming the tensor.

use cmf_format::Cmf;
use quant_codecs::{CodecError, DType, MatRef};

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
    /// A tensor the config requires is absent.
    #[error("missing tensor `{0}`")]
    Missing(String),
    /// A tensor has the wrong shape.
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    Shape {
        /// Tensor name.
        name: String,
        /// Shape the config implies.
        expected: Vec<usize>,
        /// Stored shape.
        found: Vec<usize>,
    },
    /// The payload does not decode.
    #[error("tensor `{name}`: {source}")]
    Codec {
        /// Tensor name.
        name: String,
        /// Codec error.
        source: CodecError,
    },
    /// An integer tensor holds a value that is not a valid index.
    #[error("tensor `{name}`: {detail}")]
    Integer {
        /// Tensor name.
        name: String,
        /// What is wrong.
        detail: String,
    },
}

/// Binds tensors from one CMF.
struct Binder<'a> {
    cmf: &'a Cmf,
}

impl<'a> Binder<'a> {
    fn view(&self, name: &str, shape: &[usize]) -> Result<cmf_format::TensorView<'a>, WeightError> {
        let v = self
            .cmf
            .tensor(name)
            .ok_or_else(|| WeightError::Missing(name.to_string()))?;
        if v.shape() != shape {
            return Err(WeightError::Shape {
                name: name.to_string(),
                expected: shape.to_vec(),
                found: v.shape().to_vec(),
            });
        }
        Ok(v)
    }

    fn mat(&self, name: &str, rows: usize, cols: usize) -> Result<MatRef<'a>, WeightError> {
        let v = self.view(name, &[rows, cols])?;
        MatRef::new(v.dtype(), rows, cols, v.bytes).map_err(|source| WeightError::Codec {
            name: name.to_string(),
            source,
        })
    }

    fn vec(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, WeightError> {
        let v = self.view(name, shape)?;
        quant_codecs::dequantize(v.dtype(), shape, v.bytes).map_err(|source| WeightError::Codec {
            name: name.to_string(),
            source,
        })
    }

    /// A `[groups * rows, cols]` matrix cut into `groups` row blocks.
    fn grouped(
        &self,
        name: &str,
        groups: usize,
        rows: usize,
        cols: usize,
    ) -> Result<GroupedMat, WeightError> {
        let v = self.view(name, &[groups * rows, cols])?;
        let codec = |source| WeightError::Codec {
            name: name.to_string(),
            source,
        };
        let parts = (0..groups)
            .map(|g| {
                quant_codecs::slice_rows(
                    v.dtype(),
                    groups * rows,
                    cols,
                    v.bytes,
                    g * rows,
                    (g + 1) * rows,
                )
                .map_err(codec)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let m = GroupedMat {
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

    /// An integer tensor: stored as exact f32, or in the header's `integer_tensors`.
    fn integers(&self, name: &str, shape: &[usize]) -> Result<Vec<i64>, WeightError> {
        if self.cmf.tensor(name).is_some() {
            let f = self.vec(name, shape)?;
            return f
                .into_iter()
                .map(|x| {
                    if x.fract() == 0.0 && x.is_finite() {
                        Ok(x as i64)
                    } else {
                        Err(WeightError::Integer {
                            name: name.to_string(),
                            detail: format!("holds the non-integer value {x}"),
                        })
                    }
                })
                .collect();
        }
        let t = self
            .cmf
            .header()
            .extra
            .get("integer_tensors")
            .and_then(|t| t.get(name))
            .ok_or_else(|| WeightError::Missing(name.to_string()))?;
        let found: Vec<usize> = t
            .get("shape")
            .and_then(|s| s.as_array())
            .map(|s| {
                s.iter()
                    .filter_map(|x| x.as_u64())
                    .map(|x| x as usize)
                    .collect()
            })
            .unwrap_or_default();
        if found != shape {
            return Err(WeightError::Shape {
                name: name.to_string(),
                expected: shape.to_vec(),
                found,
            });
        }
        let data = t
            .get("data")
            .and_then(|d| d.as_array())
            .and_then(|d| d.iter().map(|v| v.as_i64()).collect::<Option<Vec<_>>>())
            .ok_or_else(|| WeightError::Integer {
                name: name.to_string(),
                detail: "the header entry has no integer `data`".into(),
            })?;
        // The header's `shape` and `data` are independent JSON fields: a short (or long) array
        // under a correct shape would otherwise bind and be indexed out of bounds later.
        let want = shape.iter().try_fold(1usize, |a, &b| a.checked_mul(b));
        if want != Some(data.len()) {
            return Err(WeightError::Integer {
                name: name.to_string(),
                detail: format!(
                    "the header entry declares shape {shape:?} but `data` holds {} values",
                    data.len()
                ),
            });
        }
        Ok(data)
    }
}

/// A `[groups * rows, cols]` matrix kept as one encoded row block per group.
pub struct GroupedMat {
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
}

/// One mHC site (`DeepseekV4HyperConnection`: `attn_hc` / `ffn_hc`).
pub struct HcWeights<'a> {
    /// `fn` `[(2+N)*N, N*D]`.
    pub fn_: MatRef<'a>,
    /// `base` `[(2+N)*N]`.
    pub base: Vec<f32>,
    /// `scale` `[3]` (pre, post, comb).
    pub scale: Vec<f32>,
}

/// The final stream collapse (`DeepseekV4HyperHead`, `model.hc_head`).
pub struct HeadHcWeights<'a> {
    /// `hc_fn` `[N, N*D]`.
    pub fn_: MatRef<'a>,
    /// `hc_base` `[N]`.
    pub base: Vec<f32>,
    /// `hc_scale` `[1]`.
    pub scale: f32,
}

/// A compressor (the CSA/HCA one, or the indexer's own).
pub struct CompressorWeights<'a> {
    /// `kv_proj` `[W, D]` (W = head dim for HCA, 2x for the overlapping CSA series).
    pub kv: MatRef<'a>,
    /// `gate_proj` `[W, D]`.
    pub gate: MatRef<'a>,
    /// `position_bias` `[rate, W]`.
    pub position_bias: Vec<f32>,
    /// `kv_norm.weight` `[head dim]`.
    pub norm: Vec<f32>,
}

/// The lightning indexer of a CSA layer (`self_attn.compressor.indexer`).
pub struct IndexerWeights<'a> {
    /// Its compressor at `index_head_dim`.
    pub comp: CompressorWeights<'a>,
    /// `q_b_proj` `[nI*dI, q_lora_rank]`.
    pub q_b: MatRef<'a>,
    /// `scorer.weights_proj` `[nI, D]`.
    pub weights_proj: MatRef<'a>,
}

/// Attention (`self_attn.*`).
pub struct AttnWeights<'a> {
    /// `q_a_proj` `[q_lora_rank, D]`.
    pub q_a: MatRef<'a>,
    /// `q_a_norm.weight` `[q_lora_rank]`.
    pub q_a_norm: Vec<f32>,
    /// `q_b_proj` `[H*Dh, q_lora_rank]`.
    pub q_b: MatRef<'a>,
    /// `kv_proj` `[Dh, D]`.
    pub kv: MatRef<'a>,
    /// `kv_norm.weight` `[Dh]`.
    pub kv_norm: Vec<f32>,
    /// `o_a_proj` `[G*R, H*Dh/G]`, one `[R, H*Dh/G]` block per group.
    pub o_a: GroupedMat,
    /// `o_b_proj` `[D, G*R]`.
    pub o_b: MatRef<'a>,
    /// `sinks` `[H]`.
    pub sinks: Vec<f32>,
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
    Scored(Vec<f32>),
}

/// Sparse MoE block (`mlp.*`).
pub struct MoeWeights<'a> {
    /// Router `gate.weight` `[E, D]`.
    pub gate: MatRef<'a>,
    /// Hash table or selection bias.
    pub routing: Routing,
    /// Per expert: `gate_up_proj` `[2I, D]` (gate rows then up rows) and `down_proj` `[D, I]`.
    pub experts: Vec<(MatRef<'a>, MatRef<'a>)>,
    /// `shared_experts.gate_proj` `[I, D]`.
    pub sh_gate: MatRef<'a>,
    /// `shared_experts.up_proj` `[I, D]`.
    pub sh_up: MatRef<'a>,
    /// `shared_experts.down_proj` `[D, I]`.
    pub sh_down: MatRef<'a>,
}

/// One decoder layer.
pub struct LayerWeights<'a> {
    /// mHC before attention.
    pub attn_hc: HcWeights<'a>,
    /// `input_layernorm.weight` `[D]`.
    pub input_layernorm: Vec<f32>,
    /// Attention.
    pub attn: AttnWeights<'a>,
    /// mHC before the MoE.
    pub ffn_hc: HcWeights<'a>,
    /// `post_attention_layernorm.weight` `[D]`.
    pub post_attention_layernorm: Vec<f32>,
    /// MoE.
    pub moe: MoeWeights<'a>,
}

/// All weights of the model.
pub struct Weights<'a> {
    /// `model.embed_tokens.weight` `[V, D]`.
    pub embed_tokens: MatRef<'a>,
    /// Decoder layers.
    pub layers: Vec<LayerWeights<'a>>,
    /// `model.hc_head.*`.
    pub hc_head: HeadHcWeights<'a>,
    /// `model.norm.weight` `[D]`.
    pub norm: Vec<f32>,
    /// `lm_head.weight` `[V, D]`.
    pub lm_head: MatRef<'a>,
}

fn hc<'a>(b: &Binder<'a>, p: &str, c: &DeepseekV4Config) -> Result<HcWeights<'a>, WeightError> {
    let n = c.hc_mult;
    let m = (2 + n) * n;
    Ok(HcWeights {
        fn_: b.mat(&format!("{p}.fn"), m, n * c.hidden_size)?,
        base: b.vec(&format!("{p}.base"), &[m])?,
        scale: b.vec(&format!("{p}.scale"), &[3])?,
    })
}

fn compressor<'a>(
    b: &Binder<'a>,
    p: &str,
    c: &DeepseekV4Config,
    width: usize,
    head: usize,
    rate: usize,
) -> Result<CompressorWeights<'a>, WeightError> {
    Ok(CompressorWeights {
        kv: b.mat(&format!("{p}.kv_proj.weight"), width, c.hidden_size)?,
        gate: b.mat(&format!("{p}.gate_proj.weight"), width, c.hidden_size)?,
        position_bias: b.vec(&format!("{p}.position_bias"), &[rate, width])?,
        norm: b.vec(&format!("{p}.kv_norm.weight"), &[head])?,
    })
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
        c.validate()?;
        let b = Binder { cmf };
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
                    let comp = compressor(&b, &format!("{a}.compressor"), c, dh, dh, rate)?;
                    (Some(comp), None)
                }
                AttnKind::Csa => {
                    let rate = c.rate(kind).expect("validated");
                    let comp = compressor(&b, &format!("{a}.compressor"), c, 2 * dh, dh, rate)?;
                    let (ni, di) = (c.index_n_heads, c.index_head_dim);
                    let x = format!("{a}.compressor.indexer");
                    let idx = IndexerWeights {
                        comp: compressor(&b, &x, c, 2 * di, di, rate)?,
                        q_b: b.mat(&format!("{x}.q_b_proj.weight"), ni * di, qr)?,
                        weights_proj: b.mat(&format!("{x}.scorer.weights_proj.weight"), ni, d)?,
                    };
                    (Some(comp), Some(idx))
                }
            };
            let attn = AttnWeights {
                q_a: b.mat(&format!("{a}.q_a_proj.weight"), qr, d)?,
                q_a_norm: b.vec(&format!("{a}.q_a_norm.weight"), &[qr])?,
                q_b: b.mat(&format!("{a}.q_b_proj.weight"), h * dh, qr)?,
                kv: b.mat(&format!("{a}.kv_proj.weight"), dh, d)?,
                kv_norm: b.vec(&format!("{a}.kv_norm.weight"), &[dh])?,
                o_a: b.grouped(&format!("{a}.o_a_proj.weight"), g, r, h * dh / g)?,
                o_b: b.mat(&format!("{a}.o_b_proj.weight"), d, g * r)?,
                sinks: b.vec(&format!("{a}.sinks"), &[h])?,
                compressor,
                indexer,
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
                            .ok_or_else(|| WeightError::Integer {
                                name: name.clone(),
                                detail: format!("expert id {x} is outside [0, {e})"),
                            })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Routing::Hash(ids)
            } else {
                Routing::Scored(b.vec(&format!("{m}.gate.e_score_correction_bias"), &[e])?)
            };
            let mut experts = Vec::with_capacity(e);
            for x in 0..e {
                experts.push((
                    b.mat(&format!("{m}.experts.{x}.gate_up_proj.weight"), 2 * i, d)?,
                    b.mat(&format!("{m}.experts.{x}.down_proj.weight"), d, i)?,
                ));
            }
            let moe = MoeWeights {
                gate: b.mat(&format!("{m}.gate.weight"), e, d)?,
                routing,
                experts,
                sh_gate: b.mat(&format!("{m}.shared_experts.gate_proj.weight"), i, d)?,
                sh_up: b.mat(&format!("{m}.shared_experts.up_proj.weight"), i, d)?,
                sh_down: b.mat(&format!("{m}.shared_experts.down_proj.weight"), d, i)?,
            };
            layers.push(LayerWeights {
                attn_hc: hc(&b, &format!("{p}.attn_hc"), c)?,
                input_layernorm: b.vec(&format!("{p}.input_layernorm.weight"), &[d])?,
                attn,
                ffn_hc: hc(&b, &format!("{p}.ffn_hc"), c)?,
                post_attention_layernorm: b
                    .vec(&format!("{p}.post_attention_layernorm.weight"), &[d])?,
                moe,
            });
        }
        let scale = b.vec("model.hc_head.hc_scale", &[1])?;
        Ok(Weights {
            embed_tokens: b.mat("model.embed_tokens.weight", c.vocab_size, d)?,
            layers,
            hc_head: HeadHcWeights {
                fn_: b.mat("model.hc_head.hc_fn", n, n * d)?,
                base: b.vec("model.hc_head.hc_base", &[n])?,
                scale: scale[0],
            },
            norm: b.vec("model.norm.weight", &[d])?,
            lm_head: b.mat("lm_head.weight", c.vocab_size, d)?,
        })
    }
}
