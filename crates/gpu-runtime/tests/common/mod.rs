//! What the GPU test files share: the one context (lavapipe in CI, where `CORTIQ_REQUIRE_GPU=1`
//! makes a missing adapter a failure rather than a skip) and deterministic data.
#![allow(dead_code)]

use std::sync::OnceLock;

use gpu_runtime::{GpuContext, GpuOptions};

pub fn ctx() -> Option<&'static GpuContext> {
    static CTX: OnceLock<Option<GpuContext>> = OnceLock::new();
    CTX.get_or_init(|| open(false)).as_ref()
}

/// A second context whose tiled matmat runs the 4x4-a-lane f16 kernel
/// (`CORTIQ_MATMAT=tiled4x4`), so both variants are tested.
pub fn ctx_narrow() -> Option<&'static GpuContext> {
    static CTX: OnceLock<Option<GpuContext>> = OnceLock::new();
    CTX.get_or_init(|| open(true)).as_ref()
}

fn open(narrow_tiles: bool) -> Option<GpuContext> {
    {
        let opts = GpuOptions {
            pipeline_cache_dir: None,
            narrow_tiles,
            ..GpuOptions::default()
        };
        match GpuContext::new(&opts) {
            Ok(c) => {
                eprintln!("adapter: {}", c.describe());
                Some(c)
            }
            Err(e) if std::env::var("CORTIQ_REQUIRE_GPU").as_deref() == Ok("1") => {
                panic!("CORTIQ_REQUIRE_GPU=1 but no GPU: {e}")
            }
            Err(e) => {
                eprintln!("no GPU adapter, GPU tests skipped: {e}");
                None
            }
        }
    }
}

pub fn rng(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
    }
}

pub fn weights(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut r = rng(seed);
    (0..rows * cols)
        .map(|i| r() * if i % cols < 8 { 4.0 } else { 1.0 } * (1.0 + (i / cols % 5) as f32))
        .collect()
}

/// The tiled matmat's test shapes (rows, cols, whether the matrix is split over several
/// bindings of 4 KiB): columns split in 2 and 8, not split (4 column steps), several parts;
/// and the frames each runs: the shortest tiled, a partial token tile, one and four tiles.
pub const TILED_SHAPES: [(usize, usize, bool); 4] = [
    (70, 256, false),
    (130, 1024, false),
    (96, 128, false),
    (70, 256, true),
];
pub const TILED_FRAMES: [usize; 4] = [gpu_runtime::ops::tiled::MIN_ROWS, 40, 64, 256];

/// The arena a [`TILED_SHAPES`] case uploads into on `ctx`.
pub fn tiled_arena(ctx: &GpuContext, parted: bool) -> gpu_runtime::WeightArena {
    if parted {
        gpu_runtime::WeightArena::with_limits(1 << 30, 4096)
    } else {
        gpu_runtime::WeightArena::new(ctx)
    }
}

/// `y` of the grouped kernel for `xs` (`[x_rows, cols]`) over `ids` (`k` per row), filled with
/// [`POISON`](gpu_runtime::ops::matvec::POISON) first.
pub fn run_grouped(
    ctx: &gpu_runtime::GpuContext,
    bank: &gpu_runtime::ops::experts::ExpertBank,
    xs: &[f32],
    ids: &[u32],
    k: usize,
    epilogue: gpu_runtime::Epilogue,
    path: gpu_runtime::Path,
) -> Vec<f32> {
    let slots = ids.len();
    let init = |label, contents: &[u8], extra| {
        wgpu::util::DeviceExt::create_buffer_init(
            &ctx.device,
            &wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents,
                usage: wgpu::BufferUsages::STORAGE | extra,
            },
        )
    };
    let x = init("x", bytemuck::cast_slice(xs), wgpu::BufferUsages::empty());
    let idb = init(
        "ids",
        bytemuck::cast_slice(ids),
        wgpu::BufferUsages::empty(),
    );
    let out_rows = if epilogue == gpu_runtime::Epilogue::SiluGateUp {
        bank.rows / 2
    } else {
        bank.rows
    };
    let y = init(
        "y",
        bytemuck::cast_slice(&vec![gpu_runtime::ops::matvec::POISON; slots * out_rows]),
        wgpu::BufferUsages::COPY_SRC,
    );
    let plan = gpu_runtime::ops::matvec::Plan::for_matrix(ctx, bank.rows).with_path(path);
    let p = gpu_runtime::ops::experts::prepare_grouped(
        ctx,
        bank,
        &x,
        xs.len() / bank.cols,
        &idb,
        &y,
        slots,
        k,
        plan,
        epilogue,
    )
    .unwrap();
    let mut enc = ctx
        .device
        .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
    {
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
        p.record(&mut pass);
    }
    ctx.queue.submit([enc.finish()]);
    gpu_runtime::readback::read_f32(ctx, &y, 0, slots * out_rows).unwrap()
}

/// `experts` random experts of `dtype` (`rows x cols`), quantised; expert `e` from seed
/// `seed + e`.
pub fn expert_payloads(
    dtype: quant_codecs::DType,
    rows: usize,
    cols: usize,
    experts: usize,
    seed: u64,
) -> Vec<Vec<u8>> {
    (0..experts)
        .map(|e| {
            quant_codecs::quantize(dtype, rows, cols, &weights(rows, cols, seed + e as u64))
                .unwrap()
        })
        .collect()
}

/// A one-buffer bank of `payloads`.
pub fn bank_of(
    ctx: &GpuContext,
    dtype: quant_codecs::DType,
    rows: usize,
    cols: usize,
    payloads: &[Vec<u8>],
) -> gpu_runtime::ops::experts::ExpertBank {
    let mats: Vec<quant_codecs::MatRef<'_>> = payloads
        .iter()
        .map(|p| quant_codecs::MatRef::new(dtype, rows, cols, p).unwrap())
        .collect();
    gpu_runtime::ops::experts::ExpertBank::upload(ctx, &mats).unwrap()
}
