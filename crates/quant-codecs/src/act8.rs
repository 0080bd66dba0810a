//! Activations quantised to int8 per 32-element block: the one scheme the CPU and GPU integer
//! kernels share (docs/codecs.md, "int8 activations").
//!
//! A block's codes are `q_i = round_half_away(127 * x_i / amax)`, computed from the bits of
//! `x_i` and `amax` with integer arithmetic only, so the GPU (whose f32 division is not
//! correctly rounded) derives the same codes as the CPU, and both kernels compute the same
//! integer dot products. The block's scale `d = amax / 127` enters only the f32 part of a dot
//! product.

/// Activations per block (one weight group of the 32-element formats).
pub const ACT_BLOCK: usize = 32;

/// A block's largest magnitude as f32 bits with the sign cleared: integer order on these bits
/// is float order on magnitudes, with every NaN above infinity, so the block is non-finite
/// exactly when the result is at least `0x7F80_0000`.
pub fn amax_bits(x: &[f32]) -> u32 {
    x.iter()
        .map(|v| v.to_bits() & 0x7FFF_FFFF)
        .max()
        .unwrap_or(0)
}

/// The code of one activation whose magnitude bits are at most `amax` (both from
/// [`amax_bits`]'s domain: sign cleared, finite, `amax > 0`): `round_half_away(127 * |x| /
/// amax)` with `x`'s sign, exactly.
///
/// With `x = mx * 2^ex`, `amax = ma * 2^ea` (24-bit significands, subnormals taking exponent
/// field 1), `k = ea - ex >= 0`; `N = 127 * mx < 2^31`, `A = N / ma`, `R = N % ma`. For `k = 0`
/// the value is `A + R / ma` and rounds up when `2R >= ma`; for `k >= 1` it is
/// `(A + R / ma) / 2^k` with `A < 2^8`; as `A` is an integer and `R / ma < 1`, its fraction
/// is at least 1/2 exactly when `A mod 2^k >= 2^(k-1)`, so the code is `(A + 2^(k-1)) >> k`.
pub fn code(x_bits: u32, amax: u32) -> i8 {
    let xa = x_bits & 0x7FFF_FFFF;
    let (ex, mx) = split(xa);
    let (ea, ma) = split(amax);
    let k = ea.saturating_sub(ex).min(31);
    let n = 127 * mx;
    let (a, r) = (n / ma, n % ma);
    let mag = if k == 0 {
        a + u32::from(2 * r >= ma)
    } else {
        (a + (1 << (k - 1))) >> k
    };
    let mag = mag as i8;
    if x_bits >> 31 == 1 { -mag } else { mag }
}

/// A float's exponent field (1 for subnormals) and 24-bit significand.
#[inline(always)]
fn split(v: u32) -> (u32, u32) {
    let e = v >> 23;
    let m = v & 0x007F_FFFF;
    if e == 0 { (1, m) } else { (e, m | 0x0080_0000) }
}

/// [`code`] for every activation of a block, in f64 arithmetic the compiler vectorises: the
/// same codes (tested against [`code`] and the f64 witness), several times faster (an integer
/// division per activation made quantising a row cost more than a small matrix's dot
/// products).
///
/// `y = |x| * (127 / amax) + 1/2` in f64 has a relative error below `2^-52`, so below `2^-45`
/// absolute (`y < 128`). A true `127 |x| / amax = 127 mx / (ma 2^k)` that is not a
/// half-integer lies at least `1 / (2 ma 2^k) > 2^-(25 + k)` from one, which is more than the
/// error for `k <= 8`; for `k >= 9` the true value is below `254 / 2^9 < 1/2`, at least
/// `2^-(25 + k)` below it, and the code is 0 either way. A half-integer is exact in f64 and
/// rounds away from zero. So `trunc(y)` (`y >= 0`) is the exact code.
fn codes(x: &[f32], amax: u32, q: &mut [i8]) {
    let s = 127.0 / f64::from(f32::from_bits(amax));
    for (q, v) in q.iter_mut().zip(x) {
        // SAFETY: `|x| <= amax` (finite), so `y` lies in [0.5, 127.5]: the unchecked
        // truncation is exact (the checked `as` saturates lane by lane in scalar code and
        // kept this loop from vectorising).
        let m: i32 = unsafe { (f64::from(v.abs()) * s + 0.5).to_int_unchecked() };
        *q = (if v.is_sign_negative() { -m } else { m }) as i8;
    }
}

