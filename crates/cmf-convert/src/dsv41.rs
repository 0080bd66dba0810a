//! `deepseek_v41` (DeepSeek-V4.1-Flash): the released DeepSeek-native tensor names to
//! transformers' `DeepseekV41` module names, the inverse of upstream's
//! `conversion_mapping["deepseek_v41_text"]` (written out as `_LEAF` / `_TOP` /
//! `released_name` in tools/reference/make_dsv41_fixtures.py, which checks them against those
//! rules). It differs from `deepseek_v4`: the indexer sits under `self_attn.indexer` (with its
//! own `k_proj` / `k_norm`), there is no `hc_head`, no `ape` and no hash routing, the router
//! has a second correction bias (`bias_vl`), and layers may carry an Engram module whose
//! lookup table moves to the model level, `layers.L.engram.embed.weight` ->
//! `model.engram_tables.L.weight`.
//!
//! Storage (the release, as the fixtures reproduce it): FP8 projections with a block grid of
//! `quantization_config.weight_block_size` (32 x 32), FP4 routed experts (as V4, per expert
//! `w1`/`w3`/`w2`), and Engram tables as E4M3 rows with one E8M0 scale per 32 values, which is
//! exactly mxfp8: they are copied verbatim ([`Role::EngramTable`]). The config is composite
//! (`text_config`, `vision_config`, a top-level `quantization_config`); the header keeps the
//! text config, as for qwen4_exp. Vision tower, aligner and image delimiters (upstream's
//! `_VISION_ONLY_LOAD_PATTERNS`) are skipped; `mtp.*` (the DSpark draft layers) is kept under
//! its released names for later.

use std::path::Path;

use safetensors::Dtype;
use serde_json::Value;

use super::dsv4::{check_layer, check_shapes, is_companion_scale, routed_expert_job};
use super::source::Checkpoint;
use super::{ConvertError, Job, Plan, Role, Src, config_usize, push_job, scale_name};

const ARCH: &str = "deepseek_v41";

/// Top-level tensors: (released name, canonical name).
const TOP: [(&str, &str); 3] = [
    ("embed.weight", "model.embed_tokens.weight"),
    ("head.weight", "lm_head.weight"),
    ("norm.weight", "model.norm.weight"),
];

/// Per-layer pieces after `layers.L`: (released, canonical). A piece ending in `.` is a module
/// prefix (any parameter below it: `weight`, or a companion); any other piece must be the
/// whole rest of the name. Written in `_LEAF`'s order; no two entries match one name.
const LEAF: [(&str, &str); 32] = [
    (".attn.compressor.wkv.", ".self_attn.compressor.kv_proj."),
    (
        ".attn.compressor.wgate.",
        ".self_attn.compressor.gate_proj.",
    ),
    (".attn.compressor.norm.", ".self_attn.compressor.kv_norm."),
    (".attn.indexer.wq_b.", ".self_attn.indexer.q_b_proj."),
    (".attn.indexer.wk.", ".self_attn.indexer.k_proj."),
    (
        ".attn.indexer.weights_proj.",
        ".self_attn.indexer.weights_proj.",
    ),
    (".attn.indexer.k_norm.", ".self_attn.indexer.k_norm."),
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
    (".ffn.gate.bias_vl", ".mlp.gate.e_score_correction_bias_vl"),
    (".ffn.gate.bias", ".mlp.gate.e_score_correction_bias"),
    (".ffn.gate.weight", ".mlp.gate.weight"),
    (".ffn.shared_experts.w1.", ".mlp.shared_experts.gate_proj."),
    (".ffn.shared_experts.w2.", ".mlp.shared_experts.down_proj."),
    (".ffn.shared_experts.w3.", ".mlp.shared_experts.up_proj."),
    // The Engram module keeps its names (upstream leaves `engram.wkv` alone on purpose).
    (".engram.wkv.", ".engram.wkv."),
    (".engram.q_weight", ".engram.q_weight"),
    (".engram.k_weight", ".engram.k_weight"),
    // The Engram table `.engram.embed.weight` moves to the model level: `engram_table`.
];

