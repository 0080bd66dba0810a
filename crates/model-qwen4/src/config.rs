//! `Qwen4ExpTextConfig`: the text config of qwen4_exp, as the CMF header stores it (the composite
//! config's `text_config`).
//!
//! Field names and defaults mirror transformers 5.24's `configuration_qwen4_exp.py`
//! (`Qwen4ExpTextConfig`); only fields that change the math are kept. [`Qwen4ExpTextConfig::from_json`]
//! applies the reference's `__post_init__` (derived `layer_types`, `full_attention` rewritten to
//! `indexed_attention`, `ple_layer_ids` sorted and deduplicated) and then
//! [`Qwen4ExpTextConfig::validate`], which mirrors `validate_architecture`.

use model_core::config::check_field;
use model_core::config_enum;
use serde::Deserialize;
use serde_json::Value;

/// A config that cannot be used: the field and the broken rule.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The JSON does not have the expected types.
    #[error("qwen4_exp text config: {0}")]
    Json(#[from] serde_json::Error),
    /// A field breaks a rule of the reference.
    #[error("qwen4_exp text config: `{field}`: {rule}")]
    Invalid {
        /// The field at fault.
        field: &'static str,
        /// The rule, with its source.
        rule: String,
    },
}

fn invalid(field: &'static str, rule: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field,
        rule: rule.into(),
    }
}

config_enum! {
    /// The token mixer of one decoder layer (`layer_types`).
    pub enum LayerType {
        /// Gated DeltaNet (`linear_attention`).
        LinearAttention = "linear_attention",
        /// Full attention with the QSA indexer (`indexed_attention`; `full_attention` is
        /// rewritten to this by the reference's `__post_init__`).
        IndexedAttention = "indexed_attention" | "full_attention",
    }
}

config_enum! {
    /// MLP / expert / GDN conv activation (`hidden_act`; only silu is supported).
    pub enum HiddenAct {
        /// `silu`.
        Silu = "silu",
    }
}

config_enum! {
    /// Output gate activation of the GDN gated norm (`output_gate_type`).
    pub enum GateAct {
        /// `sigmoid` (the release).
        Sigmoid = "sigmoid",
        /// `silu` (Qwen3.5's choice).
        Silu = "silu",
    }
}

config_enum! {
    /// How RoPE frequencies are made (`rope_parameters.rope_type`; only `default`).
    pub enum RopeType {
        /// `inv_freq_i = 1 / theta^(2i / dim)`.
        Default = "default",
    }
}

/// `eos_token_id`: one id or a list (the reference uses the first).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    /// One id.
    One(i64),
    /// Several ids.
    Many(Vec<i64>),
}

/// `rope_parameters` (only the fields the text forward uses; the mRoPE section layout is
/// irrelevant for text, whose three position axes are equal).
#[derive(Debug, Clone, Deserialize)]
pub struct RopeParameters {
    /// Only `default` is supported (the released value).
    #[serde(default = "d_rope_type")]
    pub rope_type: RopeType,
    /// RoPE base.
    #[serde(default = "d_rope_theta")]
    pub rope_theta: f64,
    /// Fraction of `head_dim` that rotates (reference default 1.0).
    #[serde(default = "d_one")]
    pub partial_rotary_factor: f64,
}

fn d_rope_type() -> RopeType {
    RopeType::Default
}
fn d_rope_theta() -> f64 {
    10000.0
}
fn d_one() -> f64 {
    1.0
}

macro_rules! defaults {
    ($($name:ident: $ty:ty = $value:expr;)*) => {
        $(fn $name() -> $ty { $value })*
    };
}

defaults! {
    d_vocab: usize = 248320;
    d_hidden: usize = 2048;
    d_layers: usize = 40;
    d_heads: usize = 16;
    d_kv_heads: usize = 2;
    d_act: HiddenAct = HiddenAct::Silu;
    d_eps: f64 = 1e-6;
    d_head_dim: usize = 256;
    d_4: usize = 4;
    d_128: usize = 128;
    d_16: usize = 16;
    d_32: usize = 32;
    d_512: usize = 512;
    d_10: usize = 10;
    d_320: usize = 320;
    d_3: usize = 3;
    d_8: usize = 8;
    d_ngram_base: u64 = 20_000_000;
    d_seed: u64 = 1234;
    d_true: bool = true;
}

