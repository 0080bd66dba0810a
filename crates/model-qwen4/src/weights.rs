//! Every tensor of a qwen4_exp CMF, bound by canonical name (docs/convert.md) with the shape the
//! config implies, before anything runs.
//!
//! Binding goes through model-core's [`Binder`]: matrices stay in their stored dtype as named
//! [`Mat`]s (every profile goes through quant-codecs' CPU kernels); small vectors (norm weights,
//! conv kernels, GDN `A_log`/`dt_bias`) are decoded to f32 once into named [`Vector`]s. The
//! routed experts of each layer are a model-core [`RoutedExperts`]. A missing tensor or a wrong
//! shape is a [`WeightError`] naming the tensor.

use cmf_format::Cmf;
use model_core::{Activation, BindError, Binder, Expert, Mat, RoutedExperts, Vector};

use crate::config::{ConfigError, LayerType, Qwen4ExpTextConfig};
use crate::ple::PleHash;

/// Why the weights cannot be bound.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    /// The CMF is not a qwen4_exp model.
    #[error("not a qwen4_exp model: the CMF architecture is `{0}`")]
    Architecture(String),
    /// The header's config is unusable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A tensor is missing, has the wrong shape, or does not decode.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// A stored PLE hash buffer disagrees with the values the config implies.
    #[error(
        "PLE buffer `{name}` holds {found:?}, but the config implies {expected:?} (derived from \
         vocab_size, ngram_vocab_size_base, ngram_size, heads_per_ngram and seed: do they match \
         the checkpoint?)"
    )]
    PleBuffer {
        /// Tensor name.
        name: String,
        /// Derived from the config (the reference's construction).
        expected: Vec<i64>,
        /// Stored.
        found: Vec<i64>,
    },
}

/// One gated hyper-connection site (`Qwen4ExpTextGatedResidual`).
pub struct HcWeights<'a> {
    /// `hc_norm.weight` `[H*D]`, applied as `1 + w`.
    pub norm: Vector,
    /// `input_mix_weight_down` `[R, H*D]`.
    pub down: Mat<'a>,
    /// `input_mix_weight_up` `[H*D, R]`.
    pub up: Mat<'a>,
    /// `block_inject_weight` `[H, H*D]` (absent on the final mixer).
    pub inject: Option<Mat<'a>>,
}

/// Gated DeltaNet (`linear_attn.*`).
pub struct GdnWeights<'a> {
    /// `in_proj_qkv` `[2*Hk*dk + Hv*dv, D]`.
    pub in_qkv: Mat<'a>,
    /// `in_proj_z` `[Hv*dv, D]`.
    pub in_z: Mat<'a>,
    /// `in_proj_b` `[Hv, D]`.
    pub in_b: Mat<'a>,
    /// `in_proj_a` `[Hv, D]`.
    pub in_a: Mat<'a>,
    /// `conv1d.weight` `[C, 1, K]` as `[C*K]`.
    pub conv: Vector,
    /// `dt_bias` `[Hv]`.
    pub dt_bias: Vector,
    /// `A_log` `[Hv]`.
    pub a_log: Vector,
    /// `norm.weight` `[dv]` (a plain multiplier, not 1+w).
    pub norm: Vector,
    /// `out_proj` `[D, Hv*dv]`.
    pub out: Mat<'a>,
}

/// Full attention with the QSA indexer (`self_attn.*`).
pub struct AttnWeights<'a> {
    /// `q_proj` `[Hq*2*hd, D]` (per head: q then gate).
    pub q: Mat<'a>,
    /// `k_proj` `[Hkv*hd, D]`.
    pub k: Mat<'a>,
    /// `v_proj` `[Hkv*hd, D]`.
    pub v: Mat<'a>,
    /// `o_proj` `[D, Hq*hd]`.
    pub o: Mat<'a>,
    /// `q_norm` `[hd]` (1+w).
    pub q_norm: Vector,
    /// `k_norm` `[hd]` (1+w).
    pub k_norm: Vector,
    /// `indexer.index_qk_proj` `[(nI+1)*dI, D]`.
    pub idx_qk: Mat<'a>,
    /// `indexer.q_layernorm` `[dI]` (1+w).
    pub idx_q_norm: Vector,
    /// `indexer.k_layernorm` `[dI]` (1+w).
    pub idx_k_norm: Vector,
}

