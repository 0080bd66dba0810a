//! Small numeric helpers shared by the blocks (f32 math as the reference does it): RMSNorms,
//! the interleaved trailing-slice RoPE with its default and YaRN frequencies, and softmax. The
//! generic ones (projections, activations, top-k) are in [`quant_codecs::ops`].

use crate::config::{RopeKind, RopeParams};

/// `DeepseekV4RMSNorm` in place over each `w.len()`-sized row of `x`: `w * x / rms(x)`.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    for row in x.chunks_mut(w.len()) {
        let r = inv_rms(row, eps);
        for (v, wi) in row.iter_mut().zip(w) {
            *v = wi * (*v * r);
        }
    }
}

/// `DeepseekV4UnweightedRMSNorm` in place over each `group`-sized slice of `x`.
pub fn rms_norm_unweighted(x: &mut [f32], group: usize, eps: f32) {
    for row in x.chunks_mut(group) {
        let r = inv_rms(row, eps);
        for v in row.iter_mut() {
            *v *= r;
        }
    }
}

/// `1 / sqrt(mean(x^2) + eps)`.
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (ms + eps).sqrt()
}

/// One RoPE parameter set: its inverse frequencies and cos/sin scale.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    scale: f32,
}

impl Rope {
    /// The frequencies of `rp` for heads of `head_dim` (the reference's
    /// `compute_default_rope_parameters` / `_compute_yarn_parameters`, in f32 like torch).
    pub fn new(rp: &RopeParams, head_dim: usize) -> Rope {
        let dim = (head_dim as f64 * rp.partial_rotary_factor) as usize;
        let base = rp.theta as f32;
        let pos_freqs: Vec<f32> = (0..dim)
            .step_by(2)
            .map(|i| base.powf(i as f32 / dim as f32))
            .collect();
        let inv_freq = match rp.kind {
            RopeKind::Default => pos_freqs.iter().map(|p| 1.0 / p).collect(),
            RopeKind::Yarn {
                factor,
                original_max_position_embeddings: orig,
                beta_fast,
                beta_slow,
            } => {
                let correction = |rot: f64| {
                    (dim as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln())
                        / (2.0 * rp.theta.ln())
                };
                // `truncate` is always true for V4 (see `RopeKind::Yarn`).
                let low = correction(beta_fast).floor().max(0.0);
                let mut high = correction(beta_slow).ceil().min(dim as f64 - 1.0);
                if low == high {
                    high += 0.001;
                }
                let (low, high) = (low as f32, high as f32);
                pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                        let extra = 1.0 - ramp;
                        let interp = 1.0 / (factor as f32 * p);
                        interp * (1.0 - extra) + (1.0 / p) * extra
                    })
                    .collect()
            }
        };
        Rope {
            inv_freq,
            scale: rp.attention_factor as f32,
        }
    }

    /// The inverse frequencies (one per rotated pair).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// `(cos, sin)` at position `pos`.
    pub fn at(&self, pos: usize) -> (Vec<f32>, Vec<f32>) {
        let f: Vec<f32> = self.inv_freq.iter().map(|&w| pos as f32 * w).collect();
        (
            f.iter().map(|x| x.cos() * self.scale).collect(),
            f.iter().map(|x| x.sin() * self.scale).collect(),
        )
    }
}

/// V4's interleaved RoPE on the TRAILING `2 * cos.len()` channels of `x`: pair `(2i, 2i+1)` of
/// that slice rotates by angle `i`; `inverse` rotates by the negated angle (`-sin`).
pub fn rope_tail(x: &mut [f32], cos: &[f32], sin: &[f32], inverse: bool) {
    let start = x.len() - 2 * cos.len();
    let tail = &mut x[start..];
    for (i, (&c, &s)) in cos.iter().zip(sin).enumerate() {
        let s = if inverse { -s } else { s };
        let (a, b) = (tail[2 * i], tail[2 * i + 1]);
        tail[2 * i] = a * c - b * s;
        tail[2 * i + 1] = b * c + a * s;
    }
}

/// In-place softmax of `x`.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut z = 0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        z += *v;
    }
    for v in x.iter_mut() {
        *v /= z;
    }
}
