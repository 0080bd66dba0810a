//! The int8 activation path on the device: the quantiser's codes against quant-codecs' act8
//! (exactly: the same integers), and the int8 matvec against f64 math on the quantised
//! activations (only f32 rounding apart), the CPU's int8 kernel, and the exact activations
//! (within the documented quantisation bound), for every codec, 1..=8 token rows, both
//! reductions and the fused epilogues. The hardware f16 variant runs where the adapter has the
//! conversion.

mod common;

use common::{ctx, rng, weights};
use gpu_runtime::ops::matvec::{POISON, Plan};
use gpu_runtime::ops::{act8, matvec};
use gpu_runtime::{ActLayout, Epilogue, Path, WeightArena};
use quant_codecs::act8::{ACT_BLOCK, quantize_block};
use quant_codecs::{ActPath, DType, MatRef, quantize};

const INT8_DTYPES: [DType; 4] = [DType::Q8_2f, DType::Q4tp, DType::Q2tp, DType::Mxfp4];

/// Activations with every case the integer rounding has to get right: exact ties, subnormals,
/// a zero block, values across many octaves, an infinity and a NaN in blocks of their own.
fn hard_activations(nt: usize, cols: usize) -> Vec<f32> {
    let mut r = rng(99);
    let mut xs: Vec<f32> = (0..nt * cols)
        .map(|i| {
            let v = r();
            match i % 7 {
                0 => v * 1e-3,
                1 => v * 3e4,
                2 => (i % 255) as f32 - 127.0 + 0.5,
                3 => v * 1e-39,
                _ => v,
            }
        })
        .collect();
    // Block 1 of row 0: all zero; block 2: ties at amax = 127; block 3: subnormal only.
    xs[32..64].fill(0.0);
    for (k, x) in xs[64..96].iter_mut().enumerate() {
        *x = if k == 0 { 127.0 } else { k as f32 + 0.5 - 16.0 };
    }
    for (k, x) in xs[96..128].iter_mut().enumerate() {
        *x = f32::from_bits(k as u32 * 977 + 1) * if k % 2 == 0 { 1.0 } else { -1.0 };
    }
    if xs.len() >= 256 {
        xs[130] = f32::INFINITY;
        xs[170] = f32::NAN;
    }
    xs
}

#[test]
fn device_codes_equal_the_cpu_codes_in_every_layout() {
    let Some(ctx) = ctx() else { return };
    let (nt, cols) = (3, 512);
    let xs = hard_activations(nt, cols);
    for layout in [ActLayout::Natural, ActLayout::Pairs, ActLayout::Quads] {
        let (words, scales) = act8::quantize(ctx, &xs, cols, layout).unwrap();
        for (b, xb) in xs.chunks(ACT_BLOCK).enumerate() {
            let mut q = [0i8; ACT_BLOCK];
            let d = quantize_block(xb, &mut q);
            let mut want = [0u32; 8];
            for (e, &c) in q.iter().enumerate() {
                let s = layout.slot(e);
                want[s / 4] |= (c as u8 as u32) << (8 * (s % 4));
            }
            assert_eq!(&words[b * 8..b * 8 + 8], &want, "{layout:?} block {b}");
            let sum: i32 = q.iter().map(|&v| i32::from(v)).sum();
            assert_eq!(scales[b][1] as i32, sum, "{layout:?} block {b} sum");
            let gd = f32::from_bits(scales[b][0]);
            if d.is_subnormal() {
                // A device that flushes subnormals (the H200 does) may give 0 here; the codes,
                // checked above, are what must agree.
                assert!(
                    gd == 0.0 || (gd - d).abs() <= 4.0 * f32::from_bits(1),
                    "block {b}"
                );
            } else if d.is_nan() || d == 0.0 {
                assert!(
                    gd.is_nan() == d.is_nan() && (d.is_nan() || gd == 0.0),
                    "block {b}"
                );
            } else {
                // The device's division may be off by a few ulp; the codes may not.
                assert!(
                    (gd - d).abs() <= 4.0 * f32::EPSILON * d,
                    "block {b}: {gd} vs {d}"
                );
            }
        }
    }
}