/// The token mixer of one layer.
pub enum MixerWeights<'a> {
    /// Gated DeltaNet.
    Gdn(GdnWeights<'a>),
    /// Attention + QSA.
    Attn(AttnWeights<'a>),
}

/// Per-layer n-gram embedding (`ple.*`).
pub struct PleWeights<'a> {
    /// The n-gram table shards `[shard_rows, head_dim]` (row `r` lives in shard `r / shard_rows`).
    pub shards: Vec<Mat<'a>>,
    /// Rows per shard.
    pub shard_rows: usize,
    /// Hash constants (derived from the config, checked against the stored buffers).
    pub hash: PleHash,
    /// `key_proj` `[H*D, P]`.
    pub key: Mat<'a>,
    /// `value_proj` `[D, P]`.
    pub value: Mat<'a>,
    /// `norm_key` `[H*D]` (grouped, 1+w).
    pub norm_key: Vector,
    /// `norm_query` `[H*D]`.
    pub norm_query: Vector,
    /// `norm_conv` `[H*D]`.
    pub norm_conv: Vector,
    /// `conv1d.weight` `[H*D, 1, K]` as `[H*D*K]`.
    pub conv: Vector,
}

/// Sparse MoE block (`mlp.*`).
pub struct MoeWeights<'a> {
    /// Router `gate.weight` `[E, D]`.
    pub router: Mat<'a>,
    /// The routed experts (`experts.{x}.gate_up_proj` `[2I, D]`, gate rows then up rows, and
    /// `experts.{x}.down_proj` `[D, I]`), run by model-core's executor.
    pub routed: RoutedExperts<'a>,
    /// `shared_expert.gate_proj` `[Is, D]`.
    pub sh_gate: Mat<'a>,
    /// `shared_expert.up_proj` `[Is, D]`.
    pub sh_up: Mat<'a>,
    /// `shared_expert.down_proj` `[D, Is]`.
    pub sh_down: Mat<'a>,
    /// `shared_expert_gate` `[1, D]` as `[D]`.
    pub sh_scale: Vector,
}

/// One decoder layer.
pub struct LayerWeights<'a> {
    /// PLE, on the layers of `ple_layer_ids`.
    pub ple: Option<PleWeights<'a>>,
    /// HC site before the mixer.
    pub attn_hc: HcWeights<'a>,
    /// GDN or attention.
    pub mixer: MixerWeights<'a>,
    /// HC site before the MoE.
    pub mlp_hc: HcWeights<'a>,
    /// MoE.
    pub moe: MoeWeights<'a>,
}

/// All weights of the text model.
pub struct Weights<'a> {
    /// `model.embed_tokens.weight` `[V, D]`.
    pub embed: Mat<'a>,
    /// Decoder layers.
    pub layers: Vec<LayerWeights<'a>>,
    /// `model.hyper_connection_mixer.*` (no inject).
    pub final_mixer: HcWeights<'a>,
    /// `lm_head.weight` `[V, D]`.
    pub lm_head: Mat<'a>,
    /// The multi-token-prediction head (`mtp.*`), when the file has one.
    pub mtp: Option<Box<MtpWeights<'a>>>,
}

/// The MTP head (`mtp.*`): the next token's embedding and the trunk's final streams, each
/// normalised and projected, summed into the streams of one decoder layer (indexed attention,
/// no PLE) whose own head mixer feeds the shared `lm_head`.
pub struct MtpWeights<'a> {
    /// `mtp.fc_embedding.weight` `[D, D]`.
    pub fc_embedding: Mat<'a>,
    /// `mtp.fc_hidden.weight` `[D, D]`, applied to each stream.
    pub fc_hidden: Mat<'a>,
    /// `mtp.pre_fc_norm_embedding.weight` `[D]` ((1+w) RMSNorm over the embedding).
    pub pre_fc_norm_embedding: Vector,
    /// `mtp.pre_fc_norm_hidden.weight` `[H*D]` ((1+w) RMSNorm over all streams as one vector).
    pub pre_fc_norm_hidden: Vector,
    /// `mtp.layers.0.*`.
    pub layer: LayerWeights<'a>,
    /// `mtp.hyper_connection_mixer.*` (no inject).
    pub final_mixer: HcWeights<'a>,
}

fn hc<'a>(
    b: &dyn Source<'a>,
    p: &str,
    c: &Qwen4ExpTextConfig,
    inject: bool,
) -> Result<HcWeights<'a>, WeightError> {
    let hd = c.hc_count * c.hidden_size;
    Ok(HcWeights {
        norm: b.vector(&format!("{p}.hc_norm.weight"), &[hd])?,
        down: b.mat(
            &format!("{p}.input_mix_weight_down.weight"),
            c.hc_lowrank,
            hd,
        )?,
        up: b.mat(&format!("{p}.input_mix_weight_up.weight"), hd, c.hc_lowrank)?,
        inject: if inject {
            Some(b.mat(&format!("{p}.block_inject_weight.weight"), c.hc_count, hd)?)
        } else {
            None
        },
    })
}

