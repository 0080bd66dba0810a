//! Every tensor of a deepseek_v41 CMF, bound by canonical name (docs/convert.md) with the shape
//! the config and each layer's [`LayerRole`] imply, before anything runs.
//!
//! What V4.1 shares with V4 is bound into V4's types (the mHC sites, the attention projections,
//! the MoE block with scored routing); the V4.1-only pieces are here: the shared compressor of a
//! KV source (no overlap, no position bias, no gate at ratio 1), the indexer (keys of its own
//! only on a KV source), and the Engram module with its memory-mapped table. A missing tensor,
//! a wrong shape or an unusable table is a [`V41WeightError`] naming the tensor.

use cmf_format::Cmf;
use model_core::{BindError, Binder, Mat, Vector};

use crate::config_v41::{DeepseekV41Config, IndexRole, KvRole, V41ConfigError};
use crate::engram::{CompressedTokenMap, EngramError, EngramHasher, EngramTable, EngramTableError};
use crate::weights::{
    AttnDims, AttnWeights, HcWeights, MoeWeights, Routing, attn_projections, hc_site, moe_block,
};

/// Why a deepseek_v41 model cannot be bound.
#[derive(Debug, thiserror::Error)]
pub enum V41WeightError {
    /// The CMF is not a deepseek_v41 model.
    #[error("not a deepseek_v41 model: the CMF architecture is `{0}`")]
    Architecture(String),
    /// The header's config is unusable.
    #[error(transparent)]
    Config(#[from] V41ConfigError),
    /// A tensor is missing, has the wrong shape, or does not decode.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// An Engram table is missing or unusable.
    #[error(transparent)]
    Table(#[from] EngramTableError),
    /// The Engram layers need the tokenizer's compressed token map, and none was given.
    #[error(
        "layers {0:?} have Engram modules, whose n-gram hashes need the tokenizer's compressed \
         token map: bind with one (the engine derives it from the tokenizer in the CMF)"
    )]
    NoTokenMap(Vec<usize>),
    /// The token map does not fit the config.
    #[error(transparent)]
    Engram(#[from] EngramError),
}

/// The shared compressor of a KV source (`self_attn.compressor`).
pub struct CompressorWeights<'a> {
    /// `kv_proj` `[Dh, D]`.
    pub kv: Mat<'a>,
    /// `gate_proj` `[Dh, D]` (ratio > 1 only).
    pub gate: Option<Mat<'a>>,
    /// `kv_norm.weight` `[Dh]`.
    pub norm: Vector,
}

/// The indexer's keys, owned by an index source that is also a KV source.
pub struct IndexKeyWeights<'a> {
    /// `k_proj` `[dI, Dh]` (from the compressor latent).
    pub k_proj: Mat<'a>,
    /// `k_norm.weight` `[dI]`.
    pub k_norm: Vector,
}

/// The indexer of an index source (`self_attn.indexer`).
pub struct IndexerWeights<'a> {
    /// `q_b_proj` `[nI*dI, q_lora_rank]`.
    pub q_b: Mat<'a>,
    /// `weights_proj` `[nI, D]`.
    pub weights_proj: Mat<'a>,
    /// Its keys, on a KV source.
    pub keys: Option<IndexKeyWeights<'a>>,
}

/// The Engram module of a layer (`engram.*`) and its table (`model.engram_tables.L`).
pub struct EngramWeights<'a> {
    /// `wkv` `[(N+1)*D, n_cols*engram_head_dim]`: N keys (one per stream) and one value.
    pub wkv: Mat<'a>,
    /// `q_weight * k_weight` `[N, D]` (the reference only uses their product).
    pub qk: Vec<f32>,
    /// The memory-mapped table.
    pub table: EngramTable<'a>,
}

/// One decoder layer.
pub struct LayerWeights<'a> {
    /// Engram module, on `engram_layer_ids`.
    pub engram: Option<EngramWeights<'a>>,
    /// mHC site of the attention.
    pub attn_hc: HcWeights<'a>,
    /// `input_layernorm.weight` `[D]`.
    pub input_layernorm: Vector,
    /// Attention projections (V4's type; its compressor and indexer are `None`).
    pub attn: AttnWeights<'a>,
    /// The shared compressor, on a KV source.
    pub compressor: Option<CompressorWeights<'a>>,
    /// The indexer, on an index source.
    pub indexer: Option<IndexerWeights<'a>>,
    /// mHC site of the MoE.
    pub ffn_hc: HcWeights<'a>,
    /// `post_attention_layernorm.weight` `[D]`.
    pub post_attention_layernorm: Vector,
    /// MoE (scored routing on `e_score_correction_bias`; `_vl` is for image spans only).
    pub moe: MoeWeights<'a>,
}

/// All weights of the model.
pub struct Weights<'a> {
    /// `model.embed_tokens.weight` `[V, D]`.
    pub embed_tokens: Mat<'a>,
    /// Decoder layers.
    pub layers: Vec<LayerWeights<'a>>,
    /// `model.norm.weight` `[D]`.
    pub norm: Vector,
    /// `lm_head.weight` `[V, D]`.
    pub lm_head: Mat<'a>,
    /// The n-gram hasher (with Engram layers).
    pub hasher: Option<EngramHasher>,
}