/// What the int8 kernels multiply: per row the integer-exact weights without the factors the
/// activations absorb (q8_2f: code * row scale; the column scale goes with the activation),
/// and the dequantised int8 activations `d_b q_i`.
fn witness_terms(
    dtype: DType,
    rows: usize,
    cols: usize,
    p: &[u8],
    xs: &[f32],
) -> (Vec<f32>, Vec<f64>) {
    let m = MatRef::new(dtype, rows, cols, p).unwrap();
    let mut w = vec![0.0f32; rows * cols];
    m.dequantize(&mut w).unwrap();
    let mut xq = Vec::with_capacity(xs.len());
    for x in xs.chunks(cols) {
        let scaled: Vec<f32> = if dtype == DType::Q8_2f {
            // x_i * col_scale[i] (f32 product), as both kernels prepare it.
            let cs = |i: usize| {
                let o = rows * cols + 2 * rows + 2 * i;
                quant_codecs::float::f16_bits_to_f32(u16::from_le_bytes([p[o], p[o + 1]]))
            };
            x.iter().enumerate().map(|(i, v)| v * cs(i)).collect()
        } else {
            x.to_vec()
        };
        for xb in scaled.chunks(ACT_BLOCK) {
            let mut q = [0i8; ACT_BLOCK];
            let d = quantize_block(xb, &mut q[..xb.len()]);
            xq.extend(q[..xb.len()].iter().map(|&c| f64::from(c) * f64::from(d)));
        }
    }
    if dtype == DType::Q8_2f {
        for r in 0..rows {
            let o = rows * cols + 2 * r;
            let rs = quant_codecs::float::f16_bits_to_f32(u16::from_le_bytes([p[o], p[o + 1]]));
            for i in 0..cols {
                w[r * cols + i] = f32::from(p[r * cols + i] as i8) * rs;
            }
        }
    }
    (w, xq)
}

fn check_int8(dtype: DType, rows: usize, cols: usize, p: &[u8], xs: &[f32], got: &[f32]) {
    let nt = xs.len() / cols;
    let (w, xq) = witness_terms(dtype, rows, cols, p, xs);
    let m = MatRef::new(dtype, rows, cols, p).unwrap();
    let mut dq = vec![0.0f32; rows * cols];
    m.dequantize(&mut dq).unwrap();
    let blocks = cols / ACT_BLOCK;
    // The CPU's int8 kernel: the same integer dot products, f32 sums in another order.
    let mut cpu = vec![0.0f32; nt * rows];
    m.matmat_path(ActPath::Int8, xs, &mut cpu).unwrap();
    for t in 0..nt {
        for r in 0..rows {
            let (mut want, mut mag) = (0.0f64, 0.0f64);
            for i in 0..cols {
                let v = f64::from(w[r * cols + i]) * xq[t * cols + i];
                want += v;
                mag += v.abs();
            }
            let g = got[t * rows + r];
            assert_ne!(g, POISON, "{dtype} row {r} token {t} never written");
            // Only f32 rounding separates the kernel from this witness: each block term's
            // factor and product (2 roundings), the sums over blocks and lanes.
            let tol = (blocks as f64 + 16.0) * f64::from(f32::EPSILON) * mag + 1e-30;
            assert!(
                (f64::from(g) - want).abs() <= tol,
                "{dtype} [{rows}x{cols}] row {r} t {t}: gpu {g} witness {want} (|err| {:e} > {tol:e})",
                (f64::from(g) - want).abs()
            );
            let c = f64::from(cpu[t * rows + r]);
            assert!(
                (f64::from(g) - c).abs() <= 2.0 * tol,
                "{dtype} row {r} t {t}: gpu {g} cpu int8 kernel {c}"
            );
            // Against the exact product: the documented quantisation bound. The kernel
            // quantised x' (q8_2f: x * col_scale, one f32 rounding) and multiplies w~ (q8_2f:
            // code * row_scale), with w~_i x'_i = w_i x_i up to that rounding; each block's
            // amax' is 127 d, recovered from its codes.
            let x = &xs[t * cols..(t + 1) * cols];
            let (mut exact, mut bound) = (0.0f64, 0.0f64);
            for b in 0..blocks {
                let amax = xq_amax(&xq, t, cols, b);
                for i in b * ACT_BLOCK..(b + 1) * ACT_BLOCK {
                    let e = f64::from(dq[r * cols + i]) * f64::from(x[i]);
                    exact += e;
                    bound += f64::from(w[r * cols + i]).abs() * amax / 254.0 + e.abs() * 1.2e-7;
                }
            }
            let bound = bound * (1.0 + 2e-6) + tol;
            assert!(
                (f64::from(g) - exact).abs() <= bound,
                "{dtype} row {r} t {t}: gpu {g} exact {exact} (|err| {:e} > bound {bound:e})",
                (f64::from(g) - exact).abs()
            );
        }
    }
}