/// Released names of the vision side of the checkpoint (upstream's
/// `_VISION_ONLY_LOAD_PATTERNS`: `^vision\.`, `^aligner\.`, `^image_(start|end|newline)$`),
/// which a text-only engine skips.
fn is_vision(name: &str) -> bool {
    name.starts_with("vision.")
        || name.starts_with("aligner.")
        || matches!(name, "image_start" | "image_end" | "image_newline")
}

/// The canonical name of a released V4.1 tensor (not routed experts, not Engram tables), if
/// the mapping knows it.
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
    let (from, to) = LEAF.iter().find(|(from, _)| {
        if from.ends_with('.') {
            tail.starts_with(from) && tail.len() > from.len()
        } else {
            tail == *from
        }
    })?;
    Some(format!("model.layers.{layer}{to}{}", &tail[from.len()..]))
}

/// `L` of an Engram table `layers.L.engram.embed.weight`.
fn engram_table(name: &str) -> Option<usize> {
    name.strip_prefix("layers.")?
        .strip_suffix(".engram.embed.weight")?
        .parse()
        .ok()
}

/// The role of a canonical `deepseek_v41` tensor (docs/convert.md, "Roles"). `mtp.*` keeps the
/// released names, so their pieces (`hc_`, `ffn.gate`, `ffn.experts`, ...) are recognised too.
pub fn role(name: &str, integer: bool) -> Role {
    let mtp = name.starts_with("mtp.");
    if integer {
        Role::Integer
    } else if name.starts_with("model.engram_tables.") {
        Role::EngramTable
    } else if name.contains("attn_hc.")
        || name.contains("ffn_hc.")
        || (mtp && (name.contains(".hc_") || name.contains("hc_head")))
    {
        Role::HyperConnection
    } else if name.ends_with(".mlp.gate.weight") || (mtp && name.ends_with(".ffn.gate.weight")) {
        Role::Router
    } else if name.contains("embed_tokens.")
        || name.starts_with("lm_head.")
        || (mtp && (name.contains(".embed.") || name.contains(".head.")))
    {
        Role::Embedding
    } else if name.contains(".mlp.shared_experts.") || (mtp && name.contains(".shared_experts.")) {
        Role::SharedExpert
    } else if name.contains(".mlp.experts.") || (mtp && name.contains(".ffn.experts.")) {
        if name.ends_with("down_proj.weight") || name.ends_with(".w2.weight") {
            Role::ExpertDown
        } else {
            Role::ExpertGateUp
        }
    } else if name.ends_with(".sinks")
        || name.ends_with(".attn_sink")
        || name.ends_with(".engram.q_weight")
        || name.ends_with(".engram.k_weight")
    {
        // Sinks are per-head scalars; the Engram q/k weights `[hc_mult, hidden]` are used
        // element-wise (only as their product), never as a matrix product.
        Role::Vector
    } else {
        Role::Projection
    }
}

/// A list of unsigned integers from `cfg[key]`; `None` when absent.
fn config_list(cfg: &Value, key: &str, path: &Path) -> Result<Option<Vec<usize>>, ConvertError> {
    let Some(v) = cfg.get(key).filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    v.as_array()
        .and_then(|a| {
            a.iter()
                .map(|x| x.as_u64().map(|n| n as usize))
                .collect::<Option<Vec<usize>>>()
        })
        .map(Some)
        .ok_or_else(|| ConvertError::Config {
            path: path.to_path_buf(),
            detail: format!("{key:?} must be a list of non-negative integers, found {v}"),
        })
}

