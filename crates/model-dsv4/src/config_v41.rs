//! `DeepseekV41Config`: the config of `deepseek_v41` (DeepSeek-V4.1-Flash) as the released
//! `config.json` has it, and the role each layer plays in the shared compressed attention.
//!
//! Field names and defaults mirror the `DeepseekV41TextConfig` of transformers' main branch
//! (`configuration_deepseek_v41.py`, see tools/reference/README.md for the pinned commit); only
//! fields that change the math or the tensor layout are kept. [`DeepseekV41Config::from_json`]
//! accepts the composite form (`text_config` beside `vision_config` and a top-level
//! `quantization_config`) and the flat `deepseek_v41_text` form, applies the reference's
//! `__post_init__` (default schedule, KV / index / candidate sources, the DSpark entries of
//! `compress_ratios`, the `main` / `compress` RoPE sets built from the flat `rope_theta`,
//! `compress_rope_theta` and `rope_scaling`) and then validates: every rule is a
//! [`V41ConfigError::Invalid`] naming the field.
//!
//! [`DeepseekV41Config::roles`] says what each layer does, derived as the reference's modules
//! derive it ([`LayerRole`]). Schedules the reference would run with another KV group's state
//! (see [`LayerRole`]) are refused instead.

use model_core::config::check_field;
use serde::Deserialize;
use serde_json::Value;

use crate::config::{ConfigError, HiddenAct, MAX_LAYERS, RopeParams, ScoringFunc};
use crate::engram::EngramLayout;

/// A V4.1 config that cannot be used: the field and the broken rule.
#[derive(Debug, thiserror::Error)]
pub enum V41ConfigError {
    /// The JSON does not have the expected types.
    #[error("deepseek_v41 config: {0}")]
    Json(#[from] serde_json::Error),
    /// A field breaks a rule of the reference (or one this implementation adds; the rule
    /// says which).
    #[error("deepseek_v41 config: `{field}`: {rule}")]
    Invalid {
        /// The field at fault (`text_config` keys are named without the prefix).
        field: &'static str,
        /// What was expected, and what was found.
        rule: String,
    },
}

fn invalid(field: &'static str, rule: impl Into<String>) -> V41ConfigError {
    V41ConfigError::Invalid {
        field,
        rule: rule.into(),
    }
}

impl From<ConfigError> for V41ConfigError {
    // The RoPE set reader is shared with deepseek_v4; its errors already name the set.
    fn from(e: ConfigError) -> Self {
        match e {
            ConfigError::Json(j) => V41ConfigError::Json(j),
            ConfigError::Invalid { field, rule } => V41ConfigError::Invalid { field, rule },
        }
    }
}

/// The most hash columns all Engram layers may have together (`len(engram_layer_ids) *
/// (engram_max_ngram_size - 1) * engram_n_heads`, one prime each). The prime layout is
/// searched from the config before any tensor is read, so an absurd value must be refused
/// first (the release has 2 x 3 x 8 = 48).
pub const MAX_ENGRAM_HASH_COLUMNS: usize = 1 << 16;

/// The Engram table scales cover this many channels of a row (`DeepseekV41EngramEmbedding`).
pub const ENGRAM_SCALE_BLOCK: usize = 32;

/// The released schedule, used when `compress_ratios` is absent and there are 40 layers.
const DEFAULT_COMPRESS_RATIOS: [usize; 40] = {
    let mut r = [1usize; 40];
    r[0] = 0;
    r[1] = 0;
    let mut i = 2;
    while i < 20 {
        r[i] = 2;
        i += 1;
    }
    r
};
const DEFAULT_KV_SOURCES: [usize; 4] = [2, 8, 14, 20];
const DEFAULT_INDEX_SOURCES: [usize; 8] = [2, 8, 14, 20, 24, 28, 32, 36];

/// Which RoPE set a layer rotates with (`rope_layer_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeSet {
    /// `main`: plain `rope_theta`, for sliding-only layers.
    Main,
    /// `compress`: `compress_rope_theta` with the YaRN keys, for layers with a compressed branch.
    Compress,
}

/// Where a layer's compressed KV comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvRole {
    /// `compress_ratios[L] == 0`: the sliding window only.
    SlidingOnly,
    /// In `kv_source_layer_ids`: owns the compressor and publishes its group's compressed KV
    /// (cache layer type `shared_compressed_attention`).
    Source,
    /// A compressed layer that is not a source: attends the compressed KV of `source`, the
    /// closest KV source at or before it (CSA2 "Reuse").
    Reuse {
        /// The KV source layer.
        source: usize,
    },
}

/// Where a compressed layer's top-k entry indices come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexRole {
    /// No top-k: a sliding-only layer, or a compressed layer whose group has no index source
    /// (the reference then attends no compressed entry).
    None,
    /// An index source that is also its group's KV source: derives and publishes the indexer
    /// keys, scores them, publishes the top-k.
    Source,
    /// An index source that is not a KV source (CSA2 "Reindex"): scores with its own
    /// `wq_b` / `weights_proj` against the keys published by `keys_from`.
    Reindex {
        /// The KV source (and index source) whose indexer keys it scores.
        keys_from: usize,
    },
    /// Not an index source: reuses the top-k of `from`, the closest index source at or before
    /// it.
    Reuse {
        /// The index source whose top-k it attends.
        from: usize,
    },
}

/// A layer's part in the two-level (block, then entry) top-k.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CandidateRole {
    /// Not involved (or the two-level top-k is disabled).
    None,
    /// `candidate_source_layer_id`: publishes the mask of its top `candidate_topk_blocks`
    /// blocks (its own top-k is not restricted).
    Source,
    /// A later index source: its top-k is restricted to the candidate blocks of `by`.
    Restricted {
        /// The candidate source.
        by: usize,
    },
}

