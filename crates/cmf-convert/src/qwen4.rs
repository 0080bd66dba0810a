//! `qwen4_exp` (Qwen3.8-Flash-Next): the released BF16 layout (reference-arch.md §3.3) to
//! canonical CMF names. `model.language_model.` becomes `model.`; fused experts
//! `experts.gate_up_proj [E, 2I, D]` / `experts.down_proj [E, D, I]` (or per-expert
//! `experts.{e}.{gate,up,down}_proj.weight`) become one `gate_up_proj.weight [2I, D]` and one
//! `down_proj.weight [D, I]` per expert.

use std::path::Path;

use super::source::Checkpoint;
use super::{ConvertError, Job, Plan, Role, Src, config_usize, expect_job_shape, push_job};

const ARCH: &str = "qwen4_exp";

/// The role of a canonical `qwen4_exp` tensor (docs/convert.md, "Roles").
pub fn role(name: &str, integer: bool) -> Role {
    if integer {
        Role::Integer
    } else if name.contains("hyper_connection") {
        Role::HyperConnection
    } else if name.ends_with(".mlp.gate.weight") || name.ends_with(".mlp.shared_expert_gate.weight")
    {
        Role::Router
    } else if name.contains("embed_tokens.")
        || name.contains("ngram_embedding.")
        || name.starts_with("lm_head.")
    {
        Role::Embedding
    } else if name.contains(".mlp.shared_expert.") {
        Role::SharedExpert
    } else if name.contains(".mlp.experts.") {
        if name.ends_with("down_proj.weight") {
            Role::ExpertDown
        } else {
            Role::ExpertGateUp
        }
    } else {
        Role::Projection
    }
}

/// The plan (text config, jobs) for a `qwen4_exp` checkpoint.
pub(crate) fn plan(ckpt: &Checkpoint, config_path: &Path) -> Result<Plan, ConvertError> {
    let text = ckpt
        .config
        .get("text_config")
        .cloned()
        .ok_or_else(|| ConvertError::Config {
            path: config_path.to_path_buf(),
            detail: "qwen4_exp config has no \"text_config\"".into(),
        })?;
    let d = config_usize(&text, "hidden_size", config_path)?;
    let v = config_usize(&text, "vocab_size", config_path)?;
    let e = config_usize(&text, "num_experts", config_path)?;
    let i = config_usize(&text, "moe_intermediate_size", config_path)?;
    let layers = config_usize(&text, "num_hidden_layers", config_path)?;

    let mut jobs = Vec::new();
    let mut skipped = 0;
    let push = |jobs: &mut Vec<Job>, name: String, src: Src| push_job(ckpt, jobs, name, src, role);
    for src_name in ckpt.names() {
        let canon = if let Some(rest) = src_name.strip_prefix("model.language_model.") {
            format!("model.{rest}")
        } else if src_name.starts_with("lm_head.") || src_name.starts_with("mtp.") {
            src_name.to_string()
        } else if src_name.starts_with("model.visual.") {
            skipped += 1; // vision tower: not converted (text-only engine)
            continue;
        } else {
            return Err(ConvertError::UnknownTensor {
                path: ckpt.file_of(src_name),
                tensor: src_name.to_string(),
                arch: ARCH.into(),
            });
        };
        if let Some(layer) = layer_index(&canon)
            && layer >= layers
            && canon.starts_with("model.layers.")
        {
            return Err(ConvertError::Shape {
                path: ckpt.file_of(src_name),
                tensor: src_name.to_string(),
                expected: format!("a layer index below num_hidden_layers = {layers}"),
                found: vec![layer],
            });
        }
        // Fused experts: split by expert.
        for (suffix, out, expected) in [
            ("mlp.experts.gate_up_proj", "gate_up_proj", [e, 2 * i, d]),
            ("mlp.experts.down_proj", "down_proj", [e, d, i]),
        ] {
            if let Some(stem) = canon.strip_suffix(suffix) {
                let t = ckpt.get(src_name, &canon)?;
                if t.shape != expected {
                    return Err(ConvertError::Shape {
                        path: t.file.to_path_buf(),
                        tensor: src_name.to_string(),
                        expected: format!(
                            "{expected:?} (num_experts, moe_intermediate_size, hidden_size from {})",
                            config_path.display()
                        ),
                        found: t.shape.to_vec(),
                    });
                }
                for x in 0..e {
                    let src = Src::Slice {
                        name: src_name.to_string(),
                        index: x,
                    };
                    push(
                        &mut jobs,
                        format!("{stem}mlp.experts.{x}.{out}.weight"),
                        src,
                    )?;
                }
            }
        }
        if canon.ends_with("mlp.experts.gate_up_proj") || canon.ends_with("mlp.experts.down_proj") {
            continue;
        }
        // Per-expert sources: gate and up rows into one gate_up_proj.
        if canon.contains(".mlp.experts.") {
            if let Some(stem) = canon.strip_suffix("gate_proj.weight") {
                let up = src_name.replace("gate_proj.weight", "up_proj.weight");
                let src = Src::Rows(vec![Src::Tensor(src_name.to_string()), Src::Tensor(up)]);
                push(&mut jobs, format!("{stem}gate_up_proj.weight"), src)?;
                continue;
            }
            if canon.ends_with("up_proj.weight") {
                continue; // taken with its gate_proj
            }
        }
        push(&mut jobs, canon, Src::Tensor(src_name.to_string()))?;
    }
    for name in ["model.embed_tokens.weight", "lm_head.weight"] {
        expect_job_shape(ckpt, &jobs, name, &[v, d], config_path)?;
    }
    expect_job_shape(ckpt, &jobs, "model.norm.weight", &[d], config_path)?;
    for j in &jobs {
        if j.name.contains(".mlp.experts.") {
            let want = if j.role == Role::ExpertDown {
                [d, i]
            } else {
                [2 * i, d]
            };
            expect_job_shape(ckpt, &jobs, &j.name, &want, config_path)?;
        }
    }
    if skipped > 0 {
        tracing::info!(
            "{ARCH}: skipped {skipped} vision tensors (model.visual.*; text-only engine)"
        );
    }
    Ok(Plan {
        config: text,
        jobs,
        skipped,
    })
}

/// `L` of `model.layers.L.…`.
pub(crate) fn layer_index(canon: &str) -> Option<usize> {
    canon
        .strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}
