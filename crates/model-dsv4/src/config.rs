//! `DeepseekV4Config`: the config of deepseek_v4 as the CMF header stores it (`config.json`
//! whole).
//!
//! Field names and defaults mirror transformers 5.24's `configuration_deepseek_v4.py`; only
//! fields that change the math are kept. [`DeepseekV4Config::from_json`] applies the reference's
//! `__post_init__` (legacy `compress_ratios` / `compress_rate_csa|hca` / `num_hash_layers` /
//! `qk_rope_head_dim` folded in, `layer_types` and `mlp_layer_types` derived and truncated to
//! `num_hidden_layers`, the `main` / `compress` RoPE parameter sets built with YaRN for the
//! compressed layers) and then [`DeepseekV4Config::validate`].

use model_core::config::check_field;
use model_core::{ConfigEnum, config_enum};
use serde::Deserialize;
use serde_json::{Map, Value};

/// A config that cannot be used: the field and the broken rule.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The JSON does not have the expected types.
    #[error("deepseek_v4 config: {0}")]
    Json(#[from] serde_json::Error),
    /// A field breaks a rule of the reference.
    #[error("deepseek_v4 config: `{field}`: {rule}")]
    Invalid {
        /// The field at fault.
        field: &'static str,
        /// The rule, with its source.
        rule: String,
    },
}

fn check_layers(n: usize) -> Result<(), ConfigError> {
    if n > MAX_LAYERS {
        return Err(invalid(
            "num_hidden_layers",
            format!("{n} exceeds the supported maximum {MAX_LAYERS}"),
        ));
    }
    Ok(())
}

fn invalid(field: &'static str, rule: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field,
        rule: rule.into(),
    }
}

config_enum! {
    /// The attention kind of one layer (`layer_types`).
    pub enum AttnKind {
        /// `sliding_attention`: the sliding window only ("main" RoPE).
        Sliding = "sliding_attention",
        /// `compressed_sparse_attention`: window + ratio-m compressor with the lightning indexer.
        Csa = "compressed_sparse_attention",
        /// `heavily_compressed_attention`: window + ratio-m' compressor, dense over its entries.
        Hca = "heavily_compressed_attention",
    }
}

config_enum! {
    /// The MoE routing of one layer (`mlp_layer_types`).
    pub enum MlpKind {
        /// `hash_moe`: experts from the token id (`tid2eid`).
        HashMoe = "hash_moe",
        /// `moe`: top-k of the biased router scores.
        Moe = "moe",
    }
}

config_enum! {
    /// Router score function (`scoring_func`).
    pub enum ScoringFunc {
        /// `sqrt(softplus(x))` (the release).
        SqrtSoftplus = "sqrtsoftplus",
        /// `softmax` over the experts.
        Softmax = "softmax",
        /// `sigmoid`.
        Sigmoid = "sigmoid",
    }
}

config_enum! {
    /// Expert activation (`hidden_act`; only silu is supported).
    pub enum HiddenAct {
        /// `silu`.
        Silu = "silu",
    }
}

/// How a RoPE parameter set turns `theta` into inverse frequencies.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeKind {
    /// `inv_freq_i = 1 / theta^(2i / dim)`.
    Default,
    /// YaRN (`_compute_yarn_parameters`, with the correction range truncated, as the V4 model
    /// always does: its top-level `rope_parameters` never carries `truncate`).
    Yarn {
        /// `factor`.
        factor: f64,
        /// `original_max_position_embeddings`.
        original_max_position_embeddings: f64,
        /// `beta_fast` (default 32).
        beta_fast: f64,
        /// `beta_slow` (default 1).
        beta_slow: f64,
    },
}

/// One resolved RoPE parameter set (`rope_parameters["main"]` or `["compress"]`).
#[derive(Debug, Clone, PartialEq)]
pub struct RopeParams {
    /// `rope_theta`.
    pub theta: f64,
    /// `partial_rotary_factor` (the reference reads it from the set, default 1.0).
    pub partial_rotary_factor: f64,
    /// Default or YaRN.
    pub kind: RopeKind,
    /// Multiplies cos and sin (`attention_scaling`): 1.0 for default; for YaRN the reference's
    /// `__post_init__` forces 1.0 unless the set names one.
    pub attention_factor: f64,
}