/// What one decoder layer does, derived from the schedule fields as the reference's
/// `DeepseekV41Attention` / `DeepseekV41Indexer` / `DeepseekV41DecoderLayer` derive it.
///
/// The reference passes the compressed KV, the indexer keys, the top-k and the candidate mask
/// from layer to layer through one per-forward dict, so a layer reads whatever the last
/// publisher before it wrote. Three schedules would make a layer read another KV group's
/// state (entry indices or keys of a different compressed cache); the reference accepts
/// them, [`DeepseekV41Config::validate`] refuses them (none is used by any known checkpoint):
/// an index source whose group's KV source is not an index source; a compressed layer with
/// no index source in its group while an earlier group has one; an index source after the
/// candidate source in a later KV group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerRole {
    /// `compress_ratios[L]`: 0 sliding only, 1 one entry per token, r > 1 r tokens pooled.
    /// A [`KvRole::Reuse`] layer's own ratio only selects its RoPE set; the entries are its
    /// source's.
    pub compress_ratio: usize,
    /// The RoPE set of its queries and window KV.
    pub rope: RopeSet,
    /// Its compressed KV.
    pub kv: KvRole,
    /// Its top-k.
    pub index: IndexRole,
    /// Its part in the two-level top-k.
    pub candidate: CandidateRole,
    /// Its position in `engram_layer_ids` when it has an Engram module (applied to the
    /// streams before the attention site).
    pub engram: Option<usize>,
}

impl LayerRole {
    /// The reference's `layer_types[L]`: `shared_compressed_attention` for KV sources,
    /// `sliding_attention` otherwise.
    pub fn layer_type(&self) -> &'static str {
        match self.kv {
            KvRole::Source => "shared_compressed_attention",
            _ => "sliding_attention",
        }
    }

    /// Whether it runs the indexer (`index_source_layer_ids`).
    pub fn is_index_source(&self) -> bool {
        matches!(self.index, IndexRole::Source | IndexRole::Reindex { .. })
    }
}

/// The top-level `quantization_config` of the release (storage metadata for the converter).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct QuantizationConfig {
    /// `fp8` in the release.
    #[serde(default)]
    pub quant_method: Option<String>,
    /// `dynamic` in the release.
    #[serde(default)]
    pub activation_scheme: Option<String>,
    /// `[32, 32]` in the release: the FP8 block of the projection scales.
    #[serde(default)]
    pub weight_block_size: Option<Vec<usize>>,
    /// `ue8m0` in the release.
    #[serde(default)]
    pub scale_fmt: Option<String>,
    /// `fp4` in the release: the routed experts are packed e2m1.
    #[serde(default)]
    pub expert_dtype: Option<String>,
}

macro_rules! defaults {
    ($($name:ident: $ty:ty = $value:expr;)*) => {
        $(fn $name() -> $ty { $value })*
    };
}

defaults! {
    d_vocab: usize = 129280;
    d_hidden: usize = 5120;
    d_layers: usize = 40;
    d_heads: usize = 64;
    d_one: usize = 1;
    d_head_dim: usize = 512;
    d_q_lora: usize = 1280;
    d_rope_dim: usize = 64;
    d_rope_theta: f64 = 10000.0;
    d_compress_theta: f64 = 160000.0;
    d_max_pos: usize = 1048576;
    d_window: usize = 128;
    d_cand_blocks: usize = 2048;
    d_cand_block: usize = 8;
    d_index_heads: usize = 32;
    d_index_dim: usize = 128;
    d_index_topk: usize = 512;
    d_o_groups: usize = 8;
    d_o_lora: usize = 1024;
    d_moe_inter: usize = 2304;
    d_experts: usize = 384;
    d_topk: usize = 6;
    d_scoring: ScoringFunc = ScoringFunc::SqrtSoftplus;
    d_f1: f64 = 1.0;
    d_true: bool = true;
    d_scaling: f64 = 1.5;
    d_limit: f64 = 10.0;
    d_hc: usize = 4;
    d_sinkhorn: usize = 20;
    d_hc_eps: f64 = 1e-6;
    d_engram_vocab: u64 = 16_000_000;
    d_ngram: usize = 4;
    d_engram_heads: usize = 8;
    d_engram_dim: usize = 256;
    d_compressed_vocab: u64 = 99092;
    d_nextn: usize = 3;
    d_dspark_block: usize = 5;
    d_dspark_noise: usize = 128799;
    d_markov: usize = 256;
    d_dspark_experts: usize = 128;
    d_dspark_topk: usize = 3;
    d_act: HiddenAct = HiddenAct::Silu;
    d_eps: f64 = 1e-20;
    d_image_token: usize = 129264;
}

