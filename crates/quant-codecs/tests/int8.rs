//! The int8-activation kernels (`ActPath::Int8`, docs/codecs.md "CPU int8 kernels") against
//! f64 witnesses: the exact product within the documented bound, the product on the quantised
//! activations within the f32 accumulation bound alone (which catches a wrong weight code), and
//! against each other (matmat rows vs single rows, every instruction set, bit for bit).

use proptest::prelude::*;
use quant_codecs::act8::{ACT_BLOCK, Act8Row};
use quant_codecs::{ActPath, CodecError, DType, Isa, MAX_BATCH, MatRef, quantize};

const U: f64 = 1.0 / (1u64 << 24) as f64;
const QUANTISED: [DType; 4] = [DType::Q8_2f, DType::Q4tp, DType::Q2tp, DType::Mxfp4];

fn cfg(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn xorshift(seed: u64) -> impl FnMut() -> f64 {
    let mut s = seed | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Weights with a per-row magnitude, outlier columns, zero groups and spikes; `cols` from
/// `blocks` (a multiple of 32, or any width when `any_width`), up to 40 blocks so rows span
/// several 16-block chunks and end in partial ones.
fn weights(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut next = xorshift(seed);
    let row_mag: Vec<f64> = (0..rows).map(|_| 10f64.powf(next() * 4.0 - 3.0)).collect();
    let col_mag: Vec<f64> = (0..cols)
        .map(|_| if next() < 0.05 { 20.0 } else { 1.0 })
        .collect();
    let mut w = vec![0.0f32; rows * cols];
    for r in 0..rows {
        let zero_group = next() < 0.2;
        for i in 0..cols {
            let g = (next() + next() + next() - 1.5) * 2.0;
            let spike = if next() < 0.01 { 30.0 } else { 1.0 };
            let v = g * row_mag[r] * col_mag[i] * spike;
            w[r * cols + i] = if zero_group && (32..64).contains(&i) {
                0.0
            } else {
                v as f32
            };
        }
    }
    w
}

/// Activations with a spread of block magnitudes, some zero blocks.
fn activations(n: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut next = xorshift(seed ^ 0x5555);
    let mut xs = vec![0.0f32; n];
    for (i, x) in xs.iter_mut().enumerate() {
        let block = (i % cols) / ACT_BLOCK;
        let mag = 10f64.powf(((block * 7 + i / cols) % 5) as f64 - 2.0);
        *x = ((next() - 0.5) * 4.0 * mag) as f32;
        if (block + i / cols) % 11 == 5 {
            *x = 0.0;
        }
    }
    xs
}

fn f16_at(b: &[u8], o: usize) -> f64 {
    f64::from(half::f16::from_bits(u16::from_le_bytes([b[o], b[o + 1]])).to_f32())
}

/// The matrix and activations in the coordinates the integer kernels work in: q8_2f's
/// activations carry the column scales (`x_i * cs_i` in f32) and its weights are
/// `code * row_scale`; the other formats' are the decoded weights and the activations as given.
fn prepared(
    dtype: DType,
    rows: usize,
    cols: usize,
    p: &[u8],
    dq: &[f32],
    x: &[f32],
) -> (Vec<f64>, Vec<f32>) {
    if dtype != DType::Q8_2f {
        return (dq.iter().map(|&v| f64::from(v)).collect(), x.to_vec());
    }
    let cs_at = rows * cols + 2 * rows;
    let xp = (0..cols)
        .map(|i| x[i] * f16_at(p, cs_at + 2 * i) as f32)
        .collect();
    let wp = (0..rows * cols)
        .map(|k| f64::from(p[k] as i8) * f16_at(p, rows * cols + 2 * (k / cols)))
        .collect();
    (wp, xp)
}

fn check(
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
    let xs = activations(nt * cols, cols, seed);
    let mut ys = vec![f32::NAN; nt * rows];
    m.matmat_path(ActPath::Int8, &xs, &mut ys).unwrap();
    let nb = cols.div_ceil(ACT_BLOCK);
    // f32 part: a block term's factor is rounded once, each of the 16 lanes takes up to
    // ceil(nb / 16) fused multiply-adds, the fold adds 4 roundings, q8_2f's row scale one more;
    // the kernels' `c_i * S_b` differs from the decoded weight by at most one rounding.
    let k_f32 = (nb.div_ceil(16) + 8) as f64 * U * 1.01;
    for t in 0..nt {
        let x = &xs[t * cols..(t + 1) * cols];
        // Every instruction set, and the single-row call, give the same bits.
        for isa in [Isa::Baseline, Isa::Avx2, Isa::Avx512] {
            let mut y1 = vec![f32::NAN; rows];
            m.matmat_path_with(isa, ActPath::Int8, x, &mut y1).unwrap();
            for r in 0..rows {
                prop_assert_eq!(
                    ys[t * rows + r].to_bits(),
                    y1[r].to_bits(),
                    "{} {:?} row {} of T={} != single row {} ({} vs {})",
                    dtype,
                    isa,
                    t,
                    nt,
                    r,
                    ys[t * rows + r],
                    y1[r]
                );
            }
        }
        let (wp, xp) = prepared(dtype, rows, cols, &p, &dq, x);
        let a = Act8Row::quantize(&xp);
        for r in 0..rows {
            let got = f64::from(ys[t * rows + r]);
            let (mut wit_q, mut mag_q, mut exact, mut mag, mut qerr) = (0.0, 0.0, 0.0, 0.0, 0.0);
            for b in 0..nb {
                let d = f64::from(a.d[b]);
                let (mut wabs, mut amax) = (0.0f64, 0.0f64);
                for i in b * ACT_BLOCK..((b + 1) * ACT_BLOCK).min(cols) {
                    let wv = wp[r * cols + i];
                    let v = wv * d * f64::from(a.q[i]);
                    wit_q += v;
                    mag_q += v.abs();
                    let e = f64::from(dq[r * cols + i]) * f64::from(x[i]);
                    exact += e;
                    mag += e.abs();
                    wabs += wv.abs();
                    amax = amax.max(f64::from(xp[i]).abs());
                }
                qerr += amax / 254.0 * wabs * (1.0 + 2f64.powi(-20));
            }
            let e_f32 = k_f32 * mag_q + 1e-37;
            prop_assert!(
                (got - wit_q).abs() <= e_f32,
                "{} r{} t{}: int8 {} vs f64 on quantised activations {} (bound {})",
                dtype,
                r,
                t,
                got,
                wit_q,
                e_f32
            );
            // q8_2f's prepared coordinates differ from the decoded ones by three roundings.
            let bound = qerr + e_f32 + 4.0 * U * mag;
            prop_assert!(
                (got - exact).abs() <= bound,
                "{} r{} t{}: int8 {} vs exact {} (bound {})",
                dtype,
                r,
                t,
                got,
                exact,
                bound
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(cfg(48))]

    #[test]
    fn int8_kernels_within_bounds_and_bit_identical(
        rows in 1usize..9, blocks in 1usize..41, nt in 1usize..=MAX_BATCH, seed in any::<u64>()
    ) {
        let cols = 32 * blocks;
        let w = weights(rows, cols, seed);
        for dtype in QUANTISED {
            check(dtype, rows, cols, &w, nt, seed)?;
        }
    }

    #[test]
    fn int8_q8_2f_takes_any_width(
        rows in 1usize..9, cols in 1usize..1300, nt in 1usize..=MAX_BATCH, seed in any::<u64>()
    ) {
        let w = weights(rows, cols, seed);
        check(DType::Q8_2f, rows, cols, &w, nt, seed)?;
    }
}

#[test]
fn int8_on_a_matrix_big_enough_to_run_in_parallel() {
    let (rows, cols) = (300, 1600);
    let w = weights(rows, cols, 3);
    for dtype in QUANTISED {
        check(dtype, rows, cols, &w, 8, 99).unwrap();
        check(dtype, rows, cols, &w, 1, 7).unwrap();
    }
}

/// Wide enough that the AVX-512 kernels walk several token rows' columns in tiles (over 2048
/// columns at 8 rows, 3584 at 5), with a last group of rows short of 16: every instruction set
/// still gives the portable kernel's bits.
#[test]
fn int8_over_column_tiles_and_a_short_last_row_group() {
    let (rows, cols) = (37, 4000);
    let w = weights(rows, cols, 5);
    for dtype in QUANTISED {
        for nt in [8, 5, 2] {
            check(dtype, rows, cols, &w, nt, 40 + nt as u64).unwrap();
        }
    }
}

#[test]
fn f32_path_is_matmat_and_dtypes_without_int8_kernels_ignore_int8() {
    let (rows, cols) = (5, 96);
    let w = weights(rows, cols, 11);
    let xs = activations(3 * cols, cols, 5);
    for dtype in DType::ALL {
        let p = quantize(dtype, rows, cols, &w).unwrap();
        let m = MatRef::new(dtype, rows, cols, &p).unwrap();
        let mut want = vec![0.0f32; 3 * rows];
        m.matmat(&xs, &mut want).unwrap();
        let paths: &[ActPath] = if dtype.has_int8_kernel() {
            &[ActPath::F32]
        } else {
            &[ActPath::F32, ActPath::Int8]
        };
        for &path in paths {
            let mut got = vec![f32::NAN; 3 * rows];
            m.matmat_path(path, &xs, &mut got).unwrap();
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{dtype} {path:?}"
            );
        }
    }
}

#[test]
fn int8_non_finite_activations_poison_their_rows_only() {
    let (rows, cols) = (3, 64);
    let w = weights(rows, cols, 2);
    let mut xs = activations(2 * cols, cols, 1);
    xs[cols + 40] = f32::INFINITY;
    for dtype in QUANTISED {
        let p = quantize(dtype, rows, cols, &w).unwrap();
        let m = MatRef::new(dtype, rows, cols, &p).unwrap();
        let mut ys = vec![0.0f32; 2 * rows];
        m.matmat_path(ActPath::Int8, &xs, &mut ys).unwrap();
        assert!(ys[..rows].iter().all(|v| v.is_finite()), "{dtype}");
        assert!(ys[rows..].iter().all(|v| v.is_nan()), "{dtype}");
    }
}

#[test]
fn int8_wrong_lengths_are_errors_not_panics() {
    for dtype in DType::ALL {
        let (rows, cols) = (3, 64);
        let p = quant_codecs::synthetic_payload(dtype, rows, cols, 1).unwrap();
        let m = MatRef::new(dtype, rows, cols, &p).unwrap();
        let x = vec![0.5f32; cols];
        let mut y = vec![0.0f32; rows];
        for isa in [Isa::Baseline, Isa::Avx2, Isa::Avx512] {
            let run = |x: &[f32], y: &mut [f32]| m.matmat_path_with(isa, ActPath::Int8, x, y);
            assert!(matches!(
                run(&x[..cols - 1], &mut y),
                Err(CodecError::TooManyRows { found: 0, .. })
            ));
            assert!(matches!(
                run(&vec![0.5; cols + 1], &mut y),
                Err(CodecError::BufferLength { what: "x", .. })
            ));
            assert!(matches!(
                run(
                    &vec![0.5; (MAX_BATCH + 1) * cols],
                    &mut vec![0.0; (MAX_BATCH + 1) * rows]
                ),
                Err(CodecError::TooManyRows { .. })
            ));
            assert!(matches!(
                run(&x, &mut vec![0.0; rows + 1]),
                Err(CodecError::BufferLength { what: "y", .. })
            ));
            run(&x, &mut y).unwrap();
        }
    }
}

#[test]
fn int8_arbitrary_payloads_never_panic() {
    // Random bytes: any scale byte (NaN E8M0, huge ladders), any code.
    for dtype in QUANTISED {
        for (rows, cols) in [(1, 32), (5, 96), (17, 544)] {
            let p = quant_codecs::synthetic_payload(dtype, rows, cols, 9).unwrap();
            let mut noisy = p.clone();
            let mut next = xorshift(77);
            for b in noisy.iter_mut() {
                *b = (next() * 256.0) as u8;
            }
            for bytes in [&p, &noisy] {
                let m = MatRef::new(dtype, rows, cols, bytes).unwrap();
                let xs = activations(2 * cols, cols, 4);
                let mut want = vec![0.0f32; 2 * rows];
                m.matmat_path_with(Isa::Baseline, ActPath::Int8, &xs, &mut want)
                    .unwrap();
                for isa in [Isa::Avx2, Isa::Avx512] {
                    let mut got = vec![0.0f32; 2 * rows];
                    m.matmat_path_with(isa, ActPath::Int8, &xs, &mut got)
                        .unwrap();
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()));
                    assert!(same, "{dtype} {rows}x{cols} {isa:?}");
                }
            }
        }
    }
}

/// Several products in one parallel region equal each product's own call bit for bit, on both
/// paths, whatever mix of dtypes, widths and row counts (rows split into tasks at other
/// offsets than the single call's; a wrong offset or output slice shows here), on rayon and
/// on a spinning thread team, and a wrong length is refused naming the buffer.
#[test]
fn matmat_many_equals_each_product_alone() {
    use quant_codecs::Product;
    let shapes = [
        (DType::Q4tp, 700, 320, 1),
        (DType::Q2tp, 90, 2560, 3),
        (DType::Mxfp4, 1280, 256, 8),
        (DType::Q8_2f, 33, 96, 2),
        (DType::F16, 40, 64, 5),
        (DType::Q4tp, 8, 32, 1),
    ];
    type Case = (DType, usize, usize, usize, Vec<u8>, Vec<f32>);
    let mats: Vec<Case> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(d, rows, cols, nt))| {
            let p = quantize(d, rows, cols, &weights(rows, cols, i as u64 + 1)).unwrap();
            (
                d,
                rows,
                cols,
                nt,
                p,
                activations(nt * cols, cols, i as u64 + 9),
            )
        })
        .collect();
    let team = quant_codecs::team::Team::new(3, std::time::Duration::from_millis(1));
    let execs: [&dyn quant_codecs::team::Parallel; 2] = [&quant_codecs::team::Rayon, &team];
    for (path, exec) in [ActPath::Int8, ActPath::F32]
        .into_iter()
        .flat_map(|p| execs.into_iter().map(move |e| (p, e)))
    {
        let want: Vec<Vec<f32>> = mats
            .iter()
            .map(|(d, rows, cols, nt, p, xs)| {
                let m = MatRef::new(*d, *rows, *cols, p).unwrap();
                let mut y = vec![0.0f32; nt * rows];
                m.matmat_path(path, xs, &mut y).unwrap();
                y
            })
            .collect();
        let mut got: Vec<Vec<f32>> = mats.iter().map(|m| vec![f32::NAN; m.3 * m.1]).collect();
        let mut products: Vec<Product<'_, '_>> = mats
            .iter()
            .zip(got.iter_mut())
            .map(|((d, rows, cols, _, p, xs), ys)| Product {
                w: MatRef::new(*d, *rows, *cols, p).unwrap(),
                xs,
                ys,
            })
            .collect();
        MatRef::matmat_many_on(exec, path, &mut products).unwrap();
        drop(products);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{path:?} product {i} ({:?})",
                shapes[i]
            );
        }
    }
    let (d, rows, cols, _, p, xs) = &mats[0];
    let mut short = vec![0.0f32; rows - 1];
    let err = MatRef::matmat_many(
        ActPath::Int8,
        &mut [Product {
            w: MatRef::new(*d, *rows, *cols, p).unwrap(),
            xs,
            ys: &mut short,
        }],
    )
    .unwrap_err();
    assert!(
        matches!(err, CodecError::BufferLength { what: "y", .. }),
        "{err}"
    );
}