impl<'a> Weights<'a> {
    /// Reads the config from the header and binds every tensor. `token_map` is the tokenizer's
    /// compressed token map ([`CompressedTokenMap::from_token_strings`]), required when the
    /// model has Engram layers.
    pub fn bind(
        cmf: &'a Cmf,
        token_map: Option<CompressedTokenMap>,
    ) -> Result<(DeepseekV41Config, Weights<'a>), V41WeightError> {
        let h = cmf.header();
        if h.architecture != "deepseek_v41" {
            return Err(V41WeightError::Architecture(h.architecture.clone()));
        }
        let c = DeepseekV41Config::from_json(&h.config)?;
        let w = Self::bind_with(cmf, &c, token_map)?;
        Ok((c, w))
    }

    /// Binds every tensor `c` requires.
    pub fn bind_with(
        cmf: &'a Cmf,
        c: &DeepseekV41Config,
        token_map: Option<CompressedTokenMap>,
    ) -> Result<Weights<'a>, V41WeightError> {
        c.validate()?;
        let hasher = match (c.engram_layer_ids.is_empty(), token_map) {
            (true, _) => None,
            (false, Some(map)) => Some(EngramHasher::new(c, map)?),
            (false, None) => return Err(V41WeightError::NoTokenMap(c.engram_layer_ids.clone())),
        };
        let b = Binder::new(cmf);
        let (d, n) = (c.hidden_size, c.hc_mult);
        let (h, dh, qr) = (c.num_attention_heads, c.head_dim, c.q_lora_rank);
        let (g, r) = (c.o_groups, c.o_lora_rank);
        let (e, i) = (c.n_routed_experts, c.moe_intermediate_size);
        let (ni, di) = (c.index_n_heads, c.index_head_dim);
        let dims = AttnDims {
            hidden: d,
            heads: h,
            head_dim: dh,
            q_lora_rank: qr,
            o_groups: g,
            o_lora_rank: r,
        };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for (il, role) in c.roles().iter().enumerate() {
            let p = format!("model.layers.{il}");
            let a = format!("{p}.self_attn");
            let attn = attn_projections(&b, &a, &dims)?;
            let compressor = match role.kv {
                KvRole::Source => {
                    let x = format!("{a}.compressor");
                    Some(CompressorWeights {
                        kv: b.mat(&format!("{x}.kv_proj.weight"), dh, d)?,
                        gate: if role.compress_ratio > 1 {
                            Some(b.mat(&format!("{x}.gate_proj.weight"), dh, d)?)
                        } else {
                            None
                        },
                        norm: b.vector(&format!("{x}.kv_norm.weight"), &[dh])?,
                    })
                }
                _ => None,
            };
            let indexer = if role.is_index_source() {
                let x = format!("{a}.indexer");
                let keys = match role.index {
                    IndexRole::Source => Some(IndexKeyWeights {
                        k_proj: b.mat(&format!("{x}.k_proj.weight"), di, dh)?,
                        k_norm: b.vector(&format!("{x}.k_norm.weight"), &[di])?,
                    }),
                    _ => None,
                };
                Some(IndexerWeights {
                    q_b: b.mat(&format!("{x}.q_b_proj.weight"), ni * di, qr)?,
                    weights_proj: b.mat(&format!("{x}.weights_proj.weight"), ni, d)?,
                    keys,
                })
            } else {
                None
            };
            let engram = match role.engram {
                None => None,
                Some(_) => {
                    let x = format!("{p}.engram");
                    let layout = hasher
                        .as_ref()
                        .expect("engram layers have a hasher")
                        .layout();
                    let cols = layout.n_cols() * c.engram_head_dim;
                    let q = b.vector(&format!("{x}.q_weight"), &[n, d])?;
                    let k = b.vector(&format!("{x}.k_weight"), &[n, d])?;
                    Some(EngramWeights {
                        wkv: b.mat(&format!("{x}.wkv.weight"), (n + 1) * d, cols)?,
                        qk: q.iter().zip(k.iter()).map(|(a, b)| a * b).collect(),
                        table: EngramTable::from_config(cmf, c, il)?,
                    })
                }
            };
            let m = format!("{p}.mlp");
            let routing =
                Routing::Scored(b.vector(&format!("{m}.gate.e_score_correction_bias"), &[e])?);
            let moe = moe_block(&b, &m, routing, d, e, i, c.swiglu_limit as f32)?;
            layers.push(LayerWeights {
                engram,
                attn_hc: hc_site(&b, &format!("{p}.attn_hc"), n, d)?,
                input_layernorm: b.vector(&format!("{p}.input_layernorm.weight"), &[d])?,
                attn,
                compressor,
                indexer,
                ffn_hc: hc_site(&b, &format!("{p}.ffn_hc"), n, d)?,
                post_attention_layernorm: b
                    .vector(&format!("{p}.post_attention_layernorm.weight"), &[d])?,
                moe,
            });
        }
        Ok(Weights {
            embed_tokens: b.mat("model.embed_tokens.weight", c.vocab_size, d)?,
            layers,
            norm: b.vector("model.norm.weight", &[d])?,
            lm_head: b.mat("lm_head.weight", c.vocab_size, d)?,
            hasher,
        })
    }
}
