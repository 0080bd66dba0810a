//! `cortiq logits` (library side) against transformers' logits in the qwen4_exp and deepseek_v4
//! fixtures.

use engine::convert::{ConvertOptions, Profile, convert};
use engine::logits::{LogitsError, LogitsOptions, logits, write_npy};
use engine::model::{BindError, LoadError};
use std::path::{Path, PathBuf};

/// The container example (`cargo xtask tiny-cmf`): an architecture no model crate runs.
const TINY_EXAMPLE: &[u8] = include_bytes!("../../../assets/tiny.cmf");

fn fixture(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(case)
}

/// Minimal `.npy` reader: (shape, little-endian payload).
fn npy(path: &Path) -> (Vec<usize>, Vec<u8>) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..6], b"\x93NUMPY");
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    let header = std::str::from_utf8(&b[10..10 + hlen]).unwrap();
    assert_eq!(
        (10 + hlen) % 64,
        0,
        "header not 64-byte aligned: {header:?}"
    );
    let shape = header
        .split("'shape': (")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap();
    let shape = shape
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    (shape, b[10 + hlen..].to_vec())
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn logits_npy_matches_transformers_prefill_and_decode() {
    let dir = tempfile::tempdir().unwrap();
    let cmf = dir.path().join("b.cmf");
    convert(
        &ConvertOptions::new(fixture("qwen4_exp_b").join("hf"), cmf.clone(), Profile::F32),
        &mut |_| {},
    )
    .unwrap();
    let exp = fixture("qwen4_exp_b").join("expected");
    let (_, ids) = npy(&exp.join("p1_ids.npy"));
    let tokens: Vec<u32> = ids
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    let (shape, want) = npy(&exp.join("p1_prefill_logits.npy"));
    let want = f32s(&want);
    let tol = 1e-4 * want.iter().fold(0f32, |m, v| m.max(v.abs()));
    for decode_from in [None, Some(17)] {
        let l = logits(
            &cmf,
            &LogitsOptions {
                tokens: tokens.clone(),
                decode_from,
                ..Default::default()
            },
        )
        .unwrap();
        let out = dir.path().join("out.npy");
        let mut f = std::fs::File::create(&out).unwrap();
        write_npy(&mut f, l.rows, l.vocab, &l.data).unwrap();
        drop(f);
        let (got_shape, got) = npy(&out);
        assert_eq!(got_shape, shape);
        let err = f32s(&got)
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err <= tol,
            "decode_from {decode_from:?}: {err:.3e} > {tol:.3e}"
        );
    }
    let too_far = logits(
        &cmf,
        &LogitsOptions {
            tokens: tokens.clone(),
            decode_from: Some(tokens.len() + 1),
            ..Default::default()
        },
    );
    assert!(matches!(too_far, Err(LogitsError::DecodeFrom { .. })));
    let bad_id = logits(
        &cmf,
        &LogitsOptions {
            tokens: vec![1, 384],
            decode_from: None,
            ..Default::default()
        },
    );
    assert!(matches!(bad_id, Err(LogitsError::Forward(_))));
    let empty = logits(
        &cmf,
        &LogitsOptions {
            tokens: vec![],
            decode_from: Some(0),
            ..Default::default()
        },
    );
    assert!(matches!(empty, Err(LogitsError::Forward(_))));

    // An architecture no model crate runs: the container example assets/tiny.cmf.
    let other = dir.path().join("other.cmf");
    std::fs::write(&other, TINY_EXAMPLE).unwrap();
    let arch = logits(
        &other,
        &LogitsOptions {
            tokens: vec![1, 2],
            decode_from: None,
            ..Default::default()
        },
    );
    match arch {
        Err(LogitsError::Load(
            e @ LoadError::Bind {
                source: BindError::Architecture(_),
                ..
            },
        )) => {
            let msg = e.to_string();
            assert!(msg.contains("unsupported architecture"), "{msg}");
            assert!(msg.contains("other.cmf"), "the error names the file: {msg}");
        }
        other => panic!("{other:?}"),
    }
}