/// Products that read one activation buffer (a layer's cold experts all read the MoE input)
/// may share its quantisation, but only with the same code layout and offset: q4tp and mxfp4
/// share a layout with different offsets, q8_2f scales by its own column scales, and a
/// shorter slice from the same start is other activations. Each still equals its own call.
#[test]
fn matmat_many_shares_activations_only_where_they_match() {
    use quant_codecs::Product;
    let cols = 512;
    let xs = activations(3 * cols, cols, 77);
    let shapes = [
        (DType::Q4tp, 64, 3),
        (DType::Mxfp4, 48, 3),
        (DType::Q4tp, 80, 3),
        (DType::Q2tp, 40, 3),
        (DType::Q8_2f, 24, 3),
        (DType::Q8_2f, 16, 3),
        (DType::Q4tp, 32, 1),
    ];
    let mats: Vec<(DType, usize, usize, Vec<u8>)> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(d, rows, nt))| {
            let p = quantize(d, rows, cols, &weights(rows, cols, i as u64 + 40)).unwrap();
            (d, rows, nt, p)
        })
        .collect();
    let want: Vec<Vec<f32>> = mats
        .iter()
        .map(|(d, rows, nt, p)| {
            let m = MatRef::new(*d, *rows, cols, p).unwrap();
            let mut y = vec![0.0f32; nt * rows];
            m.matmat_path(ActPath::Int8, &xs[..nt * cols], &mut y)
                .unwrap();
            y
        })
        .collect();
    let mut got: Vec<Vec<f32>> = mats.iter().map(|m| vec![f32::NAN; m.2 * m.1]).collect();
    let mut products: Vec<Product<'_, '_>> = mats
        .iter()
        .zip(got.iter_mut())
        .map(|((d, rows, nt, p), ys)| Product {
            w: MatRef::new(*d, *rows, cols, p).unwrap(),
            xs: &xs[..nt * cols],
            ys,
        })
        .collect();
    MatRef::matmat_many(ActPath::Int8, &mut products).unwrap();
    drop(products);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
            "product {i} ({:?})",
            shapes[i]
        );
    }
}

