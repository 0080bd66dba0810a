//! The Engram module of a V4.1 decoder layer (`DeepseekV41Engram`): writes the n-gram rows
//! gathered for a token into its mHC streams, each stream gated by how well it matches.
//!
//! `[key_1..key_N | value] = wkv . rows` (the token's `n_cols` rows of `engram_head_dim`,
//! concatenated); per stream `k`:
//! `dot = sum(h_k * (q_weight * k_weight)_k * key_k) / (rms(h_k) rms(key_k) sqrt(D))`,
//! `gate = sigmoid(sign(dot) sqrt(max(|dot|, 1e-6)))`, `h_k += gate * value`. The norms are
//! per (token, stream), with `rms_norm_eps` inside the square roots.

use crate::ops::inv_rms;
use crate::v41::weights::EngramWeights;
use quant_codecs::ops::{linear, sigmoid};

/// Applies the module to the streams `x` `[t, N, D]` in place, with `rows` `[t, n_cols * hd]`
/// the token's gathered table rows.
pub fn forward_cpu(
    w: &EngramWeights<'_>,
    x: &mut [f32],
    rows: &[f32],
    t: usize,
    n: usize,
    eps: f32,
) {
    let d = w.qk.len() / n;
    let kv = linear(&w.wkv, rows, t);
    let inv_sqrt_d = (d as f32).powf(-0.5);
    for r in 0..t {
        let kvr = &kv[r * (n + 1) * d..(r + 1) * (n + 1) * d];
        let value = &kvr[n * d..];
        for k in 0..n {
            let key = &kvr[k * d..(k + 1) * d];
            let h = &mut x[(r * n + k) * d..(r * n + k + 1) * d];
            let wk = &w.qk[k * d..(k + 1) * d];
            let rstd = inv_rms(h, eps) * inv_rms(key, eps);
            let dot: f32 = h
                .iter()
                .zip(wk)
                .zip(key)
                .map(|((a, b), c)| a * b * c)
                .sum::<f32>()
                * rstd
                * inv_sqrt_d;
            let gate = sigmoid(dot.abs().max(1e-6).sqrt().copysign(dot));
            for (a, v) in h.iter_mut().zip(value) {
                *a += gate * v;
            }
        }
    }
}