/// Where the weights come from: a CMF file ([`Binder`]), or weights made in memory (the
/// synthetic release-geometry model of `cortiq bench model --synthetic`). The shapes and names
/// are the binding's, in one place.
pub trait Source<'a> {
    /// The matrix `name`, `[rows, cols]`.
    fn mat(&self, name: &str, rows: usize, cols: usize) -> Result<Mat<'a>, WeightError>;
    /// The vector `name` of `shape`, decoded to f32.
    fn vector(&self, name: &str, shape: &[usize]) -> Result<Vector, WeightError>;
    /// Whether the source holds a tensor `name` (what optional parts are bound by).
    fn has(&self, _name: &str) -> bool {
        false
    }
    /// A stored integer buffer to check against the value the config implies (`header`: kept
    /// in the header's integer tensors, else a tensor of `len` values); `None` when absent.
    fn stored_integers(
        &self,
        name: &str,
        len: usize,
        header: bool,
    ) -> Result<Option<Vec<i64>>, WeightError>;
}

impl<'a> Source<'a> for Binder<'a> {
    fn has(&self, name: &str) -> bool {
        self.cmf().tensor(name).is_some()
    }

    fn mat(&self, name: &str, rows: usize, cols: usize) -> Result<Mat<'a>, WeightError> {
        Ok(Binder::mat(self, name, rows, cols)?)
    }

    fn vector(&self, name: &str, shape: &[usize]) -> Result<Vector, WeightError> {
        Ok(Binder::vector(self, name, shape)?)
    }

    fn stored_integers(
        &self,
        name: &str,
        len: usize,
        header: bool,
    ) -> Result<Option<Vec<i64>>, WeightError> {
        if header {
            return Ok(self.header_integers(name).and_then(|v| {
                v.get("data")?
                    .as_array()?
                    .iter()
                    .map(|v| v.as_i64())
                    .collect()
            }));
        }
        Ok(self
            .cmf()
            .tensor(name)
            .map(|_| Binder::vector(self, name, &[len]))
            .transpose()?
            .map(|v| v.iter().map(|&x| x as i64).collect()))
    }
}

impl<'a> Weights<'a> {
    /// Reads the config from the header and binds every tensor.
    pub fn bind(cmf: &'a Cmf) -> Result<(Qwen4ExpTextConfig, Weights<'a>), WeightError> {
        let h = cmf.header();
        if h.architecture != "qwen4_exp" {
            return Err(WeightError::Architecture(h.architecture.clone()));
        }
        let c = Qwen4ExpTextConfig::from_json(&h.config)?;
        let w = Self::bind_with(cmf, &c)?;
        Ok((c, w))
    }

    /// Validates `c` and binds every tensor it requires.
    pub fn bind_with(cmf: &'a Cmf, c: &Qwen4ExpTextConfig) -> Result<Weights<'a>, WeightError> {
        Self::bind_from(&Binder::new(cmf), c)
    }

    /// Validates `c` and binds every tensor it requires from `b`.
    pub fn bind_from(
        b: &dyn Source<'a>,
        c: &Qwen4ExpTextConfig,
    ) -> Result<Weights<'a>, WeightError> {
        c.validate()?;
        let d = c.hidden_size;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for il in 0..c.num_hidden_layers {
            let p = format!("model.layers.{il}");
            let ple = match c.ple_layer_index(il) {
                None => None,
                Some(pi) => Some(Self::bind_ple(b, c, &format!("{p}.ple"), pi)?),
            };
            layers.push(Self::bind_layer(b, c, &p, c.layer_type(il), ple)?);
        }
        let mtp = if b.has("mtp.fc_embedding.weight") {
            let hd = c.hc_count * d;
            Some(Box::new(MtpWeights {
                fc_embedding: b.mat("mtp.fc_embedding.weight", d, d)?,
                fc_hidden: b.mat("mtp.fc_hidden.weight", d, d)?,
                pre_fc_norm_embedding: b.vector("mtp.pre_fc_norm_embedding.weight", &[d])?,
                pre_fc_norm_hidden: b.vector("mtp.pre_fc_norm_hidden.weight", &[hd])?,
                layer: Self::bind_layer(b, c, "mtp.layers.0", LayerType::IndexedAttention, None)?,
                final_mixer: hc(b, "mtp.hyper_connection_mixer", c, false)?,
            }))
        } else {
            None
        };
        Ok(Weights {
            embed: b.mat("model.embed_tokens.weight", c.vocab_size, d)?,
            layers,
            final_mixer: hc(b, "model.hyper_connection_mixer", c, false)?,
            lm_head: b.mat("lm_head.weight", c.vocab_size, d)?,
            mtp,
        })
    }