/// Converts fixture `case` (f32) into `dir` and checks the engine's logits of prompt `p`
/// against transformers' prefill logits, one-shot and decoded from each of `decode_froms`;
/// returns the CMF path.
fn engine_logits_match(case: &str, p: usize, decode_froms: &[usize], dir: &Path) -> PathBuf {
    let cmf = dir.join(format!("{case}.cmf"));
    convert(
        &ConvertOptions::new(fixture(case).join("hf"), cmf.clone(), Profile::F32),
        &mut |_| {},
    )
    .unwrap();
    let exp = fixture(case).join("expected");
    let (_, ids) = npy(&exp.join(format!("p{p}_ids.npy")));
    let tokens: Vec<u32> = ids
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    let (shape, want) = npy(&exp.join(format!("p{p}_prefill_logits.npy")));
    let want = f32s(&want);
    let tol = 1e-4 * want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let starts = std::iter::once(None).chain(decode_froms.iter().map(|&k| Some(k)));
    for decode_from in starts {
        let l = logits(
            &cmf,
            &LogitsOptions {
                tokens: tokens.clone(),
                decode_from,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(vec![l.rows, l.vocab], shape);
        let err = l
            .data
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err <= tol,
            "{case} p{p} decode_from {decode_from:?}: {err:.3e} > {tol:.3e}"
        );
    }
    cmf
}

/// The same engine path runs deepseek_v41 (one-shot prefill and cached decode from two points,
/// one mid-group of the ratio-2 sources), the Engram token map derived from the embedded
/// tokenizer.
#[test]
fn logits_of_a_deepseek_v41_model_match_transformers() {
    let dir = tempfile::tempdir().unwrap();
    engine_logits_match("deepseek_v41_b", 1, &[17, 30], dir.path());
}

/// The same engine path runs deepseek_v4 (one-shot prefill and cached decode).
#[test]
fn logits_of_a_deepseek_v4_model_match_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let cmf = engine_logits_match("deepseek_v4_b", 0, &[93], dir.path());
    let bad_id = logits(
        &cmf,
        &LogitsOptions {
            tokens: vec![1, 512],
            decode_from: None,
            ..Default::default()
        },
    );
    assert!(
        matches!(&bad_id, Err(LogitsError::Forward(e)) if e.to_string().contains("token id 512")),
        "{bad_id:?}"
    );
}

/// `cortiq logits --backend wgpu` on a conversion that keeps every weight exact (`--quant
/// bf16` for the qwen4_exp fixtures, whose checkpoints are bf16; `--quant source` for the
/// deepseek_v4 and deepseek_v41 ones, whose release layout mixes FP8, FP4, bf16 and f32) against
/// transformers' f32 logits within 1e-4 x max|logit|, prefill and `--decode-from K`; the
/// model must have run on the device (the backend named in the placement). Needs a GPU (lavapipe in CI; skipped
/// without one unless `CORTIQ_REQUIRE_GPU=1`).
#[test]
fn gpu_logits_on_exact_conversions_match_transformers() {
    let opts = engine::gpu_runtime::GpuOptions {
        pipeline_cache_dir: None,
        ..Default::default()
    };
    if let Err(e) = engine::gpu_runtime::GpuContext::new(&opts) {
        return test_support::no_gpu(&e);
    }
    let place = engine::model::Placement {
        backend: engine::gpu_runtime::BackendChoice::Wgpu,
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("qwen4_exp_a", Profile::Bf16),
        ("qwen4_exp_b", Profile::Bf16),
        ("qwen4_exp_c", Profile::Bf16),
        ("deepseek_v4_a", Profile::Source),
        ("deepseek_v4_b", Profile::Source),
        ("deepseek_v4_c", Profile::Source),
        ("deepseek_v41_a", Profile::Source),
        ("deepseek_v41_b", Profile::Source),
    ];
    for (case, profile) in cases {
        let cmf = dir.path().join(format!("{case}.cmf"));
        convert(
            &ConvertOptions::new(fixture(case).join("hf"), cmf.clone(), profile),
            &mut |_| {},
        )
        .unwrap();
        let exp = fixture(case).join("expected");
        let (_, ids) = npy(&exp.join("p0_ids.npy"));
        let tokens: Vec<u32> = ids
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect();
        let want = f32s(&npy(&exp.join("p0_prefill_logits.npy")).1);
        let tol = 1e-4 * want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for decode_from in [None, Some(tokens.len() / 2)] {
            let l = logits(
                &cmf,
                &LogitsOptions {
                    tokens: tokens.clone(),
                    decode_from,
                    placement: place.clone(),
                },
            )
            .unwrap();
            let err = l
                .data
                .iter()
                .zip(&want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert_eq!(l.data.len(), want.len());
            assert_eq!(l.backend, "gpu", "{case}: the device refused the model");
            assert!(
                err <= tol,
                "{case} decode_from {decode_from:?}: {err:.3e} > {tol:.3e}"
            );
        }
    }
}