/// The deepseek_v41 text config (transformers main's `DeepseekV41TextConfig` defaults, i.e.
/// the released V4.1-Flash geometry), resolved by [`Self::from_json`].
#[derive(Debug, Clone, Deserialize)]
pub struct DeepseekV41Config {
    /// Vocabulary (default 129280).
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    /// D, the width of one mHC stream (default 5120).
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    /// Backbone layers (default 40; the DSpark layers are not counted).
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    /// Query heads (default 64).
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    /// Read but unused, as in the reference: one KV latent broadcast to every head.
    #[serde(default = "d_one")]
    pub num_key_value_heads: usize,
    /// Per-head dim of q, the KV latent and the compressed entries (default 512).
    #[serde(default = "d_head_dim")]
    pub head_dim: usize,
    /// Low-rank Q bottleneck (default 1280).
    #[serde(default = "d_q_lora")]
    pub q_lora_rank: usize,
    /// Trailing channels of each head that rotate (default 64).
    #[serde(default = "d_rope_dim")]
    pub qk_rope_head_dim: usize,
    /// RoPE base of the `main` set (sliding-only layers; default 10000).
    #[serde(default = "d_rope_theta")]
    pub rope_theta: f64,
    /// RoPE base of the `compress` set (layers with a compressed branch; default 160000).
    #[serde(default = "d_compress_theta")]
    pub compress_rope_theta: f64,
    /// Nested `{main, compress}` sets; when absent they are built from the flat fields.
    #[serde(default)]
    pub rope_parameters: Option<Value>,
    /// The flat YaRN keys of the `compress` set (`{"rope_type": "yarn", "factor": 16, ...}`).
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    /// Context length (default 1048576).
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    /// Biases on the attention projections (default false; not supported).
    #[serde(default)]
    pub attention_bias: bool,
    /// Sliding window of every layer, self included (default 128).
    #[serde(default = "d_window")]
    pub sliding_window: usize,
    /// Per-layer compress ratio, `num_hidden_layers + num_nextn_predict_layers` entries after
    /// resolution (the DSpark entries are 0). Default: the released schedule for 40 layers,
    /// else 2 sliding-only layers, a ratio-2 block and a ratio-1 block.
    #[serde(skip)]
    pub compress_ratios: Vec<usize>,
    /// Layers owning a compressor. Default: `[2, 8, 14, 20]` on the released schedule, else the
    /// first layer of each same-ratio run with ratio > 0.
    #[serde(skip)]
    pub kv_source_layer_ids: Vec<usize>,
    /// Layers running the indexer. Default: `[2, 8, 14, 20, 24, 28, 32, 36]` with the released
    /// KV sources, else the KV sources.
    #[serde(skip)]
    pub index_source_layer_ids: Vec<usize>,
    /// The two-level top-k's candidate source; `None` disables it (a negative id in JSON).
    /// Default: the last listed KV source.
    #[serde(skip)]
    pub candidate_source_layer_id: Option<usize>,
    /// Blocks kept by the candidate source (default 2048).
    #[serde(default = "d_cand_blocks")]
    pub candidate_topk_blocks: usize,
    /// Compressed entries per candidate block (default 8).
    #[serde(default = "d_cand_block")]
    pub candidate_block_size: usize,
    /// Lightning-indexer query heads (default 32).
    #[serde(default = "d_index_heads")]
    pub index_n_heads: usize,
    /// Lightning-indexer head dim (default 128).
    #[serde(default = "d_index_dim")]
    pub index_head_dim: usize,
    /// Compressed entries kept per query (default 512).
    #[serde(default = "d_index_topk")]
    pub index_topk: usize,
    /// Groups of the grouped output projection (default 8).
    #[serde(default = "d_o_groups")]
    pub o_groups: usize,
    /// Per-group bottleneck of the output projection (default 1024).
    #[serde(default = "d_o_lora")]
    pub o_lora_rank: usize,
    /// Routed and shared expert FFN width (default 2304).
    #[serde(default = "d_moe_inter")]
    pub moe_intermediate_size: usize,
    /// Routed experts (default 384).
    #[serde(default = "d_experts")]
    pub n_routed_experts: usize,
    /// Read but unused, as in the reference: it builds exactly one shared expert.
    #[serde(default = "d_one")]
    pub n_shared_experts: usize,
    /// Routed experts per token (default 6).
    #[serde(default = "d_topk")]
    pub num_experts_per_tok: usize,
    /// Router score: `sqrtsoftplus` (default), `softmax` or `sigmoid`.
    #[serde(default = "d_scoring")]
    pub scoring_func: ScoringFunc,
    /// Divides the router logits before the score function (default 1).
    #[serde(default = "d_f1")]
    pub gate_temp: f64,
    /// Renormalise the selected routing weights (with top-k > 1; default true).
    #[serde(default = "d_true")]
    pub norm_topk_prob: bool,
    /// Multiplies the routed weights (default 1.5).
    #[serde(default = "d_scaling")]
    pub routed_scaling_factor: f64,
    /// Read but unused, as in the reference (`noaux_tc`: the bias steers selection only).
    #[serde(default)]
    pub topk_method: Option<String>,
    /// SwiGLU clamp of routed and shared experts (default 10).
    #[serde(default = "d_limit")]
    pub swiglu_limit: f64,
    /// mHC residual streams (default 4).
    #[serde(default = "d_hc")]
    pub hc_mult: usize,
    /// Sinkhorn-Knopp iterations (default 20).
    #[serde(default = "d_sinkhorn")]
    pub hc_sinkhorn_iters: usize,
    /// Sinkhorn / pre-gate floor (default 1e-6).
    #[serde(default = "d_hc_eps")]
    pub hc_eps: f64,
    /// Layers with an Engram module, in table order (default none; the release has `[1, 14]`).
    #[serde(skip)]
    pub engram_layer_ids: Vec<usize>,
    /// The prime search of the table layout starts here (default 16000000).
    #[serde(default = "d_engram_vocab")]
    pub engram_vocab_size: u64,
    /// Rows of each Engram table; must equal the prime layout's total for that layer.
    #[serde(skip)]
    pub engram_num_embeddings: Vec<u64>,
    /// Largest n-gram hashed (orders 2..N; default 4).
    #[serde(default = "d_ngram")]
    pub engram_max_ngram_size: usize,
    /// Hash heads per n-gram order (default 8).
    #[serde(default = "d_engram_heads")]
    pub engram_n_heads: usize,
    /// Row width of the Engram tables (default 256, a multiple of 32).
    #[serde(default = "d_engram_dim")]
    pub engram_head_dim: usize,
    /// Token id hashed in n-gram slots with no history (default 2). The release writes
    /// `engram_pad_token_id`, transformers' field is `engram_pad_id`; either is read.
    #[serde(skip)]
    pub engram_pad_token_id: usize,
    /// Distinct keys of the tokenizer-derived compressed vocabulary (default 99092); every
    /// hash multiplier depends on it.
    #[serde(default = "d_compressed_vocab")]
    pub engram_compressed_vocab_size: u64,
    /// DSpark draft layers after the backbone (default 3; not run here).
    #[serde(default = "d_nextn")]
    pub num_nextn_predict_layers: usize,
    /// DSpark: tokens drafted per block (default 5).
    #[serde(default = "d_dspark_block")]
    pub dspark_block_size: usize,
    /// DSpark: the token filling a draft block's non-anchor positions (default 128799).
    #[serde(default = "d_dspark_noise")]
    pub dspark_noise_token_id: usize,
    /// DSpark: backbone layers feeding the draft model. Default: the last three non-KV-source
    /// layers.
    #[serde(skip)]
    pub dspark_target_layer_ids: Vec<usize>,
    /// DSpark: Markov head rank (default 256).
    #[serde(default = "d_markov")]
    pub dspark_markov_rank: usize,
    /// DSpark: routed experts of the draft layers (default 128).
    #[serde(default = "d_dspark_experts")]
    pub dspark_n_routed_experts: usize,
    /// DSpark: experts per token in the draft layers (default 3).
    #[serde(default = "d_dspark_topk")]
    pub dspark_num_experts_per_tok: usize,
    /// Expert activation (only `silu`).
    #[serde(default = "d_act")]
    pub hidden_act: HiddenAct,
    /// Epsilon of every RMSNorm (default 1e-20, as released).
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f64,
    /// Untied in the release; tying is not supported.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// The composite config's image placeholder id (default 129264; text only here).
    #[serde(skip)]
    pub image_token_id: usize,
    /// The top-level `quantization_config` (or the text config's own), when present.
    #[serde(skip)]
    pub quantization_config: Option<QuantizationConfig>,
    /// The resolved `main` RoPE set (filled by [`Self::from_json`]).
    #[serde(skip)]
    pub rope_main: Option<RopeParams>,
    /// The resolved `compress` RoPE set (filled by [`Self::from_json`]).
    #[serde(skip)]
    pub rope_compress: Option<RopeParams>,
    #[serde(skip)]
    roles: Vec<LayerRole>,
    #[serde(skip)]
    engram_layout: Option<EngramLayout>,
}