    /// One decoder layer under `p` (`model.layers.N`, or the MTP head's `mtp.layers.0`).
    fn bind_layer(
        b: &dyn Source<'a>,
        c: &Qwen4ExpTextConfig,
        p: &str,
        kind: LayerType,
        ple: Option<PleWeights<'a>>,
    ) -> Result<LayerWeights<'a>, WeightError> {
        let d = c.hidden_size;
        {
            let mixer = match kind {
                LayerType::LinearAttention => {
                    let (hk, hv) = (c.linear_num_key_heads, c.linear_num_value_heads);
                    let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
                    let conv_dim = 2 * hk * dk + hv * dv;
                    let k = c.linear_conv_kernel_dim;
                    let q = format!("{p}.linear_attn");
                    MixerWeights::Gdn(GdnWeights {
                        in_qkv: b.mat(&format!("{q}.in_proj_qkv.weight"), conv_dim, d)?,
                        in_z: b.mat(&format!("{q}.in_proj_z.weight"), hv * dv, d)?,
                        in_b: b.mat(&format!("{q}.in_proj_b.weight"), hv, d)?,
                        in_a: b.mat(&format!("{q}.in_proj_a.weight"), hv, d)?,
                        conv: b.vector(&format!("{q}.conv1d.weight"), &[conv_dim, 1, k])?,
                        dt_bias: b.vector(&format!("{q}.dt_bias"), &[hv])?,
                        a_log: b.vector(&format!("{q}.A_log"), &[hv])?,
                        norm: b.vector(&format!("{q}.norm.weight"), &[dv])?,
                        out: b.mat(&format!("{q}.out_proj.weight"), d, hv * dv)?,
                    })
                }
                LayerType::IndexedAttention => {
                    let (hq, hkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
                    let qsa = c
                        .qsa()
                        .expect("validated: indexed attention has QSA fields");
                    let q = format!("{p}.self_attn");
                    MixerWeights::Attn(AttnWeights {
                        q: b.mat(&format!("{q}.q_proj.weight"), hq * 2 * hd, d)?,
                        k: b.mat(&format!("{q}.k_proj.weight"), hkv * hd, d)?,
                        v: b.mat(&format!("{q}.v_proj.weight"), hkv * hd, d)?,
                        o: b.mat(&format!("{q}.o_proj.weight"), d, hq * hd)?,
                        q_norm: b.vector(&format!("{q}.q_norm.weight"), &[hd])?,
                        k_norm: b.vector(&format!("{q}.k_norm.weight"), &[hd])?,
                        idx_qk: b.mat(
                            &format!("{q}.indexer.index_qk_proj.weight"),
                            (qsa.n_heads + 1) * qsa.head_dim,
                            d,
                        )?,
                        idx_q_norm: b
                            .vector(&format!("{q}.indexer.q_layernorm.weight"), &[qsa.head_dim])?,
                        idx_k_norm: b
                            .vector(&format!("{q}.indexer.k_layernorm.weight"), &[qsa.head_dim])?,
                    })
                }
            };
            let (e, i, is) = (
                c.num_experts,
                c.moe_intermediate_size,
                c.shared_expert_intermediate_size,
            );
            let m = format!("{p}.mlp");
            let mut experts = Vec::with_capacity(e);
            for x in 0..e {
                experts.push(Expert {
                    gate_up: b.mat(&format!("{m}.experts.{x}.gate_up_proj.weight"), 2 * i, d)?,
                    down: b.mat(&format!("{m}.experts.{x}.down_proj.weight"), d, i)?,
                });
            }
            let moe = MoeWeights {
                router: b.mat(&format!("{m}.gate.weight"), e, d)?,
                routed: RoutedExperts {
                    experts,
                    hidden: d,
                    intermediate: i,
                    activation: Activation::SwiGlu { limit: None },
                },
                sh_gate: b.mat(&format!("{m}.shared_expert.gate_proj.weight"), is, d)?,
                sh_up: b.mat(&format!("{m}.shared_expert.up_proj.weight"), is, d)?,
                sh_down: b.mat(&format!("{m}.shared_expert.down_proj.weight"), d, is)?,
                sh_scale: b.vector(&format!("{m}.shared_expert_gate.weight"), &[1, d])?,
            };
            Ok(LayerWeights {
                ple,
                attn_hc: hc(b, &format!("{p}.attn_hyper_connection"), c, true)?,
                mixer,
                mlp_hc: hc(b, &format!("{p}.mlp_hyper_connection"), c, true)?,
                moe,
            })
        }
    }

