//! Property tests of every format, in candle's three ways: reconstruction error against the
//! documented per-format bound, the fast kernels against an f64 dot product of the decoded
//! matrix, and the kernels against each other (matmat rows vs matvec, every ISA, the plain
//! reference). Bounds and rules come from docs/codecs.md.

use proptest::prelude::*;
use quant_codecs::{CodecError, DType, Isa, MAX_BATCH, MatRef, dequantize, quantize};

fn cfg(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Weights with the features real checkpoints have: a per-row magnitude, outlier columns,
/// occasional zero groups and single spikes.
fn weights(cols_unit: usize) -> impl Strategy<Value = (usize, usize, Vec<f32>)> {
    (1usize..9, 1usize..6, any::<u64>()).prop_map(move |(rows, k, seed)| {
        let cols = if cols_unit == 32 { 32 * k } else { 13 * k + 3 };
        let mut s = seed | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64
        };
        let row_mag: Vec<f64> = (0..rows).map(|_| 10f64.powf(next() * 4.0 - 3.0)).collect();
        let col_mag: Vec<f64> = (0..cols)
            .map(|_| if next() < 0.05 { 20.0 } else { 1.0 })
            .collect();
        let mut w = vec![0.0f32; rows * cols];
        for r in 0..rows {
            let zero_group = next() < 0.1;
            for i in 0..cols {
                let g = (next() + next() + next() - 1.5) * 2.0;
                let spike = if next() < 0.01 { 30.0 } else { 1.0 };
                let v = g * row_mag[r] * col_mag[i] * spike;
                w[r * cols + i] = if zero_group && i < 32 { 0.0 } else { v as f32 };
            }
        }
        (rows, cols, w)
    })
}

fn f16(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32()
}

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}

fn sse(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum()
}

const SLACK: f64 = 1.0 + 1e-5;

