//! The float storage formats (f32, f16, bf16): element conversions and BF16 rounding.
//!
//! Decoding f16 is on every kernel's hot path (f16 matrices, per-row f16 parameters), so it is
//! written as straight-line integer code the compiler vectorises, and proven against `half` on
//! all 65,536 inputs by a test.

use crate::DType;
use crate::kernel::{RowKernel, fold, group_dot, zeroed};

/// f16 bits to f32, exactly (subnormals, infinities and NaN payloads included).
#[inline(always)]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let em = h & 0x7fff;
    let exp = em & 0x7c00;
    // Normal numbers: rebias the exponent by 127 - 15.
    let normal = (em << 13) + ((127 - 15) << 23);
    // Inf/NaN: all-ones exponent, mantissa kept.
    let infnan = (em << 13) | 0x7f80_0000;
    // Subnormals (and zero): mantissa * 2^-24, exact in f32.
    let sub = ((em as f32) * f32::from_bits(0x3380_0000)).to_bits(); // 2^-24
    let mag = if exp == 0x7c00 {
        infnan
    } else if exp == 0 {
        sub
    } else {
        normal
    };
    f32::from_bits(mag | sign)
}

/// f32 to f16 bits, rounding to nearest even (overflow to infinity, NaN stays NaN).
#[inline]
pub fn f32_to_f16_bits(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// bf16 bits to f32 (exact: bf16 is the upper half of a binary32).
#[inline(always)]
pub fn bf16_bits_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// f32 to bf16 bits with round-to-nearest-even; Inf and NaN keep their bits' upper half.
#[inline]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    (round_bf16(x).to_bits() >> 16) as u16
}

/// Rounds an f32 to the nearest bf16 value (ties to even), returned as f32.
///
/// Infinities and NaNs are returned unchanged (a NaN keeps its full payload), as the original
/// engine's DeepSeek-V4.1 boundaries do: `(bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000`
/// for finite values. A finite value just below `f32::MAX` rounds to infinity, as IEEE says.
#[inline(always)]
pub fn round_bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    if bits & 0x7f80_0000 == 0x7f80_0000 {
        return x;
    }
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000;
    f32::from_bits(rounded)
}

/// Element `i` of a float payload as f32.
#[inline(always)]
pub(crate) fn element(dtype: DType, bytes: &[u8], i: usize) -> f32 {
    match dtype {
        DType::F16 => f16_bits_to_f32(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])),
        DType::BF16 => bf16_bits_to_f32(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])),
        _ => f32::from_le_bytes([
            bytes[4 * i],
            bytes[4 * i + 1],
            bytes[4 * i + 2],
            bytes[4 * i + 3],
        ]),
    }
}

/// Decodes 32 consecutive elements starting at element `i`.
#[inline(always)]
fn group(dtype: DType, bytes: &[u8], i: usize) -> [f32; 32] {
    let mut w = [0.0f32; 32];
    match dtype {
        DType::F16 => {
            for (w, b) in w.iter_mut().zip(bytes[2 * i..][..64].chunks_exact(2)) {
                *w = f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        DType::BF16 => {
            for (w, b) in w.iter_mut().zip(bytes[2 * i..][..64].chunks_exact(2)) {
                *w = bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        _ => {
            for (w, b) in w.iter_mut().zip(bytes[4 * i..][..128].chunks_exact(4)) {
                *w = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
    }
    w
}

/// Encodes f32 values into a float dtype's payload (f16/bf16 round to nearest even).
pub(crate) fn encode(dtype: DType, w: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F16 => w
            .iter()
            .flat_map(|&v| f32_to_f16_bits(v).to_le_bytes())
            .collect(),
        DType::BF16 => w
            .iter()
            .flat_map(|&v| f32_to_bf16_bits(v).to_le_bytes())
            .collect(),
        _ => w.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// The matvec kernel over one f32, f16 or bf16 matrix.
pub(crate) struct Kernel<'a> {
    pub dtype: DType,
    pub cols: usize,
    pub bytes: &'a [u8],
}

impl RowKernel for Kernel<'_> {
    #[inline(always)]
    fn row_dot<const NT: usize>(&self, r: usize, xs: &[f32], out: &mut [f32; NT]) {
        let cols = self.cols;
        let base = r * cols;
        let full = cols / 32 * 32;
        let mut acc = zeroed::<NT>();
        for g in 0..full / 32 {
            let w = group(self.dtype, self.bytes, base + g * 32);
            group_dot(&mut acc, &w, xs, cols, g);
        }
        for (t, (o, a)) in out.iter_mut().zip(&acc).enumerate() {
            let mut s = fold(a);
            for i in full..cols {
                s = element(self.dtype, self.bytes, base + i).mul_add(xs[t * cols + i], s);
            }
            *o = s;
        }
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn rows_avx512<const NT: usize>(&self, r0: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
        // SAFETY: the caller guarantees AVX-512 (the trait's contract).
        unsafe { crate::simd512::float_rows::<NT>(self, r0, xs, outs) }
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn rows_avx2<const NT: usize>(&self, r0: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
        // SAFETY: the caller guarantees AVX2 (the trait's contract).
        unsafe { crate::simd256::float_rows::<NT>(self, r0, xs, outs) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_decode_matches_half_on_every_input() {
        for h in 0..=u16::MAX {
            let ours = f16_bits_to_f32(h);
            let theirs = half::f16::from_bits(h).to_f32();
            if theirs.is_nan() {
                assert!(ours.is_nan(), "{h:#06x}");
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{h:#06x}");
            }
        }
    }

    #[test]
    fn bf16_rounding_is_nearest_even_and_leaves_inf_nan() {
        // Exactly halfway between two bf16 values: ties go to the even mantissa.
        let lo = f32::from_bits(0x3f80_0000); // 1.0, mantissa even
        let tie_up_from_even = f32::from_bits(0x3f80_8000);
        assert_eq!(round_bf16(tie_up_from_even).to_bits(), lo.to_bits());
        let tie_from_odd = f32::from_bits(0x3f81_8000);
        assert_eq!(round_bf16(tie_from_odd).to_bits(), 0x3f82_0000);
        assert_eq!(
            round_bf16(f32::from_bits(0x3f80_8001)).to_bits(),
            0x3f81_0000
        );
        assert_eq!(round_bf16(f32::INFINITY), f32::INFINITY);
        assert_eq!(round_bf16(f32::NEG_INFINITY), f32::NEG_INFINITY);
        let nan = f32::from_bits(0x7fc0_1234);
        assert_eq!(
            round_bf16(nan).to_bits(),
            0x7fc0_1234,
            "NaN payload untouched"
        );
        assert_eq!(round_bf16(f32::MAX), f32::INFINITY);
        // Agrees with half's RNE for finite values.
        for bits in (0u32..=u32::MAX).step_by(65_521) {
            let x = f32::from_bits(bits);
            if x.is_finite() {
                let h = half::bf16::from_f32(x).to_f32();
                assert_eq!(round_bf16(x).to_bits(), h.to_bits(), "{bits:#x}");
            }
        }
    }
}