    fn bind_ple(
        b: &dyn Source<'a>,
        c: &Qwen4ExpTextConfig,
        p: &str,
        ple_index: usize,
    ) -> Result<PleWeights<'a>, WeightError> {
        let hash = PleHash::new(c, ple_index);
        let hdim = c.hc_count * c.hidden_size;
        let pdim = c.ple_embed_dim();
        let head_dim = pdim / c.ngram_heads();
        let parts = c.split_ngram_parts.max(1);
        let shard_rows = hash.padded_rows.div_ceil(parts);
        let mut shards = Vec::with_capacity(parts);
        for k in 0..parts {
            shards.push(b.mat(
                &format!("{p}.ple_embedding.ngram_embedding.shard_{k}.weight"),
                shard_rows,
                head_dim,
            )?);
        }
        // The stored buffers must equal the reference's construction.
        let nh = c.ngram_heads();
        let check = |name: String, expected: Vec<i64>, found: Option<Vec<i64>>| match found {
            Some(f) if f != expected => Err(WeightError::PleBuffer {
                name,
                expected,
                found: f,
            }),
            _ => Ok(()),
        };
        let name = format!("{p}.ple_embedding.ngram_heads_vocab_sizes");
        let found = b.stored_integers(&name, nh, false)?;
        check(
            name,
            hash.vocab_sizes.iter().map(|&x| x as i64).collect(),
            found,
        )?;
        let name = format!("{p}.ple_embedding.ngram_heads_offsets");
        let found = b.stored_integers(&name, nh, false)?;
        check(
            name,
            hash.offsets.iter().map(|&x| x as i64).collect(),
            found,
        )?;
        let name = format!("{p}.ple_embedding.layer_multipliers");
        let found = b.stored_integers(&name, c.ngram_size, true)?;
        check(
            name,
            hash.multipliers.iter().map(|&x| x as i64).collect(),
            found,
        )?;
        Ok(PleWeights {
            shards,
            shard_rows,
            hash,
            key: b.mat(&format!("{p}.key_proj.weight"), hdim, pdim)?,
            value: b.mat(&format!("{p}.value_proj.weight"), c.hidden_size, pdim)?,
            norm_key: b.vector(&format!("{p}.norm_key.weight"), &[hdim])?,
            norm_query: b.vector(&format!("{p}.norm_query.weight"), &[hdim])?,
            norm_conv: b.vector(&format!("{p}.norm_conv.weight"), &[hdim])?,
            conv: b.vector(
                &format!("{p}.conv1d.weight"),
                &[hdim, 1, c.ple_conv_kernel_size],
            )?,
        })
    }
}

impl Weights<'_> {
    /// Weight bytes one decoded token reads: every matrix of the layers, the final mixer and
    /// the lm_head, of the routed experts the `top_k` chosen per layer (an average expert's
    /// share); the embedding and n-gram tables contribute one row each, counted as nothing.
    pub fn bytes_per_token(&self, top_k: usize) -> u64 {
        let b = |m: &Mat<'_>| m.bytes().len() as u64;
        let hc = |h: &HcWeights<'_>| b(&h.down) + b(&h.up) + h.inject.as_ref().map_or(0, b);
        let mut total = hc(&self.final_mixer) + b(&self.lm_head);
        for l in &self.layers {
            total += hc(&l.attn_hc) + hc(&l.mlp_hc);
            if let Some(p) = &l.ple {
                total += b(&p.key) + b(&p.value);
            }
            total += match &l.mixer {
                MixerWeights::Gdn(g) => {
                    b(&g.in_qkv) + b(&g.in_z) + b(&g.in_b) + b(&g.in_a) + b(&g.out)
                }
                MixerWeights::Attn(a) => b(&a.q) + b(&a.k) + b(&a.v) + b(&a.o) + b(&a.idx_qk),
            };
            let m = &l.moe;
            total += b(&m.router) + b(&m.sh_gate) + b(&m.sh_up) + b(&m.sh_down);
            let ex = &m.routed.experts;
            let all: u64 = ex.iter().map(|e| b(&e.gate_up) + b(&e.down)).sum();
            total += all * top_k.min(ex.len()) as u64 / ex.len().max(1) as u64;
        }
        total
    }
}
