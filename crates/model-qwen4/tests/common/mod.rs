//! Test helpers: the shared ones from `test-support`, and this crate's fixture list.
#![allow(dead_code, unused_imports)]

pub use test_support::*;

/// The qwen4_exp fixture cases.
pub const CASES: [&str; 3] = ["qwen4_exp_a", "qwen4_exp_b", "qwen4_exp_c"];

/// Tolerance relative to `max|logit|` for the f32 profile (the issue asked for 1e-4; measured
/// errors are about 2e-6 relative: f32 summation-order noise through GDN, QSA, PLE and MoE).
pub const TOL: f32 = 1e-5;

/// A traced forward's intermediates in order: (name, layer, values).
pub type Traced = Vec<(String, usize, Vec<f32>)>;

/// Feeds `step` to the CPU model `c` and the device model `g`, traced, and compares every
/// intermediate: those off by more than `tol x max|CPU value|` (or of another length, or a
/// different list of names) as lines naming `what`; and how many were compared.
pub fn compare_step(
    what: &str,
    c: &model_qwen4::Model<'_>,
    sc: &mut model_qwen4::SeqState,
    g: &model_qwen4::GpuModel<'_>,
    sg: &mut model_qwen4::GpuState,
    step: &[u32],
    tol: f32,
) -> (usize, Vec<String>) {
    use model_qwen4::CausalLm;
    let mut want: Traced = Vec::new();
    c.forward_traced(step, sc, &mut |n, l, d| {
        want.push((n.to_string(), l, d.to_vec()))
    })
    .unwrap();
    let mut got: Traced = Vec::new();
    g.forward_traced(step, sg, &mut |n, l, d| {
        got.push((n.to_string(), l, d.to_vec()))
    })
    .unwrap();
    let wn: Vec<_> = want.iter().map(|w| (&w.0, w.1)).collect();
    let gn: Vec<_> = got.iter().map(|w| (&w.0, w.1)).collect();
    if wn != gn {
        return (0, vec![format!("{what}: trace names {gn:?} != {wn:?}")]);
    }
    let mut failures = Vec::new();
    for (w, gv) in want.iter().zip(&got) {
        let scale = max_abs(&w.2).max(1e-3);
        let err = max_abs_diff(&w.2, &gv.2);
        if w.2.len() != gv.2.len() || err > tol * scale {
            failures.push(format!(
                "{what} {} layer {}: max|diff| {err:.3e} (scale {scale:.3e}, len {} vs {})",
                w.0,
                w.1,
                gv.2.len(),
                w.2.len()
            ));
        }
    }
    (want.len(), failures)
}