impl RopeParams {
    /// Reads one resolved set (`rope_type` default or yarn); `field` names it in errors.
    /// Shared with [`crate::config_v41`], whose sets follow the same rules.
    pub(crate) fn from_value(
        field: &'static str,
        v: &Map<String, Value>,
    ) -> Result<RopeParams, ConfigError> {
        let num = |k: &str| v.get(k).and_then(Value::as_f64);
        let rope_type = v
            .get("rope_type")
            .or_else(|| v.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let theta = num("rope_theta").ok_or_else(|| invalid(field, "has no `rope_theta`"))?;
        let partial_rotary_factor = num("partial_rotary_factor").unwrap_or(1.0);
        let (kind, attention_factor) = match rope_type {
            "default" => (RopeKind::Default, 1.0),
            "yarn" => {
                let factor =
                    num("factor").ok_or_else(|| invalid(field, "yarn requires `factor`"))?;
                let orig = num("original_max_position_embeddings").ok_or_else(|| {
                    invalid(field, "yarn requires `original_max_position_embeddings`")
                })?;
                let attention_factor = match num("attention_factor") {
                    Some(a) => a,
                    None => {
                        // `_compute_yarn_parameters` derives it from `factor` / `mscale`.
                        let get = |s: f64, m: f64| {
                            if s <= 1.0 {
                                1.0
                            } else {
                                0.1 * m * s.ln() + 1.0
                            }
                        };
                        match (num("mscale"), num("mscale_all_dim")) {
                            (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                                get(factor, m) / get(factor, a)
                            }
                            _ => get(factor, 1.0),
                        }
                    }
                };
                let or = |k: &str, d: f64| num(k).filter(|x| *x != 0.0).unwrap_or(d);
                (
                    RopeKind::Yarn {
                        factor,
                        original_max_position_embeddings: orig,
                        beta_fast: or("beta_fast", 32.0),
                        beta_slow: or("beta_slow", 1.0),
                    },
                    attention_factor,
                )
            }
            other => {
                return Err(invalid(
                    field,
                    format!("rope_type `{other}` is not supported (default or yarn)"),
                ));
            }
        };
        Ok(RopeParams {
            theta,
            partial_rotary_factor,
            kind,
            attention_factor,
        })
    }
}

macro_rules! defaults {
    ($($name:ident: $ty:ty = $value:expr;)*) => {
        $(fn $name() -> $ty { $value })*
    };
}

defaults! {
    d_vocab: usize = 129280;
    d_hidden: usize = 4096;
    d_moe_inter: usize = 2048;
    d_layers: usize = 43;
    d_heads: usize = 64;
    d_one: usize = 1;
    d_head_dim: usize = 512;
    d_1024: usize = 1024;
    d_6: usize = 6;
    d_256: usize = 256;
    d_scoring: ScoringFunc = ScoringFunc::SqrtSoftplus;
    d_true: bool = true;
    d_scaling: f64 = 1.5;
    d_max_pos: usize = 1048576;
    d_rope_theta: f64 = 10000.0;
    d_compress_theta: f64 = 160000.0;
    d_4: usize = 4;
    d_20: usize = 20;
    d_eps: f64 = 1e-6;
    d_limit: f64 = 10.0;
    d_128: usize = 128;
    d_8: usize = 8;
    d_64: usize = 64;
    d_512: usize = 512;
    d_act: HiddenAct = HiddenAct::Silu;
}

/// The deepseek_v4 config (transformers' `DeepseekV4Config`, 5.24 defaults).
#[derive(Debug, Clone, Deserialize)]
pub struct DeepseekV4Config {
    /// Vocabulary (default 129280).
    #[serde(default = "d_vocab")]
    pub vocab_size: usize,
    /// D, the width of one mHC stream (default 4096).
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    /// Routed and shared expert FFN width (default 2048).
    #[serde(default = "d_moe_inter")]
    pub moe_intermediate_size: usize,
    /// Decoder layers (default 43; MTP layers are not counted).
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    /// Query heads (default 64).
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    /// Read but unused, as in the reference: K = V is one `head_dim` latent broadcast to every
    /// head (default 1).
    #[serde(default = "d_one")]
    pub num_key_value_heads: usize,
    /// Per-head dim of q, the KV latent and the compressed entries (default 512).
    #[serde(default = "d_head_dim")]
    pub head_dim: usize,
    /// Low-rank Q bottleneck (default 1024).
    #[serde(default = "d_1024")]
    pub q_lora_rank: usize,
    /// Routed experts per token (default 6).
    #[serde(default = "d_6")]
    pub num_experts_per_tok: usize,
    /// Routed experts (default 256).
    #[serde(default = "d_256")]
    pub n_routed_experts: usize,
    /// Read but unused, as in the reference: it builds exactly one shared expert (default 1).
    #[serde(default = "d_one")]
    pub n_shared_experts: usize,
    /// Router score: `sqrtsoftplus` (default), `softmax` or `sigmoid`.
    #[serde(default = "d_scoring")]
    pub scoring_func: ScoringFunc,
    /// Read but unused, as in the reference: the V4 routers always renormalise the selected
    /// weights (default true).
    #[serde(default = "d_true")]
    pub norm_topk_prob: bool,
    /// Multiplies the renormalised routed weights (default 1.5).
    #[serde(default = "d_scaling")]
    pub routed_scaling_factor: f64,
    /// Context length (default 1048576).
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    /// RoPE base of the `main` set, used by sliding-only layers (default 10000).
    #[serde(default = "d_rope_theta")]
    pub rope_theta: f64,
    /// Per-layer attention kind; derived when absent (see [`Self::from_json`]).
    #[serde(default)]
    pub layer_types: Option<Vec<AttnKind>>,
    /// Tokens per compressed entry, per attention kind (default CSA 4, HCA 128).
    #[serde(default)]
    pub compress_rates: Option<Map<String, Value>>,
    /// RoPE base of the `compress` set, used by CSA/HCA layers (default 160000).
    #[serde(default = "d_compress_theta")]
    pub compress_rope_theta: f64,
    /// mHC residual streams (default 4).
    #[serde(default = "d_4")]
    pub hc_mult: usize,
    /// Sinkhorn-Knopp iterations (default 20).
    #[serde(default = "d_20")]
    pub hc_sinkhorn_iters: usize,
    /// Sinkhorn / pre-gate floor (default 1e-6).
    #[serde(default = "d_eps")]
    pub hc_eps: f64,
    /// Per-layer MoE kind (`hash_moe` / `moe`); derived when absent.
    #[serde(default)]
    pub mlp_layer_types: Option<Vec<MlpKind>>,
    /// SwiGLU clamp of routed and shared experts (default 10).
    #[serde(default = "d_limit")]
    pub swiglu_limit: f64,
    /// Sliding window of every layer, self included (default 128).
    #[serde(default = "d_128")]
    pub sliding_window: usize,
    /// Groups of the grouped output projection (default 8).
    #[serde(default = "d_8")]
    pub o_groups: usize,
    /// Per-group bottleneck of the output projection (default 1024).
    #[serde(default = "d_1024")]
    pub o_lora_rank: usize,
    /// Lightning-indexer query heads (default 64).
    #[serde(default = "d_64")]
    pub index_n_heads: usize,
    /// Lightning-indexer head dim (default 128).
    #[serde(default = "d_128")]
    pub index_head_dim: usize,
    /// Compressed entries kept per query in CSA layers (default 512).
    #[serde(default = "d_512")]
    pub index_topk: usize,
    /// Expert activation (only `silu`).
    #[serde(default = "d_act")]
    pub hidden_act: HiddenAct,
    /// RMSNorm epsilon, also of the unweighted norms (default 1e-6).
    #[serde(default = "d_eps")]
    pub rms_norm_eps: f64,
    /// Nested `{main, compress}` sets, or a flat set whose YaRN keys go to `compress`.
    #[serde(default)]
    pub rope_parameters: Option<Value>,
    /// Legacy spelling of the flat YaRN set (the released `config.json`).
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    /// Fraction of `head_dim` that rotates; default `qk_rope_head_dim / head_dim`, else 64/512.
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    /// Legacy: per-layer ratios 0 / 4 / 128 (used only when `layer_types` is absent).
    #[serde(default)]
    pub compress_ratios: Option<Vec<i64>>,
    /// Legacy CSA rate override.
    #[serde(default)]
    pub compress_rate_csa: Option<usize>,
    /// Legacy HCA rate override.
    #[serde(default)]
    pub compress_rate_hca: Option<usize>,
    /// Legacy: the first `num_hash_layers` layers are `hash_moe` (default 3).
    #[serde(default)]
    pub num_hash_layers: Option<usize>,
    /// Legacy: rotating dims (folds into `partial_rotary_factor`).
    #[serde(default)]
    pub qk_rope_head_dim: Option<usize>,
    /// Untied in every release; tying is not supported.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Biases on the shared expert (default false; not supported).
    #[serde(default)]
    pub mlp_bias: bool,
    /// The resolved `main` RoPE set (filled by [`Self::from_json`]).
    #[serde(skip)]
    pub rope_main: Option<RopeParams>,
    /// The resolved `compress` RoPE set (filled by [`Self::from_json`]).
    #[serde(skip)]
    pub rope_compress: Option<RopeParams>,
}

/// The most decoder layers a config may declare. Per-layer vectors are built from
/// `num_hidden_layers` before any tensor is read, so an absurd value must be refused first (the
/// largest release has 61 layers).
pub const MAX_LAYERS: usize = 4096;

const CSA: &str = "compressed_sparse_attention";
const HCA: &str = "heavily_compressed_attention";

impl DeepseekV4Config {
    /// Parses `config.json`, applies the reference's `__post_init__`, then [`Self::validate`].
    pub fn from_json(value: &Value) -> Result<Self, ConfigError> {
        // Values that select math are enums; an unknown one is reported with its field.
        for (field, check) in [
            ("layer_types", check_field::<AttnKind>(value, "layer_types")),
            (
                "mlp_layer_types",
                check_field::<MlpKind>(value, "mlp_layer_types"),
            ),
            (
                "scoring_func",
                check_field::<ScoringFunc>(value, "scoring_func"),
            ),
            ("hidden_act", check_field::<HiddenAct>(value, "hidden_act")),
        ] {
            check.map_err(|rule| invalid(field, rule))?;
        }
        let mut c: DeepseekV4Config = serde_json::from_value(value.clone())?;
        let n = c.num_hidden_layers;
        check_layers(n)?;
        let mut rates = c.compress_rates.take().unwrap_or_else(|| {
            let mut m = Map::new();
            m.insert(CSA.into(), 4.into());
            m.insert(HCA.into(), 128.into());
            m
        });
        if let Some(r) = c.compress_rate_csa {
            rates.insert(CSA.into(), r.into());
        }
        if let Some(r) = c.compress_rate_hca {
            rates.insert(HCA.into(), r.into());
        }
        c.compress_rates = Some(rates);
        if c.layer_types.is_none()
            && let Some(ratios) = &c.compress_ratios
        {
            let mut types = Vec::with_capacity(ratios.len());
            for &r in ratios {
                types.push(match r {
                    0 => AttnKind::Sliding,
                    4 => AttnKind::Csa,
                    128 => AttnKind::Hca,
                    other => {
                        return Err(invalid(
                            "compress_ratios",
                            format!("ratio {other} has no layer type (the reference maps only 0, 4, 128)"),
                        ));
                    }
                });
            }
            c.layer_types = Some(types);
        }
        let mut types = c.layer_types.take().unwrap_or_else(|| {
            // The reference's default: 2x HCA, then HCA/CSA interleaved (the V4-Pro pattern).
            let mut t = vec![AttnKind::Hca; n.min(2)];
            t.extend((0..n.saturating_sub(2)).map(|i| {
                if i % 2 == 1 {
                    AttnKind::Csa
                } else {
                    AttnKind::Hca
                }
            }));
            t
        });
        types.truncate(n);
        c.layer_types = Some(types);
        let mut mlp = c.mlp_layer_types.take().unwrap_or_else(|| {
            let hash = c.num_hash_layers.unwrap_or(3);
            (0..n)
                .map(|i| {
                    if i < hash {
                        MlpKind::HashMoe
                    } else {
                        MlpKind::Moe
                    }
                })
                .collect()
        });
        mlp.truncate(n);
        c.mlp_layer_types = Some(mlp);
        if c.partial_rotary_factor.is_none() {
            c.partial_rotary_factor = Some(match c.qk_rope_head_dim {
                Some(r) if c.head_dim > 0 => r as f64 / c.head_dim as f64,
                _ => 64.0 / 512.0,
            });
        }
        c.resolve_rope()?;
        c.validate()?;
        Ok(c)
    }