proptest! {
    #![proptest_config(cfg(200))]

    #[test]
    fn q8_2f_error_within_bound((rows, cols, w) in weights(1)) {
        let p = quantize(DType::Q8_2f, rows, cols, &w).unwrap();
        let d = dequantize(DType::Q8_2f, &[rows, cols], &p).unwrap();
        let n = rows * cols;
        let cs: Vec<f32> = (0..cols).map(|i| f16(u16_at(&p, n + 2 * rows + 2 * i))).collect();
        for r in 0..rows {
            let row = &w[r * cols..(r + 1) * cols];
            let m = row.iter().zip(&cs).fold(0.0f32, |m, (v, c)| m.max(v.abs() / c));
            // s1: the smallest f16 >= m / 127.
            let mut s1 = half::f16::from_f32(m / 127.0);
            if s1.to_f32() < m / 127.0 {
                s1 = half::f16::from_bits(s1.to_bits() + 1);
            }
            let bound: f64 = cs.iter().map(|c| (s1.to_f32() as f64 * *c as f64 / 2.0).powi(2)).sum();
            let e = sse(row, &d[r * cols..(r + 1) * cols]);
            prop_assert!(e <= bound * SLACK + 1e-40, "row {r}: sse {e} > bound {bound}");
        }
    }

    #[test]
    fn q4tp_and_q2tp_error_within_bound((rows, cols, w) in weights(32), q2 in any::<bool>()) {
        let (dtype, qmax, zero_rung, plane) =
            if q2 { (DType::Q2tp, 1.5f32, true, rows * cols / 4) } else { (DType::Q4tp, 7.0, false, rows * cols / 2) };
        let p = quantize(dtype, rows, cols, &w).unwrap();
        let d = dequantize(dtype, &[rows, cols], &p).unwrap();
        for r in 0..rows {
            let lo = f16(u16_at(&p, plane + 4 * r));
            let step = f16(u16_at(&p, plane + 4 * r + 2));
            let rungs: Vec<f32> = (0..32)
                .filter(|&c| !zero_rung || c > 0)
                .map(|c| quant_codecs::tiered::exp2q(lo + (if zero_rung { c - 1 } else { c }) as f32 * step))
                .collect();
            for g in 0..cols / 32 {
                let o = r * cols + g * 32;
                let gw = &w[o..o + 32];
                let amax = gw.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let need = amax / qmax;
                let up = rungs.iter().copied().find(|&s| s >= need);
                prop_assert!(up.is_some(), "row {r} group {g}: top rung {} below {need}", rungs[rungs.len() - 1]);
                let bound = 32.0 * (up.unwrap() as f64 / 2.0).powi(2);
                let e = sse(gw, &d[o..o + 32]);
                prop_assert!(e <= bound * SLACK + 1e-40, "row {r} group {g}: sse {e} > {bound}");
            }
        }
    }

    #[test]
    fn mxfp4_error_within_bound((rows, cols, w) in weights(32)) {
        let p = quantize(DType::Mxfp4, rows, cols, &w).unwrap();
        let d = dequantize(DType::Mxfp4, &[rows, cols], &p).unwrap();
        for (gi, (gw, gd)) in w.chunks(32).zip(d.chunks(32)).enumerate() {
            let amax = gw.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
            if amax == 0.0 {
                prop_assert!(gd.iter().all(|v| *v == 0.0));
                continue;
            }
            let mut e = -130i32;
            while 6.0 * 2f64.powi(e) < amax { e += 1; }
            let s = 2f64.powi(e);
            let bound: f64 = gw.iter().map(|v| {
                let a = v.abs() as f64 / s;
                let h = if a < 2.0 { 0.25 } else if a < 4.0 { 0.5 } else { 1.0 };
                (h * s).powi(2)
            }).sum();
            let err = sse(gw, gd);
            prop_assert!(err <= bound * SLACK, "group {gi}: sse {err} > {bound}");
        }
    }

    #[test]
    fn mxfp8_error_within_bound((rows, cols, w) in weights(32)) {
        // docs/codecs.md: e_up = the smallest e with 448 * 2^e >= amax; every element within
        // half the E4M3 gap around |w| / 2^e_up, times 2^e_up.
        let p = quantize(DType::Mxfp8, rows, cols, &w).unwrap();
        let d = dequantize(DType::Mxfp8, &[rows, cols], &p).unwrap();
        for (gi, (gw, gd)) in w.chunks(32).zip(d.chunks(32)).enumerate() {
            let amax = gw.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
            if amax == 0.0 {
                prop_assert!(gd.iter().all(|v| *v == 0.0));
                prop_assert_eq!(p[rows * cols + gi], 0);
                continue;
            }
            let mut e = -140i32;
            while 448.0 * 2f64.powi(e) < amax { e += 1; }
            prop_assert_eq!(p[rows * cols + gi] as i32, e + 127, "group {} scale", gi);
            let s = 2f64.powi(e);
            for (k, (&v, &g)) in gw.iter().zip(gd).enumerate() {
                let a = v.abs() as f64 / s;
                let half_gap = if a < 2f64.powi(-6) { 2f64.powi(-10) } else { 2f64.powi(a.log2().floor() as i32 - 4) };
                let err = (v as f64 - g as f64).abs();
                prop_assert!(err <= half_gap * s * SLACK, "group {} [{}]: {} vs {} (err {} > {})", gi, k, v, g, err, half_gap * s);
            }
        }
    }

    #[test]
    fn mxfp8_canonical_payloads_round_trip(rows in 1usize..5, k in 1usize..4, seed in any::<u64>()) {
        // Canonical: every group's scale byte in 1..=246 (no product overflows f32) with some
        // element in E4M3's top binade (exponent field 15, so the scale is the one the
        // quantiser picks), or a zero group (codes 0x00 / 0x80, scale byte 0); no NaN code.
        let cols = 32 * k;
        let mut s = seed | 1;
        let mut next = || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; s };
        let n = rows * cols;
        let mut p = vec![0u8; DType::Mxfp8.expected_nbytes(&[rows, cols]).unwrap()];
        for g in 0..rows * k {
            let zero = next() % 10 == 0;
            let codes = &mut p[g * 32..(g + 1) * 32];
            for c in codes.iter_mut() {
                *c = if zero { (next() % 2 * 0x80) as u8 } else { (next() % 256) as u8 };
                if *c & 0x7f == 0x7f {
                    *c ^= 1;
                }
            }
            if !zero {
                let j = (next() % 32) as usize;
                codes[j] = (codes[j] & 0x80) | 0x78 | (next() % 7) as u8;
            }
            p[n + g] = if zero { 0 } else { 1 + (next() % 246) as u8 };
        }
        let d = dequantize(DType::Mxfp8, &[rows, cols], &p).unwrap();
        prop_assert_eq!(quantize(DType::Mxfp8, rows, cols, &d).unwrap(), p);
    }

    #[test]
    fn float_formats_round_trip_exactly(bits in prop::collection::vec(any::<u16>(), 1..200)) {
        // Every non-NaN f16/bf16 payload survives decode + encode unchanged.
        for dtype in [DType::F16, DType::BF16] {
            let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
            let v = dequantize(dtype, &[bits.len()], &bytes).unwrap();
            if v.iter().any(|x| x.is_nan()) { continue; }
            prop_assert_eq!(quantize(dtype, 1, bits.len(), &v).unwrap(), bytes);
        }
    }

    #[test]
    fn mxfp4_canonical_payloads_round_trip(rows in 1usize..5, k in 1usize..4, seed in any::<u64>()) {
        let cols = 32 * k;
        let gpr = k;
        let mut s = seed | 1;
        let mut next = || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; s };
        let mut p = vec![0u8; DType::Mxfp4.expected_nbytes(&[rows, cols]).unwrap()];
        for g in 0..rows * gpr {
            let zero = next() % 10 == 0;
            let mut codes = [0u8; 32];
            for c in codes.iter_mut() {
                *c = if zero { (next() % 2 * 8) as u8 } else { (next() % 16) as u8 };
            }
            if !zero {
                let j = (next() % 32) as usize;
                codes[j] = (codes[j] & 8) | (6 + (next() % 2) as u8);
            }
            for b in 0..16 {
                p[g * 16 + b] = codes[2 * b] | (codes[2 * b + 1] << 4);
            }
            p[rows * cols / 2 + g] = if zero { 0 } else { 1 + (next() % 252) as u8 };
        }
        let d = dequantize(DType::Mxfp4, &[rows, cols], &p).unwrap();
        prop_assert_eq!(quantize(DType::Mxfp4, rows, cols, &d).unwrap(), p);
    }

    #[test]
    fn tiered_codes_re_encode_from_their_own_scales((rows, cols, w) in weights(32), q2 in any::<bool>()) {
        // docs/codecs.md: given a payload's own scales, re-encoding its decoded values
        // reproduces its element codes (wherever the group scale is not zero).
        let dtype = if q2 { DType::Q2tp } else { DType::Q4tp };
        let p = quantize(dtype, rows, cols, &w).unwrap();
        let d = dequantize(dtype, &[rows, cols], &p).unwrap();
        let plane = if q2 { rows * cols / 4 } else { rows * cols / 2 };
        let cst = (cols / 32 * 5).div_ceil(8);
        for (e, &v) in d.iter().enumerate() {
            let (r, g) = (e / cols, e % cols / 32);
            let lo = f16(u16_at(&p, plane + 4 * r));
            let step = f16(u16_at(&p, plane + 4 * r + 2));
            let rb = &p[plane + 4 * rows + r * cst..][..cst];
            let b0 = rb[5 * g / 8] as u32;
            let b1 = rb.get(5 * g / 8 + 1).copied().unwrap_or(0) as u32;
            let code = ((b0 | b1 << 8) >> (5 * g % 8)) & 31;
            let scale = match (q2, code) {
                (true, 0) => continue,
                (true, c) => quant_codecs::tiered::exp2q(lo + (c - 1) as f32 * step),
                (false, c) => quant_codecs::tiered::exp2q(lo + c as f32 * step),
            };
            let stored = if q2 { (p[e / 4] >> (2 * (e % 4))) & 3 } else { (p[e / 2] >> (4 * (e % 2))) & 15 };
            let re = if q2 {
                (v / scale + 2.0).floor().clamp(0.0, 3.0) as u8
            } else {
                ((v / scale).round().clamp(-8.0, 7.0) + 8.0) as u8
            };
            prop_assert_eq!(re, stored, "element {}", e);
        }
    }

    #[test]
    fn q8_2f_codes_re_encode_from_their_own_scales((rows, cols, w) in weights(1)) {
        let p = quantize(DType::Q8_2f, rows, cols, &w).unwrap();
        let d = dequantize(DType::Q8_2f, &[rows, cols], &p).unwrap();
        let n = rows * cols;
        for (e, &v) in d.iter().enumerate() {
            let (r, i) = (e / cols, e % cols);
            let rs = f16(u16_at(&p, n + 2 * r));
            let cs = f16(u16_at(&p, n + 2 * rows + 2 * i));
            if rs == 0.0 { continue; }
            let re = (v / cs / rs).round().clamp(-127.0, 127.0) as i8;
            prop_assert_eq!(re, p[e] as i8, "element {}", e);
        }
    }
}

