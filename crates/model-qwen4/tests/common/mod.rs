//! Test helpers: the shared ones from `test-support`, and this crate's fixture list.
#![allow(dead_code, unused_imports)]

pub use test_support::*;

/// The qwen4_exp fixture cases.
pub const CASES: [&str; 3] = ["qwen4_exp_a", "qwen4_exp_b", "qwen4_exp_c"];

/// Tolerance relative to `max|logit|` for the f32 profile (the issue asked for 1e-4; measured
/// errors are about 2e-6 relative: f32 summation-order noise through GDN, QSA, PLE and MoE).
pub const TOL: f32 = 1e-5;

/// A 64-token prompt of the demo model in one frame (the tiled matmat's long frames) against
/// the same prompt in frames of 8 (the 8-row kernel; every other step is the same arithmetic
/// per row): every row's logits within `rel x max|logit|`, and the same token wherever its
/// margin over the runner-up is wider than that. Returns the failures.
pub fn long_frame_against_eights(g: &model_qwen4::GpuModel<'_>, rel: f32) -> Vec<String> {
    use model_qwen4::CausalLm;
    assert!(g.frame_rows() >= 64, "frames of {} rows", g.frame_rows());
    let v = g.vocab_size();
    let ids: Vec<u32> = (0..64).map(|i| ((40 + 37 * i) % v) as u32).collect();
    let at_once = g.forward(&ids, &mut g.new_state()).unwrap();
    let mut st = g.new_state();
    let mut eights = Vec::new();
    for f in ids.chunks(8) {
        eights.extend(g.forward(f, &mut st).unwrap());
    }
    assert_eq!(at_once.len(), eights.len());
    let tol = rel * max_abs(&eights);
    let mut failures = Vec::new();
    let mut worst_all = 0.0f32;
    for (row, (a, b)) in at_once.chunks(v).zip(eights.chunks(v)).enumerate() {
        let worst = max_abs_diff(a, b);
        worst_all = worst_all.max(worst);
        if worst > tol {
            failures.push(format!("row {row}: |diff| {worst} > {tol}"));
        }
        let mut order: Vec<usize> = (0..v).collect();
        order.sort_by(|&i, &j| b[j].total_cmp(&b[i]));
        if b[order[0]] - b[order[1]] > tol && argmax(a) != argmax(b) {
            failures.push(format!("row {row}: token {} vs {}", argmax(a), argmax(b)));
        }
    }
    eprintln!("a long frame against frames of 8: max |diff| {worst_all:e} (bound {tol:e})");
    failures
}
