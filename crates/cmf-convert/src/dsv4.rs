//! `deepseek_v4` (DeepSeek-V4-Flash): the original DeepSeek tensor names (reference-arch.md
//! §1.3) to transformers' `DeepseekV4` module names (its `conversion_mapping["deepseek_v4"]`;
//! the inverse is `_DS_LEAF` / `_DS_TOP` in tools/reference/make_fixtures.py). Routed experts
//! `ffn.experts.{e}.w1/w3/w2` become `mlp.experts.{e}.gate_up_proj.weight` (w1 rows, then w3
//! rows) and `mlp.experts.{e}.down_proj.weight`. FP8 weights are read with their `.scale`
//! block grid; FP4 experts with their per-32 scales.

use std::path::Path;

use safetensors::Dtype;
use serde_json::Value;

use super::source::Checkpoint;
use super::{ConvertError, Job, Plan, Role, Src, config_usize, expect_job_shape, push_job};

const ARCH: &str = "deepseek_v4";

/// Top-level tensors: (DeepSeek name, canonical name).
const TOP: [(&str, &str); 6] = [
    ("embed.weight", "model.embed_tokens.weight"),
    ("head.weight", "lm_head.weight"),
    ("norm.weight", "model.norm.weight"),
    ("hc_head_fn", "model.hc_head.hc_fn"),
    ("hc_head_base", "model.hc_head.hc_base"),
    ("hc_head_scale", "model.hc_head.hc_scale"),
];

