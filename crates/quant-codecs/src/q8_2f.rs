//! q8_2f: an int8 plane with an f16 scale per row and an f16 scale per column,
//! `w[r, i] = (q[r, i] * row_scale[r]) * col_scale[i]`.
//!
//! Column scales absorb outlier input channels (`sqrt` of each column's range, the
//! SmoothQuant balance point); each row scale is then searched for the least squared error.

use rayon::prelude::*;

use crate::Layout;
use crate::float::{f16_bits_to_f32, f32_to_f16_bits};
use crate::kernel::{RowKernel, fold, group_dot, zeroed};

/// Fractions of the max-abs row scale the search tries (1.0 first: the no-clipping choice).
const SEARCH: [f32; 11] = [
    1.0, 0.98, 0.96, 0.94, 0.92, 0.90, 0.88, 0.86, 0.84, 0.82, 0.80,
];

#[inline(always)]
fn half_at(bytes: &[u8], byte: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([bytes[byte], bytes[byte + 1]]))
}

/// Row `r`'s scale.
#[inline(always)]
pub(crate) fn row_scale(l: &Layout, bytes: &[u8], r: usize) -> f32 {
    half_at(bytes, l.second + 2 * r)
}

/// All column scales.
pub(crate) fn col_scales(l: &Layout, bytes: &[u8]) -> Vec<f32> {
    (0..l.cols)
        .map(|i| half_at(bytes, l.third + 2 * i))
        .collect()
}

/// Decodes row `r` into `out`, given the column scales.
pub(crate) fn dequantize_row(l: &Layout, bytes: &[u8], cs: &[f32], r: usize, out: &mut [f32]) {
    let rs = row_scale(l, bytes, r);
    let q = &bytes[r * l.cols..][..l.cols];
    for ((o, &q), &c) in out.iter_mut().zip(q).zip(cs) {
        *o = (q as i8 as f32 * rs) * c;
    }
}

/// Smallest f16 not below `x` (x >= 0).
fn f16_at_least(x: f32) -> u16 {
    let h = f32_to_f16_bits(x);
    if f16_bits_to_f32(h) < x { h + 1 } else { h }
}

fn encode(v: f32, s: f32) -> i8 {
    (v / s).round().clamp(-127.0, 127.0) as i8
}

/// Each column's largest magnitude.
pub(crate) fn col_max(w: &[f32], cols: usize) -> Vec<f32> {
    w.par_chunks(cols)
        .fold(
            || vec![0.0f32; cols],
            |mut m, row| {
                for (m, v) in m.iter_mut().zip(row) {
                    *m = m.max(v.abs());
                }
                m
            },
        )
        .reduce(
            || vec![0.0f32; cols],
            |mut a, b| {
                for (a, b) in a.iter_mut().zip(b) {
                    *a = a.max(b);
                }
                a
            },
        )
}

/// Column scales (f16 bits) from the columns' maxima: sqrt(colmax / gmax), floored at the
/// smallest normal f16.
pub(crate) fn col_scales_from_max(colmax: &[f32]) -> Vec<u16> {
    let gmax = colmax.iter().fold(0.0f32, |m, &v| m.max(v));
    colmax
        .iter()
        .map(|&m| {
            let c = if gmax > 0.0 {
                ((m / gmax) as f64).sqrt() as f32
            } else {
                1.0
            };
            f32_to_f16_bits(c.max(f32::from_bits(0x3880_0000))) // 2^-14
        })
        .collect()
}

/// Quantises rows given the column scales: writes each row's int8 codes and f16 row scale.
pub(crate) fn quantize_rows(w: &[f32], cols: usize, cs: &[f32], plane: &mut [u8], rsec: &mut [u8]) {
    plane
        .par_chunks_mut(cols)
        .zip(rsec.par_chunks_mut(2))
        .zip(w.par_chunks(cols))
        .for_each(|((q, rs), row)| {
            let m = row
                .iter()
                .zip(cs)
                .fold(0.0f32, |m, (v, c)| m.max(v.abs() / c));
            let mut best: Option<(u16, f32)> = None;
            if m > 0.0 {
                for f in SEARCH {
                    let h = f16_at_least(m / 127.0 * f);
                    let s = f16_bits_to_f32(h);
                    if s == 0.0 || !s.is_finite() {
                        continue;
                    }
                    let sse: f32 = row
                        .iter()
                        .zip(cs)
                        .map(|(&v, &c)| {
                            let e = v - (encode(v / c, s) as f32 * s) * c;
                            e * e
                        })
                        .sum();
                    if best.is_none_or(|(_, b)| sse < b) {
                        best = Some((h, sse));
                    }
                }
            }
            let h = best.map_or(0, |(h, _)| h);
            rs.copy_from_slice(&h.to_le_bytes());
            let s = f16_bits_to_f32(h);
            if s > 0.0 {
                for ((q, &v), &c) in q.iter_mut().zip(row).zip(cs) {
                    *q = encode(v / c, s) as u8;
                }
            }
        });
}

/// Quantises a `[rows, cols]` matrix of finite values.
pub(crate) fn quantize(l: &Layout, w: &[f32]) -> Vec<u8> {
    let (rows, cols) = (l.rows, l.cols);
    let cs16 = col_scales_from_max(&col_max(w, cols));
    let cs: Vec<f32> = cs16.iter().map(|&h| f16_bits_to_f32(h)).collect();
    let mut out = vec![0u8; l.nbytes];
    let (plane, rest) = out.split_at_mut(l.second);
    let (rsec, csec) = rest.split_at_mut(2 * rows);
    for (dst, h) in csec.chunks_exact_mut(2).zip(&cs16) {
        dst.copy_from_slice(&h.to_le_bytes());
    }
    quantize_rows(w, cols, &cs, plane, rsec);
    out
}

/// The matvec kernel over one q8_2f matrix; activations arrive pre-multiplied by the column scales.
pub(crate) struct Kernel<'a> {
    pub l: Layout,
    pub bytes: &'a [u8],
}

impl RowKernel for Kernel<'_> {
    #[inline(always)]
    fn row_dot<const NT: usize>(&self, r: usize, xs: &[f32], out: &mut [f32; NT]) {
        let cols = self.l.cols;
        let q = &self.bytes[r * cols..][..cols];
        let mut acc = zeroed::<NT>();
        let full = cols / 32 * 32;
        for (g, qg) in q[..full].chunks_exact(32).enumerate() {
            let mut w = [0.0f32; 32];
            for j in 0..32 {
                w[j] = qg[j] as i8 as f32;
            }
            group_dot(&mut acc, &w, xs, cols, g);
        }
        let rs = row_scale(&self.l, self.bytes, r);
        for (t, (o, a)) in out.iter_mut().zip(&acc).enumerate() {
            let mut s = fold(a);
            for i in full..cols {
                s = (q[i] as i8 as f32).mul_add(xs[t * cols + i], s);
            }
            *o = s * rs;
        }
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn rows_avx512<const NT: usize>(&self, r0: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
        // SAFETY: the caller guarantees AVX-512 (the trait's contract).
        unsafe { crate::simd512::q8_2f_rows::<NT>(self, r0, xs, outs) }
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn rows_avx2<const NT: usize>(&self, r0: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
        // SAFETY: the caller guarantees AVX2 (the trait's contract).
        unsafe { crate::simd256::q8_2f_rows::<NT>(self, r0, xs, outs) }
    }
}
