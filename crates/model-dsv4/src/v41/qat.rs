//! V4.1's quantisation-aware-training fake quantisers: values the model was trained to see
//! through FP8 / FP4 caches are rounded onto those grids and back, in every run (they are part
//! of the model, not a storage choice). The reference's `_fake_quant_fp8_block` and
//! `_fake_quant_fp4_block`, bit for bit:
//!
//! - window KV: FP8 E4M3 per block of 32 channels with a power-of-two (ue8m0) scale,
//!   `2^ceil(log2(max(amax, 1e-4) * (1/448)))`;
//! - compressed KV: FP4 E2M1 per block of 16 with an E4M3 scale `e4m3(max(amax, 6*2^-9) / 6)`;
//! - indexer queries and keys: FP4 E2M1 per block of 32 with a ue8m0 scale
//!   `2^ceil(log2(max(amax, 6*2^-126) * (1/6)))`.
//!
//! Rounding is to nearest, ties to even (quant-codecs' encoders, which the reference's
//! threshold tables equal). A vector whose width is not a multiple of the block is left
//! unquantised, as the reference leaves it.

use quant_codecs::{mxfp4, mxfp8};

/// How an FP4 block's scale is formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp4Scale {
    /// A power of two (ue8m0), rounded up.
    Ue8m0,
    /// An E4M3 value, rounded to nearest.
    E4m3,
}

/// `2^ceil(log2(v))` for a positive normal f32, as the reference computes it from the bits:
/// the exponent field minus 127, plus one when any mantissa bit is set.
pub fn pow2_ceil(v: f32) -> f32 {
    let bits = v.to_bits();
    let k = ((bits >> 23) & 0xff) as i32 - 127 + i32::from(bits & 0x7f_ffff != 0);
    (k as f32).exp2()
}

fn amax(block: &[f32]) -> f32 {
    block.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// FP8 E4M3 fake quantisation of each `block`-wide slice of `x` in place (the window KV).
pub fn fp8_ue8m0(x: &mut [f32], block: usize) {
    if block == 0 || !x.len().is_multiple_of(block) {
        return;
    }
    for b in x.chunks_exact_mut(block) {
        let scale = pow2_ceil(amax(b).max(1e-4) * (1.0 / mxfp8::E4M3_MAX));
        for v in b.iter_mut() {
            let q = (*v / scale).clamp(-mxfp8::E4M3_MAX, mxfp8::E4M3_MAX);
            *v = mxfp8::e4m3(mxfp8::encode(q)) * scale;
        }
    }
}

/// FP4 E2M1 fake quantisation of each `block`-wide slice of `x` in place.
pub fn fp4(x: &mut [f32], block: usize, scale: Fp4Scale) {
    if block == 0 || !x.len().is_multiple_of(block) {
        return;
    }
    for b in x.chunks_exact_mut(block) {
        let a = amax(b);
        let s = match scale {
            Fp4Scale::Ue8m0 => pow2_ceil(a.max(6.0 * 2f32.powi(-126)) * (1.0 / 6.0)),
            Fp4Scale::E4m3 => mxfp8::e4m3(mxfp8::encode(a.max(6.0 * 2f32.powi(-9)) / 6.0)),
        };
        for v in b.iter_mut() {
            let q = (*v / s).clamp(-6.0, 6.0);
            *v = mxfp4::e2m1(mxfp4::encode(q)) * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f64 witnesses of the grids: every output is a grid value times the block scale, the
    /// nearest one to the input (ties to the even code), and the scales are the documented ones.
    #[test]
    fn fp8_blocks_round_to_the_nearest_e4m3_multiple_of_a_power_of_two_scale() {
        // amax 3.0: 3/448 = 0.0067 -> 2^-7 = 0.0078125; values / scale on the E4M3 grid.
        let mut x = vec![0f32; 32];
        x[0] = 3.0;
        x[1] = -1.0;
        x[2] = 0.3;
        x[3] = 1e-3;
        let orig = x.clone();
        fp8_ue8m0(&mut x, 32);
        let scale = 2f64.powi(-7);
        let grid: Vec<f64> = (0u8..=0x7e).map(|c| mxfp8::e4m3(c) as f64).collect();
        for (o, v) in orig.iter().zip(&x) {
            let q = (*o as f64 / scale).abs();
            let best = grid
                .iter()
                .copied()
                .min_by(|a, b| (a - q).abs().total_cmp(&(b - q).abs()))
                .unwrap();
            assert_eq!((*v as f64).abs(), best * scale, "{o}");
            assert_eq!(v.is_sign_negative(), o.is_sign_negative());
        }
        // A width that is not a multiple of the block is left alone.
        let mut y = vec![0.123f32; 33];
        fp8_ue8m0(&mut y, 32);
        assert!(y.iter().all(|&v| v == 0.123));
    }

    #[test]
    fn fp4_blocks_use_the_documented_scales_and_ties_to_even() {
        // ue8m0: amax 5 -> 5/6 -> 2^0 = 1. Ties go to the even code: 5 -> 4, 2.5 -> 2,
        // 0.75 -> 1, 0.25 -> 0, 1.25 -> 1, 1.75 -> 2.
        let mut x = vec![5.0f32, 2.5, -0.75, 0.25, 1.25, 1.75];
        x.resize(32, 0.0);
        fp4(&mut x, 32, Fp4Scale::Ue8m0);
        assert_eq!(&x[..6], &[4.0f32, 2.0, -1.0, 0.0, 1.0, 2.0]);
        // e4m3: amax 3 -> 0.5 exactly, values / 0.5 on the E2M1 grid.
        let mut y = vec![3.0f32, 0.2, -1.3, 0.0];
        y.resize(16, 0.0);
        fp4(&mut y, 16, Fp4Scale::E4m3);
        assert_eq!(&y[..4], &[3.0, 0.25, -1.5, 0.0]);
        // amax 0.7: 0.7/6 = 0.11667 -> nearest E4M3 0.1171875 (1.875 * 2^-4).
        let mut z = vec![0.7f32, 0.35];
        z.resize(16, 0.0);
        fp4(&mut z, 16, Fp4Scale::E4m3);
        let s = 0.1171875f32;
        // 0.7 / s = 5.973 -> 6; 0.35 / s = 2.987 -> 3.
        assert_eq!(&z[..2], &[6.0 * s, 3.0 * s]);
    }

    #[test]
    fn pow2_ceil_rounds_up_to_a_power_of_two() {
        assert_eq!(pow2_ceil(1.0), 1.0);
        assert_eq!(pow2_ceil(1.0001), 2.0);
        assert_eq!(pow2_ceil(0.75), 1.0);
        assert_eq!(pow2_ceil(0.25), 0.25);
        assert_eq!(pow2_ceil(3.0 / 448.0), 2f32.powi(-7));
    }
}