    fn resolve_rope(&mut self) -> Result<(), ConfigError> {
        let prf = self.partial_rotary_factor.unwrap_or(0.125);
        // A flat set: `rope_parameters`, else the legacy `rope_scaling`.
        let flat = self.rope_parameters.as_ref().or(self.rope_scaling.as_ref());
        let (main, compress) = rope_sets(
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

    /// Checks every invariant the forward relies on: the reference's `validate_layer_type`
    /// and rules it enforces by construction (marked "construction"), and that every tensor
    /// size the weights are bound with fits in `usize`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        model_core::config::check_positive(&[
            ("rms_norm_eps", self.rms_norm_eps),
            ("hc_eps", self.hc_eps),
            ("routed_scaling_factor", self.routed_scaling_factor),
            ("rope_theta", self.rope_theta),
            ("compress_rope_theta", self.compress_rope_theta),
        ])
        .map_err(|(field, rule)| invalid(field, rule))?;
        let n = self.num_hidden_layers;
        check_layers(n)?;
        let types = self.layer_types.as_deref().unwrap_or(&[]);
        if types.len() != n {
            return Err(invalid(
                "layer_types",
                format!("has {} entries but num_hidden_layers is {n}", types.len()),
            ));
        }
        let mlp = self.mlp_layer_types.as_deref().unwrap_or(&[]);
        if mlp.len() != n {
            return Err(invalid(
                "mlp_layer_types",
                format!("has {} entries but num_hidden_layers is {n}", mlp.len()),
            ));
        }
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("head_dim", self.head_dim),
            ("q_lora_rank", self.q_lora_rank),
            ("n_routed_experts", self.n_routed_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("hc_mult", self.hc_mult),
            ("sliding_window", self.sliding_window),
            ("o_groups", self.o_groups),
            ("o_lora_rank", self.o_lora_rank),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(invalid(field, "must be > 0 (construction)"));
            }
        }
        // The reference clamps `up` to `[-limit, limit]` unconditionally; a negative limit
        // inverts that interval (torch then returns `limit` everywhere, a degenerate model) and
        // NaN makes it undefined, so neither is accepted. `inf` disables the clamp.
        if self.swiglu_limit.is_nan() || self.swiglu_limit < 0.0 {
            return Err(invalid(
                "swiglu_limit",
                format!(
                    "must be >= 0 (the SwiGLU clamp interval [-limit, limit]), got {}",
                    self.swiglu_limit
                ),
            ));
        }
        if self.num_experts_per_tok > self.n_routed_experts {
            return Err(invalid(
                "num_experts_per_tok",
                format!(
                    "{} exceeds n_routed_experts {} (construction: topk)",
                    self.num_experts_per_tok, self.n_routed_experts
                ),
            ));
        }
        self.check_sizes()?;
        if !(self.num_attention_heads * self.head_dim).is_multiple_of(self.o_groups) {
            return Err(invalid(
                "o_groups",
                "must divide num_attention_heads * head_dim (construction: DeepseekV4GroupedLinear)",
            ));
        }
        if self.tie_word_embeddings {
            return Err(invalid(
                "tie_word_embeddings",
                "tied embeddings are not supported",
            ));
        }
        if self.mlp_bias {
            return Err(invalid("mlp_bias", "MLP biases are not supported"));
        }
        let kinds: Vec<AttnKind> = (0..n).map(|il| self.attn_kind(il)).collect();
        for (kind, name) in [(AttnKind::Csa, CSA), (AttnKind::Hca, HCA)] {
            if kinds.contains(&kind) {
                match self.rate(kind) {
                    Some(r) if r > 0 => {}
                    _ => {
                        return Err(invalid(
                            "compress_rates",
                            format!("`{name}` needs a positive integer rate (construction)"),
                        ));
                    }
                }
            }
        }
        if kinds.contains(&AttnKind::Csa) {
            for (field, v) in [
                ("index_n_heads", self.index_n_heads),
                ("index_head_dim", self.index_head_dim),
                ("index_topk", self.index_topk),
            ] {
                if v == 0 {
                    return Err(invalid(field, "must be > 0 in a model with CSA layers"));
                }
            }
        }
        for (field, rp, width) in [
            (
                "rope_parameters.main",
                self.rope_main.as_ref(),
                self.head_dim,
            ),
            (
                "rope_parameters.compress",
                self.rope_compress.as_ref(),
                if kinds.contains(&AttnKind::Csa) {
                    self.head_dim.min(self.index_head_dim)
                } else {
                    self.head_dim
                },
            ),
        ] {
            let rp = rp.ok_or_else(|| invalid(field, "not resolved (use from_json)"))?;
            let rot = Self::rot_dim(rp, self.head_dim);
            if rot == 0 || rot > width || !rot.is_multiple_of(2) {
                return Err(invalid(
                    field,
                    format!(
                        "rotary dim {rot} must be even and in [2, {width}] (head_dim, and index_head_dim for CSA)"
                    ),
                ));
            }
            if let RopeKind::Yarn {
                factor,
                original_max_position_embeddings,
                ..
            } = rp.kind
                && (factor <= 0.0 || original_max_position_embeddings <= 0.0)
            {
                return Err(invalid(
                    field,
                    "yarn `factor` and `original_max_position_embeddings` must be > 0",
                ));
            }
        }
        Ok(())
    }

    /// Every product of config fields that sizes a tensor ([`crate::Weights::bind_with`]) or a
    /// per-token buffer, computed with overflow checks so that later plain arithmetic on them
    /// cannot wrap.
    fn check_sizes(&self) -> Result<(), ConfigError> {
        let mul = |field: &'static str, what: &str, a: usize, b: usize| {
            a.checked_mul(b).ok_or_else(|| {
                invalid(
                    field,
                    format!("{what} = {a} * {b} overflows usize (construction: tensor size)"),
                )
            })
        };
        let (n, d) = (self.hc_mult, self.hidden_size);
        mul(
            "num_attention_heads",
            "num_attention_heads * head_dim",
            self.num_attention_heads,
            self.head_dim,
        )?;
        let hc = mul("hc_mult", "(2 + hc_mult) * hc_mult", n.saturating_add(2), n)?;
        mul("hc_mult", "hc_mult * hidden_size", n, d)?;
        mul("hc_mult", "mHC fn size", hc, n * d)?;
        mul(
            "vocab_size",
            "vocab_size * num_experts_per_tok (tid2eid)",
            self.vocab_size,
            self.num_experts_per_tok,
        )?;
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
        mul("moe_intermediate_size", "gate_up_proj size", i2, d)?;
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
        let width = mul("head_dim", "2 * head_dim", 2, self.head_dim)?;
        let iwidth = mul(
            "index_head_dim",
            "2 * index_head_dim",
            2,
            self.index_head_dim,
        )?;
        mul(
            "index_n_heads",
            "index_n_heads * index_head_dim",
            self.index_n_heads,
            self.index_head_dim,
        )?;
        for kind in [AttnKind::Csa, AttnKind::Hca] {
            if let Some(rate) = self.rate(kind) {
                // position_bias `[rate, W]`, W at most 2 * max(head_dim, index_head_dim).
                mul(
                    "compress_rates",
                    "rate * compressor width",
                    rate,
                    width.max(iwidth),
                )?;
            }
        }
        Ok(())
    }

    fn rot_dim(rp: &RopeParams, head_dim: usize) -> usize {
        // `int(head_dim * partial_rotary_factor)`; `arange(0, dim, 2)` gives ceil(dim / 2)
        // frequencies, each rotating a pair.
        let dim = (head_dim as f64 * rp.partial_rotary_factor) as usize;
        2 * dim.div_ceil(2)
    }

    /// The attention kind of layer `il`.
    pub fn attn_kind(&self, il: usize) -> AttnKind {
        self.layer_types
            .as_ref()
            .and_then(|t| t.get(il).copied())
            .unwrap_or(AttnKind::Sliding)
    }

    /// Whether layer `il`'s MoE is hash-routed (`tid2eid`).
    pub fn is_hash_layer(&self, il: usize) -> bool {
        self.mlp_layer_types
            .as_ref()
            .and_then(|t| t.get(il))
            .is_some_and(|&k| k == MlpKind::HashMoe)
    }

    /// Tokens per compressed entry of `kind` (`None` for sliding layers).
    pub fn rate(&self, kind: AttnKind) -> Option<usize> {
        let key = match kind {
            AttnKind::Sliding => return None,
            kind => kind.name(),
        };
        self.compress_rates
            .as_ref()?
            .get(key)?
            .as_u64()
            .map(|r| r as usize)
    }

    /// The `main` RoPE set.
    pub fn rope_main(&self) -> &RopeParams {
        self.rope_main.as_ref().expect("resolved by from_json")
    }

    /// The `compress` RoPE set.
    pub fn rope_compress(&self) -> &RopeParams {
        self.rope_compress.as_ref().expect("resolved by from_json")
    }

    /// Rotating channels (the trailing ones) of a head under `rp`.
    pub fn rotary_dim(&self, rp: &RopeParams) -> usize {
        Self::rot_dim(rp, self.head_dim)
    }
}