/// The qwen4_exp text config (transformers' `Qwen4ExpTextConfig`, 5.24 defaults).
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen4ExpTextConfig {
    /// Token vocabulary (default 248320).
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    /// D, the width of one hyper-connection stream (default 2048).
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    /// Decoder layers (default 40).
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    /// Full-attention query heads (default 16).
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    /// Full-attention KV heads (default 2).
    #[serde(default = "d_kv_heads")]
    pub num_key_value_heads: usize,
    /// MLP / expert / GDN conv activation (default `silu`; the only one supported).
    #[serde(default = "d_act")]
    pub hidden_act: HiddenAct,
    /// RMSNorm epsilon (default 1e-6).
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f64,
    /// Full-attention head dim (default 256).
    #[serde(default = "d_head_dim")]
    pub head_dim: usize,
    /// RoPE parameters (reference: required; `rope_type` default).
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    /// GDN depthwise conv kernel (default 4).
    #[serde(default = "d_4")]
    pub linear_conv_kernel_dim: usize,
    /// GDN key head dim (default 128).
    #[serde(default = "d_128")]
    pub linear_key_head_dim: usize,
    /// GDN value head dim (default 128).
    #[serde(default = "d_128")]
    pub linear_value_head_dim: usize,
    /// GDN key heads (default 16).
    #[serde(default = "d_16")]
    pub linear_num_key_heads: usize,
    /// GDN value heads (default 32).
    #[serde(default = "d_32")]
    pub linear_num_value_heads: usize,
    /// Routed expert FFN width (default 512).
    #[serde(default = "d_512")]
    pub moe_intermediate_size: usize,
    /// Shared expert FFN width (default 512).
    #[serde(default = "d_512")]
    pub shared_expert_intermediate_size: usize,
    /// Experts per token (default 10).
    #[serde(default = "d_10")]
    pub num_experts_per_tok: usize,
    /// Routed experts (default 512).
    #[serde(default = "d_512")]
    pub num_experts: usize,
    /// Renormalise the top-k probabilities (default true).
    #[serde(default = "d_true")]
    pub norm_topk_prob: bool,
    /// Per-layer mixer kinds; derived from `full_attention_interval` (default 4) when absent.
    #[serde(default)]
    pub layer_types: Option<Vec<LayerType>>,
    /// Interval of the derived layer pattern (a constructor kwarg in the reference, default 4).
    #[serde(default)]
    pub full_attention_interval: Option<usize>,
    /// EOS id(s); required when PLE is on (EOS delimits the n-gram contexts).
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    /// Hyper-connection streams (default 4, must be > 1).
    #[serde(default = "d_4")]
    pub hc_count: usize,
    /// Low rank of the HC input mixer (default 320).
    #[serde(default = "d_320")]
    pub hc_lowrank: usize,
    /// ONE-indexed layer ids carrying PLE (default none).
    #[serde(default)]
    pub ple_layer_ids: Option<Vec<usize>>,
    /// Width of the concatenated n-gram embedding (default `hidden_size`).
    #[serde(default)]
    pub ple_embed_dim: Option<usize>,
    /// PLE dilated conv kernel (default 4; dilation = `ngram_size`).
    #[serde(default = "d_4")]
    pub ple_conv_kernel_size: usize,
    /// Largest n-gram order (default 3; orders 2..=ngram_size).
    #[serde(default = "d_3")]
    pub ngram_size: usize,
    /// Hash heads per n-gram order (default 8).
    #[serde(default = "d_8")]
    pub heads_per_ngram: usize,
    /// Primes for the head vocabularies are searched from here (default 20,000,000).
    #[serde(default = "d_ngram_base")]
    pub ngram_vocab_size_base: u64,
    /// Padding of the n-gram table rows (default 128).
    #[serde(default = "d_128")]
    pub make_ngram_vocab_size_divisible_by: usize,
    /// Seed of the hash multipliers (default 1234).
    #[serde(default = "d_seed")]
    pub seed: u64,
    /// Checkpoint shards of each n-gram table (default 512).
    #[serde(default = "d_512")]
    pub split_ngram_parts: usize,
    /// QSA indexer query heads (all five QSA fields or none).
    #[serde(default)]
    pub indexer_n_heads: Option<usize>,
    /// QSA indexer key heads (must be 1).
    #[serde(default)]
    pub indexer_kv_heads: Option<usize>,
    /// QSA indexer head dim.
    #[serde(default)]
    pub indexer_head_dim: Option<usize>,
    /// QSA token budget from complete blocks.
    #[serde(default)]
    pub indexer_budget: Option<usize>,
    /// Tokens per QSA block.
    #[serde(default)]
    pub indexer_compress_ratio: Option<usize>,
    /// GDN gated-norm activation (`sigmoid` or `silu`; default `hidden_act`).
    #[serde(default)]
    pub output_gate_type: Option<GateAct>,
    /// Untied in every release; tying is not supported.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Biases on the attention projections (default false; not supported).
    #[serde(default)]
    pub attention_bias: bool,
}