/// `json[field]` as a list of non-negative integers; `None` when absent or `null`.
fn id_list(json: &Value, field: &'static str) -> Result<Option<Vec<u64>>, V41ConfigError> {
    match json.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_u64().ok_or_else(|| {
                    invalid(
                        field,
                        format!("expected a list of non-negative integers, found {v}"),
                    )
                })
            })
            .collect::<Result<Vec<u64>, _>>()
            .map(Some),
        Some(v) => Err(invalid(
            field,
            format!("expected a list of non-negative integers, found {v}"),
        )),
    }
}

/// [`id_list`] for layer ids (which index per-layer vectors, so they must fit `usize`).
fn layer_list(json: &Value, field: &'static str) -> Result<Option<Vec<usize>>, V41ConfigError> {
    id_list(json, field)?
        .map(|v| {
            v.into_iter()
                .map(|i| {
                    usize::try_from(i)
                        .map_err(|_| invalid(field, format!("id {i} does not fit in usize")))
                })
                .collect()
        })
        .transpose()
}

/// `json[field]` as a signed integer; `None` when absent or `null`.
fn opt_int(json: &Value, field: &'static str) -> Result<Option<i64>, V41ConfigError> {
    match json.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| invalid(field, format!("expected an integer, found {v}"))),
    }
}

/// `[ids]` for messages.
fn list(ids: &[usize]) -> String {
    format!("{ids:?}")
}

impl DeepseekV41Config {
    /// Parses the released `config.json` (composite, with `text_config`) or a flat
    /// `deepseek_v41_text` one, applies the reference's `__post_init__`, derives the layer
    /// roles and the Engram table layout, then [`Self::validate`]s.
    pub fn from_json(value: &Value) -> Result<Self, V41ConfigError> {
        if !value.is_object() {
            return Err(invalid("config", "expected a JSON object"));
        }
        let text = match value.get("text_config") {
            None | Some(Value::Null) => value,
            Some(t @ Value::Object(_)) => t,
            Some(v) => {
                return Err(invalid(
                    "text_config",
                    format!("expected an object, found {v}"),
                ));
            }
        };
        if let Some(t) = value.get("model_type").and_then(Value::as_str)
            && t != "deepseek_v41"
            && t != "deepseek_v41_text"
        {
            return Err(invalid(
                "model_type",
                format!("expected deepseek_v41 or deepseek_v41_text, found `{t}`"),
            ));
        }
        if !std::ptr::eq(text, value)
            && let Some(t) = text.get("model_type").and_then(Value::as_str)
            && t != "deepseek_v41_text"
        {
            return Err(invalid(
                "text_config.model_type",
                format!("expected deepseek_v41_text, found `{t}`"),
            ));
        }
        // Values that select math are enums; an unknown one is reported with its field.
        for (field, check) in [
            (
                "scoring_func",
                check_field::<ScoringFunc>(text, "scoring_func"),
            ),
            ("hidden_act", check_field::<HiddenAct>(text, "hidden_act")),
        ] {
            check.map_err(|rule| invalid(field, rule))?;
        }
        let mut c: DeepseekV41Config = serde_json::from_value(text.clone())?;
        let n = c.num_hidden_layers;
        if n == 0 || n > MAX_LAYERS {
            return Err(invalid(
                "num_hidden_layers",
                format!("expected 1..={MAX_LAYERS}, found {n}"),
            ));
        }
        if c.num_nextn_predict_layers > MAX_LAYERS {
            return Err(invalid(
                "num_nextn_predict_layers",
                format!(
                    "expected at most {MAX_LAYERS}, found {}",
                    c.num_nextn_predict_layers
                ),
            ));
        }

        // Composite-level fields: the reference's text config sees the top-level
        // quantization_config, and `tie_word_embeddings` is declared at both levels.
        c.image_token_id = match opt_int(value, "image_token_id")? {
            Some(v) => usize::try_from(v)
                .map_err(|_| invalid("image_token_id", format!("expected >= 0, found {v}")))?,
            None => d_image_token(),
        };
        c.tie_word_embeddings |= value
            .get("tie_word_embeddings")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        c.quantization_config = match value
            .get("quantization_config")
            .or_else(|| text.get("quantization_config"))
        {
            None | Some(Value::Null) => None,
            Some(q) => Some(serde_json::from_value(q.clone())?),
        };

        c.resolve_schedule(text)?;
        c.resolve_engram(text)?;
        c.resolve_rope()?;
        c.validate()?;
        Ok(c)
    }

