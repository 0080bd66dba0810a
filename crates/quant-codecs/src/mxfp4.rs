//! mxfp4 (OCP MX FP4, dtype id 21): E2M1 codes in groups of 32, one E8M0 scale byte per group;
//! the code plane first, then the scale plane.

use crate::kernel::{RowKernel, fold, group_dot, zeroed};
use crate::{GROUP, Layout};

/// The eight E2M1 magnitudes, by the low three bits of a code.
pub const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// An E2M1 code (low nibble) as f32, by bit construction: no table, no branch the compiler
/// cannot turn into a select. Code 8 is -0.0.
#[inline(always)]
pub fn e2m1(n: u8) -> f32 {
    let m = (n & 7) as u32;
    let big = 0x3f00_0000 + (m << 22);
    let small = (m as f32 * 0.5).to_bits();
    let mag = if m < 2 { small } else { big };
    f32::from_bits(mag | (((n & 8) as u32) << 28))
}

/// An E8M0 scale byte as f32: 255 is NaN, 0 is 2^-127, otherwise exactly 2^(k - 127).
#[inline(always)]
pub fn e8m0(k: u8) -> f32 {
    match k {
        255 => f32::from_bits(0x7fc0_0000),
        0 => f32::from_bits(0x0040_0000),
        k => f32::from_bits((k as u32) << 23),
    }
}

/// Decodes row `r` into `out` (`cols` values).
pub(crate) fn dequantize_row(l: &Layout, bytes: &[u8], r: usize, out: &mut [f32]) {
    let gpr = l.groups_per_row();
    let plane = &bytes[r * l.cols / 2..][..l.cols / 2];
    let scales = &bytes[l.second + r * gpr..][..gpr];
    for (g, out) in out.chunks_exact_mut(GROUP).enumerate() {
        let s = e8m0(scales[g]);
        for (k, &b) in plane[g * 16..][..16].iter().enumerate() {
            out[2 * k] = e2m1(b & 15) * s;
            out[2 * k + 1] = e2m1(b >> 4) * s;
        }
    }
}

/// Nearest E2M1 code of `v` (already divided by the scale), ties to the even code, saturating at 6,
/// sign kept (so -0.0 is code 8).
pub fn encode(v: f32) -> u8 {
    let a = v.abs();
    // Midpoints between neighbouring magnitudes; an even lower code wins a tie (strict >),
    // an odd one loses it (>=).
    let m = (a > 0.25) as u8
        + (a >= 0.75) as u8
        + (a > 1.25) as u8
        + (a >= 1.75) as u8
        + (a > 2.5) as u8
        + (a >= 3.5) as u8
        + (a > 5.0) as u8;
    m | if v.is_sign_negative() { 8 } else { 0 }
}

fn encode_group(w: &[f32], e: i32) -> ([u8; GROUP], f32) {
    let inv = (-(e as f64)).exp2();
    let scale = (e as f64).exp2();
    let mut codes = [0u8; GROUP];
    let mut sse = 0.0f64;
    for (c, &v) in codes.iter_mut().zip(w) {
        *c = encode((v as f64 * inv) as f32);
        let d = v as f64 - e2m1(*c) as f64 * scale;
        sse += d * d;
    }
    (codes, sse as f32)
}

/// Quantises one row: `plane` is the row's `cols / 2` code bytes, `scales` its `cols / 32` bytes.
pub(crate) fn quantize_row(w: &[f32], plane: &mut [u8], scales: &mut [u8]) {
    for (g, gw) in w.chunks_exact(GROUP).enumerate() {
        let amax = gw.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
        let (e, codes) = if amax == 0.0 {
            (-127, encode_group(gw, -127).0)
        } else {
            // Smallest e with 6 * 2^e >= amax: no code saturates.
            let mut e = amax.log2().floor() as i32 - 3;
            while 6.0 * (e as f64).exp2() < amax {
                e += 1;
            }
            let e = e.clamp(-127, 127);
            let (mut best, mut best_sse) = encode_group(gw, e);
            let mut best_e = e;
            if e > -127 {
                let (c, s) = encode_group(gw, e - 1);
                if s < best_sse {
                    (best, best_sse, best_e) = (c, s, e - 1);
                }
            }
            let _ = best_sse;
            (best_e, best)
        };
        scales[g] = (e + 127) as u8;
        for k in 0..16 {
            plane[g * 16 + k] = codes[2 * k] | (codes[2 * k + 1] << 4);
        }
    }
}

/// The matvec kernel over one mxfp4 matrix.
pub(crate) struct Kernel<'a> {
    pub l: Layout,
    pub bytes: &'a [u8],
}

impl RowKernel for Kernel<'_> {
    #[inline(always)]
    fn row_dot<const NT: usize>(&self, r: usize, xs: &[f32], out: &mut [f32; NT]) {
        let l = &self.l;
        let gpr = l.groups_per_row();
        let plane = &self.bytes[r * l.cols / 2..][..l.cols / 2];
        let scales = &self.bytes[l.second + r * gpr..][..gpr];
        let mut acc = zeroed::<NT>();
        for g in 0..gpr {
            let b = &plane[g * 16..][..16];
            let s = e8m0(scales[g]);
            let mut w = [0.0f32; 32];
            // Lane order as q4tp's: even elements, then odd ones.
            for k in 0..16 {
                w[k] = e2m1(b[k] & 15) * s;
                w[16 + k] = e2m1(b[k] >> 4) * s;
            }
            group_dot(&mut acc, &w, xs, l.cols, g);
        }
        for (o, a) in out.iter_mut().zip(&acc) {
            *o = fold(a);
        }
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn rows_avx512<const NT: usize>(&self, r0: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
        // SAFETY: the caller guarantees AVX-512 (the trait's contract).
        unsafe { crate::simd512::mxfp4_rows::<NT>(&self.l, self.bytes, r0, xs, outs) }
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn rows_avx2<const NT: usize>(&self, r0: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
        // SAFETY: the caller guarantees AVX2 (the trait's contract).
        unsafe { crate::simd256::mxfp4_rows::<NT>(&self.l, self.bytes, r0, xs, outs) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2m1_table_and_signs() {
        for n in 0..16u8 {
            let want = E2M1[(n & 7) as usize] * if n & 8 != 0 { -1.0 } else { 1.0 };
            assert_eq!(e2m1(n).to_bits(), want.to_bits(), "code {n}");
        }
        assert_eq!(e2m1(8).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn e8m0_rules() {
        assert!(e8m0(255).is_nan());
        assert_eq!(e8m0(0), 2f32.powi(-127));
        assert_eq!(e8m0(127), 1.0);
        assert_eq!(e8m0(254), 2f32.powi(127));
        assert_eq!(e8m0(1), f32::MIN_POSITIVE);
    }

    #[test]
    fn encode_rounds_to_nearest_with_ties_to_even() {
        let cases = [
            (0.25, 0),
            (0.26, 1),
            (0.75, 2),
            (1.25, 2),
            (1.75, 4),
            (2.5, 4),
            (3.5, 6),
            (5.0, 6),
            (5.01, 7),
            (100.0, 7),
            (-0.0, 8),
            (-3.0, 13),
        ];
        for (v, want) in cases {
            assert_eq!(encode(v), want, "{v}");
        }
    }
}