/// The plan for a `deepseek_v41` checkpoint.
pub(crate) fn plan(ckpt: &Checkpoint, config_path: &Path) -> Result<Plan, ConvertError> {
    // The released config is composite; a flat text config (what transformers writes for the
    // bare text model) is read as it is.
    let text = ckpt
        .config
        .get("text_config")
        .cloned()
        .unwrap_or_else(|| ckpt.config.clone());
    let layers = config_usize(&text, "num_hidden_layers", config_path)?;
    let e = config_usize(&text, "n_routed_experts", config_path)?;
    let engram_layers = config_list(&text, "engram_layer_ids", config_path)?.unwrap_or_default();
    let engram_rows = config_list(&text, "engram_num_embeddings", config_path)?;
    if let Some(rows) = &engram_rows
        && rows.len() != engram_layers.len()
    {
        return Err(ConvertError::Config {
            path: config_path.to_path_buf(),
            detail: format!(
                "engram_num_embeddings has {} entries for {} engram_layer_ids",
                rows.len(),
                engram_layers.len()
            ),
        });
    }
    let engram_dim = text
        .get("engram_head_dim")
        .map(|_| config_usize(&text, "engram_head_dim", config_path))
        .transpose()?;

    let mut jobs = Vec::new();
    let mut skipped = 0;
    for name in ckpt.names() {
        if is_vision(name) {
            skipped += 1;
            continue;
        }
        if is_companion_scale(ckpt, name) {
            continue;
        }
        check_layer(ckpt, name, layers)?;
        if routed_expert_job(ckpt, &mut jobs, name, e, role)? {
            continue;
        }
        if let Some(l) = engram_table(name) {
            let Some(k) = engram_layers.iter().position(|&x| x == l) else {
                return Err(ConvertError::Shape {
                    path: ckpt.file_of(name),
                    tensor: name.to_string(),
                    expected: format!(
                        "an Engram table of a layer in engram_layer_ids = {engram_layers:?} (from {})",
                        config_path.display()
                    ),
                    found: vec![l],
                });
            };
            push_engram_table(ckpt, &mut jobs, name, l)?;
            // Rows from engram_num_embeddings (0 = not given, upstream's default), columns
            // from engram_head_dim, where the config has them.
            let rows = engram_rows.as_ref().map(|r| r[k]).filter(|&r| r > 0);
            let shape = jobs.last().map(|j| j.shape.clone()).unwrap_or_default();
            let fits = match shape[..] {
                [r, c] => rows.is_none_or(|want| r == want) && engram_dim.is_none_or(|d| c == d),
                _ => false,
            };
            if !fits {
                let show = |v: Option<usize>| v.map_or("?".to_string(), |v| v.to_string());
                return Err(ConvertError::Shape {
                    path: ckpt.file_of(name),
                    tensor: name.to_string(),
                    expected: format!(
                        "[{}, {}] (engram_num_embeddings[{k}], engram_head_dim from {})",
                        show(rows),
                        show(engram_dim),
                        config_path.display()
                    ),
                    found: shape,
                });
            }
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
    // Every Engram layer needs its table: without it the model cannot run.
    for &l in &engram_layers {
        let canon = format!("model.engram_tables.{l}.weight");
        if !jobs.iter().any(|j| j.name == canon) {
            return Err(ConvertError::MissingTensor {
                dir: ckpt.dir.clone(),
                tensor: format!("layers.{l}.engram.embed.weight"),
                needed_by: canon,
            });
        }
    }
    check_shapes(ckpt, &jobs, &text, config_path)?;
    if skipped > 0 {
        tracing::info!(
            "{ARCH}: skipped {skipped} vision tensors (vision.*, aligner.*, image delimiters; text-only engine)"
        );
    }
    Ok(Plan {
        config: text,
        jobs,
        skipped,
    })
}

/// Adds `layers.L.engram.embed.weight` as `model.engram_tables.L.weight`: the release's FP8
/// rows (with `.scale`) as an mxfp8 copy; a float table (no release has one) as an embedding,
/// encoded per profile, so no profile requantises float values to FP8 behind the user's back.
fn push_engram_table(
    ckpt: &Checkpoint,
    jobs: &mut Vec<Job>,
    name: &str,
    layer: usize,
) -> Result<(), ConvertError> {
    let canon = format!("model.engram_tables.{layer}.weight");
    let t = ckpt.get(name, &canon)?;
    match t.dtype {
        Dtype::F8_E4M3 => {
            // The scale must exist; its dtype and shape are checked when the job is sized.
            ckpt.get(&scale_name(name), &canon)?;
            push_job(ckpt, jobs, canon, Src::Mxfp8(name.to_string()), role)
        }
        _ => {
            push_job(ckpt, jobs, canon, Src::Tensor(name.to_string()), role)?;
            if let Some(j) = jobs.last_mut() {
                j.role = Role::Embedding;
            }
            Ok(())
        }
    }
}