fn dot64(w: &[f32], x: &[f32]) -> (f64, f64) {
    w.iter().zip(x).fold((0.0, 0.0), |(s, a), (&w, &x)| {
        (s + w as f64 * x as f64, a + (w as f64 * x as f64).abs())
    })
}

fn kernels_check(
    dtype: DType,
    rows: usize,
    cols: usize,
    w: &[f32],
    nt: usize,
    seed: u64,
) -> Result<(), TestCaseError> {
    let p = quantize(dtype, rows, cols, w).unwrap();
    let m = MatRef::new(dtype, rows, cols, &p).unwrap();
    let mut dq = vec![0.0f32; rows * cols];
    m.dequantize(&mut dq).unwrap();
    let mut s = seed | 1;
    let xs: Vec<f32> = (0..nt * cols)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
        })
        .collect();
    let mut ys = vec![f32::NAN; nt * rows];
    m.matmat(&xs, &mut ys).unwrap();
    let tol = (cols as f64 / 16.0 + 8.0) * 2f64.powi(-23);
    for t in 0..nt {
        let x = &xs[t * cols..(t + 1) * cols];
        let mut y1 = vec![f32::NAN; rows];
        m.matvec(x, &mut y1).unwrap();
        let mut yr = vec![f32::NAN; rows];
        m.matvec_ref(x, &mut yr).unwrap();
        for r in 0..rows {
            let got = ys[t * rows + r];
            prop_assert_eq!(
                got.to_bits(),
                y1[r].to_bits(),
                "{} matmat row {} != matvec at {}",
                dtype,
                t,
                r
            );
            let (exact, mag) = dot64(&dq[r * cols..(r + 1) * cols], x);
            prop_assert!(
                (got as f64 - exact).abs() <= tol * mag + 1e-37,
                "{} r{} got {} exact {} mag {}",
                dtype,
                r,
                got,
                exact,
                mag
            );
            prop_assert!((yr[r] as f64 - exact).abs() <= tol * mag * 8.0 + 1e-37);
        }
    }
    for isa in [Isa::Baseline, Isa::Avx2, Isa::Avx512] {
        let mut yi = vec![f32::NAN; nt * rows];
        m.matmat_with(isa, &xs, &mut yi).unwrap();
        prop_assert!(
            yi.iter().zip(&ys).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{} differs on {:?}",
            dtype,
            isa
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(cfg(64))]

    #[test]
    fn kernels_agree_with_f64_and_each_other((rows, cols, w) in weights(32), nt in 1usize..=MAX_BATCH, seed in any::<u64>()) {
        for dtype in DType::ALL {
            kernels_check(dtype, rows, cols, &w, nt, seed)?;
        }
    }

    #[test]
    fn float_and_q8_kernels_take_any_width((rows, cols, w) in weights(1), nt in 1usize..=MAX_BATCH, seed in any::<u64>()) {
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::Q8_2f] {
            kernels_check(dtype, rows, cols, &w, nt, seed)?;
        }
    }
}