/// amax of block `b` of token `t` as the quantiser saw it, recovered from its dequantised
/// codes (the code 127 * sign sits at the block's largest magnitude).
fn xq_amax(xq: &[f64], t: usize, cols: usize, b: usize) -> f64 {
    let s = t * cols + b * ACT_BLOCK;
    xq[s..s + ACT_BLOCK]
        .iter()
        .fold(0.0f64, |a, v| a.max(v.abs()))
}

fn upload(
    ctx: &gpu_runtime::GpuContext,
    arena: &WeightArena,
    dtype: DType,
    rows: usize,
    cols: usize,
    seed: u64,
) -> (Vec<u8>, std::sync::Arc<gpu_runtime::GpuMatrix>) {
    let w = weights(rows, cols, seed);
    let p = quantize(dtype, rows, cols, &w).unwrap();
    let g = arena
        .get_or_upload(
            ctx,
            seed,
            &format!("{dtype}-{rows}x{cols}-{seed}"),
            &MatRef::new(dtype, rows, cols, &p).unwrap(),
        )
        .unwrap();
    (p, g)
}

#[test]
fn int8_matvec_matches_f64_for_every_codec_1_to_8_rows_every_reduction() {
    let Some(ctx) = ctx() else { return };
    let arena = WeightArena::new(ctx);
    for dtype in INT8_DTYPES {
        for (rows, cols, seed) in [(37, 128, 5), (130, 640, 6), (8, 256, 7)] {
            let (p, g) = upload(ctx, &arena, dtype, rows, cols, seed);
            for r in [1, 2, 4] {
                let device = Plan {
                    rows: r,
                    ..Plan::for_matrix(ctx, rows)
                }
                .with_path(Path::Int8);
                for (plan, nt) in [
                    (device, 1),
                    (device, 3),
                    (device, 8),
                    (device.shared_memory(), 1),
                    (device.shared_memory(), 8),
                    (device.split(128), 1),
                    (device.split(256), 8),
                ] {
                    let mut rr = rng(seed ^ nt as u64);
                    let xs: Vec<f32> = (0..nt * cols).map(|_| rr()).collect();
                    let y = matvec::matmat(ctx, &g, &xs, plan).unwrap();
                    check_int8(dtype, rows, cols, &p, &xs, &y);
                }
            }
        }
    }
}

/// Long frames of q8_2f matrices on int8 activations run the tiled matmat: every row within
/// the witness's bounds (the same integer dot products, f32 sums in another order), with and
/// without the columns split, over partial last tiles, and over a matrix in several bindings.
/// The 8x8-a-lane kernel (default) and the 4x4 one (`CORTIQ_MATMAT=tiled4x4`, a second
/// context) compute the same products in the same order: where they split the columns alike,
/// the same bits.
#[test]
fn long_q8_2f_frames_run_tiled_within_the_f64_bound() {
    use gpu_runtime::ops::tiled::splits;
    use kernels_wgsl::{TILE_ROWS, TILE_TOKENS, Tiled};
    let Some(ctx) = ctx() else { return };
    assert!(ctx.tiled_matmat, "CORTIQ_MATMAT=plain is set");
    assert!(ctx.wide_tiles, "CORTIQ_MATMAT=tiled4x4 is set");
    let narrow = common::ctx_narrow().expect("a second context");
    let mut compared = 0;
    for (rows, cols, parted) in common::TILED_SHAPES {
        let arena = common::tiled_arena(ctx, parted);
        let arena_n = common::tiled_arena(narrow, parted);
        let seed = (rows + cols) as u64;
        let (p, g) = upload(ctx, &arena, DType::Q8_2f, rows, cols, seed);
        let (_, gn) = upload(narrow, &arena_n, DType::Q8_2f, rows, cols, seed);
        assert_eq!(g.parts.len() > 1, parted, "{} parts", g.parts.len());
        let plan = Plan::for_shape(ctx, rows, cols).with_path(Path::Int8);
        let plan_n = Plan::for_shape(narrow, rows, cols).with_path(Path::Int8);
        for nt in common::TILED_FRAMES {
            let mut rr = rng(seed ^ nt as u64);
            let xs: Vec<f32> = (0..nt * cols).map(|_| rr()).collect();
            let y = matvec::matmat(ctx, &g, &xs, plan).unwrap();
            // The CPU kernel (a witness) takes 8 rows at a time.
            for (x8, y8) in xs.chunks(8 * cols).zip(y.chunks(8 * rows)) {
                check_int8(DType::Q8_2f, rows, cols, &p, x8, y8);
            }
            let yn = matvec::matmat(narrow, &gn, &xs, plan_n).unwrap();
            for (x8, y8) in xs.chunks(8 * cols).zip(yn.chunks(8 * rows)) {
                check_int8(DType::Q8_2f, rows, cols, &p, x8, y8);
            }
            let tiles = rows.div_ceil(TILE_ROWS as usize) * nt.div_ceil(TILE_TOKENS as usize);
            let alike = parted
                || splits(tiles, Tiled::WIDE_WG as usize, cols)
                    == splits(tiles, Tiled::WG as usize, cols);
            if alike {
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&y), bits(&yn), "[{rows}x{cols}] T{nt}: 8x8 vs 4x4");
                compared += 1;
            }
        }
    }
    assert!(compared >= 8, "only {compared} frames split alike");
}