    /// `compress_ratios`, the KV / index / candidate sources and the DSpark targets, as the
    /// reference's `__post_init__` derives them, and its checks on them.
    fn resolve_schedule(&mut self, text: &Value) -> Result<(), V41ConfigError> {
        let n = self.num_hidden_layers;
        let n_nextn = self.num_nextn_predict_layers;
        let ratios = match layer_list(text, "compress_ratios")? {
            Some(r) => r,
            None if n == DEFAULT_COMPRESS_RATIOS.len() => DEFAULT_COMPRESS_RATIOS.to_vec(),
            None => {
                let slide = n.min(2);
                let enc = (n - slide).div_ceil(2);
                let mut r = vec![0; slide];
                r.resize(slide + enc, 2);
                r.resize(n, 1);
                r
            }
        };
        if ratios.len() < n || ratios.len() > n + n_nextn {
            return Err(invalid(
                "compress_ratios",
                format!(
                    "expected num_hidden_layers ({n}) to num_hidden_layers + \
                     num_nextn_predict_layers ({}) entries, found {}",
                    n + n_nextn,
                    ratios.len()
                ),
            ));
        }
        let mut ratios = ratios;
        // The DSpark layers are sliding-window only: missing trailing entries are 0.
        ratios.resize(n + n_nextn, 0);
        let backbone = &ratios[..n];
        let is_default_schedule =
            n <= DEFAULT_COMPRESS_RATIOS.len() && backbone == &DEFAULT_COMPRESS_RATIOS[..n];

        let kv = match layer_list(text, "kv_source_layer_ids")? {
            Some(k) => k,
            None if is_default_schedule => DEFAULT_KV_SOURCES.to_vec(),
            // The first layer of each same-ratio run publishes for its group.
            None => (0..n)
                .filter(|&i| backbone[i] > 0 && (i == 0 || backbone[i - 1] != backbone[i]))
                .collect(),
        };
        let index = match layer_list(text, "index_source_layer_ids")? {
            Some(x) => x,
            None if kv == DEFAULT_KV_SOURCES => DEFAULT_INDEX_SOURCES.to_vec(),
            None => kv.clone(),
        };
        for (field, ids) in [
            ("kv_source_layer_ids", &kv),
            ("index_source_layer_ids", &index),
        ] {
            if let Some(&i) = ids.iter().find(|&&i| i >= n) {
                return Err(invalid(
                    field,
                    format!("layer {i} is past num_hidden_layers ({n}) in {}", list(ids)),
                ));
            }
            if let Some(&i) = ids.iter().find(|&&i| backbone[i] == 0) {
                return Err(invalid(
                    field,
                    format!(
                        "layer {i} has compress_ratios[{i}] = 0; a source needs a compressed \
                         branch (ratio > 0)"
                    ),
                ));
            }
        }
        if let Some(&i) = index
            .iter()
            .find(|&&i| !kv.contains(&i) && !kv.iter().any(|&s| s < i))
        {
            return Err(invalid(
                "index_source_layer_ids",
                format!(
                    "index source {i} has no KV source before it to publish the indexer keys \
                     (kv_source_layer_ids {})",
                    list(&kv)
                ),
            ));
        }
        let candidate = match opt_int(text, "candidate_source_layer_id")? {
            None => kv.last().copied(),
            Some(v) if v < 0 => None,
            Some(v) => Some(v as usize),
        };
        if let Some(cand) = candidate
            && !index.contains(&cand)
        {
            return Err(invalid(
                "candidate_source_layer_id",
                format!(
                    "{cand} must be one of index_source_layer_ids {}",
                    list(&index)
                ),
            ));
        }
        if let Some(i) = (0..n).find(|&i| backbone[i] > 0 && !kv.iter().any(|&s| s <= i)) {
            return Err(invalid(
                "compress_ratios",
                format!(
                    "layer {i} has ratio {} but no kv_source_layer_ids entry at or before it",
                    backbone[i]
                ),
            ));
        }
        let dspark = match layer_list(text, "dspark_target_layer_ids")? {
            Some(d) => d,
            None => {
                let rest: Vec<usize> = (0..n).filter(|i| !kv.contains(i)).collect();
                rest[rest.len().saturating_sub(3)..].to_vec()
            }
        };
        if let Some(&i) = dspark.iter().find(|&&i| i >= n) {
            return Err(invalid(
                "dspark_target_layer_ids",
                format!("layer {i} is past num_hidden_layers ({n})"),
            ));
        }
        self.compress_ratios = ratios;
        self.kv_source_layer_ids = kv;
        self.index_source_layer_ids = index;
        self.candidate_source_layer_id = candidate;
        self.dspark_target_layer_ids = dspark;
        self.roles = self.derive_roles()?;
        Ok(())
    }