#[test]
fn kernels_on_a_matrix_big_enough_to_run_in_parallel() {
    let (rows, cols) = (700, 320);
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 700.0)
        .collect();
    for dtype in DType::ALL {
        kernels_check(dtype, rows, cols, &w, 8, 99).unwrap();
        kernels_check(dtype, rows, cols, &w, 1, 7).unwrap();
    }
}

#[test]
fn wrong_lengths_are_errors_not_panics() {
    for dtype in DType::ALL {
        let (rows, cols) = (3, 64);
        let n = dtype.expected_nbytes(&[rows, cols]).unwrap();
        for bad in [0, 1, n - 1, n + 1, 2 * n] {
            let buf = vec![0u8; bad];
            assert!(
                matches!(
                    MatRef::new(dtype, rows, cols, &buf),
                    Err(CodecError::PayloadLength { .. })
                ),
                "{dtype} {bad}"
            );
            assert!(dequantize(dtype, &[rows, cols], &buf).is_err());
        }
        let p = vec![0u8; n];
        let m = MatRef::new(dtype, rows, cols, &p).unwrap();
        let mut y = vec![0.0; rows];
        assert!(m.matvec(&[0.0; 63], &mut y).is_err());
        assert!(m.matvec(&[0.0; 64], &mut [0.0; 2]).is_err());
        assert!(
            m.matmat(&[0.0; 64 * 9], &mut [0.0; 27]).is_err(),
            "more than MAX_BATCH rows"
        );
        assert!(m.matmat(&[0.0; 128], &mut [0.0; 3]).is_err());
        assert!(m.matvec_ref(&[0.0; 65], &mut y).is_err());
        assert!(m.dequantize(&mut [0.0; 10]).is_err());
        assert!(m.dequantize_row(3, &mut [0.0; 64]).is_err());
        assert!(m.dequantize_row(0, &mut [0.0; 63]).is_err());
        assert!(quantize(dtype, rows, cols, &[0.0; 100]).is_err());
    }
    assert!(matches!(
        quantize(DType::Q4tp, 1, 32, &[f32::NAN; 32]),
        Err(CodecError::NonFinite { row: 0, col: 0, .. })
    ));
    assert!(matches!(
        quantize(DType::Mxfp4, 1, 33, &[0.0; 33]),
        Err(CodecError::Shape { .. })
    ));
    assert!(matches!(
        quantize(DType::Mxfp8, 1, 40, &[0.0; 40]),
        Err(CodecError::Shape { .. })
    ));
    assert!(matches!(
        quantize(DType::Mxfp8, 1, 32, &[f32::INFINITY; 32]),
        Err(CodecError::NonFinite { row: 0, col: 0, .. })
    ));
    assert!(dequantize(DType::Q4tp, &[64], &[0; 32]).is_err());
}