/// Long frames of q4tp, q2tp and mxfp4 experts run expert by expert (`ops::experts_tiled`): every slot's
/// sums within the f64 witness's bounds for its own expert and activation row, through
/// partial row tiles and partial tiles of slots, an expert chosen by many slots (several
/// tiles) and one by none, activation rows shared by `k` slots and one row per slot (the down
/// projection's), column counts that leave a partial last chunk; the gate/up pair's SiLU
/// product equals the product of its two rows' sums computed without it.
#[test]
fn long_frames_of_4_and_2_bit_experts_run_expert_by_expert_within_the_f64_bound() {
    use gpu_runtime::ops::experts_tiled::MIN_SLOTS;
    let Some(ctx) = ctx() else { return };
    assert!(ctx.tiled_matmat, "CORTIQ_MATMAT=plain is set");
    let experts = 13;
    // q2tp's columns: a multiple of 64 (the last chunk of 192 and 640 is still partial).
    let cases = [
        (400, 256, 10, 40),
        (300, 192, 1, 300),
        (2 * 136, 640, 8, 33),
    ];
    for (dtype, (rows, cols, k, nt)) in [DType::Q4tp, DType::Q2tp, DType::Mxfp4]
        .into_iter()
        .flat_map(|d| cases.map(|c| (d, c)))
    {
        let payloads = common::expert_payloads(dtype, rows, cols, experts, 60);
        let mats: Vec<MatRef<'_>> = payloads
            .iter()
            .map(|p| MatRef::new(dtype, rows, cols, p).unwrap())
            .collect();
        let bank = common::bank_of(ctx, dtype, rows, cols, &payloads);
        // Expert 0 takes every third slot; expert 12 none.
        let ids: Vec<u32> = (0..nt * k)
            .map(|s| {
                if s % 3 == 0 {
                    0
                } else {
                    ((s * 7 + s / k) % (experts - 1)) as u32
                }
            })
            .collect();
        assert!(ids.len() >= MIN_SLOTS);
        let mut rr = rng((rows * cols) as u64);
        let xs: Vec<f32> = (0..nt * cols).map(|_| rr()).collect();
        // The frame runs expert by expert (not the one-slot kernels' fallback).
        let codec = gpu_runtime::arena::kernel_codec(dtype).unwrap();
        for e in [Epilogue::None, Epilogue::SiluGateUp] {
            let segments = kernels_wgsl::Segments::One;
            assert!(
                gpu_runtime::ops::experts_tiled::applies(
                    ctx,
                    &bank,
                    codec,
                    Path::Int8,
                    segments,
                    ids.len(),
                    e
                ),
                "{dtype} {e:?} would not run expert by expert"
            );
        }
        let y = common::run_grouped(ctx, &bank, &xs, &ids, k, Epilogue::None, Path::Int8);
        for (s, &e) in ids.iter().enumerate() {
            let x = &xs[(s / k) * cols..(s / k + 1) * cols];
            check_int8(
                dtype,
                rows,
                cols,
                &payloads[e as usize],
                x,
                &y[s * rows..(s + 1) * rows],
            );
        }
        let pair = common::run_grouped(ctx, &bank, &xs, &ids, k, Epilogue::SiluGateUp, Path::Int8);
        let half = rows / 2;
        let dq: Vec<Vec<f32>> = mats
            .iter()
            .map(|m| {
                let mut w = vec![0.0f32; rows * cols];
                m.dequantize(&mut w).unwrap();
                w
            })
            .collect();
        for (s, &e) in ids.iter().enumerate() {
            let x = &xs[(s / k) * cols..(s / k + 1) * cols];
            // A row sum's f32 error (check_int8's bound): the two variants' sums are the same
            // terms in the same order, but the driver may fuse a term's multiply and add in
            // one and not the other.
            let err = |r: usize| {
                let w = &dq[e as usize][r * cols..(r + 1) * cols];
                let mag: f64 = w.iter().zip(x).map(|(a, b)| f64::from(a * b).abs()).sum();
                2.0 * (cols / 32 + 16) as f64 * f64::from(f32::EPSILON) * mag
            };
            for o in 0..half {
                let (g, u) = (y[s * rows + o], y[s * rows + half + o]);
                let silu = g / (1.0 + (-g).exp());
                let want = silu * u;
                let got = pair[s * half + o];
                // The device's exp and division need not be correctly rounded (lavapipe's
                // are a few ulp off); a wrong pairing of rows is off by far more.
                let tol = 1e-5 * f64::from(want.abs())
                    + 1.1 * err(o) * f64::from(u.abs())
                    + err(half + o) * f64::from(silu.abs())
                    + 1e-30;
                assert!(
                    f64::from((got - want).abs()) <= tol,
                    "slot {s} output {o}: {got} against silu(g) u = {want}"
                );
            }
        }
    }
}

