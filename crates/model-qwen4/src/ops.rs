//! Small numeric helpers shared by the blocks (f32 math as the reference does it): the
//! zero-centred grouped RMSNorm and rotate-half RoPE. The generic ones (projections,
//! activations, top-k) are in [`quant_codecs::ops`].

/// `Qwen4ExpTextRMSNorm` in place over each `group`-sized slice of `x`, with a weight of
/// `x.len()`-periodic length `w.len()` applied as `1 + w` (zero-centred).
pub fn rms_norm_1p(x: &mut [f32], w: &[f32], group: usize, eps: f32) {
    for row in x.chunks_mut(w.len()) {
        for (g, wg) in row.chunks_mut(group).zip(w.chunks(group)) {
            let ms = g.iter().map(|v| v * v).sum::<f32>() / group as f32;
            let r = 1.0 / (ms + eps).sqrt();
            for (v, wi) in g.iter_mut().zip(wg) {
                *v = *v * r * (1.0 + wi);
            }
        }
    }
}

/// Rotate-half RoPE on the first `cos.len() * 2` dims of `x` (pairs `(i, i + half)`).
pub fn rope(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i] + a * sin[i];
    }
}

/// RoPE tables: `inv_freq_i = 1 / theta^(2i / rot)`; cos/sin of `pos * inv_freq` for `i < rot/2`.
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    /// For `rot` rotating dims and base `theta`.
    pub fn new(rot: usize, theta: f64) -> Rope {
        // The reference computes `base ** (arange(0, dim, 2).float() / dim)` in f32.
        let inv_freq = (0..rot / 2)
            .map(|i| {
                let e = (2 * i) as f32 / rot as f32;
                1.0 / (theta as f32).powf(e)
            })
            .collect();
        Rope { inv_freq }
    }

    /// `(cos, sin)` at position `pos`.
    pub fn at(&self, pos: usize) -> (Vec<f32>, Vec<f32>) {
        let f: Vec<f32> = self.inv_freq.iter().map(|&w| pos as f32 * w).collect();
        (
            f.iter().map(|x| x.cos()).collect(),
            f.iter().map(|x| x.sin()).collect(),
        )
    }
}