#[test]
fn arbitrary_payloads_never_panic() {
    // Garbage bytes (NaN parameters, scale byte 255, any codes) decode and multiply without panic.
    for dtype in DType::ALL {
        let (rows, cols) = (5, 96);
        let n = dtype.expected_nbytes(&[rows, cols]).unwrap();
        for fill in [0x00u8, 0xff, 0x7c, 0x80] {
            let p: Vec<u8> = (0..n).map(|i| fill ^ (i as u8).wrapping_mul(31)).collect();
            let m = MatRef::new(dtype, rows, cols, &p).unwrap();
            let mut y = vec![0.0; rows];
            m.matvec(&vec![1.0; cols], &mut y).unwrap();
            dequantize(dtype, &[2, rows, cols], &[p.clone(), p].concat()).unwrap();
        }
    }
}

proptest! {
    #![proptest_config(cfg(64))]

    #[test]
    fn slice_rows_decodes_to_the_same_rows((rows, cols, w) in weights(32), a in 0usize..8, len in 1usize..8) {
        let start = a % rows;
        let end = (start + len).min(rows);
        for dtype in DType::ALL {
            let p = quantize(dtype, rows, cols, &w).unwrap();
            let whole = dequantize(dtype, &[rows, cols], &p).unwrap();
            let part = quant_codecs::slice_rows(dtype, rows, cols, &p, start, end).unwrap();
            let got = dequantize(dtype, &[end - start, cols], &part).unwrap();
            prop_assert!(
                got.iter().zip(&whole[start * cols..end * cols]).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{} rows {}..{}", dtype, start, end
            );
        }
    }
}

