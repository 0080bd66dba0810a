//! Every GPU codec kernel against quant-codecs (f64 math on the decoded matrix, and the CPU
//! kernel), on whatever adapter is present: lavapipe in CI, where `CORTIQ_REQUIRE_GPU=1` makes a
//! missing adapter a failure rather than a skip.

mod common;

use common::{ctx, rng, weights};
use gpu_runtime::ops::matvec::{self, POISON, Plan};
use gpu_runtime::ops::tiled;
use gpu_runtime::{GpuContext, GpuError, WeightArena};
use quant_codecs::{DType, MatRef, quantize};

const GPU_DTYPES: [DType; 6] = [
    DType::F16,
    DType::BF16,
    DType::Q8_2f,
    DType::Q4tp,
    DType::Q2tp,
    DType::Mxfp4,
];

/// Checks GPU output against f64 math on the decoded matrix: |err| <= 4e-6 * sum |w x|.
fn check(dtype: DType, rows: usize, cols: usize, w: &[f32], xs: &[f32], got: &[f32]) {
    let p = quantize(dtype, rows, cols, w).unwrap();
    let m = MatRef::new(dtype, rows, cols, &p).unwrap();
    let mut dq = vec![0.0f32; rows * cols];
    m.dequantize(&mut dq).unwrap();
    let nt = xs.len() / cols;
    // The CPU kernel is the second witness.
    let mut cpu = vec![0.0f32; nt * rows];
    m.matmat(xs, &mut cpu).unwrap();
    for t in 0..nt {
        let x = &xs[t * cols..(t + 1) * cols];
        for r in 0..rows {
            let (mut exact, mut mag) = (0.0f64, 0.0f64);
            for i in 0..cols {
                let p = dq[r * cols + i] as f64 * x[i] as f64;
                exact += p;
                mag += p.abs();
            }
            let g = got[t * rows + r];
            assert_ne!(g, POISON, "{dtype} row {r} token {t} never written");
            let c = cpu[t * rows + r] as f64;
            assert!(
                (g as f64 - c).abs() <= 8e-6 * mag + 1e-30,
                "{dtype} [{rows}x{cols}] row {r} token {t}: gpu {g} cpu kernel {c}"
            );
            assert!(
                (g as f64 - exact).abs() <= 4e-6 * mag + 1e-30,
                "{dtype} [{rows}x{cols}] row {r} token {t}: gpu {g} exact {exact} (|err| {} > {})",
                (g as f64 - exact).abs(),
                4e-6 * mag
            );
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn run(
    ctx: &GpuContext,
    arena: &WeightArena,
    dtype: DType,
    rows: usize,
    cols: usize,
    nt: usize,
    plan: Plan,
    seed: u64,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let w = weights(rows, cols, seed);
    let p = quantize(dtype, rows, cols, &w).unwrap();
    let m = MatRef::new(dtype, rows, cols, &p).unwrap();
    let g = arena
        .get_or_upload(ctx, seed, &format!("{dtype}-{rows}x{cols}"), &m)
        .unwrap();
    let mut r = rng(seed ^ 0xabc);
    let xs: Vec<f32> = (0..nt * cols).map(|_| r()).collect();
    let y = matvec::matmat(ctx, &g, &xs, plan).unwrap();
    (w, xs, y)
}

#[test]
fn every_codec_matches_f64_for_1_to_8_rows_in_every_reduction() {
    let Some(ctx) = ctx() else { return };
    let arena = WeightArena::new(ctx);
    for dtype in GPU_DTYPES {
        for (rows, cols) in [(37, 128), (5, 320), (130, 640), (64, 128)] {
            for r in [1, 2, 4] {
                let device_plan = Plan {
                    rows: r,
                    ..Plan::for_matrix(ctx, rows)
                };
                for (plan, nt) in [
                    (device_plan, 1),
                    (device_plan, 3),
                    (device_plan, 8),
                    (device_plan.shared_memory(), 1),
                    (device_plan.shared_memory(), 8),
                    (device_plan.split(128), 1),
                    (device_plan.split(256), 8),
                ] {
                    let (w, xs, y) = run(ctx, &arena, dtype, rows, cols, nt, plan, 7);
                    check(dtype, rows, cols, &w, &xs, &y);
                }
            }
        }
    }
}

#[test]
fn rows_split_across_a_workgroup_match_f64_at_the_hyper_connection_shapes() {
    let Some(ctx) = ctx() else { return };
    let arena = WeightArena::new(ctx);
    for dtype in GPU_DTYPES {
        for (rows, cols) in [(4, 10240), (40, 10240)] {
            let plan = Plan::for_shape(ctx, rows, cols);
            assert!(
                plan.lanes > Plan::for_matrix(ctx, rows).lanes,
                "{rows}x{cols}: {plan:?} does not split its rows"
            );
            for nt in [1, 8] {
                let (w, xs, y) = run(ctx, &arena, dtype, rows, cols, nt, plan, 9);
                check(dtype, rows, cols, &w, &xs, &y);
            }
        }
    }
}

/// Random weights of `dtype` (seed `seed`) and their resident matrix.
fn resident(
    ctx: &GpuContext,
    arena: &WeightArena,
    dtype: DType,
    rows: usize,
    cols: usize,
    seed: u64,
) -> (Vec<f32>, std::sync::Arc<gpu_runtime::GpuMatrix>) {
    let w = weights(rows, cols, seed);
    let p = quantize(dtype, rows, cols, &w).unwrap();
    let m = MatRef::new(dtype, rows, cols, &p).unwrap();
    let g = arena.get_or_upload(ctx, seed, dtype.name(), &m).unwrap();
    (w, g)
}

/// Token rows `ts` of `all` (the matmat of `xs`) against each row's own one-row matmat, bit
/// for bit.
fn rows_equal_one_row_matmats(
    ctx: &GpuContext,
    g: &gpu_runtime::GpuMatrix,
    plan: Plan,
    xs: &[f32],
    all: &[f32],
    ts: &[usize],
    what: &str,
) {
    let (rows, cols) = (g.rows, g.cols);
    for &t in ts {
        let one = matvec::matmat(ctx, g, &xs[t * cols..(t + 1) * cols], plan).unwrap();
        for (a, b) in one.iter().zip(&all[t * rows..(t + 1) * rows]) {
            assert_eq!(a.to_bits(), b.to_bits(), "{what} token {t}");
        }
    }
}

#[test]
fn matmat_row_t_equals_matvec_bit_for_bit() {
    let Some(ctx) = ctx() else { return };
    let arena = WeightArena::new(ctx);
    let (rows, cols) = (70, 640);
    let plan = Plan::for_matrix(ctx, rows);
    for dtype in GPU_DTYPES {
        let (_, g) = resident(ctx, &arena, dtype, rows, cols, 3);
        let mut r = rng(11);
        let xs: Vec<f32> = (0..8 * cols).map(|_| r()).collect();
        let all = matvec::matmat(ctx, &g, &xs, plan).unwrap();
        let ts: Vec<usize> = (0..8).collect();
        rows_equal_one_row_matmats(ctx, &g, plan, &xs, &all, &ts, &dtype.to_string());
    }
}

/// A frame longer than 8 rows (a prompt's: 16, 32, 256) runs the 8-row kernel on tiles of 8
/// rows: every row equals its own one-row matvec bit for bit and the f64 witness within the
/// codec's bound, on the f32 path and (quantised codecs) on int8 activations (the frames of
/// [`tiled::MIN_ROWS`] rows and more that run the tiled matmat: f16's against the witness
/// only, q8_2f's on int8 in int8.rs); a frame that is not a multiple of 8, or longer than the
/// kernels take, is refused.
#[test]
fn frames_longer_than_8_rows_run_in_tiles_of_8_bit_for_bit() {
    use gpu_runtime::Path;
    let Some(ctx) = ctx() else { return };
    let arena = WeightArena::new(ctx);
    let (rows, cols) = (70, 256);
    for dtype in GPU_DTYPES {
        let (w, g) = resident(ctx, &arena, dtype, rows, cols, 5);
        let mut paths = vec![Path::F32];
        if Path::Int8.supports(gpu_runtime::arena::kernel_codec(dtype).unwrap()) {
            paths.push(Path::Int8);
        }
        for path in paths {
            let plan = Plan::for_matrix(ctx, rows).with_path(path);
            for nt in [16, 32, matvec::MAX_FRAME_ROWS] {
                let mut r = rng(nt as u64);
                let xs: Vec<f32> = (0..nt * cols).map(|_| r()).collect();
                let all = matvec::matmat(ctx, &g, &xs, plan).unwrap();
                if path == Path::F32 {
                    // The CPU kernel (check's second witness) takes 8 rows at a time.
                    for (x8, y8) in xs.chunks(8 * cols).zip(all.chunks(8 * rows)) {
                        check(dtype, rows, cols, &w, x8, y8);
                    }
                }
                // f16 frames of 32 rows and more, and q8_2f's on int8 activations, run the
                // tiled matmat (their own tests: below, and in int8.rs).
                let tiled_codec =
                    dtype == DType::F16 || (dtype == DType::Q8_2f && path == Path::Int8);
                if tiled_codec && nt >= tiled::MIN_ROWS {
                    continue;
                }
                let what = format!("{dtype} {path:?} T{nt}");
                rows_equal_one_row_matmats(ctx, &g, plan, &xs, &all, &[0, 7, 8, 13, nt - 1], &what);
            }
            for nt in [12, matvec::MAX_FRAME_ROWS + 8] {
                let e = matvec::matmat(ctx, &g, &vec![1.0; nt * cols], plan).unwrap_err();
                assert!(
                    matches!(e, GpuError::BadLength { .. }),
                    "{dtype} T{nt}: {e}"
                );
            }
        }
    }
}

/// Long frames of f16 matrices run the tiled matmat: every row within the f64 witness's bound
/// and the CPU kernel's (its sums are added in another order than the 8-row kernel's), with
/// and without the columns split, over a partial last tile of rows and of token rows, with
/// silu, and over a matrix in several bindings (each part's rows at its offset); the default
/// 8x8-a-lane kernel and the 4x4 one (`CORTIQ_MATMAT=tiled4x4`).
#[test]
fn long_f16_frames_run_tiled_within_the_f64_bound() {
    let Some(ctx) = ctx() else { return };
    assert!(ctx.tiled_matmat, "CORTIQ_MATMAT=plain is set");
    assert!(ctx.wide_tiles, "CORTIQ_MATMAT=tiled4x4 is set");
    long_f16_frames(ctx);
    let narrow = common::ctx_narrow().expect("a second context");
    assert!(!narrow.wide_tiles);
    long_f16_frames(narrow);
}

fn long_f16_frames(ctx: &GpuContext) {
    use gpu_runtime::Epilogue;
    for (rows, cols, parted) in common::TILED_SHAPES {
        let arena = common::tiled_arena(ctx, parted);
        let (w, g) = resident(
            ctx,
            &arena,
            DType::F16,
            rows,
            cols,
            rows as u64 + cols as u64,
        );
        assert_eq!(g.parts.len() > 1, parted, "{} parts", g.parts.len());
        let plan = Plan::for_shape(ctx, rows, cols);
        for nt in common::TILED_FRAMES {
            let mut r = rng(nt as u64 ^ 0x5eed);
            let xs: Vec<f32> = (0..nt * cols).map(|_| r()).collect();
            let y = matvec::matmat(ctx, &g, &xs, plan).unwrap();
            for (x8, y8) in xs.chunks(8 * cols).zip(y.chunks(8 * rows)) {
                check(DType::F16, rows, cols, &w, x8, y8);
            }
            if g.parts.len() == 1 {
                let s = matvec::matmat_fused(ctx, &g, &xs, plan, Epilogue::Silu).unwrap();
                for (a, b) in s.iter().zip(&y) {
                    let want = silu(*b as f64);
                    assert!(
                        (*a as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                        "silu [{rows}x{cols}] T{nt}: {a} vs {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn more_than_65535_workgroups_use_a_2d_grid() {
    let Some(ctx) = ctx() else { return };
    let arena = WeightArena::new(ctx);
    let rows = 8 * 4 * 65535 + 1000; // more workgroups than one grid dimension holds
    let plan = Plan {
        rows: 1,
        ..Plan::for_matrix(ctx, rows)
    };
    assert!(rows.div_ceil((plan.wg / plan.lanes * plan.rows) as usize) > 65535);
    let (w, xs, y) = run(ctx, &arena, DType::Mxfp4, rows, 32, 1, plan, 5);
    check(DType::Mxfp4, rows, 32, &w, &xs, &y);
}

#[test]
fn a_matrix_split_over_several_bindings_is_still_one_matrix() {
    let Some(ctx) = ctx() else { return };
    // A binding limit of 4 KiB forces many parts; q8_2f's shared column scales go with each.
    let arena = WeightArena::with_limits(1 << 30, 4096);
    for dtype in GPU_DTYPES {
        let (rows, cols) = (97, 128);
        let w = weights(rows, cols, 9);
        let p = quantize(dtype, rows, cols, &w).unwrap();
        let g = arena
            .get_or_upload(
                ctx,
                9,
                dtype.name(),
                &MatRef::new(dtype, rows, cols, &p).unwrap(),
            )
            .unwrap();
        assert!(g.parts.len() > 1, "{dtype}: {} part(s)", g.parts.len());
        let mut r = rng(1);
        let xs: Vec<f32> = (0..2 * cols).map(|_| r()).collect();
        let y = matvec::matmat(ctx, &g, &xs, Plan::for_matrix(ctx, rows)).unwrap();
        check(dtype, rows, cols, &w, &xs, &y);
    }
}

#[test]
fn a_tensor_larger_than_the_real_binding_limit() {
    let Some(ctx) = ctx() else { return };
    let max = ctx.max_binding();
    if max > 1 << 28 {
        eprintln!(
            "binding limit {max} bytes: a larger tensor would not fit this test's memory; the split is covered above"
        );
        return;
    }
    let arena = WeightArena::new(ctx);
    let cols = 8192;
    let rows = (max as usize / (2 * cols)) + 8; // f16: just past one binding
    let plan = Plan::for_matrix(ctx, rows);
    let (w, xs, y) = run(ctx, &arena, DType::F16, rows, cols, 1, plan, 13);
    let g = arena
        .get_or_upload(
            ctx,
            13,
            &format!("f16-{rows}x{cols}"),
            &MatRef::new(
                DType::F16,
                rows,
                cols,
                &quantize(DType::F16, rows, cols, &w).unwrap(),
            )
            .unwrap(),
        )
        .unwrap();
    assert!(g.parts.len() >= 2);
    check(DType::F16, rows, cols, &w, &xs, &y);
}

#[test]
fn wrong_dtype_shape_or_length_is_refused() {
    let Some(ctx) = ctx() else { return };
    let arena = WeightArena::new(ctx);
    // f32 matrices are read (the exact-weight parity profile): their matvec is the f32 sum.
    let vals: Vec<f32> = (0..128).map(|i| (i as f32 * 0.37).sin()).collect();
    let f32m = quantize(DType::F32, 4, 32, &vals).unwrap();
    let g = arena
        .get_or_upload(
            ctx,
            1,
            "f32",
            &MatRef::new(DType::F32, 4, 32, &f32m).unwrap(),
        )
        .unwrap();
    let x: Vec<f32> = (0..32).map(|i| (i as f32 * 0.11).cos()).collect();
    let y = matvec::matmat(ctx, &g, &x, Plan::for_matrix(ctx, 4)).unwrap();
    for (r, got) in y.iter().enumerate() {
        let want: f64 = (0..32).map(|c| vals[r * 32 + c] as f64 * x[c] as f64).sum();
        assert!(
            (*got as f64 - want).abs() < 1e-5,
            "f32 row {r}: {got} vs {want}"
        );
    }
    let q2 = quantize(DType::Q2tp, 4, 32, &[1.0; 128]).unwrap();
    let e = arena
        .get_or_upload(ctx, 1, "q2", &MatRef::new(DType::Q2tp, 4, 32, &q2).unwrap())
        .unwrap_err();
    assert!(
        matches!(e, GpuError::UnsupportedShape { multiple: 64, .. }),
        "{e}"
    );
    let q4 = quantize(DType::Q4tp, 4, 64, &[1.0; 256]).unwrap();
    let g = arena
        .get_or_upload(ctx, 1, "q4", &MatRef::new(DType::Q4tp, 4, 64, &q4).unwrap())
        .unwrap();
    let e = matvec::matmat(ctx, &g, &[1.0; 63], Plan::for_matrix(ctx, 4)).unwrap_err();
    assert!(matches!(e, GpuError::BadLength { .. }), "{e}");
    let e = matvec::matmat(ctx, &g, &[1.0; 64 * 9], Plan::for_matrix(ctx, 4)).unwrap_err();
    assert!(matches!(e, GpuError::BadLength { .. }), "{e}");
}

#[test]
fn the_arena_evicts_least_recently_used_and_respects_pins() {
    let Some(ctx) = ctx() else { return };
    let (rows, cols) = (64, 256);
    let p = quantize(DType::Q8_2f, rows, cols, &weights(rows, cols, 2)).unwrap();
    let m = MatRef::new(DType::Q8_2f, rows, cols, &p).unwrap();
    let size = (p.len() as u64).next_multiple_of(16);
    let arena = WeightArena::with_limits(2 * size, ctx.max_binding());
    arena.get_or_upload(ctx, 1, "a", &m).unwrap();
    arena.get_or_upload(ctx, 1, "b", &m).unwrap();
    assert_eq!(arena.resident_bytes(), 2 * size);
    arena.get_or_upload(ctx, 1, "a", &m).unwrap(); // a is now the most recent
    arena.get_or_upload(ctx, 1, "c", &m).unwrap(); // evicts b
    assert!(arena.contains(1, "a") && arena.contains(1, "c") && !arena.contains(1, "b"));
    assert!(arena.pin(1, "a", true) && arena.pin(1, "c", true));
    let e = arena.get_or_upload(ctx, 1, "d", &m).unwrap_err();
    assert!(matches!(e, GpuError::OverBudget { .. }), "{e}");
    assert_eq!(arena.resident_bytes(), 2 * size);
}

#[test]
fn a_rejected_kernel_is_an_error_not_a_crash() {
    let Some(ctx) = ctx() else { return };
    let bad = || "@compute @workgroup_size(1) fn main() { let x: u32 = 1.5; }".to_string();
    for _ in 0..2 {
        let e = ctx
            .compute_pipeline("broken", &bad, "main", &[])
            .unwrap_err();
        assert!(matches!(e, GpuError::PipelineRejected { .. }), "{e}");
    }
    // The device still works.
    let arena = WeightArena::new(ctx);
    let (w, xs, y) = run(
        ctx,
        &arena,
        DType::Q4tp,
        8,
        64,
        1,
        Plan::for_matrix(ctx, 8),
        17,
    );
    check(DType::Q4tp, 8, 64, &w, &xs, &y);
}

fn silu(v: f64) -> f64 {
    v / (1.0 + (-v).exp())
}

#[test]
fn fused_silu_and_gate_up_match_f64() {
    let Some(ctx) = ctx() else { return };
    let arena = WeightArena::new(ctx);
    let (half, cols) = (45, 256);
    for dtype in GPU_DTYPES {
        let w = weights(2 * half, cols, 21);
        let p = quantize(dtype, 2 * half, cols, &w).unwrap();
        let m = MatRef::new(dtype, 2 * half, cols, &p).unwrap();
        let mut dq = vec![0.0f32; 2 * half * cols];
        m.dequantize(&mut dq).unwrap();
        let g = arena.get_or_upload(ctx, 21, dtype.name(), &m).unwrap();
        for nt in [1, 5] {
            let mut r = rng(4);
            let xs: Vec<f32> = (0..nt * cols).map(|_| r() * 0.1).collect();
            let dot = |row: usize, t: usize| -> (f64, f64) {
                (0..cols).fold((0.0, 0.0), |(s, a), i| {
                    let p = dq[row * cols + i] as f64 * xs[t * cols + i] as f64;
                    (s + p, a + p.abs())
                })
            };
            let plan = Plan::for_matrix(ctx, 2 * half);
            let pair = matvec::matmat_fused(ctx, &g, &xs, plan, gpu_runtime::Epilogue::SiluGateUp)
                .unwrap();
            let act =
                matvec::matmat_fused(ctx, &g, &xs, plan, gpu_runtime::Epilogue::Silu).unwrap();
            assert_eq!(pair.len(), nt * half);
            for t in 0..nt {
                for row in 0..half {
                    let ((gv, gm), (uv, um)) = (dot(row, t), dot(row + half, t));
                    let want = silu(gv) * uv;
                    let got = pair[t * half + row] as f64;
                    // Propagated bound: silu' <= 1.1, each dot within 4e-6 of its magnitude sum.
                    let tol = 4e-6 * (1.1 * gm * uv.abs() + silu(gv).abs() * um) + 1e-12;
                    assert!(
                        (got - want).abs() <= tol,
                        "{dtype} gate/up row {row} t {t}: {got} vs {want}"
                    );
                }
                for row in 0..2 * half {
                    let (v, mag) = dot(row, t);
                    let got = act[t * 2 * half + row] as f64;
                    assert!(
                        (got - silu(v)).abs() <= 1.1 * 4e-6 * mag + 1e-12,
                        "{dtype} silu row {row}: {got} vs {}",
                        silu(v)
                    );
                }
            }
        }
    }
    // An odd row count cannot be a gate/up pair.
    let p = quantize(DType::Q4tp, 3, 64, &[0.5; 192]).unwrap();
    let g = arena
        .get_or_upload(
            ctx,
            22,
            "odd",
            &MatRef::new(DType::Q4tp, 3, 64, &p).unwrap(),
        )
        .unwrap();
    let e = matvec::matmat_fused(
        ctx,
        &g,
        &[1.0; 64],
        Plan::for_matrix(ctx, 3),
        gpu_runtime::Epilogue::SiluGateUp,
    )
    .unwrap_err();
    assert!(matches!(e, GpuError::UnsupportedFusion { .. }), "{e}");
}

#[test]
fn matmat_or_cpu_falls_back_with_the_cpu_result() {
    use gpu_runtime::ops::matvec::{Ran, matmat_or_cpu};
    let Some(ctx) = ctx() else { return };
    let arena = WeightArena::new(ctx);
    // q2tp with 32 columns: no GPU kernel takes it (rows must be whole 16-byte chunks).
    let w = weights(6, 32, 31);
    let p = quantize(DType::Q2tp, 6, 32, &w).unwrap();
    let m = MatRef::new(DType::Q2tp, 6, 32, &p).unwrap();
    let xs: Vec<f32> = (0..32).map(|i| i as f32 / 32.0).collect();
    let (ys, ran) = matmat_or_cpu(Some((ctx, &arena)), 31, "narrow", &m, &xs).unwrap();
    assert!(matches!(ran, Ran::Cpu(_)), "{ran:?}");
    let mut want = vec![0.0f32; 6];
    m.matvec(&xs, &mut want).unwrap();
    assert_eq!(ys, want);
    // The same call with a shape the GPU takes runs there.
    let p = quantize(DType::Q4tp, 6, 64, &weights(6, 64, 32)).unwrap();
    let m = MatRef::new(DType::Q4tp, 6, 64, &p).unwrap();
    let (_, ran) = matmat_or_cpu(Some((ctx, &arena)), 32, "ok", &m, &[0.5; 64]).unwrap();
    assert_eq!(ran, Ran::Gpu);
    // A wrong activation length is an error either way, never a panic.
    assert!(matmat_or_cpu(Some((ctx, &arena)), 32, "ok", &m, &[0.5; 63]).is_err());
    assert!(matmat_or_cpu(None, 32, "ok", &m, &[0.5; 63]).is_err());
}

/// The report `cortiq doctor` prints: every codec's matvec at 1 and 8 rows plus the two
/// read-bandwidth probes, each built on this adapter.
#[test]
fn the_kernel_report_builds_every_kernel() {
    let Some(ctx) = ctx() else { return };
    let r = gpu_runtime::report::kernel_report(ctx);
    assert_eq!(r.kernels.len(), 2 * kernels_wgsl::Codec::ALL.len() + 2);
    assert!(r.all_ok(), "{:?}", r.kernels);
    assert!(
        r.limits
            .iter()
            .any(|(k, v)| k == "max_buffer_size" && *v > 0)
    );
    assert!(r.plan_text().contains("lanes per workgroup"));
    eprintln!("software adapter: {}", ctx.is_software());
}

fn sigmoid(v: f64) -> f64 {
    1.0 / (1.0 + (-v).exp())
}

/// The hyper-connection epilogues with the site's norm folded in, against f64 math on the
/// decoded matrix: the front over raw streams (the pending block output injected first, or
/// none) gives `silu(v / H)` and `2 sigmoid(v / H)` of `v = W xn`, `xn` each stream's
/// `x / rms(x) * (1 + w)`, and each token row's `1 / rms`; the read-out injects into the
/// streams it reads (written back) and normalises them with the given `1 / rms`. Float codecs,
/// 1, 3 and 8 token rows, 2-4 streams, every row-group shape the plans give.
#[test]
fn folded_norm_epilogues_match_f64() {
    use gpu_runtime::Epilogue;
    use gpu_runtime::ops::matvec::NormInputs;
    let Some(ctx) = ctx() else { return };
    if !matvec::folds_norm(ctx) {
        // A device without nine storage buffers a dispatch keeps the norm apart; CI's
        // lavapipe has them, so there the kernels must run.
        assert_ne!(
            std::env::var("CORTIQ_REQUIRE_GPU").as_deref(),
            Ok("1"),
            "CORTIQ_REQUIRE_GPU=1 but the adapter binds fewer than nine storage buffers"
        );
        return;
    }
    let arena = WeightArena::new(ctx);
    let eps = 1e-6f32;
    let decoded = |dtype: DType, rows: usize, cols: usize, w: &[f32]| {
        let p = quantize(dtype, rows, cols, w).unwrap();
        let mut dq = vec![0.0f32; rows * cols];
        MatRef::new(dtype, rows, cols, &p)
            .unwrap()
            .dequantize(&mut dq)
            .unwrap();
        (p, dq)
    };
    for (i, dtype) in [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .enumerate()
    {
        let seed = 140 + i as u64;
        for (h, d) in [(4, 64), (3, 32), (2, 48)] {
            let (low, cols) = (20, h * d);
            let rows = low + h;
            let (p, dq) = decoded(dtype, rows, cols, &weights(rows, cols, seed));
            let m = MatRef::new(dtype, rows, cols, &p).unwrap();
            let g = arena
                .get_or_upload(ctx, seed * 10 + h as u64, &format!("front {dtype} {h}"), &m)
                .unwrap();
            let base = Plan::for_shape(ctx, rows, cols);
            for (plan, nt, inject) in [
                (base, 1, true),
                (base, 1, false),
                (base, 3, true),
                (Plan { rows: 2, ..base }, 3, true),
                (Plan { rows: 4, ..base }.shared_memory(), 1, true),
                (base.split(128), 8, true),
            ] {
                let mut r = rng(seed ^ 0x5a);
                let xs: Vec<f32> = (0..nt * cols).map(|_| r() * 2.0).collect();
                let blk: Vec<f32> = (0..nt * d).map(|_| r()).collect();
                let inj: Vec<f32> = (0..nt * h).map(|_| 1.0 + r()).collect();
                let nw: Vec<f32> = (0..cols).map(|_| r() * 0.3).collect();
                let norm = NormInputs {
                    pending: inject.then_some((&blk[..], &inj[..])),
                    weight: &nw,
                    rstd: &vec![POISON; nt * h],
                    eps,
                };
                let (y, inj_new, rstd) = matvec::matmat_norm(
                    ctx,
                    &g,
                    &xs,
                    &vec![POISON; nt * h],
                    h,
                    norm,
                    plan,
                    Epilogue::HcFrontNorm,
                )
                .unwrap();
                for t in 0..nt {
                    // The injected streams and each stream's 1 / rms, in f64.
                    let x: Vec<f64> = (0..cols)
                        .map(|c| {
                            let v = xs[t * cols + c] as f64;
                            let add = inj[t * h + c / d] as f64 * blk[t * d + c % d] as f64;
                            if inject { v + add } else { v }
                        })
                        .collect();
                    let rs: Vec<f64> = (0..h)
                        .map(|k| {
                            let ss: f64 = x[k * d..(k + 1) * d].iter().map(|v| v * v).sum();
                            1.0 / (ss / d as f64 + eps as f64).sqrt()
                        })
                        .collect();
                    for k in 0..h {
                        let got = rstd[t * h + k] as f64;
                        assert!(
                            (got - rs[k]).abs() <= 1e-5 * rs[k],
                            "{dtype} {plan:?} 1/rms t {t} stream {k}: {got} vs {}",
                            rs[k]
                        );
                    }
                    for row in 0..rows {
                        let (dot, mag) = (0..cols).fold((0.0f64, 0.0f64), |(s, a), c| {
                            let xn = x[c] * rs[c / d] * (1.0 + nw[c] as f64);
                            let p = dq[row * cols + c] as f64 * xn;
                            (s + p, a + p.abs())
                        });
                        let v = dot / h as f64;
                        // The dot within 1e-5 of its magnitude sum (the 1 / rms within 1e-6
                        // beside the sums' rounding); silu' <= 1.1, sigmoid' <= 1/4.
                        let err = 1e-5 * mag / h as f64;
                        let (got, want, tol) = if row < low {
                            (y[t * low + row], silu(v), 1.1 * err)
                        } else {
                            (inj_new[t * h + row - low], 2.0 * sigmoid(v), 0.5 * err)
                        };
                        assert_ne!(got, POISON, "{dtype} front row {row} t {t} never written");
                        assert!(
                            (got as f64 - want).abs() <= tol + 1e-6 * want.abs() + 1e-12,
                            "{dtype} {plan:?} h {h} inject {inject} front row {row} t {t}: {got} vs {want}"
                        );
                    }
                }
            }
            // The read-out: the up matrix `[H * D, 40]` with its rows interleaved by stream.
            let lr = 40;
            let urows = h * d;
            let (p, dq) = decoded(dtype, urows, lr, &weights(urows, lr, seed + 100));
            let order: Vec<usize> = (0..urows).map(|i| (i % h) * d + i / h).collect();
            let by_stream = quant_codecs::gather_rows(dtype, urows, lr, &p, &order).unwrap();
            let m = MatRef::new(dtype, urows, lr, &by_stream).unwrap();
            let g = arena
                .get_or_upload(
                    ctx,
                    seed * 10 + 5 + h as u64,
                    &format!("up {dtype} {h}"),
                    &m,
                )
                .unwrap();
            for (nt, inject) in [(1, true), (1, false), (3, true), (8, true)] {
                let mut r = rng(seed ^ 0x77);
                let xs: Vec<f32> = (0..nt * lr).map(|_| r() * 0.2).collect();
                let streams: Vec<f32> = (0..nt * urows).map(|_| r() * 3.0).collect();
                let blk: Vec<f32> = (0..nt * d).map(|_| r()).collect();
                let inj: Vec<f32> = (0..nt * h).map(|_| 1.0 + r()).collect();
                let nw: Vec<f32> = (0..urows).map(|_| r() * 0.3).collect();
                let rs: Vec<f32> = (0..nt * h).map(|_| 1.25 + r()).collect();
                let norm = NormInputs {
                    pending: inject.then_some((&blk[..], &inj[..])),
                    weight: &nw,
                    rstd: &rs,
                    eps,
                };
                let plan = Plan::for_shape(ctx, urows, lr);
                let (u, back, rs_back) = matvec::matmat_norm(
                    ctx,
                    &g,
                    &xs,
                    &streams,
                    h,
                    norm,
                    plan,
                    Epilogue::HcReadoutNorm,
                )
                .unwrap();
                assert_eq!(rs_back, rs, "the read-out wrote into the 1 / rms");
                for t in 0..nt {
                    for j in 0..d {
                        let (mut want, mut tol) = (0.0f64, 0.0f64);
                        for k in 0..h {
                            let q = t * urows + k * d + j;
                            let add = inj[t * h + k] as f64 * blk[t * d + j] as f64;
                            let x = streams[q] as f64 + if inject { add } else { 0.0 };
                            let stored = back[q] as f64;
                            assert!(
                                (stored - x).abs() <= 1e-6 * (x.abs() + add.abs()),
                                "{dtype} h {h} stream {k} column {j} t {t}: {stored} vs {x}"
                            );
                            let xn = x * rs[t * h + k] as f64 * (1.0 + nw[k * d + j] as f64);
                            let row = k * d + j;
                            let (dot, mag) = (0..lr).fold((0.0f64, 0.0f64), |(s, a), c| {
                                let p = dq[row * lr + c] as f64 * xs[t * lr + c] as f64;
                                (s + p, a + p.abs())
                            });
                            want += sigmoid(dot) * xn;
                            tol += (0.25 * 4e-6 * mag + 1e-6) * xn.abs();
                        }
                        want /= h as f64;
                        let got = u[t * d + j] as f64;
                        assert!(
                            (got - want).abs() <= tol / h as f64 + 1e-12,
                            "{dtype} h {h} inject {inject} read-out column {j} t {t}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

/// The hyper-connection epilogues against f64 math on the decoded matrix: the front's
/// activations (`silu(v / H)` for the low-rank rows, `2 sigmoid(v / H)` for the injection
/// rows, into two buffers) and the read-out over an up matrix whose rows are interleaved by
/// stream (`sum_k sigmoid(g_k) xn_k / H`), for every codec, 1 and 3 token rows, 2-4 streams and
/// every row-group shape the plans give.
#[test]
fn hyper_connection_epilogues_match_f64() {
    use gpu_runtime::Epilogue;
    let Some(ctx) = ctx() else { return };
    let arena = WeightArena::new(ctx);
    let decoded = |dtype: DType, rows: usize, cols: usize, w: &[f32]| {
        let p = quantize(dtype, rows, cols, w).unwrap();
        let mut dq = vec![0.0f32; rows * cols];
        MatRef::new(dtype, rows, cols, &p)
            .unwrap()
            .dequantize(&mut dq)
            .unwrap();
        (p, dq)
    };
    for (i, dtype) in [DType::F32].into_iter().chain(GPU_DTYPES).enumerate() {
        let seed = 40 + i as u64;
        // The front: 20 low-rank rows and 4 injection rows.
        let (low, h, cols) = (20, 4, 256);
        let rows = low + h;
        let (p, dq) = decoded(dtype, rows, cols, &weights(rows, cols, seed));
        let m = MatRef::new(dtype, rows, cols, &p).unwrap();
        let g = arena
            .get_or_upload(ctx, seed, &format!("front {dtype}"), &m)
            .unwrap();
        let base = Plan::for_shape(ctx, rows, cols);
        for (plan, nt) in [
            (base, 1),
            (base, 3),
            (Plan { rows: 2, ..base }, 3),
            (Plan { rows: 4, ..base }.shared_memory(), 1),
            (base.split(128), 3),
            // f16: the tiled matmat, its columns split in two.
            (base, 32),
            (base, 64),
        ] {
            let mut r = rng(seed ^ 0x55);
            let xs: Vec<f32> = (0..nt * cols).map(|_| r() * 0.2).collect();
            let (y, inj) = matvec::matmat_aux(
                ctx,
                &g,
                &xs,
                &vec![POISON; nt * h],
                h,
                plan,
                Epilogue::HcFront,
            )
            .unwrap();
            for t in 0..nt {
                for row in 0..rows {
                    let (dot, mag) = (0..cols).fold((0.0f64, 0.0f64), |(s, a), c| {
                        let p = dq[row * cols + c] as f64 * xs[t * cols + c] as f64;
                        (s + p, a + p.abs())
                    });
                    let v = dot / h as f64;
                    // The dot within 4e-6 of its magnitude sum; silu' <= 1.1, sigmoid' <= 1/4.
                    let err = 4e-6 * mag / h as f64;
                    let (got, want, tol) = if row < low {
                        (y[t * low + row], silu(v), 1.1 * err)
                    } else {
                        (inj[t * h + row - low], 2.0 * sigmoid(v), 0.5 * err)
                    };
                    assert_ne!(got, POISON, "{dtype} front row {row} t {t} never written");
                    assert!(
                        (got as f64 - want).abs() <= tol + 1e-6 * want.abs() + 1e-12,
                        "{dtype} {plan:?} front row {row} t {t}: {got} vs {want}"
                    );
                }
            }
        }
        // The read-out: H streams of D columns, low rank 64.
        for h in [2, 3, 4] {
            let (d, cols) = (24, 64);
            let rows = h * d;
            let w = weights(rows, cols, seed + 100);
            let (p, dq) = decoded(dtype, rows, cols, &w);
            let order: Vec<usize> = (0..rows).map(|i| (i % h) * d + i / h).collect();
            let by_stream = quant_codecs::gather_rows(dtype, rows, cols, &p, &order).unwrap();
            let m = MatRef::new(dtype, rows, cols, &by_stream).unwrap();
            let g = arena
                .get_or_upload(ctx, seed + 100 + h as u64, &format!("up {dtype} {h}"), &m)
                .unwrap();
            // 32 and 256: f16 over 4 streams runs the tiled matmat.
            for nt in [1, 3, 32, 256] {
                let mut r = rng(seed ^ 0x77);
                let xs: Vec<f32> = (0..nt * cols).map(|_| r() * 0.2).collect();
                let xn: Vec<f32> = (0..nt * rows).map(|_| r() * 3.0).collect();
                let plan = Plan::for_shape(ctx, rows, cols);
                let (u, back) =
                    matvec::matmat_aux(ctx, &g, &xs, &xn, h, plan, Epilogue::HcReadout).unwrap();
                assert_eq!(back, xn, "the read-out wrote into the streams");
                for t in 0..nt {
                    for j in 0..d {
                        let (mut want, mut tol) = (0.0f64, 0.0f64);
                        for k in 0..h {
                            let row = k * d + j;
                            let (dot, mag) = (0..cols).fold((0.0f64, 0.0f64), |(s, a), c| {
                                let p = dq[row * cols + c] as f64 * xs[t * cols + c] as f64;
                                (s + p, a + p.abs())
                            });
                            let x = xn[t * rows + row] as f64;
                            want += sigmoid(dot) * x;
                            tol += (0.25 * 4e-6 * mag + 1e-6) * x.abs();
                        }
                        want /= h as f64;
                        let got = u[t * d + j] as f64;
                        assert!(
                            (got - want).abs() <= tol / h as f64 + 1e-12,
                            "{dtype} read-out h {h} column {j} t {t}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
    // What the epilogues cannot take is refused, not run.
    let p = quantize(DType::F16, 10, 64, &weights(10, 64, 3)).unwrap();
    let g = arena
        .get_or_upload(ctx, 3, "ten", &MatRef::new(DType::F16, 10, 64, &p).unwrap())
        .unwrap();
    let plan = Plan::for_matrix(ctx, 10);
    let e = matvec::matmat_aux(
        ctx,
        &g,
        &[0.5; 64],
        &[0.0; 10],
        5,
        plan,
        Epilogue::HcReadout,
    )
    .unwrap_err();
    assert!(matches!(e, GpuError::UnsupportedFusion { .. }), "{e}");
    let e =
        matvec::matmat_aux(ctx, &g, &[0.5; 64], &[0.0; 1], 2, plan, Epilogue::HcFront).unwrap_err();
    assert!(matches!(e, GpuError::BadLength { .. }), "{e}");
}

/// The MoE output epilogue (the shared expert's down projection adding the routed slots'
/// weighted sum and scaling itself by the row's gate) against f64 math on the slots and the
/// same matrix's plain matvec (checked against f64 above), for every codec on the f32 and int8
/// paths, 1, 3 and 8 token rows and the row-group shapes the plans give.
#[test]
fn the_moe_output_epilogue_matches_the_slots_sum_and_the_plain_matvec() {
    use gpu_runtime::Epilogue;
    use gpu_runtime::Path;
    let Some(ctx) = ctx() else { return };
    let arena = WeightArena::new(ctx);
    let (rows, cols, k) = (96usize, 128usize, 10usize);
    for (i, dtype) in [DType::F32].into_iter().chain(GPU_DTYPES).enumerate() {
        let seed = 70 + i as u64;
        let p = quantize(dtype, rows, cols, &weights(rows, cols, seed)).unwrap();
        let m = MatRef::new(dtype, rows, cols, &p).unwrap();
        let g = arena
            .get_or_upload(ctx, seed, &format!("shared down {dtype}"), &m)
            .unwrap();
        let base = Plan::for_shape(ctx, rows, cols);
        let float = matches!(dtype, DType::F32 | DType::F16 | DType::BF16);
        let paths: &[Path] = if float {
            &[Path::F32]
        } else {
            &[Path::F32, Path::Int8]
        };
        for &path in paths {
            for (plan, nt) in [
                (base, 1),
                (Plan { rows: 2, ..base }, 3),
                (Plan { rows: 4, ..base }.shared_memory(), 8),
            ] {
                let plan = plan.with_path(path);
                let mut r = rng(seed ^ 0x99);
                let xs: Vec<f32> = (0..nt * cols).map(|_| r() * 0.2).collect();
                let (sw_off, g_off) = matvec::moe_out_offsets(nt, k, rows);
                let slots: Vec<f32> = (0..g_off + nt).map(|_| r()).collect();
                let (y, back) =
                    matvec::matmat_aux(ctx, &g, &xs, &slots, k, plan, Epilogue::MoeOut).unwrap();
                assert_eq!(back, slots, "{dtype}: the epilogue wrote into the slots");
                let plain = matvec::matmat(ctx, &g, &xs, plan).unwrap();
                for t in 0..nt {
                    let gate = slots[g_off + t] as f64;
                    for row in 0..rows {
                        let (mut want, mut mag) = (0.0f64, 0.0f64);
                        for s in 0..k {
                            let p = slots[sw_off + t * k + s] as f64
                                * slots[(t * k + s) * rows + row] as f64;
                            want += p;
                            mag += p.abs();
                        }
                        let v = gate * plain[t * rows + row] as f64;
                        want += v;
                        mag += v.abs();
                        let got = y[t * rows + row] as f64;
                        assert_ne!(y[t * rows + row], POISON, "{dtype} row {row} t {t}");
                        // k + 1 f32 additions of terms at most `mag` in all.
                        assert!(
                            (got - want).abs() <= 2e-7 * (k as f64 + 2.0) * mag + 1e-30,
                            "{dtype} {path:?} {plan:?} row {row} t {t}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
