//! mxfp8 (OCP MX FP8 E4M3, dtype id 22): one E4M3 code byte per element in groups of 32, one
//! E8M0 scale byte per group; the code plane first, then the scale plane.
//!
//! This is byte for byte how DeepSeek-V4.1 stores its Engram tables (E4M3 rows with a ue8m0
//! scale per 32 channels), so the converter copies them verbatim and a model gathers a row
//! from a memory map by reading `cols` code bytes and `cols / 32` scale bytes.

use crate::kernel::{RowKernel, fold, group_dot, zeroed};
use crate::mxfp4::e8m0;
use crate::{GROUP, Layout};

/// The largest finite E4M3 magnitude (code 0x7E).
pub const E4M3_MAX: f32 = 448.0;

/// An OCP FP8 E4M3 code as f32 (the "fn" variant: no infinities, S.1111.111 is NaN), by bit
/// construction: exponent field `e` > 0 gives `(1 + m/8) * 2^(e - 7)`, `e` = 0 the subnormal
/// `m * 2^-9`. Every E4M3 value is exact in f32.
#[inline(always)]
pub fn e4m3(b: u8) -> f32 {
    let sign = u32::from(b & 0x80) << 24;
    let e = u32::from((b >> 3) & 15);
    let m = u32::from(b & 7);
    let mag = if e == 0 {
        // m * 2^-9: a small integer times a power of two, exact.
        (m as f32 * (1.0 / 512.0)).to_bits()
    } else if e == 15 && m == 7 {
        0x7fc0_0000
    } else {
        // f32 exponent field e - 7 + 127, the three mantissa bits on top of f32's 23.
        ((e + 120) << 23) | (m << 20)
    };
    f32::from_bits(mag | sign)
}

/// Nearest E4M3 code of a finite `v` (already divided by the scale): ties to the even code,
/// saturating at 448, sign kept (so -0.0 is code 0x80).
pub fn encode(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 0x80 } else { 0 };
    let a = v.abs();
    let mag = if a >= E4M3_MAX {
        0x7e
    } else if a < 1.0 / 64.0 {
        // Subnormal range: codes 0..=7 are m * 2^-9; a rounding up to 8 is 2^-6, which is
        // exactly code 0x08 (exponent field 1, mantissa 0). Scaling by 512 is exact.
        (a * 512.0).round_ties_even() as u8
    } else {
        // a is a normal f32 in [2^-6, 448): its exponent k in -6..=8, and its 23 fraction bits
        // rounded to 3 (exact in f32: an integer below 2^23 divided by 2^20). A carry out of
        // the mantissa (q = 8) moves to the next exponent, which adding it to the code does.
        let bits = a.to_bits();
        let k = (bits >> 23) as i32 - 127;
        let q = ((bits & 0x7f_ffff) as f32 / (1u32 << 20) as f32).round_ties_even() as u32;
        let code = (((k + 7) as u32) << 3) + q;
        // 0x7f would be NaN: only reachable when rounding 447.x up to 480, which saturates.
        code.min(0x7e) as u8
    };
    mag | sign
}

/// Decodes row `r` into `out` (`cols` values): `e4m3(code) * e8m0(scale)`.
pub(crate) fn dequantize_row(l: &Layout, bytes: &[u8], r: usize, out: &mut [f32]) {
    let gpr = l.groups_per_row();
    let plane = &bytes[r * l.cols..][..l.cols];
    let scales = &bytes[l.second + r * gpr..][..gpr];
    for ((out, codes), &k) in out
        .chunks_exact_mut(GROUP)
        .zip(plane.chunks_exact(GROUP))
        .zip(scales)
    {
        let s = e8m0(k);
        for (o, &c) in out.iter_mut().zip(codes) {
            *o = e4m3(c) * s;
        }
    }
}