proptest! {
    #![proptest_config(cfg(32))]

    /// A gathered row decodes to exactly the row it was gathered from, in every dtype, for any
    /// order (repeats included).
    #[test]
    fn gather_rows_decodes_to_the_rows_in_that_order((rows, cols, w) in weights(32), picks in proptest::collection::vec(0usize..64, 1..12)) {
        let order: Vec<usize> = picks.iter().map(|p| p % rows).collect();
        for dtype in DType::ALL {
            let p = quantize(dtype, rows, cols, &w).unwrap();
            let whole = dequantize(dtype, &[rows, cols], &p).unwrap();
            let got = quant_codecs::gather_rows(dtype, rows, cols, &p, &order).unwrap();
            let got = dequantize(dtype, &[order.len(), cols], &got).unwrap();
            for (i, &r) in order.iter().enumerate() {
                prop_assert!(
                    got[i * cols..(i + 1) * cols].iter().zip(&whole[r * cols..(r + 1) * cols]).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{} gathered row {} (source row {})", dtype, i, r
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(cfg(32))]

    /// Concatenated matrices decode to their rows in order (q8_2f: the first part's rows; the
    /// second's codes and row scales are carried, its column scales are not).
    #[test]
    fn concat_rows_decodes_to_the_parts_rows((rows, cols, w) in weights(32), split in 1usize..31) {
        let split = split.min(rows.saturating_sub(1)).max(1);
        prop_assume!(split < rows);
        for dtype in DType::ALL {
            let (wa, wb) = w.split_at(split * cols);
            let pa = quantize(dtype, split, cols, wa).unwrap();
            let pb = quantize(dtype, rows - split, cols, wb).unwrap();
            let a = MatRef::new(dtype, split, cols, &pa).unwrap();
            let b = MatRef::new(dtype, rows - split, cols, &pb).unwrap();
            let both = quant_codecs::concat_rows(&[a, b]).unwrap();
            let got = dequantize(dtype, &[rows, cols], &both).unwrap();
            let da = dequantize(dtype, &[split, cols], &pa).unwrap();
            let db = dequantize(dtype, &[rows - split, cols], &pb).unwrap();
            let same = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
            prop_assert!(same(&got[..split * cols], &da), "{} first part", dtype);
            if dtype != DType::Q8_2f {
                prop_assert!(same(&got[split * cols..], &db), "{} second part", dtype);
            }
        }
    }
}

#[test]
fn concat_rows_refuses_mixed_widths() {
    let pa = quantize(DType::F16, 2, 32, &[0.5; 64]).unwrap();
    let pb = quantize(DType::F16, 2, 64, &[0.5; 128]).unwrap();
    let a = MatRef::new(DType::F16, 2, 32, &pa).unwrap();
    let b = MatRef::new(DType::F16, 2, 64, &pb).unwrap();
    assert!(quant_codecs::concat_rows(&[a, b]).is_err());
    assert!(quant_codecs::concat_rows(&[]).is_err());
}

#[test]
fn gather_rows_refuses_rows_past_the_end() {
    let p = quantize(DType::Q8_2f, 4, 32, &[0.5; 128]).unwrap();
    assert!(quant_codecs::gather_rows(DType::Q8_2f, 4, 32, &p, &[3, 4]).is_err());
    assert!(quant_codecs::gather_rows(DType::Q8_2f, 4, 32, &p[1..], &[0]).is_err());
}

#[test]
fn slice_rows_refuses_bad_ranges() {
    let p = quantize(DType::Q4tp, 4, 32, &[0.5; 128]).unwrap();
    assert!(quant_codecs::slice_rows(DType::Q4tp, 4, 32, &p, 2, 2).is_err());
    assert!(quant_codecs::slice_rows(DType::Q4tp, 4, 32, &p, 0, 5).is_err());
    assert!(quant_codecs::slice_rows(DType::Q4tp, 4, 32, &p[1..], 0, 2).is_err());
}

#[test]
fn synthetic_payloads_decode_to_finite_values() {
    for dtype in DType::ALL {
        let p = quant_codecs::synthetic_payload(dtype, 33, 128, 5).unwrap();
        let d = dequantize(dtype, &[33, 128], &p).unwrap();
        assert!(d.iter().all(|v| v.is_finite()), "{dtype}");
        assert!(d.iter().any(|v| *v != 0.0), "{dtype}");
    }
}

proptest! {
    #![proptest_config(cfg(64))]

    #[test]
    fn row_blocks_encode_exactly_as_quantize((rows, cols, w) in weights(32), block in 1usize..5) {
        for dtype in DType::ALL {
            let whole = quantize(dtype, rows, cols, &w).unwrap();
            let mut colmax = vec![0.0f32; cols];
            for b in w.chunks(block * cols) {
                quant_codecs::column_maxima(&mut colmax, b);
            }
            let mut enc = quant_codecs::RowEncoder::new(dtype, rows, cols, Some(&colmax)).unwrap();
            let mut streamed = Vec::new();
            for b in w.chunks(block * cols) {
                streamed.extend(enc.push_rows(b).unwrap());
            }
            streamed.extend(enc.finish().unwrap());
            prop_assert!(streamed == whole, "{} block {}", dtype, block);
        }
    }
}

#[test]
fn row_encoder_refuses_misuse() {
    use quant_codecs::RowEncoder;
    assert!(RowEncoder::new(DType::Q8_2f, 2, 64, None).is_err());
    assert!(RowEncoder::new(DType::Q8_2f, 2, 64, Some(&[1.0; 63])).is_err());
    let mut e = RowEncoder::new(DType::Q4tp, 2, 64, None).unwrap();
    assert!(e.push_rows(&[0.0; 65]).is_err());
    assert!(
        e.push_rows(&[0.0; 192]).is_err(),
        "more rows than the matrix has"
    );
    e.push_rows(&[0.0; 64]).unwrap();
    assert!(e.finish().is_err(), "a row is missing");
}
