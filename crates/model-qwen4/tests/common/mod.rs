//! Test helpers: `.npy` reading (through `engine::logits::read_npy`) and fixture conversion.
#![allow(dead_code)]

use engine::convert::{ConvertOptions, Profile, convert};
use std::path::{Path, PathBuf};

pub use engine::logits::Npy;

/// [`engine::logits::read_npy`], panicking with the path on any error.
pub fn read_npy(path: &Path) -> Npy {
    engine::logits::read_npy(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `fixtures/<case>`.
pub fn fixture(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(case)
}

/// Converts a fixture's `hf/` to a CMF in `dir` under `profile`.
pub fn convert_fixture(case: &str, dir: &Path, profile: Profile) -> PathBuf {
    let out = dir.join(format!("{case}.cmf"));
    convert(
        &ConvertOptions::new(fixture(case).join("hf"), out.clone(), profile),
        &mut |_| {},
    )
    .unwrap_or_else(|e| panic!("converting {case}: {e}"));
    out
}

/// The qwen4_exp fixture cases.
pub const CASES: [&str; 3] = ["qwen4_exp_a", "qwen4_exp_b", "qwen4_exp_c"];

/// `k_prefill` of prompt `p` in `expected/cases.json`.
pub fn k_prefill(case: &str, p: usize) -> usize {
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(case).join("expected/cases.json")).unwrap(),
    )
    .unwrap();
    v["prompts"][p]["k_prefill"].as_u64().unwrap() as usize
}

/// `max |a - b|` (NaN counts as infinite).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let e = (x - y).abs();
            if e.is_nan() { f32::INFINITY } else { e }
        })
        .fold(0f32, f32::max)
}

/// `max |x|`.
pub fn max_abs(a: &[f32]) -> f32 {
    a.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// Index of the largest value (first on ties).
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best
}