    /// Walks the layers in order, tracking what the reference's per-forward `shared` dict
    /// holds when each layer reads it.
    fn derive_roles(&self) -> Result<Vec<LayerRole>, V41ConfigError> {
        let n = self.num_hidden_layers;
        let kv = &self.kv_source_layer_ids;
        let index = &self.index_source_layer_ids;
        let cand = self.candidate_source_layer_id;
        let mut roles = Vec::with_capacity(n);
        // The last KV source, the last index source and the last key publisher seen.
        let mut group: Option<usize> = None;
        let mut last_index: Option<usize> = None;
        let mut keys: Option<usize> = None;
        for il in 0..n {
            let ratio = self.compress_ratios[il];
            let is_kv = kv.contains(&il);
            let is_index = index.contains(&il);
            if is_kv {
                group = Some(il);
            }
            let mut role = LayerRole {
                compress_ratio: ratio,
                rope: if ratio > 0 {
                    RopeSet::Compress
                } else {
                    RopeSet::Main
                },
                kv: KvRole::SlidingOnly,
                index: IndexRole::None,
                candidate: CandidateRole::None,
                engram: None,
            };
            if ratio > 0 {
                // resolve_schedule checked that every compressed layer has a source before.
                let Some(source) = group else {
                    return Err(invalid(
                        "kv_source_layer_ids",
                        format!("layer {il} has no KV source at or before it"),
                    ));
                };
                role.kv = if is_kv {
                    KvRole::Source
                } else {
                    KvRole::Reuse { source }
                };
                if is_index {
                    if is_kv {
                        keys = Some(il);
                        role.index = IndexRole::Source;
                    } else if keys == Some(source) {
                        role.index = IndexRole::Reindex { keys_from: source };
                    } else {
                        return Err(invalid(
                            "index_source_layer_ids",
                            format!(
                                "index source {il} has no indexer keys of its own KV group to \
                                 score: its KV source {source} is not an index source, so the \
                                 reference would read another group's keys or none \
                                 (unsupported schedule)"
                            ),
                        ));
                    }
                    last_index = Some(il);
                    role.candidate = match cand {
                        Some(c) if c == il => CandidateRole::Source,
                        Some(c) if c < il => {
                            if source > c {
                                return Err(invalid(
                                    "candidate_source_layer_id",
                                    format!(
                                        "index source {il} (KV group {source}) would be \
                                         restricted by the candidate blocks of layer {c}, in \
                                         another KV group (unsupported schedule)"
                                    ),
                                ));
                            }
                            CandidateRole::Restricted { by: c }
                        }
                        _ => CandidateRole::None,
                    };
                } else {
                    role.index = match last_index {
                        Some(from) if from >= source => IndexRole::Reuse { from },
                        None => IndexRole::None,
                        Some(from) => {
                            return Err(invalid(
                                "index_source_layer_ids",
                                format!(
                                    "layer {il} (KV group {source}) would attend the top-k of \
                                     index source {from}, chosen over another KV group's \
                                     entries (unsupported schedule)"
                                ),
                            ));
                        }
                    };
                }
            }
            roles.push(role);
        }
        Ok(roles)
    }

    /// The Engram fields (the pad id under either name) and the table layout they imply.
    fn resolve_engram(&mut self, text: &Value) -> Result<(), V41ConfigError> {
        let n = self.num_hidden_layers;
        self.engram_layer_ids = layer_list(text, "engram_layer_ids")?.unwrap_or_default();
        let ids = &self.engram_layer_ids;
        self.engram_num_embeddings =
            id_list(text, "engram_num_embeddings")?.unwrap_or_else(|| vec![0; ids.len()]);
        if let Some(&i) = ids.iter().find(|&&i| i >= n) {
            return Err(invalid(
                "engram_layer_ids",
                format!("layer {i} is past num_hidden_layers ({n})"),
            ));
        }
        if let Some((k, &i)) = ids.iter().enumerate().find(|&(k, i)| ids[..k].contains(i)) {
            return Err(invalid(
                "engram_layer_ids",
                format!("layer {i} is listed twice (again at entry {k}); each layer has one table"),
            ));
        }
        if self.engram_num_embeddings.len() != ids.len() {
            return Err(invalid(
                "engram_num_embeddings",
                format!(
                    "expected one row count per engram_layer_ids entry ({}), found {}",
                    ids.len(),
                    self.engram_num_embeddings.len()
                ),
            ));
        }
        let pad_token = opt_int(text, "engram_pad_token_id")?;
        let pad = opt_int(text, "engram_pad_id")?;
        let pad = match (pad_token, pad) {
            (Some(a), Some(b)) if a != b => {
                return Err(invalid(
                    "engram_pad_token_id",
                    format!("{a} disagrees with engram_pad_id {b}"),
                ));
            }
            (Some(a), _) | (None, Some(a)) => a,
            (None, None) => 2,
        };
        self.engram_pad_token_id = usize::try_from(pad).map_err(|_| {
            invalid(
                "engram_pad_token_id",
                format!("expected a token id >= 0, found {pad}"),
            )
        })?;
        for (role, il) in self.roles.iter_mut().zip(0..) {
            role.engram = self.engram_layer_ids.iter().position(|&e| e == il);
        }
        if self.engram_layer_ids.is_empty() {
            return Ok(());
        }
        for (field, v, min) in [
            // Orders 2..N are hashed: N = 1 would leave no hash column.
            ("engram_max_ngram_size", self.engram_max_ngram_size, 2),
            ("engram_n_heads", self.engram_n_heads, 1),
            ("engram_head_dim", self.engram_head_dim, 1),
        ] {
            if v < min {
                return Err(invalid(
                    field,
                    format!("expected >= {min} with Engram layers, found {v}"),
                ));
            }
        }
        if !self.engram_head_dim.is_multiple_of(ENGRAM_SCALE_BLOCK) {
            return Err(invalid(
                "engram_head_dim",
                format!(
                    "expected a multiple of {ENGRAM_SCALE_BLOCK} (one table scale per \
                     {ENGRAM_SCALE_BLOCK} channels), found {}",
                    self.engram_head_dim
                ),
            ));
        }
        (self.engram_max_ngram_size - 1)
            .checked_mul(self.engram_n_heads)
            .and_then(|c| c.checked_mul(self.engram_layer_ids.len()))
            .filter(|&c| c <= MAX_ENGRAM_HASH_COLUMNS)
            .ok_or_else(|| {
                invalid(
                    "engram_n_heads",
                    format!(
                        "expected Engram layers * (engram_max_ngram_size - 1) * \
                         engram_n_heads <= {MAX_ENGRAM_HASH_COLUMNS} (one prime each)"
                    ),
                )
            })?;
        if self.engram_compressed_vocab_size == 0
            || self.engram_compressed_vocab_size > u64::from(u32::MAX)
        {
            return Err(invalid(
                "engram_compressed_vocab_size",
                format!(
                    "expected 1..={}, found {}",
                    u32::MAX,
                    self.engram_compressed_vocab_size
                ),
            ));
        }
        if self.engram_pad_token_id >= self.vocab_size {
            return Err(invalid(
                "engram_pad_token_id",
                format!(
                    "{} is past vocab_size ({})",
                    self.engram_pad_token_id, self.vocab_size
                ),
            ));
        }
        let layout = EngramLayout::new(
            self.engram_layer_ids.len(),
            self.engram_vocab_size,
            self.engram_max_ngram_size,
            self.engram_n_heads,
        )
        .map_err(|e| invalid("engram_vocab_size", e.to_string()))?;
        for (k, (&rows, &want)) in self
            .engram_num_embeddings
            .iter()
            .zip(layout.table_rows())
            .enumerate()
        {
            if rows != want {
                return Err(invalid(
                    "engram_num_embeddings",
                    format!(
                        "table {k} (layer {}) has {rows} rows but the prime layout of \
                         engram_vocab_size {}, engram_max_ngram_size {} and engram_n_heads {} \
                         addresses {want}",
                        self.engram_layer_ids[k],
                        self.engram_vocab_size,
                        self.engram_max_ngram_size,
                        self.engram_n_heads
                    ),
                ));
            }
        }
        self.engram_layout = Some(layout);
        Ok(())
    }

