//! Gated hyper-connections (`Qwen4ExpTextGatedResidual`): H residual streams of width D, mixed
//! into one block input and re-injected after the block. Not mHC: no Sinkhorn, no comb matrix.
//!
//! `Xn = RMSNorm_grouped(X) (1+w)`; `g = sigmoid(W_up silu(W_down Xn / H))`;
//! `u = mean_k g_k Xn_k`; `inj = 2 sigmoid(W_inject Xn / H)`; after the block `X_k += inj_k y`.

use crate::ops::rms_norm_1p;
use crate::weights::HcWeights;
use quant_codecs::ops::{linear, sigmoid, silu};

/// Output of one HC site over `t` tokens.
pub struct HcMix {
    /// Block input `[t, D]`.
    pub input: Vec<f32>,
    /// Injection weights `[t, H]` (empty for the final mixer).
    pub inject: Vec<f32>,
}

/// Runs the site on streams `x` `[t, H*D]`.
pub fn forward_cpu(w: &HcWeights<'_>, x: &[f32], t: usize, h: usize, d: usize, eps: f32) -> HcMix {
    let mut xn = x.to_vec();
    rms_norm_1p(&mut xn, &w.norm, d, eps);
    let mut low = linear(&w.down, &xn, t);
    for v in &mut low {
        *v = silu(*v / h as f32);
    }
    let g = linear(&w.up, &low, t);
    let mut input = vec![0f32; t * d];
    for r in 0..t {
        let out = &mut input[r * d..(r + 1) * d];
        for k in 0..h {
            let base = r * h * d + k * d;
            for j in 0..d {
                out[j] += sigmoid(g[base + j]) * xn[base + j];
            }
        }
        for v in out.iter_mut() {
            *v /= h as f32;
        }
    }
    let inject = match &w.inject {
        Some(m) => linear(m, &xn, t)
            .into_iter()
            .map(|v| 2.0 * sigmoid(v / h as f32))
            .collect(),
        None => Vec::new(),
    };
    HcMix { input, inject }
}

/// `X_k += inj_k * y` for every token and stream.
pub fn inject(x: &mut [f32], y: &[f32], inj: &[f32], t: usize, h: usize, d: usize) {
    for r in 0..t {
        for k in 0..h {
            let wk = inj[r * h + k];
            let xs = &mut x[r * h * d + k * d..r * h * d + (k + 1) * d];
            for (a, b) in xs.iter_mut().zip(&y[r * d..(r + 1) * d]) {
                *a += wk * b;
            }
        }
    }
}
