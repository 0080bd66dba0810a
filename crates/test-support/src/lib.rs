//! Test helpers every crate's tests share (a dev-dependency only): where the committed
//! fixtures are, converting one to a CMF, reading the `.npy` files transformers wrote, and the
//! comparisons the parity tests make. Helpers panic with the path or case on any error: they
//! serve tests, where a panic is the report.
#![deny(missing_docs)]

use std::path::{Path, PathBuf};

pub mod bench;
pub mod harness;
pub mod mtp;

pub use cmf_convert::Profile;
pub use cmf_format::npy::Npy;

/// What a GPU test does where no adapter is found (`what` says why): fails under
/// `CORTIQ_REQUIRE_GPU=1` (CI, whose GPU is lavapipe), else notes the skip on stderr, and the
/// test returns.
pub fn no_gpu(what: &dyn std::fmt::Display) {
    assert_ne!(
        std::env::var("CORTIQ_REQUIRE_GPU").as_deref(),
        Ok("1"),
        "CORTIQ_REQUIRE_GPU=1 but no GPU: {what}"
    );
    eprintln!("no GPU, skipped: {what}");
}

/// The workspace root.
pub fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `fixtures/<case>`.
pub fn fixture(case: &str) -> PathBuf {
    workspace().join("fixtures").join(case)
}

/// Converts a fixture's `hf/` to `<dir>/<case>.cmf` under `profile`.
pub fn convert_fixture(case: &str, dir: &Path, profile: Profile) -> PathBuf {
    let out = dir.join(format!("{case}.cmf"));
    cmf_convert::convert(
        &cmf_convert::ConvertOptions::new(fixture(case).join("hf"), out.clone(), profile),
        &mut |_| {},
    )
    .unwrap_or_else(|e| panic!("converting {case}: {e}"));
    out
}

/// [`cmf_format::npy::read_npy`], panicking with the path on any error.
pub fn read_npy(path: &Path) -> Npy {
    cmf_format::npy::read_npy(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `k_prefill` of prompt `p` in `fixtures/<case>/expected/cases.json`.
pub fn k_prefill(case: &str, p: usize) -> usize {
    let path = fixture(case).join("expected/cases.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    v["prompts"][p]["k_prefill"]
        .as_u64()
        .unwrap_or_else(|| panic!("{}: no prompts[{p}].k_prefill", path.display())) as usize
}

/// Prompt `p`'s token ids (`expected/p<p>_ids.npy`).
pub fn ids(case: &str, p: usize) -> Vec<u32> {
    read_npy(&fixture(case).join(format!("expected/p{p}_ids.npy")))
        .i64
        .iter()
        .map(|&i| i as u32)
        .collect()
}

/// `max |a - b|` (NaN counts as infinite).
///
/// # Panics
/// If the lengths differ.
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

/// `log_softmax` in f64.
pub fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let z: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
    x.iter().map(|&v| v as f64 - m - z).collect()
}

/// `KL(p || q)` of two logit rows.
pub fn kl_div(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let (lp, lq) = (log_softmax(p_logits), log_softmax(q_logits));
    lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comparisons_against_hand_values() {
        assert_eq!(max_abs_diff(&[1.0, -2.0], &[1.5, -2.0]), 0.5);
        assert_eq!(max_abs_diff(&[f32::NAN], &[0.0]), f32::INFINITY);
        assert_eq!(max_abs(&[1.0, -3.0, 2.0]), 3.0);
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 0.0]), 1);
        // Identical rows: KL 0; log_softmax of two equal logits is ln(1/2).
        assert!(kl_div(&[0.3, 1.2], &[0.3, 1.2]).abs() < 1e-15);
        assert!((log_softmax(&[5.0, 5.0])[0] - 0.5f64.ln()).abs() < 1e-15);
    }

    #[test]
    fn fixtures_are_found() {
        assert!(fixture("qwen4_exp_a").join("hf/config.json").is_file());
        assert_eq!(
            ids("qwen4_exp_a", 0).len(),
            read_npy(&fixture("qwen4_exp_a").join("expected/p0_ids.npy")).shape[0]
        );
    }
}