    fn resolve_rope(&mut self) -> Result<(), V41ConfigError> {
        if self.head_dim == 0 {
            return Err(invalid("head_dim", "expected > 0, found 0"));
        }
        let prf = self.qk_rope_head_dim as f64 / self.head_dim as f64;
        // The release's flat form: `rope_scaling` carries the compressed branch's YaRN keys.
        let flat = self.rope_scaling.as_ref().or(self.rope_parameters.as_ref());
        let (main, compress) = crate::config::rope_sets(
            self.rope_parameters.as_ref(),
            flat,
            self.rope_theta,
            self.compress_rope_theta,
            prf,
        )?;
        self.rope_main = Some(main);
        self.rope_compress = Some(compress);
        Ok(())
    }

    /// Checks every invariant the forward relies on that [`Self::from_json`] has not already
    /// checked while resolving: positive sizes, float ranges, unsupported options, the RoPE
    /// sets, and that every tensor size fits in `usize`.
    pub fn validate(&self) -> Result<(), V41ConfigError> {
        model_core::config::check_positive(&[
            ("rms_norm_eps", self.rms_norm_eps),
            ("hc_eps", self.hc_eps),
            ("routed_scaling_factor", self.routed_scaling_factor),
            ("gate_temp", self.gate_temp),
            ("rope_theta", self.rope_theta),
            ("compress_rope_theta", self.compress_rope_theta),
        ])
        .map_err(|(field, rule)| invalid(field, rule))?;
        let n = self.num_hidden_layers;
        if self.roles.len() != n || self.compress_ratios.len() != n + self.num_nextn_predict_layers
        {
            return Err(invalid(
                "compress_ratios",
                "not resolved (use DeepseekV41Config::from_json)",
            ));
        }
        let mut positive = vec![
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("head_dim", self.head_dim),
            ("q_lora_rank", self.q_lora_rank),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("n_routed_experts", self.n_routed_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("hc_mult", self.hc_mult),
            ("sliding_window", self.sliding_window),
            ("o_groups", self.o_groups),
            ("o_lora_rank", self.o_lora_rank),
        ];
        if !self.index_source_layer_ids.is_empty() {
            positive.extend([
                ("index_n_heads", self.index_n_heads),
                ("index_head_dim", self.index_head_dim),
                ("index_topk", self.index_topk),
            ]);
        }
        if self.candidate_source_layer_id.is_some() {
            positive.extend([
                ("candidate_topk_blocks", self.candidate_topk_blocks),
                ("candidate_block_size", self.candidate_block_size),
            ]);
        }
        for (field, v) in positive {
            if v == 0 {
                return Err(invalid(field, "expected > 0, found 0"));
            }
        }
        // A negative limit inverts the clamp interval and NaN makes it undefined.
        if self.swiglu_limit.is_nan() || self.swiglu_limit < 0.0 {
            return Err(invalid(
                "swiglu_limit",
                format!("expected >= 0, found {}", self.swiglu_limit),
            ));
        }
        if self.num_experts_per_tok > self.n_routed_experts {
            return Err(invalid(
                "num_experts_per_tok",
                format!(
                    "expected at most n_routed_experts ({}), found {}",
                    self.n_routed_experts, self.num_experts_per_tok
                ),
            ));
        }
        for (field, v) in [
            ("tie_word_embeddings", self.tie_word_embeddings),
            ("attention_bias", self.attention_bias),
        ] {
            if v {
                return Err(invalid(field, "expected false (not supported)"));
            }
        }
        if let Some(q) = &self.quantization_config
            && let Some(b) = &q.weight_block_size
            && (b.len() != 2 || b.contains(&0))
        {
            return Err(invalid(
                "quantization_config.weight_block_size",
                format!("expected two positive sizes, found {b:?}"),
            ));
        }
        self.check_sizes()?;
        if !(self.num_attention_heads * self.head_dim).is_multiple_of(self.o_groups) {
            return Err(invalid(
                "o_groups",
                "expected a divisor of num_attention_heads * head_dim \
                 (construction: DeepseekV41GroupedLinear)",
            ));
        }
        let any_index = !self.index_source_layer_ids.is_empty();
        for (field, rp, width) in [
            (
                "rope_parameters.main",
                self.rope_main.as_ref(),
                self.head_dim,
            ),
            (
                "rope_parameters.compress",
                self.rope_compress.as_ref(),
                if any_index {
                    self.head_dim.min(self.index_head_dim)
                } else {
                    self.head_dim
                },
            ),
        ] {
            let rp = rp.ok_or_else(|| invalid(field, "not resolved (use from_json)"))?;
            let rot = rot_dim(rp, self.head_dim);
            if rot == 0 || rot > width || !rot.is_multiple_of(2) {
                return Err(invalid(
                    field,
                    format!(
                        "expected an even rotary dim in [2, {width}] (head_dim, and \
                         index_head_dim with index sources), found {rot}"
                    ),
                ));
            }
            if let crate::config::RopeKind::Yarn {
                factor,
                original_max_position_embeddings,
                ..
            } = rp.kind
                && (factor <= 0.0 || original_max_position_embeddings <= 0.0)
            {
                return Err(invalid(
                    field,
                    "expected yarn `factor` and `original_max_position_embeddings` > 0",
                ));
            }
        }
        Ok(())
    }

    /// Every product of config fields that sizes a tensor or a per-token buffer, with
    /// overflow checks, so that later plain arithmetic on them cannot wrap.
    fn check_sizes(&self) -> Result<(), V41ConfigError> {
        let mul = |field: &'static str, what: &str, a: usize, b: usize| {
            a.checked_mul(b).ok_or_else(|| {
                invalid(
                    field,
                    format!("{what} = {a} * {b} overflows usize (tensor size)"),
                )
            })
        };
        let (hc, d) = (self.hc_mult, self.hidden_size);
        mul(
            "num_attention_heads",
            "num_attention_heads * head_dim",
            self.num_attention_heads,
            self.head_dim,
        )?;
        let hc_rows = mul(
            "hc_mult",
            "(2 + hc_mult) * hc_mult",
            hc.saturating_add(2),
            hc,
        )?;
        let streams = mul("hc_mult", "hc_mult * hidden_size", hc, d)?;
        mul("hc_mult", "mHC fn size", hc_rows, streams)?;
        mul("vocab_size", "vocab_size * hidden_size", self.vocab_size, d)?;
        mul(
            "o_lora_rank",
            "o_groups * o_lora_rank",
            self.o_groups,
            self.o_lora_rank,
        )?;
        let i2 = mul(
            "moe_intermediate_size",
            "2 * moe_intermediate_size",
            2,
            self.moe_intermediate_size,
        )?;
        mul("moe_intermediate_size", "experts.gate_up_proj size", i2, d)?;
        mul(
            "n_routed_experts",
            "n_routed_experts * hidden_size",
            self.n_routed_experts,
            d,
        )?;
        mul(
            "q_lora_rank",
            "q_lora_rank * hidden_size",
            self.q_lora_rank,
            d,
        )?;
        mul(
            "index_n_heads",
            "index_n_heads * index_head_dim",
            self.index_n_heads,
            self.index_head_dim,
        )?;
        if let Some(layout) = &self.engram_layout {
            let width = mul(
                "engram_head_dim",
                "hash columns * engram_head_dim",
                layout.n_cols(),
                self.engram_head_dim,
            )?;
            let out = mul(
                "hc_mult",
                "(hc_mult + 1) * hidden_size",
                hc.saturating_add(1),
                d,
            )?;
            mul("engram_head_dim", "engram.wkv size", width, out)?;
            for &rows in layout.table_rows() {
                let rows = usize::try_from(rows).map_err(|_| {
                    invalid(
                        "engram_num_embeddings",
                        format!("{rows} rows do not fit in usize"),
                    )
                })?;
                mul(
                    "engram_num_embeddings",
                    "table rows * engram_head_dim",
                    rows,
                    self.engram_head_dim,
                )?;
            }
        }
        Ok(())
    }