/// Quantises one block (`x.len() <= ACT_BLOCK`; a short block is a row's tail) into `q` and
/// returns its scale `d = amax / 127`. A zero block has `d = 0` and codes 0; a block holding
/// an infinity or a NaN has codes 0 and `d = NaN`, so every dot product it enters is NaN, as
/// the f32 kernels' would be.
pub fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    debug_assert!(x.len() <= ACT_BLOCK && q.len() == x.len());
    let amax = amax_bits(x);
    if amax == 0 || amax >= 0x7F80_0000 {
        q.fill(0);
        return if amax == 0 { 0.0 } else { f32::NAN };
    }
    codes(x, amax, q);
    f32::from_bits(amax) / 127.0
}

/// One activation row quantised: `q` (one code per activation), `d` (one scale per block of
/// 32) and `sums` (per block, the sum of its codes: the tiered formats' levels are offset,
/// `n - 8` and `2c - 3`, and the offset's share is `offset * sum`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Act8Row {
    /// Codes, one per activation.
    pub q: Vec<i8>,
    /// Block scales.
    pub d: Vec<f32>,
    /// Block code sums.
    pub sums: Vec<i32>,
}

impl Act8Row {
    /// Quantises `x` block by block.
    pub fn quantize(x: &[f32]) -> Act8Row {
        let blocks = x.len().div_ceil(ACT_BLOCK);
        let mut out = Act8Row {
            q: vec![0; x.len()],
            d: Vec::with_capacity(blocks),
            sums: Vec::with_capacity(blocks),
        };
        for (xb, qb) in x.chunks(ACT_BLOCK).zip(out.q.chunks_mut(ACT_BLOCK)) {
            out.d.push(quantize_block(xb, qb));
            out.sums.push(qb.iter().map(|&v| i32::from(v)).sum());
        }
        out
    }