#[test]
fn int8_matvec_on_hard_activations() {
    let Some(ctx) = ctx() else { return };
    let arena = WeightArena::new(ctx);
    let (rows, cols) = (24, 256);
    for dtype in INT8_DTYPES {
        let (p, g) = upload(ctx, &arena, dtype, rows, cols, 17);
        let mut xs = hard_activations(2, cols);
        // Non-finite values poison their token row: checked apart.
        xs[130] = 1.0;
        xs[170] = -2.0;
        let plan = Plan::for_matrix(ctx, rows).with_path(Path::Int8);
        let y = matvec::matmat(ctx, &g, &xs, plan).unwrap();
        check_int8(dtype, rows, cols, &p, &xs, &y);
        let mut bad = xs.clone();
        bad[cols + 40] = f32::INFINITY;
        let y = matvec::matmat(ctx, &g, &bad, plan).unwrap();
        assert!(
            y[rows..].iter().all(|v| v.is_nan()),
            "{dtype}: inf must poison its row"
        );
        assert!(
            y[..rows].iter().all(|v| v.is_finite()),
            "{dtype}: row 0 is clean"
        );
    }
}

#[test]
fn int8_fused_epilogues_and_row_t_equals_matvec() {
    let Some(ctx) = ctx() else { return };
    let arena = WeightArena::new(ctx);
    let (half, cols) = (40, 256);
    for dtype in INT8_DTYPES {
        let (p, g) = upload(ctx, &arena, dtype, 2 * half, cols, 31);
        let plan = Plan::for_matrix(ctx, 2 * half).with_path(Path::Int8);
        let mut r = rng(8);
        let xs: Vec<f32> = (0..5 * cols).map(|_| r()).collect();
        let plain = matvec::matmat(ctx, &g, &xs, plan).unwrap();
        check_int8(dtype, 2 * half, cols, &p, &xs, &plain);
        let pair = matvec::matmat_fused(ctx, &g, &xs, plan, Epilogue::SiluGateUp).unwrap();
        let act = matvec::matmat_fused(ctx, &g, &xs, plan, Epilogue::Silu).unwrap();
        let silu = |v: f32| v / (1.0 + (-v).exp());
        for t in 0..5 {
            for row in 0..half {
                let (gv, uv) = (plain[t * 2 * half + row], plain[t * 2 * half + row + half]);
                let want = silu(gv) * uv;
                let got = pair[t * half + row];
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{dtype} gate/up {row}: {got} vs {want}"
                );
            }
            for row in 0..2 * half {
                let want = silu(plain[t * 2 * half + row]);
                let got = act[t * 2 * half + row];
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{dtype} silu {row}"
                );
            }
            // Token row t of the batch is the matvec of x_t, bit for bit.
            let one = matvec::matmat(ctx, &g, &xs[t * cols..(t + 1) * cols], plan).unwrap();
            for (a, b) in one.iter().zip(&plain[t * 2 * half..(t + 1) * 2 * half]) {
                assert_eq!(a.to_bits(), b.to_bits(), "{dtype} token {t}");
            }
        }
    }
}