/// Quantises one row: `plane` is the row's `cols` code bytes, `scales` its `cols / 32` bytes.
/// Each group takes the smallest power-of-two scale that covers its largest magnitude
/// (`448 * 2^e >= amax`, OCP's no-clipping choice, and how DeepSeek's tables were made), and
/// each element the nearest E4M3 value of `w / 2^e`. A zero group stores scale byte 0.
pub(crate) fn quantize_row(w: &[f32], plane: &mut [u8], scales: &mut [u8]) {
    for ((gw, codes), scale) in w
        .chunks_exact(GROUP)
        .zip(plane.chunks_exact_mut(GROUP))
        .zip(scales.iter_mut())
    {
        let amax = gw.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
        let e = if amax == 0.0 {
            -127
        } else {
            let mut e = (amax / E4M3_MAX as f64).log2().floor() as i32;
            while (E4M3_MAX as f64) * (e as f64).exp2() < amax {
                e += 1;
            }
            while e > -127 && (E4M3_MAX as f64) * ((e - 1) as f64).exp2() >= amax {
                e -= 1;
            }
            e.clamp(-127, 127)
        };
        *scale = (e + 127) as u8;
        // Dividing by a power of two in f64 is exact; the f32 result can only lose bits below
        // 2^-126, far under E4M3's resolution.
        let inv = (-(e as f64)).exp2();
        for (c, &v) in codes.iter_mut().zip(gw) {
            *c = encode((v as f64 * inv) as f32);
        }
    }
}

/// The matvec kernel over one mxfp8 matrix (lanes in element order: one code byte per lane).
pub(crate) struct Kernel<'a> {
    pub l: Layout,
    pub bytes: &'a [u8],
}

impl RowKernel for Kernel<'_> {
    #[inline(always)]
    fn row_dot<const NT: usize>(&self, r: usize, xs: &[f32], out: &mut [f32; NT]) {
        let l = &self.l;
        let gpr = l.groups_per_row();
        let plane = &self.bytes[r * l.cols..][..l.cols];
        let scales = &self.bytes[l.second + r * gpr..][..gpr];
        let mut acc = zeroed::<NT>();
        for (g, (codes, &k)) in plane.chunks_exact(GROUP).zip(scales).enumerate() {
            let s = e8m0(k);
            let mut w = [0.0f32; GROUP];
            for (w, &c) in w.iter_mut().zip(codes) {
                *w = e4m3(c) * s;
            }
            group_dot(&mut acc, &w, xs, l.cols, g);
        }
        for (o, a) in out.iter_mut().zip(&acc) {
            *o = fold(a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// E4M3 by the OCP definition in f64.
    fn witness(b: u8) -> f64 {
        let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = ((b >> 3) & 15) as i32;
        let m = (b & 7) as f64;
        if e == 0 {
            s * m / 8.0 * 2f64.powi(-6)
        } else {
            s * (1.0 + m / 8.0) * 2f64.powi(e - 7)
        }
    }

    #[test]
    fn e4m3_known_values_and_every_code() {
        assert_eq!(e4m3(0x00).to_bits(), 0);
        assert_eq!(e4m3(0x80).to_bits(), (-0.0f32).to_bits());
        assert_eq!(e4m3(0x38), 1.0);
        assert_eq!(e4m3(0x7e), 448.0);
        assert_eq!(e4m3(0xfe), -448.0);
        assert_eq!(e4m3(0x01), 2f32.powi(-9));
        assert_eq!(e4m3(0x08), 2f32.powi(-6));
        assert!(e4m3(0x7f).is_nan() && e4m3(0xff).is_nan());
        for b in 0..=255u8 {
            if b & 0x7f == 0x7f {
                continue;
            }
            assert_eq!(e4m3(b) as f64, witness(b), "code {b:#04x}");
        }
    }

    #[test]
    fn encode_inverts_decode_and_rounds_to_nearest_even() {
        for b in 0..=255u8 {
            if b & 0x7f != 0x7f {
                assert_eq!(encode(e4m3(b)), b, "code {b:#04x}");
            }
        }
        // Midpoints between neighbours go to the even code.
        for b in 0..0x7du8 {
            let mid = ((witness(b) + witness(b + 1)) / 2.0) as f32;
            let want = if b % 2 == 0 { b } else { b + 1 };
            assert_eq!(encode(mid), want, "midpoint above {b:#04x}");
            assert_eq!(encode(-mid), want | 0x80);
        }
        assert_eq!(encode(447.9), 0x7e);
        assert_eq!(encode(460.0), 0x7e, "saturates, never NaN");
        assert_eq!(encode(1e30), 0x7e);
        assert_eq!(
            encode(2f32.powi(-11)),
            0,
            "below half the smallest subnormal"
        );
        assert_eq!(encode(-0.0), 0x80);
    }
}