    /// The dequantised activations `d_b * q_i` (what the integer kernels multiply by, up to
    /// the f32 rounding of the scale products).
    pub fn dequantize(&self) -> Vec<f32> {
        self.q
            .chunks(ACT_BLOCK)
            .zip(&self.d)
            .flat_map(|(qb, &d)| qb.iter().map(move |&q| f32::from(q) * d))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The witness: the same rounding in f64, which is exact here (127 * |x| has at most 31
    /// significant bits; the quotient's distance from a half-integer, when not zero, is at
    /// least 2^-(24 + 8 + 24) relative, far above f64's 2^-53).
    fn witness(x: f32, amax: f32) -> i8 {
        let v = 127.0 * f64::from(x.abs()) / f64::from(amax);
        let m = (v + 0.5).floor() as i8;
        if x.is_sign_negative() { -m } else { m }
    }

    fn check_block(x: &[f32]) {
        let mut q = vec![0i8; x.len()];
        let d = quantize_block(x, &mut q);
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        if amax == 0.0 {
            assert_eq!(d, 0.0);
            assert!(q.iter().all(|&v| v == 0));
            return;
        }
        assert_eq!(d, amax / 127.0);
        for (&v, &c) in x.iter().zip(&q) {
            assert_eq!(c, witness(v, amax), "x = {v:e}, amax = {amax:e}");
        }
    }

    #[test]
    fn ties_round_away_from_zero() {
        // amax 127: the codes are round(x), and x = n + 0.5 are exact ties.
        let mut x = vec![
            127.0f32, -127.0, 2.5, -2.5, 0.5, -0.5, 1.5, 126.5, -0.0, 0.0,
        ];
        x.extend([1e-45f32, 3.0, 0.49999997, 0.5000001]);
        let mut q = vec![0i8; x.len()];
        quantize_block(&x, &mut q);
        assert_eq!(&q[..10], &[127, -127, 3, -3, 1, -1, 2, 127, 0, 0]);
        assert_eq!(&q[10..], &[0, 3, 0, 1]);
    }

    #[test]
    fn non_finite_blocks_poison_their_scale() {
        let mut q = [5i8; 3];
        assert!(quantize_block(&[1.0, f32::INFINITY, 2.0], &mut q).is_nan());
        assert_eq!(q, [0; 3]);
        assert!(quantize_block(&[f32::NAN, 1.0, 2.0], &mut q).is_nan());
        assert_eq!(quantize_block(&[0.0, -0.0, 0.0], &mut q), 0.0);
    }

    #[test]
    fn subnormal_blocks() {
        check_block(&[1e-45, 3e-45, -7e-44, 1e-40, -1.1754942e-38]);
        check_block(&[1e-40, 1.0e-3, -2.0e-39, 5.0e-42]);
        check_block(&[f32::MAX, -f32::MAX / 3.0, 1.0, 1e-30]);
    }

    #[test]
    fn rows_split_into_blocks_with_sums() {
        let x: Vec<f32> = (0..70).map(|i| (i as f32 - 35.0) * 0.37).collect();
        let r = Act8Row::quantize(&x);
        assert_eq!((r.q.len(), r.d.len(), r.sums.len()), (70, 3, 3));
        for (b, xb) in x.chunks(ACT_BLOCK).enumerate() {
            check_block(xb);
            let s: i32 = r.q[b * 32..(b * 32 + xb.len())]
                .iter()
                .map(|&v| i32::from(v))
                .sum();
            assert_eq!(r.sums[b], s);
        }
        for (xh, x) in r.dequantize().iter().zip(&x) {
            let amax = 35.0 * 0.37f32;
            assert!((xh - x).abs() <= amax / 254.0 * 1.0001 + 1e-6);
        }
    }

    proptest! {
        #[test]
        fn codes_equal_the_f64_witness(
            bits in prop::collection::vec(any::<u32>(), 1..=32),
            scale in -140i32..120,
        ) {
            // Random finite values spread over a wide exponent range, subnormals included.
            let x: Vec<f32> = bits
                .iter()
                .map(|&b| {
                    let v = f32::from_bits(b & 0x807F_FFFF | 0x3F80_0000) - 1.5f32.copysign(f32::from_bits(b));
                    v * 2f32.powi(scale) * ((b >> 23 & 15) as f32 / 4.0)
                })
                .collect();
            check_block(&x);
        }

        #[test]
        fn block_codes_equal_the_per_activation_code(
            bits in prop::collection::vec(0u32..0x7F80_0000, 1..=32),
            signs in any::<u32>(),
        ) {
            let x: Vec<f32> = bits.iter().enumerate()
                .map(|(i, &b)| f32::from_bits(b | ((signs >> i) & 1) << 31))
                .collect();
            let amax = amax_bits(&x);
            prop_assume!(amax > 0);
            let mut q = vec![0i8; x.len()];
            codes(&x, amax, &mut q);
            for (v, c) in x.iter().zip(&q) {
                prop_assert_eq!(*c, code(v.to_bits(), amax), "x bits {:#x}, amax {:#x}", v.to_bits(), amax);
            }
        }

        #[test]
        fn codes_equal_the_witness_on_raw_bits(bits in prop::collection::vec(0u32..0x7F80_0000, 1..=32)) {
            let x: Vec<f32> = bits.iter().enumerate()
                .map(|(i, &b)| f32::from_bits(b | if i % 3 == 0 { 0x8000_0000 } else { 0 }))
                .collect();
            check_block(&x);
        }
    }
}