#[test]
fn paths_fall_back_where_they_do_not_apply() {
    let Some(ctx) = ctx() else { return };
    let arena = WeightArena::new(ctx);
    // bf16 has no int8 path, q8_2f with 48 columns no whole blocks: both run the f32 path.
    for (dtype, cols) in [(DType::BF16, 64), (DType::Q8_2f, 48)] {
        let (_, g) = upload(ctx, &arena, dtype, 8, cols, 41);
        let plan = Plan::for_matrix(ctx, 8).with_path(Path::Int8);
        let x = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: (cols * 4) as u64,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let y = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: 32,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let prepared = matvec::prepare(ctx, &g, &x, &y, 1, plan).unwrap();
        assert_eq!(prepared.path, Path::F32, "{dtype} {cols}");
    }
}

#[test]
fn hardware_f16_matches_the_integer_f16_decode() {
    let Some(ctx) = ctx() else { return };
    if !ctx.caps.f16_in_f32 {
        eprintln!("adapter lacks the f16 conversion builtins: hardware f16 variant not run");
        return;
    }
    let arena = WeightArena::new(ctx);
    let (rows, cols) = (70, 512);
    let (_, g) = upload(ctx, &arena, DType::F16, rows, cols, 51);
    for nt in [1, 8] {
        let mut r = rng(3);
        let xs: Vec<f32> = (0..nt * cols).map(|_| r()).collect();
        let plan = Plan::for_matrix(ctx, rows);
        let sw = matvec::matmat(ctx, &g, &xs, plan).unwrap();
        let hw = matvec::matmat(ctx, &g, &xs, plan.with_path(Path::HwF16)).unwrap();
        // The same decoded values in the same order: bit-identical sums.
        for (a, b) in sw.iter().zip(&hw) {
            assert_eq!(a.to_bits(), b.to_bits());
        }
    }
}

/// Runs `g` and reads `count` floats of `buf`.
fn replay(
    ctx: &gpu_runtime::GpuContext,
    g: &gpu_runtime::ops::graph::Graph,
    buf: &wgpu::Buffer,
    count: usize,
) -> Vec<f32> {
    let mut enc = ctx.device.create_command_encoder(&Default::default());
    g.record(ctx, &mut enc, None);
    ctx.queue.submit([enc.finish()]);
    gpu_runtime::readback::read_f32(ctx, buf, 0, count).unwrap()
}

#[test]
fn one_quantiser_shared_by_q8_2f_matrices_gives_their_own_results_bit_for_bit() {
    use gpu_runtime::ops::graph::{Graph, storage, upload_f32};
    let Some(ctx) = ctx() else { return };
    let arena = WeightArena::new(ctx);
    let cols = 256;
    let mats: Vec<_> = [(48, 31), (200, 32), (8, 33)]
        .iter()
        .map(|&(rows, seed)| upload(ctx, &arena, DType::Q8_2f, rows, cols, seed).1)
        .collect();
    let refs: Vec<&gpu_runtime::GpuMatrix> = mats.iter().map(|m| &**m).collect();
    let table = act8::col_scale_table(ctx, &refs).expect("q8_2f matrices of one width");
    for nt in [1, 8] {
        let mut r = rng(nt as u64);
        let xs: Vec<f32> = (0..nt * cols).map(|_| r()).collect();
        let x = upload_f32(ctx, "x", &xs);
        let ys: Vec<wgpu::Buffer> = mats
            .iter()
            .map(|m| storage(ctx, "y", nt * m.rows))
            .collect();
        let pairs: Vec<_> = refs.iter().copied().zip(&ys).collect();
        let mut shared = Graph::new();
        shared.matvecs_shared(ctx, &pairs, &x, nt, &table).unwrap();
        assert_eq!(shared.dispatches(), 1 + mats.len());
        let mut each = Graph::new();
        let zs: Vec<wgpu::Buffer> = mats
            .iter()
            .map(|m| storage(ctx, "z", nt * m.rows))
            .collect();
        for (m, z) in refs.iter().zip(&zs) {
            each.matvec(ctx, m, &x, z, nt, Path::Int8, Epilogue::None)
                .unwrap();
        }
        for (i, m) in mats.iter().enumerate() {
            let a = replay(ctx, &shared, &ys[i], nt * m.rows);
            let b = replay(ctx, &each, &zs[i], nt * m.rows);
            assert!(a.iter().all(|v| v.is_finite() && *v != 0.0));
            let same = a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(same, "matrix {i} ({} rows), {nt} token rows", m.rows);
        }
    }
}