/// Per-layer substrings: (DeepSeek, canonical). The first match wins; order matters.
const LEAF: [(&str, &str); 31] = [
    (
        ".attn.indexer.weights_proj.",
        ".self_attn.compressor.indexer.scorer.weights_proj.",
    ),
    (
        ".attn.indexer.wq_b.",
        ".self_attn.compressor.indexer.q_b_proj.",
    ),
    (
        ".attn.indexer.compressor.wkv.",
        ".self_attn.compressor.indexer.kv_proj.",
    ),
    (
        ".attn.indexer.compressor.wgate.",
        ".self_attn.compressor.indexer.gate_proj.",
    ),
    (
        ".attn.indexer.compressor.norm.",
        ".self_attn.compressor.indexer.kv_norm.",
    ),
    (
        ".attn.indexer.compressor.ape",
        ".self_attn.compressor.indexer.position_bias",
    ),
    (".attn.compressor.wkv.", ".self_attn.compressor.kv_proj."),
    (
        ".attn.compressor.wgate.",
        ".self_attn.compressor.gate_proj.",
    ),
    (".attn.compressor.norm.", ".self_attn.compressor.kv_norm."),
    (
        ".attn.compressor.ape",
        ".self_attn.compressor.position_bias",
    ),
    (".attn.wq_a.", ".self_attn.q_a_proj."),
    (".attn.q_norm.", ".self_attn.q_a_norm."),
    (".attn.wq_b.", ".self_attn.q_b_proj."),
    (".attn.wkv.", ".self_attn.kv_proj."),
    (".attn.kv_norm.", ".self_attn.kv_norm."),
    (".attn.wo_a.", ".self_attn.o_a_proj."),
    (".attn.wo_b.", ".self_attn.o_b_proj."),
    (".attn.attn_sink", ".self_attn.sinks"),
    (".attn_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".hc_attn_fn", ".attn_hc.fn"),
    (".hc_attn_base", ".attn_hc.base"),
    (".hc_attn_scale", ".attn_hc.scale"),
    (".hc_ffn_fn", ".ffn_hc.fn"),
    (".hc_ffn_base", ".ffn_hc.base"),
    (".hc_ffn_scale", ".ffn_hc.scale"),
    (".ffn.gate.bias", ".mlp.gate.e_score_correction_bias"),
    (".ffn.gate.", ".mlp.gate."),
    (".ffn.shared_experts.w1.", ".mlp.shared_experts.gate_proj."),
    (".ffn.shared_experts.w2.", ".mlp.shared_experts.down_proj."),
    (".ffn.shared_experts.w3.", ".mlp.shared_experts.up_proj."),
];

/// The canonical name of a DeepSeek tensor (not routed experts), if the mapping knows it.
pub fn canonical(name: &str) -> Option<String> {
    if let Some((_, c)) = TOP.iter().find(|(s, _)| *s == name) {
        return Some((*c).to_string());
    }
    if name.starts_with("mtp.") {
        return Some(name.to_string());
    }
    let rest = name.strip_prefix("layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let tail = format!(".{tail}");
    let (from, to) = LEAF.iter().find(|(from, _)| tail.starts_with(from))?;
    Some(format!("model.layers.{layer}{to}{}", &tail[from.len()..]))
}

/// The role of a canonical `deepseek_v4` tensor (docs/convert.md, "Roles").
pub fn role(name: &str, integer: bool) -> Role {
    if integer {
        Role::Integer
    } else if name.contains("hc_head.") || name.contains("attn_hc.") || name.contains("ffn_hc.") {
        Role::HyperConnection
    } else if name.ends_with(".mlp.gate.weight") {
        Role::Router
    } else if name.contains("embed_tokens.") || name.starts_with("lm_head.") {
        Role::Embedding
    } else if name.contains(".mlp.shared_experts.") {
        Role::SharedExpert
    } else if name.contains(".mlp.experts.") {
        if name.ends_with("down_proj.weight") {
            Role::ExpertDown
        } else {
            Role::ExpertGateUp
        }
    } else if name.contains("position_bias") || name.ends_with(".sinks") {
        Role::Vector
    } else {
        Role::Projection
    }
}

/// The plan for a `deepseek_v4` checkpoint.
pub(crate) fn plan(ckpt: &Checkpoint, config_path: &Path) -> Result<Plan, ConvertError> {
    let cfg = &ckpt.config;
    let layers = config_usize(cfg, "num_hidden_layers", config_path)?;
    let e = config_usize(cfg, "n_routed_experts", config_path)?;

    let mut jobs = Vec::new();
    for name in ckpt.names() {
        if is_companion_scale(ckpt, name) {
            continue;
        }
        check_layer(ckpt, name, layers)?;
        if routed_expert_job(ckpt, &mut jobs, name, e, role)? {
            continue;
        }
        let Some(canon) = canonical(name) else {
            return Err(ConvertError::UnknownTensor {
                path: ckpt.file_of(name),
                tensor: name.to_string(),
                arch: ARCH.into(),
            });
        };
        push_job(ckpt, &mut jobs, canon, Src::Tensor(name.to_string()), role)?;
    }
    check_shapes(ckpt, &jobs, cfg, config_path)?;
    Ok(Plan {
        config: cfg.clone(),
        jobs,
        skipped: 0,
    })
}

/// True for `<stem>.scale` next to an FP8 or FP4 `<stem>.weight`: scales travel with their
/// weight and get no CMF tensor of their own.
pub(crate) fn is_companion_scale(ckpt: &Checkpoint, name: &str) -> bool {
    name.strip_suffix(".scale").is_some_and(|stem| {
        ckpt.meta(&format!("{stem}.weight"))
            .is_some_and(|m| matches!(m.dtype, Dtype::F8_E4M3 | Dtype::I8))
    })
}

/// Refuses `layers.L.*` with `L >= num_hidden_layers`, naming the tensor.
pub(crate) fn check_layer(
    ckpt: &Checkpoint,
    name: &str,
    layers: usize,
) -> Result<(), ConvertError> {
    if let Some(l) = name
        .strip_prefix("layers.")
        .and_then(|r| r.split('.').next())
        .and_then(|l| l.parse::<usize>().ok())
        && l >= layers
    {
        return Err(ConvertError::Shape {
            path: ckpt.file_of(name),
            tensor: name.to_string(),
            expected: format!("a layer index below num_hidden_layers = {layers}"),
            found: vec![l],
        });
    }
    Ok(())
}

/// For a routed expert `layers.L.ffn.experts.E.w{1,2,3}.weight`: adds its job (w1 with w3's
/// rows as `gate_up_proj`, w2 as `down_proj`; w3 alone adds nothing) and returns true.
/// `experts` is `n_routed_experts`; `role` the architecture's role rule.
pub(crate) fn routed_expert_job(
    ckpt: &Checkpoint,
    jobs: &mut Vec<Job>,
    name: &str,
    experts: usize,
    role: fn(&str, bool) -> Role,
) -> Result<bool, ConvertError> {
    let Some((layer, expert, w)) = routed_expert(name) else {
        return Ok(false);
    };
    if expert >= experts {
        return Err(ConvertError::Shape {
            path: ckpt.file_of(name),
            tensor: name.to_string(),
            expected: format!("an expert index below n_routed_experts = {experts}"),
            found: vec![expert],
        });
    }
    let stem = format!("model.layers.{layer}.mlp.experts.{expert}");
    match w {
        "w1" => {
            let up = name.replace(".w1.weight", ".w3.weight");
            let src = Src::Rows(vec![Src::Tensor(name.to_string()), Src::Tensor(up)]);
            push_job(ckpt, jobs, format!("{stem}.gate_up_proj.weight"), src, role)?;
        }
        "w2" => push_job(
            ckpt,
            jobs,
            format!("{stem}.down_proj.weight"),
            Src::Tensor(name.to_string()),
            role,
        )?,
        _ => {} // w3: taken with w1
    }
    Ok(true)
}

/// The plan's shapes against the config `cfg` (`hidden_size`, `vocab_size`,
/// `moe_intermediate_size`): embedding and head `[V, D]`, final norm `[D]`, every routed
/// expert `[2I, D]` / `[D, I]`.
pub(crate) fn check_shapes(
    ckpt: &Checkpoint,
    jobs: &[Job],
    cfg: &Value,
    config_path: &Path,
) -> Result<(), ConvertError> {
    let d = config_usize(cfg, "hidden_size", config_path)?;
    let v = config_usize(cfg, "vocab_size", config_path)?;
    let i = config_usize(cfg, "moe_intermediate_size", config_path)?;
    for name in ["model.embed_tokens.weight", "lm_head.weight"] {
        expect_job_shape(ckpt, jobs, name, &[v, d], config_path)?;
    }
    expect_job_shape(ckpt, jobs, "model.norm.weight", &[d], config_path)?;
    for j in jobs {
        if j.name.starts_with("model.layers.") && j.name.contains(".mlp.experts.") {
            let want = if j.role == Role::ExpertDown {
                [d, i]
            } else {
                [2 * i, d]
            };
            expect_job_shape(ckpt, jobs, &j.name, &want, config_path)?;
        }
    }
    Ok(())
}

/// (layer, expert, "w1" | "w2" | "w3") of `layers.L.ffn.experts.E.wK.weight`.
fn routed_expert(name: &str) -> Option<(usize, usize, &str)> {
    let rest = name.strip_prefix("layers.")?;
    let (layer, rest) = rest.split_once(".ffn.experts.")?;
    let (expert, rest) = rest.split_once('.')?;
    let w = rest.strip_suffix(".weight")?;
    if !matches!(w, "w1" | "w2" | "w3") {
        return None;
    }
    Some((layer.parse().ok()?, expert.parse().ok()?, w))
}