    /// What each backbone layer does.
    pub fn roles(&self) -> &[LayerRole] {
        &self.roles
    }

    /// Layer `il`'s role (`None` past the backbone).
    pub fn role(&self, il: usize) -> Option<&LayerRole> {
        self.roles.get(il)
    }

    /// The reference's `layer_types`.
    pub fn layer_types(&self) -> Vec<&'static str> {
        self.roles.iter().map(LayerRole::layer_type).collect()
    }

    /// The Engram table layout (`None` without Engram layers).
    pub fn engram_layout(&self) -> Option<&EngramLayout> {
        self.engram_layout.as_ref()
    }

    /// The `main` RoPE set.
    pub fn rope_main(&self) -> Option<&RopeParams> {
        self.rope_main.as_ref()
    }

    /// The `compress` RoPE set.
    pub fn rope_compress(&self) -> Option<&RopeParams> {
        self.rope_compress.as_ref()
    }

    /// Rotating channels (the trailing ones) of a head under `rp`.
    pub fn rotary_dim(&self, rp: &RopeParams) -> usize {
        rot_dim(rp, self.head_dim)
    }
}

/// `int(head_dim * partial_rotary_factor)`, rounded up to a pair (`arange(0, dim, 2)` gives
/// `ceil(dim / 2)` frequencies, each rotating a pair).
fn rot_dim(rp: &RopeParams, head_dim: usize) -> usize {
    let dim = (head_dim as f64 * rp.partial_rotary_factor) as usize;
    2 * dim.div_ceil(2)
}
