//! Small numeric helpers shared by the blocks (f32 math as the reference does it).

use quant_codecs::{MAX_BATCH, MatRef};

/// `y = x W^T` for `t` rows: `x` is `[t, cols]`, the result `[t, rows]`. Rows go through
/// `matmat` in chunks of up to [`MAX_BATCH`].
pub fn linear(w: &MatRef<'_>, x: &[f32], t: usize) -> Vec<f32> {
    let (rows, cols) = (w.rows(), w.cols());
    debug_assert_eq!(x.len(), t * cols);
    let mut y = vec![0f32; t * rows];
    for (xs, ys) in x
        .chunks(MAX_BATCH * cols)
        .zip(y.chunks_mut(MAX_BATCH * rows))
    {
        w.matmat(xs, ys).expect("shapes checked at bind time");
    }
    y
}

/// `1 / (1 + e^-x)`.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `x * sigmoid(x)`.
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// torch's softplus (beta 1, threshold 20).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

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

/// Indices of the `k` largest values, largest first; ties keep the lower index first.
pub fn top_k(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}