/// Two matrices of one shape uploaded as one (`concat_rows`) and run in one dispatch with a
/// shared quantiser's two members: each half's sums are its own matrix's, bit for bit (the
/// same lanes, the same order, each half's activations scaled by its own column scales), for
/// q8_2f (two members) and q4tp (one activation for both); the gate/up product from those
/// sums.
#[test]
fn two_matrices_in_one_dispatch_give_their_own_results_bit_for_bit() {
    use gpu_runtime::ops::graph::{Graph, Member, storage, upload_f32};
    let Some(ctx) = ctx() else { return };
    let arena = WeightArena::new(ctx);
    let (half, cols) = (48, 256);
    for (i, dtype) in [DType::Q8_2f, DType::Q4tp].into_iter().enumerate() {
        let seed = 60 + 2 * i as u64;
        let (pa, a) = upload(ctx, &arena, dtype, half, cols, seed);
        let (pb, b) = upload(ctx, &arena, dtype, half, cols, seed + 1);
        let ma = MatRef::new(dtype, half, cols, &pa).unwrap();
        let mb = MatRef::new(dtype, half, cols, &pb).unwrap();
        let both = quant_codecs::concat_rows(&[ma, mb]).unwrap();
        let m = arena
            .get_or_upload(
                ctx,
                seed + 2,
                &format!("{dtype} both"),
                &MatRef::new(dtype, 2 * half, cols, &both).unwrap(),
            )
            .unwrap();
        let table = act8::col_scale_table_host(ctx, &[&ma, &mb]);
        assert_eq!(table.is_some(), dtype == DType::Q8_2f);
        // The witness: each matrix alone under the plan the pair runs (one row a group).
        let plan = Plan {
            rows: 1,
            ..Plan::for_shape(ctx, 2 * half, cols)
        }
        .with_path(Path::Int8);
        for nt in [1, 3, 8] {
            let mut r = rng(nt as u64 + seed);
            let xs: Vec<f32> = (0..nt * cols).map(|_| r()).collect();
            let wa = matvec::matmat(ctx, &a, &xs, plan).unwrap();
            let wb = matvec::matmat(ctx, &b, &xs, plan).unwrap();
            let x = upload_f32(ctx, "x", &xs);
            let (y, aux) = (storage(ctx, "y", nt * half), storage(ctx, "aux", nt * half));
            let mut g = Graph::new();
            g.matvec_two(
                ctx,
                &m,
                &x,
                &y,
                Some(&aux),
                nt,
                Path::Int8,
                Epilogue::PairTwo,
                table.as_ref(),
            )
            .unwrap();
            assert_eq!(g.dispatches(), 2, "one quantiser, one matvec");
            let (ga, gb) = (
                replay(ctx, &g, &y, nt * half),
                replay(ctx, &g, &aux, nt * half),
            );
            let bits =
                |p: &[f32], q: &[f32]| p.iter().zip(q).all(|(u, v)| u.to_bits() == v.to_bits());
            assert!(bits(&ga, &wa), "{dtype} first half, {nt} token rows");
            assert!(bits(&gb, &wb), "{dtype} second half, {nt} token rows");
            if let Some(t3) = (dtype == DType::Q8_2f)
                .then(|| act8::col_scale_table_host(ctx, &[&ma, &ma, &mb]))
                .flatten()
            {
                // A matrix and a pair behind one quantiser of three members.
                let z = storage(ctx, "z", nt * half);
                let items = [
                    Member {
                        m: &a,
                        y: &z,
                        aux: None,
                        epilogue: Epilogue::None,
                    },
                    Member {
                        m: &m,
                        y: &y,
                        aux: Some(&aux),
                        epilogue: Epilogue::PairTwo,
                    },
                ];
                let mut g = Graph::new();
                g.matvecs_members(ctx, &items, &x, nt, &t3).unwrap();
                assert_eq!(g.dispatches(), 3, "one quantiser, two matvecs");
                assert!(bits(&replay(ctx, &g, &z, nt * half), &wa), "member matrix");
                assert!(
                    bits(&replay(ctx, &g, &y, nt * half), &wa),
                    "member pair, first"
                );
                assert!(
                    bits(&replay(ctx, &g, &aux, nt * half), &wb),
                    "member pair, second"
                );
            }
            let mut g = Graph::new();
            g.matvec_two(
                ctx,
                &m,
                &x,
                &y,
                None,
                nt,
                Path::Int8,
                Epilogue::GateUpTwo,
                table.as_ref(),
            )
            .unwrap();
            let got = replay(ctx, &g, &y, nt * half);
            for (k, v) in got.iter().enumerate() {
                let (gv, uv) = (wa[k] as f64, wb[k] as f64);
                let want = gv / (1.0 + (-gv).exp()) * uv;
                // WGSL's exp is within 3 + 2|x| ulp, the division 2.5 and the product 1:
                // 32 ulp of f32 covers them at these |x| (lavapipe lands ~20 ulp off).
                assert!(
                    (*v as f64 - want).abs() <= 32.0 * f32::EPSILON as f64 * want.abs() + 1e-30,
                    "{dtype} gate/up {k}: {v} vs {want}"
                );
            }
        }
    }
    // q8_2f's halves cannot share one activation: without the members it is refused.
    let (pa, _) = upload(ctx, &arena, DType::Q8_2f, 4, 64, 70);
    let ma = MatRef::new(DType::Q8_2f, 4, 64, &pa).unwrap();
    let both = quant_codecs::concat_rows(&[ma, ma]).unwrap();
    let m = arena
        .get_or_upload(
            ctx,
            71,
            "q8 both",
            &MatRef::new(DType::Q8_2f, 8, 64, &both).unwrap(),
        )
        .unwrap();
    let x = upload_f32(ctx, "x", &[0.5; 64]);
    let y = storage(ctx, "y", 4);
    let mut g = Graph::new();
    let e = g
        .matvec_two(
            ctx,
            &m,
            &x,
            &y,
            None,
            1,
            Path::Int8,
            Epilogue::GateUpTwo,
            None,
        )
        .unwrap_err();
    assert!(
        matches!(e, gpu_runtime::GpuError::UnsupportedFusion { .. }),
        "{e}"
    );
}