/// The QSA indexer geometry (present when the five indexer fields are set).
#[derive(Debug, Clone, Copy)]
pub struct Qsa {
    /// Query heads.
    pub n_heads: usize,
    /// Head dim.
    pub head_dim: usize,
    /// Token budget from complete blocks.
    pub budget: usize,
    /// Tokens per block.
    pub ratio: usize,
}

impl Qsa {
    /// Blocks kept per query: `indexer_budget / indexer_compress_ratio`.
    pub fn block_topk(&self) -> usize {
        self.budget / self.ratio
    }
}

impl Qwen4ExpTextConfig {
    /// Parses the text config (the CMF header's `config`), applies the reference's
    /// `__post_init__`, then [`Self::validate`].
    pub fn from_json(value: &Value) -> Result<Self, ConfigError> {
        // Values that select math are enums; an unknown one is reported with its field.
        let rope = value.get("rope_parameters").unwrap_or(&Value::Null);
        for (field, check) in [
            (
                "layer_types",
                check_field::<LayerType>(value, "layer_types"),
            ),
            ("hidden_act", check_field::<HiddenAct>(value, "hidden_act")),
            (
                "output_gate_type",
                check_field::<GateAct>(value, "output_gate_type"),
            ),
            (
                "rope_parameters",
                check_field::<RopeType>(rope, "rope_type"),
            ),
        ] {
            check.map_err(|rule| invalid(field, rule))?;
        }
        let mut c: Qwen4ExpTextConfig = serde_json::from_value(value.clone())?;
        // __post_init__: ple_layer_ids = sorted(set(...)).
        let mut ids = c.ple_layer_ids.take().unwrap_or_default();
        ids.sort_unstable();
        ids.dedup();
        c.ple_layer_ids = Some(ids);
        // __post_init__: layer_types derived from the interval when absent (`full_attention`
        // already parsed as `indexed_attention`).
        if c.layer_types.is_none() {
            let interval = c.full_attention_interval.unwrap_or(4);
            if interval == 0 {
                return Err(invalid("full_attention_interval", "must be > 0"));
            }
            c.layer_types = Some(
                (0..c.num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % interval != 0 {
                            LayerType::LinearAttention
                        } else {
                            LayerType::IndexedAttention
                        }
                    })
                    .collect(),
            );
        }
        c.validate()?;
        Ok(c)
    }

    /// Checks every invariant the forward relies on. The rules are transformers'
    /// `Qwen4ExpTextConfig.validate_architecture` (quoted per check) plus shape rules the
    /// reference enforces by construction (marked "construction").
    pub fn validate(&self) -> Result<(), ConfigError> {
        let rope = self.rope();
        model_core::config::check_positive(&[
            ("rms_norm_eps", self.rms_norm_eps),
            ("rope_parameters.rope_theta", rope.rope_theta),
            (
                "rope_parameters.partial_rotary_factor",
                rope.partial_rotary_factor,
            ),
        ])
        .map_err(|(field, rule)| invalid(field, rule))?;
        let types = self.layer_types.as_deref().unwrap_or(&[]);
        if types.len() != self.num_hidden_layers {
            return Err(invalid(
                "layer_types",
                format!(
                    "has {} entries but num_hidden_layers is {}",
                    types.len(),
                    self.num_hidden_layers
                ),
            ));
        }
        if self.hc_count <= 1 {
            return Err(invalid(
                "hc_count",
                format!(
                    "must be > 1, got {} (validate_architecture; qwen4exp.cpp)",
                    self.hc_count
                ),
            ));
        }
        if self.num_experts == 0 {
            return Err(invalid(
                "num_experts",
                "must be > 0 (validate_architecture)",
            ));
        }
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
            return Err(invalid(
                "num_experts_per_tok",
                format!(
                    "must be in [1, num_experts={}], got {} (validate_architecture)",
                    self.num_experts, self.num_experts_per_tok
                ),
            ));
        }
        if self.moe_intermediate_size == 0 || self.shared_expert_intermediate_size == 0 {
            return Err(invalid(
                "moe_intermediate_size",
                "moe_intermediate_size and shared_expert_intermediate_size must be > 0 (validate_architecture)",
            ));
        }
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
            ("hc_lowrank", self.hc_lowrank),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(invalid(field, "must be > 0 (construction)"));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(invalid(
                "num_key_value_heads",
                "must divide num_attention_heads (construction: repeat_kv)",
            ));
        }
        if !self
            .linear_num_value_heads
            .is_multiple_of(self.linear_num_key_heads)
        {
            return Err(invalid(
                "linear_num_value_heads",
                "must be a multiple of linear_num_key_heads (construction: repeat_interleave)",
            ));
        }
        if self.tie_word_embeddings {
            return Err(invalid(
                "tie_word_embeddings",
                "tied embeddings are not supported",
            ));
        }
        if self.attention_bias {
            return Err(invalid(
                "attention_bias",
                "attention biases are not supported",
            ));
        }
        let rot = self.rotary_dim();
        if rot == 0 || !rot.is_multiple_of(2) || rot > self.head_dim {
            return Err(invalid(
                "rope_parameters",
                format!("rotary dim {rot} must be even and in [2, head_dim]"),
            ));
        }

        // QSA: all five fields or none (validate_architecture).
        let qsa = [
            ("indexer_n_heads", self.indexer_n_heads),
            ("indexer_kv_heads", self.indexer_kv_heads),
            ("indexer_head_dim", self.indexer_head_dim),
            ("indexer_budget", self.indexer_budget),
            ("indexer_compress_ratio", self.indexer_compress_ratio),
        ];
        let any_set = qsa.iter().any(|(_, v)| v.is_some());
        let has_attention = types.contains(&LayerType::IndexedAttention);
        if any_set || has_attention {
            for (field, v) in qsa {
                match v {
                    None => {
                        return Err(invalid(
                            field,
                            "QSA config is missing a required field: the indexer fields are all-or-none \
                             (validate_architecture), and every indexed_attention layer builds an indexer",
                        ));
                    }
                    Some(0) => {
                        return Err(invalid(
                            field,
                            "QSA config values must be positive (validate_architecture)",
                        ));
                    }
                    Some(_) => {}
                }
            }
            if self.indexer_kv_heads != Some(1) {
                return Err(invalid(
                    "indexer_kv_heads",
                    "Qwen4-Exp QSA requires indexer_kv_heads=1 (validate_architecture)",
                ));
            }
            let (b, r) = (
                self.indexer_budget.unwrap_or(0),
                self.indexer_compress_ratio.unwrap_or(1),
            );
            if !b.is_multiple_of(r) {
                return Err(invalid(
                    "indexer_budget",
                    format!(
                        "{b} must be divisible by indexer_compress_ratio {r} (validate_architecture)"
                    ),
                ));
            }
            if rot > self.indexer_head_dim.unwrap_or(0) {
                return Err(invalid(
                    "indexer_head_dim",
                    format!("rotary_dim={rot} must fit the QSA index head (validate_architecture)"),
                ));
            }
        }

        let ple = self.ple_layer_ids.as_deref().unwrap_or(&[]);
        if !ple.is_empty() {
            let heads = self.ngram_heads();
            let dim = self.ple_embed_dim();
            if heads == 0 || dim == 0 || !dim.is_multiple_of(heads) {
                return Err(invalid(
                    "ple_embed_dim",
                    format!(
                        "must be positive and divisible by the {heads} n-gram heads, got {dim} (validate_architecture)"
                    ),
                ));
            }
            if self.ple_conv_kernel_size == 0 || self.make_ngram_vocab_size_divisible_by == 0 {
                return Err(invalid(
                    "ple_conv_kernel_size",
                    "must be > 0 (construction)",
                ));
            }
            for &id in ple {
                if id < 1 || id > self.num_hidden_layers {
                    return Err(invalid(
                        "ple_layer_ids",
                        format!(
                            "ids are ONE-indexed and must lie in [1, {}], got {id} (validate_architecture)",
                            self.num_hidden_layers
                        ),
                    ));
                }
                if types[id - 1] != LayerType::LinearAttention {
                    return Err(invalid(
                        "ple_layer_ids",
                        format!(
                            "PLE is only supported on linear_attention layers, got layer id {id} (validate_architecture)"
                        ),
                    ));
                }
            }
            if self.eos_id().is_none() {
                return Err(invalid(
                    "eos_token_id",
                    "must be set when PLE layers are enabled: EOS delimits the n-gram contexts (validate_architecture)",
                ));
            }
        }
        Ok(())
    }

    /// The mixer kind of layer `il`.
    pub fn layer_type(&self, il: usize) -> LayerType {
        self.layer_types
            .as_ref()
            .and_then(|t| t.get(il).copied())
            .unwrap_or(LayerType::LinearAttention)
    }

    /// The RoPE parameters (reference defaults when absent).
    pub fn rope(&self) -> RopeParameters {
        self.rope_parameters.clone().unwrap_or(RopeParameters {
            rope_type: d_rope_type(),
            rope_theta: d_rope_theta(),
            partial_rotary_factor: 1.0,
        })
    }

    /// Rotating dims per head: `int(head_dim * partial_rotary_factor)`.
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.rope().partial_rotary_factor) as usize
    }

    /// The QSA geometry, when configured.
    pub fn qsa(&self) -> Option<Qsa> {
        Some(Qsa {
            n_heads: self.indexer_n_heads?,
            head_dim: self.indexer_head_dim?,
            budget: self.indexer_budget?,
            ratio: self.indexer_compress_ratio?,
        })
    }

    /// The first EOS id (the reference takes `eos_token_id[0]` of a list).
    pub fn eos_id(&self) -> Option<i64> {
        match &self.eos_token_id {
            Some(TokenIds::One(v)) => Some(*v),
            Some(TokenIds::Many(v)) => v.first().copied(),
            None => None,
        }
    }

    /// The PLE module index (position in the sorted `ple_layer_ids`) of 0-based layer `il`.
    /// `ple_layer_ids` counts from ONE: id 2 is layer index 1.
    pub fn ple_layer_index(&self, il: usize) -> Option<usize> {
        self.ple_layer_ids
            .as_deref()
            .unwrap_or(&[])
            .iter()
            .position(|&id| id == il + 1)
    }

    /// `ple_embed_dim`, defaulting to `hidden_size`.
    pub fn ple_embed_dim(&self) -> usize {
        self.ple_embed_dim.unwrap_or(self.hidden_size)
    }

    /// Hash heads per PLE module: `(ngram_size - 1) * heads_per_ngram`.
    pub fn ngram_heads(&self) -> usize {
        self.ngram_size.saturating_sub(1) * self.heads_per_ngram
    }

    /// GDN gated-norm activation (`output_gate_type`, else `hidden_act`).
    pub fn gate_act(&self) -> GateAct {
        self.output_gate_type.unwrap_or(match self.hidden_act {
            HiddenAct::Silu => GateAct::Silu,
        })
    }
}