/// Pairs `second . between(first . xs)` in one region equal the two products run one after
/// the other with `between` applied between, bit for bit: several pairs of mixed dtypes and
/// widths (one pair's first matrix split into many tasks, its second into one), on both
/// paths, on rayon and on a team. A `between` that reads the wrong pair's width or a second
/// product started before its first finished shows here. A wrong output length is refused,
/// and a panicking `between` fails the call instead of hanging it.
#[test]
fn matmat_chain_equals_the_two_products_in_turn() {
    use quant_codecs::Link;
    use quant_codecs::team::{Parallel, Rayon, Team};
    // (first dtype, second dtype, first rows = 2 * inner, cols, nt)
    let shapes = [
        (DType::Q4tp, DType::Q4tp, 2 * 640, 512, 1),
        (DType::Mxfp4, DType::Mxfp4, 2 * 96, 256, 3),
        (DType::Q2tp, DType::Q8_2f, 2 * 160, 320, 8),
        (DType::Q8_2f, DType::Q4tp, 2 * 64, 96, 2),
        // DeepSeek's expert width: the second product's 8 activation rows of 2048 columns
        // are the size a batch quantises in parallel elsewhere.
        (DType::Q4tp, DType::Mxfp4, 2 * 2048, 64, 8),
    ];
    type Case = (MatRef<'static>, MatRef<'static>, Vec<f32>);
    let leak = |v: Vec<u8>| -> &'static [u8] { Box::leak(v.into_boxed_slice()) };
    let cases: Vec<Case> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(d1, d2, r1, cols, nt))| {
            let s = i as u64 * 10;
            let p1 = leak(quantize(d1, r1, cols, &weights(r1, cols, s + 1)).unwrap());
            let p2 = leak(quantize(d2, cols, r1 / 2, &weights(cols, r1 / 2, s + 2)).unwrap());
            (
                MatRef::new(d1, r1, cols, p1).unwrap(),
                MatRef::new(d2, cols, r1 / 2, p2).unwrap(),
                activations(nt * cols, cols, s + 3),
            )
        })
        .collect();
    // Each pair's own width, from the pair index: a squared gate times the up half.
    let widths: Vec<usize> = cases.iter().map(|c| c.1.cols()).collect();
    let between = |j: usize, y: &[f32], x: &mut [f32]| {
        let i = widths[j];
        for (y, x) in y.chunks(2 * i).zip(x.chunks_mut(i)) {
            for k in 0..i {
                x[k] = y[k] * y[k].abs() * 0.01 + y[i + k];
            }
        }
    };
    let team = Team::new(3, std::time::Duration::from_millis(1));
    let execs: [&dyn Parallel; 2] = [&Rayon, &team];
    for path in [ActPath::Int8, ActPath::F32] {
        let want: Vec<Vec<f32>> = cases
            .iter()
            .enumerate()
            .map(|(j, (a, b, xs))| {
                let nt = xs.len() / a.cols();
                let mut y = vec![0.0f32; nt * a.rows()];
                a.matmat_path(path, xs, &mut y).unwrap();
                let mut x = vec![0.0f32; nt * b.cols()];
                between(j, &y, &mut x);
                let mut z = vec![0.0f32; nt * b.rows()];
                b.matmat_path(path, &x, &mut z).unwrap();
                z
            })
            .collect();
        for exec in execs {
            let mut got: Vec<Vec<f32>> = want.iter().map(|w| vec![f32::NAN; w.len()]).collect();
            let mut links: Vec<Link<'_, '_>> = cases
                .iter()
                .zip(got.iter_mut())
                .map(|((a, b, xs), ys)| Link {
                    first: *a,
                    xs,
                    second: *b,
                    ys,
                })
                .collect();
            MatRef::matmat_chain_on(exec, path, &mut links, &between).unwrap();
            drop(links);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{path:?} pair {i} ({:?})",
                    shapes[i]
                );
            }
        }
    }
    let (a, b, xs) = &cases[0];
    let mut short = vec![0.0f32; b.rows() - 1];
    let mut bad = [Link {
        first: *a,
        xs,
        second: *b,
        ys: &mut short,
    }];
    let err = MatRef::matmat_chain_on(&Rayon, ActPath::Int8, &mut bad, &between).unwrap_err();
    assert!(
        matches!(err, CodecError::BufferLength { what: "y", .. }),
        "{err}"
    );
    for exec in execs {
        let mut ys: Vec<Vec<f32>> = cases
            .iter()
            .map(|c| vec![0.0; c.2.len() / c.0.cols() * c.1.rows()])
            .collect();
        let mut links: Vec<Link<'_, '_>> = cases
            .iter()
            .zip(ys.iter_mut())
            .map(|((a, b, xs), ys)| Link {
                first: *a,
                xs,
                second: *b,
                ys,
            })
            .collect();
        let boom = |j: usize, y: &[f32], x: &mut [f32]| {
            if j == 1 {
                panic!("between failed");
            }
            between(j, y, x)
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            MatRef::matmat_chain_on(exec, ActPath::Int8, &mut links, &boom)
        }));
        assert!(r.is_err(), "the panic was swallowed");
    }
}