/// One quantiser for a MoE block's routed experts (q4tp's, q2tp's or mxfp4's code layout, no
/// column scales: the table's first row a placeholder the kernel does not read) and its shared
/// expert's two q8_2f matrices (their own column scales): each member's codes and block pairs
/// are what a quantiser of its own writes, bit for bit.
#[test]
fn a_first_member_of_another_layout_gets_its_own_quantisers_codes() {
    use gpu_runtime::ops::graph::{Graph, upload_f32};
    let Some(ctx) = ctx() else { return };
    let arena = WeightArena::new(ctx);
    let cols = 256;
    let (pa, _) = upload(ctx, &arena, DType::Q8_2f, 40, cols, 91);
    let (pb, _) = upload(ctx, &arena, DType::Q8_2f, 40, cols, 92);
    let ma = MatRef::new(DType::Q8_2f, 40, cols, &pa).unwrap();
    let mb = MatRef::new(DType::Q8_2f, 40, cols, &pb).unwrap();
    let pair = act8::col_scale_table_host(ctx, &[&ma, &mb]).unwrap();
    let table = act8::col_scale_table_host_units(ctx, 1, &[&ma, &mb]).unwrap();
    let read = |acts: &act8::ActBuffers| {
        let blocks = acts.nt * acts.cols / 32;
        let q = gpu_runtime::readback::read_f32(ctx, &acts.xq, acts.xq_offset, blocks * 8);
        let d = gpu_runtime::readback::read_f32(ctx, &acts.xd, acts.xd_offset, blocks * 2);
        let bits = |v: Vec<f32>| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
        (bits(q.unwrap()), bits(d.unwrap()))
    };
    for layout in [ActLayout::Pairs, ActLayout::Quads, ActLayout::Natural] {
        for nt in [1, 8] {
            let xs = hard_activations(nt, cols);
            let x = upload_f32(ctx, "x", &xs);
            let mut g = Graph::new();
            let layouts = [layout, ActLayout::Natural, ActLayout::Natural];
            let acts = g
                .quantise_shared(ctx, &x, nt, cols, &layouts, &table, true)
                .unwrap();
            let mut two = Graph::new();
            let own = two
                .quantise_shared(ctx, &x, nt, cols, &layouts[1..], &pair, false)
                .unwrap();
            replay(ctx, &g, &x, 1);
            let (q0, d0) = read(&acts[0]);
            let (wq, wd) = act8::quantize(ctx, &xs, cols, layout).unwrap();
            let wd: Vec<u32> = wd.iter().flatten().copied().collect();
            assert_eq!(q0, wq, "{layout:?} member 0 codes, {nt} rows");
            assert_eq!(d0, wd, "{layout:?} member 0 scales and sums, {nt} rows");
            let got = [read(&acts[1]), read(&acts[2])];
            replay(ctx, &two, &x, 1);
            let want = [read(&own[0]), read(&own[1])];
            assert_eq!(got, want, "{layout:?} shared pair members, {nt} rows");
        }
    }
}