/// The (main, compress) RoPE sets of a DeepSeek config (V4 and V4.1 write them alike): a nested
/// `{main, compress}` object in `nested`, else `flat`, the compressed layers' keys (YaRN), with
/// `main` plain RoPE at `rope_theta`. A legacy `"type"` key counts as `rope_type`: transformers
/// ignores it and silently gives plain RoPE, but the checkpoints were trained with what it names.
pub(crate) fn rope_sets(
    nested: Option<&Value>,
    flat: Option<&Value>,
    rope_theta: f64,
    compress_rope_theta: f64,
    partial_rotary_factor: f64,
) -> Result<(RopeParams, RopeParams), ConfigError> {
    let pair = nested.and_then(|rp| {
        let m = rp.get("main")?.as_object()?;
        let k = rp.get("compress")?.as_object()?;
        Some((m.clone(), k.clone()))
    });
    if let Some((m, k)) = pair {
        return Ok((
            RopeParams::from_value("rope_parameters.main", &m)?,
            RopeParams::from_value("rope_parameters.compress", &k)?,
        ));
    }
    let flat = flat.and_then(Value::as_object).cloned().unwrap_or_default();
    let mut m = Map::new();
    m.insert("rope_type".into(), "default".into());
    m.insert("rope_theta".into(), rope_theta.into());
    m.insert("partial_rotary_factor".into(), partial_rotary_factor.into());
    let mut k: Map<String, Value> = flat
        .into_iter()
        .filter(|(key, _)| key != "main" && key != "compress")
        .collect();
    if let Some(t) = k.remove("type") {
        k.entry("rope_type").or_insert(t);
    }
    k.insert("rope_theta".into(), compress_rope_theta.into());
    k.insert("partial_rotary_factor".into(), partial_rotary_factor.into());
    k.entry("rope_type").or_insert("default".into());
    if k.get("rope_type").and_then(Value::as_str) == Some("yarn") {
        // YaRN's mscale is not applied (`attention_factor` 1), as the reference.
        k.entry("attention_factor").or_insert(1.0.into());
    }
    Ok((
        RopeParams::from_value("rope_parameters.main", &m)?,
        RopeParams::from_value("rope_parameters.compress", &k)?,
    ))
}