/// Every instruction set at every batch size, at the codes' extremes: the largest code
/// magnitudes against activations all at +-127, which overflow a 16-bit partial sum in a
/// kernel that adds too many products before widening (the AVX2 kernels add several
/// `vpmaddubsw` results first, as many as each format's codes allow), and mxfp4's E8M0 byte 0.
#[test]
fn int8_at_the_codes_extremes_on_every_instruction_set() {
    for dtype in [DType::Q8_2f, DType::Q4tp, DType::Q2tp, DType::Mxfp4] {
        let (rows, cols) = (19, 640);
        let mut p = quant_codecs::synthetic_payload(dtype, rows, cols, 9).unwrap();
        let l = *MatRef::new(dtype, rows, cols, &p).unwrap().layout();
        let row_bytes = l.codes_len / rows;
        for (r, row) in p[..l.codes_len].chunks_mut(row_bytes).enumerate() {
            let fill = match dtype {
                // Codes -128 and 127.
                DType::Q8_2f if r % 2 == 0 => 0x80,
                DType::Q8_2f => 0x7F,
                // Both E2M1 codes 6.0, the largest unsigned code `2 * 6 + 12`.
                DType::Mxfp4 => 0x77,
                // The largest nibble, the largest bit pairs.
                _ => 0xFF,
            };
            row.fill(fill);
        }
        if dtype == DType::Mxfp4 {
            for (i, s) in p[l.second..l.third].iter_mut().enumerate() {
                // Row 0 all at byte 0 (2^-127: its sums stay far from zero in f32).
                *s = if i < cols / ACT_BLOCK || i % 3 == 0 {
                    0
                } else {
                    127
                };
            }
        }
        let m = MatRef::new(dtype, rows, cols, &p).unwrap();
        let xs: Vec<f32> = (0..8 * cols)
            .map(|i| match (i / cols) % 3 {
                0 => 1.0,
                1 => -1.0,
                _ if i % 2 == 0 => 1.0,
                _ => -1.0,
            })
            .collect();
        for nt in [1, 3, 8] {
            let x = &xs[..nt * cols];
            let mut want = vec![f32::NAN; nt * rows];
            m.matmat_path_with(Isa::Baseline, ActPath::Int8, x, &mut want)
                .unwrap();
            assert!(want.iter().all(|v| v.is_finite()), "{dtype}");
            for isa in [Isa::Avx2, Isa::Avx512] {
                let mut got = vec![f32::NAN; nt * rows];
                m.matmat_path_with(isa, ActPath::Int8, x, &mut got).unwrap();
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{dtype} {isa:?} T={nt} [{i}]: {g} vs {w}"
                    );
                }
            }
        }
    }
}
