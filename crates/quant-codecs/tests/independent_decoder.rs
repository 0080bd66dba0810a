//! A second decoder, written from docs/codecs.md alone (it calls no decoding code of the crate),
//! checked bit for bit against `quant_codecs::dequantize` on random payloads: the document is
//! the contract, and this test is what keeps the code and the document the same thing.

use proptest::prelude::*;
use quant_codecs::{DType, dequantize};

fn u16_at(b: &[u8], o: usize) -> u16 {
    b[o] as u16 | (b[o + 1] as u16) << 8
}

/// binary16 -> binary32, by the IEEE definition in f64 (exact for every f16).
fn f16(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let e = ((h >> 10) & 31) as i32;
    let m = (h & 1023) as f64;
    let v = match e {
        0 => m * 2f64.powi(-24),
        31 if m == 0.0 => f64::INFINITY,
        31 => return f32::NAN,
        _ => (1.0 + m / 1024.0) * 2f64.powi(e - 15),
    };
    (sign * v) as f32
}

fn exp2q(t: f32) -> f32 {
    let t = if t.is_nan() {
        -126.0
    } else {
        t.clamp(-126.0, 127.0)
    };
    let i = t.floor();
    let f = t - i;
    let c: Vec<f32> = [
        0x3f800000u32,
        0x3f317213,
        0x3e75feef,
        0x3d634140,
        0x3c1e98cd,
        0x3aa306d3,
        0x39635e05,
    ]
    .iter()
    .map(|&b| f32::from_bits(b))
    .collect();
    let mut p = c[6];
    for k in (0..6).rev() {
        p = p * f + c[k];
    }
    p * 2f32.powi(i as i32)
}

fn decode(dtype: DType, rows: usize, cols: usize, b: &[u8]) -> Vec<f32> {
    let n = rows * cols;
    let gpr = cols / 32;
    let cst = (gpr * 5).div_ceil(8);
    let mut out = vec![0.0f32; n];
    match dtype {
        DType::F32 => {
            for (e, o) in out.iter_mut().enumerate() {
                *o = f32::from_le_bytes(b[4 * e..4 * e + 4].try_into().unwrap());
            }
        }
        DType::F16 => {
            for (e, o) in out.iter_mut().enumerate() {
                *o = f16(u16_at(b, 2 * e));
            }
        }
        DType::BF16 => {
            for (e, o) in out.iter_mut().enumerate() {
                *o = f32::from_bits((u16_at(b, 2 * e) as u32) << 16);
            }
        }
        DType::Q8_2f => {
            for r in 0..rows {
                let rs = f16(u16_at(b, n + 2 * r));
                for i in 0..cols {
                    let cs = f16(u16_at(b, n + 2 * rows + 2 * i));
                    out[r * cols + i] = (b[r * cols + i] as i8 as f32 * rs) * cs;
                }
            }
        }
        DType::Q4tp | DType::Q2tp => {
            let q4 = dtype == DType::Q4tp;
            let p = if q4 { n / 2 } else { n / 4 };
            let c = p + 4 * rows;
            for r in 0..rows {
                let lo = f16(u16_at(b, p + 4 * r));
                let step = f16(u16_at(b, p + 4 * r + 2));
                let rb = &b[c + r * cst..c + (r + 1) * cst];
                for i in 0..cols {
                    let g = i / 32;
                    let byte = (5 * g) >> 3;
                    let b0 = rb[byte] as u32;
                    let b1 = rb.get(byte + 1).copied().unwrap_or(0) as u32;
                    let code = ((b0 | b1 << 8) >> ((5 * g) & 7)) & 31;
                    let e = r * cols + i;
                    let (level, scale) = if q4 {
                        let nib = (b[e / 2] >> (4 * (e % 2))) & 15;
                        (nib as f32 - 8.0, exp2q(lo + code as f32 * step))
                    } else {
                        let cc = (b[e / 4] >> (2 * (e % 4))) & 3;
                        let s = if code == 0 {
                            0.0
                        } else {
                            exp2q(lo + (code - 1) as f32 * step)
                        };
                        (cc as f32 - 1.5, s)
                    };
                    out[e] = level * scale;
                }
            }
        }
        DType::Mxfp4 => {
            let table = [0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
            for e in 0..n {
                let (r, i) = (e / cols, e % cols);
                let nib = (b[e / 2] >> (4 * (e % 2))) & 15;
                let mag = table[(nib & 7) as usize];
                let v = if nib & 8 != 0 { -mag } else { mag };
                let k = b[n / 2 + r * gpr + i / 32];
                let s = match k {
                    255 => f32::NAN,
                    0 => 2f32.powi(-127),
                    k => 2f32.powi(k as i32 - 127),
                };
                out[e] = v * s;
            }
        }
        DType::Mxfp8 => {
            for e in 0..n {
                let (r, i) = (e / cols, e % cols);
                let c = b[e];
                let sign = if c & 0x80 != 0 { -1.0f64 } else { 1.0 };
                let ex = ((c >> 3) & 15) as i32;
                let m = (c & 7) as f64;
                let v = if ex == 15 && m == 7.0 {
                    f64::NAN
                } else if ex == 0 {
                    sign * m * 2f64.powi(-9)
                } else {
                    sign * (1.0 + m / 8.0) * 2f64.powi(ex - 7)
                };
                let k = b[n + r * gpr + i / 32];
                let s = match k {
                    255 => f64::NAN,
                    k => 2f64.powi(k as i32 - 127),
                };
                // The product of two exact values, rounded once to f32.
                out[e] = (v * s) as f32;
            }
        }
        other => panic!("the document has no section for {other}"),
    }
    out
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

fn payload(dtype: DType) -> impl Strategy<Value = (usize, usize, Vec<u8>)> {
    let col_unit = if matches!(
        dtype,
        DType::Q4tp | DType::Q2tp | DType::Mxfp4 | DType::Mxfp8
    ) {
        32
    } else {
        1
    };
    (1usize..6, 1usize..5).prop_flat_map(move |(rows, k)| {
        let cols = if col_unit == 32 { 32 * k } else { 7 * k + 1 };
        let n = dtype.expected_nbytes(&[rows, cols]).unwrap();
        (
            Just(rows),
            Just(cols),
            prop::collection::vec(any::<u8>(), n),
        )
    })
}

macro_rules! agree {
    ($name:ident, $dtype:expr) => {
        proptest! {
            #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]
            #[test]
            fn $name((rows, cols, bytes) in payload($dtype)) {
                let ours = dequantize($dtype, &[rows, cols], &bytes).unwrap();
                let theirs = decode($dtype, rows, cols, &bytes);
                prop_assert!(same_bits(&ours, &theirs));
            }
        }
    };
}

agree!(f32_agrees, DType::F32);
agree!(f16_agrees, DType::F16);
agree!(bf16_agrees, DType::BF16);
agree!(q8_2f_agrees, DType::Q8_2f);
agree!(q4tp_agrees, DType::Q4tp);
agree!(q2tp_agrees, DType::Q2tp);
agree!(mxfp4_agrees, DType::Mxfp4);
agree!(mxfp8_agrees, DType::Mxfp8);

#[test]
fn every_dtype_has_a_section() {
    for d in DType::ALL {
        let (rows, cols) = (2, 64);
        let n = d.expected_nbytes(&[rows, cols]).unwrap();
        let bytes: Vec<u8> = (0..n).map(|i| (i * 131 % 251) as u8).collect();
        assert!(
            same_bits(
                &decode(d, rows, cols, &bytes),
                &dequantize(d, &[rows, cols], &bytes).unwrap()
            ),
            "{d}"
        );
    }
}
