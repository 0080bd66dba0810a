//! `cortiq bench kernels`: every codec's matvec/matmat throughput in GB/s of weight bytes,
//! next to the read bandwidth of the same device measured in the same run, plus the
//! per-dispatch launch floor. One record type, printed as a table or JSON.

use std::hint::black_box;
use std::time::Instant;

use gpu_runtime::ops::matvec::Plan;
use gpu_runtime::staging::StagingRing;
use gpu_runtime::{Epilogue, GpuContext, GpuError, GpuMatrix, GpuOptions, Selected};
use quant_codecs::{ActPath, DType, MatRef, synthetic_payload};
use rayon::prelude::*;
use serde::Serialize;

/// What to measure.
#[derive(Debug, Clone)]
pub struct KernelBenchOptions {
    /// Backend selection (auto falls back to the CPU).
    pub gpu: GpuOptions,
    /// Bytes of the large matrix (default 1 GiB: past every cache).
    pub large_bytes: u64,
    /// Target seconds of measurement per record.
    pub seconds: f64,
    /// Only these formats (all when empty).
    pub formats: Vec<DType>,
}

/// One measurement.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRecord {
    /// `read_ceiling`, `launch_floor` or `matvec`.
    pub test: &'static str,
    /// Weight format (`-` for the ceiling and the floor).
    pub format: String,
    /// Matrix shape `ROWSxCOLS`.
    pub shape: String,
    /// Token rows per call (1 = matvec).
    pub rows_per_call: usize,
    /// Bytes read per call.
    pub bytes: u64,
    /// Microseconds per call.
    pub us: f64,
    /// GB/s (10^9 bytes per second) of the bytes read.
    pub gbps: f64,
    /// Percent of the read ceiling measured in the same run.
    pub pct_of_ceiling: f64,
    /// The bytes fit in the device's last-level cache, so the row measures the cache rather than
    /// memory and its percentage of the (memory) read ceiling can pass 100.
    pub cache_resident: bool,
    /// `timestamps` (GPU timer queries) or `wall` (clock around submit and wait).
    pub timing: &'static str,
    /// The activation path: `f32`, `hw-f16` (f16 through the hardware conversion) or `int8`
    /// (activations quantised per 32-block; the quantiser is its own `act_quant` record, as a
    /// forward shares one quantised input among the matrices that read it).
    pub path: &'static str,
    /// llama.cpp's figure for the nearest format on this device, where docs/perf.md has one.
    pub llama_cpp: Option<String>,
}

/// A whole run: the device and its records.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// `wgpu` or `cpu`.
    pub backend: String,
    /// The adapter line, or the CPU's ISA and threads.
    pub device: String,
    /// The last-level cache size assumed for [`BenchRecord::cache_resident`].
    pub cache_bytes: u64,
    /// The records, ceiling first.
    pub records: Vec<BenchRecord>,
}

const GPU_FORMATS: [DType; 6] = [
    DType::F16,
    DType::BF16,
    DType::Q8_2f,
    DType::Q4tp,
    DType::Q2tp,
    DType::Mxfp4,
];

/// The decode shapes of the target models, then the large matrix; `(rows, cols, token rows)`.
fn shapes(dtype: DType, large_bytes: u64) -> Vec<(usize, usize, usize)> {
    let cols = 8192;
    let row_bytes = dtype.expected_nbytes(&[1, cols]).unwrap_or(cols) as u64;
    let large = large_bytes.div_ceil(row_bytes) as usize;
    vec![
        (2560, 2560, 1),
        (2560, 2560, 8),
        (640, 2560, 1),
        // A hyper-connection site's low-rank down and injection matrices (few long rows).
        (320, 10240, 1),
        (4, 10240, 1),
        (10240, 2560, 1),
        (248320, 2560, 1),
        (large, cols, 1),
        (large, cols, 8),
    ]
}

/// The GPU's prompt-frame shapes (256 token rows, the tiled matmat's case) of the matrices a
/// frame spends most on: f16, the hyper-connection front (low rank + injection rows) and
/// read-out and a router; q8_2f, GDN's projections.
fn frame_shapes(dtype: DType) -> Vec<(usize, usize, usize)> {
    match dtype {
        DType::F16 => vec![(324, 10240, 256), (10240, 320, 256), (512, 2560, 256)],
        DType::Q8_2f => vec![(10240, 2560, 256), (2560, 6144, 256)],
        _ => Vec::new(),
    }
}

fn record(
    test: &'static str,
    format: String,
    shape: String,
    nt: usize,
    bytes: u64,
    seconds: f64,
    timing: &'static str,
) -> BenchRecord {
    BenchRecord {
        test,
        format,
        shape,
        rows_per_call: nt,
        bytes,
        us: seconds * 1e6,
        gbps: bytes as f64 / seconds / 1e9,
        pct_of_ceiling: 0.0,
        cache_resident: false,
        timing,
        path: "f32",
        llama_cpp: None,
    }
}

/// The paths a GPU row is measured on: f32, and the device's fastest for `dtype` where that is
/// another.
fn gpu_paths(ctx: &GpuContext, dtype: DType) -> Vec<gpu_runtime::Path> {
    let mut paths = vec![gpu_runtime::Path::F32];
    if let Some(c) = gpu_runtime::arena::kernel_codec(dtype) {
        let fast = Plan::fastest_path(ctx, c);
        if fast != gpu_runtime::Path::F32 {
            paths.push(fast);
        }
    }
    paths
}

fn path_name(p: gpu_runtime::Path) -> &'static str {
    match p {
        gpu_runtime::Path::F32 => "f32",
        gpu_runtime::Path::HwF16 => "hw-f16",
        gpu_runtime::Path::Int8 => "int8",
    }
}

/// llama.cpp's Vulkan mat-vec on the H200 (../shared/notes/machines.md §2, weights past the
/// L2, % of its 4236 GB/s read ceiling), for the large T=1 rows.
fn llama_cpp_h200(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::F16 | DType::BF16 => "f16 100%",
        DType::Q8_2f => "q8_0 57%",
        DType::Q4tp => "q4_0 47%, q4_K 38%",
        DType::Q2tp => "q2_K 37%",
        DType::Mxfp4 => "mxfp4 31%",
        _ => return None,
    })
}

/// The size of the last-level cache assumed when marking rows: the CPU's from sysfs where it
/// says, else 32 MiB; for GPUs (wgpu does not report it) 64 MiB, above the largest consumer L2
/// (72 MB on an RTX 4090 rounds down; the H200's is 50 MB).
fn cache_bytes(backend: &str) -> u64 {
    if backend != "cpu" {
        return 64 << 20;
    }
    let sysfs = (0..8)
        .filter_map(|i| {
            let dir = format!("/sys/devices/system/cpu/cpu0/cache/index{i}");
            let size = std::fs::read_to_string(format!("{dir}/size")).ok()?;
            gpu_runtime::parse_size(size.trim())
        })
        .max();
    sysfs.unwrap_or(32 << 20)
}

fn finish(backend: &str, device: String, mut records: Vec<BenchRecord>) -> BenchReport {
    let cache = cache_bytes(backend);
    let ceiling = records
        .iter()
        .find(|r| r.test == "read_ceiling")
        .map_or(0.0, |r| r.gbps);
    for r in records.iter_mut().filter(|r| r.test != "launch_floor") {
        // The experts rows judge residency by their whole bank (the caller sets it).
        if r.test != "experts" {
            r.cache_resident = r.test != "read_ceiling" && r.bytes <= cache;
        }
        r.pct_of_ceiling = if ceiling > 0.0 {
            100.0 * r.gbps / ceiling
        } else {
            0.0
        };
    }
    BenchReport {
        backend: backend.into(),
        device,
        cache_bytes: cache,
        records,
    }
}

/// Runs the kernel benchmark on the selected backend; `progress` hears each record as it lands.
pub fn kernels(
    opts: &KernelBenchOptions,
    progress: &mut dyn FnMut(&BenchRecord),
) -> Result<BenchReport, GpuError> {
    match gpu_runtime::select(&opts.gpu)? {
        Selected::Gpu(ctx) => gpu(&ctx, opts, progress),
        Selected::Cpu(reason) => {
            if opts.gpu.backend == gpu_runtime::BackendChoice::Cpu {
                tracing::info!("measuring the CPU kernels (--backend cpu)");
            } else {
                tracing::warn!("no GPU in use ({reason}); measuring the CPU kernels");
            }
            Ok(cpu(opts, progress))
        }
    }
}

fn formats(opts: &KernelBenchOptions, all: &[DType]) -> Vec<DType> {
    all.iter()
        .copied()
        .filter(|d| opts.formats.is_empty() || opts.formats.contains(d))
        .collect()
}

fn gpu(
    ctx: &GpuContext,
    opts: &KernelBenchOptions,
    progress: &mut dyn FnMut(&BenchRecord),
) -> Result<BenchReport, GpuError> {
    let mut records = Vec::new();
    let mut push = |r: BenchRecord, records: &mut Vec<BenchRecord>| {
        progress(&r);
        records.push(r);
    };
    // The probe call is the warm-up; a call that alone takes longer than --seconds is measured
    // once more, not three times.
    let reps_for = |one: f64| ((opts.seconds / one.max(1e-7)) as usize).clamp(1, 2000);
    let probe = gpu_runtime::bench::read_ceiling(ctx, opts.large_bytes, 1)?;
    let (bw, t) =
        gpu_runtime::bench::read_ceiling(ctx, opts.large_bytes, reps_for(probe.1.seconds))?;
    let bytes = (bw * t.seconds) as u64;
    let timing = if t.timestamps { "timestamps" } else { "wall" };
    push(
        record(
            "read_ceiling",
            "-".into(),
            format!("{bytes} B"),
            1,
            bytes,
            t.seconds,
            timing,
        ),
        &mut records,
    );
    let t = gpu_runtime::bench::launch_floor(ctx, 1000)?;
    push(
        record(
            "launch_floor",
            "-".into(),
            "1 lane".into(),
            1,
            0,
            t.seconds,
            if t.timestamps { "timestamps" } else { "wall" },
        ),
        &mut records,
    );
    for v in [
        gpu_runtime::bench::FloorVariant::Uniform,
        gpu_runtime::bench::FloorVariant::Immediate,
        gpu_runtime::bench::FloorVariant::WorkgroupMemory,
        gpu_runtime::bench::FloorVariant::Alternate,
        gpu_runtime::bench::FloorVariant::Fresh,
    ] {
        if let Some((t, _)) = gpu_runtime::bench::launch_floor_variant(ctx, v, 1000)? {
            push(
                record(
                    "launch_floor",
                    "-".into(),
                    v.name().into(),
                    1,
                    0,
                    t.seconds,
                    if t.timestamps { "timestamps" } else { "wall" },
                ),
                &mut records,
            );
        }
    }
    let h200 = ctx.info.name.contains("H200");
    // The int8 path's quantiser at the activation widths of the shapes above.
    for (cols, nt) in [(2560, 1), (2560, 8), (8192, 1), (8192, 8)] {
        let probe = gpu_runtime::bench::act_quant(ctx, nt, cols, 1)?;
        let t = gpu_runtime::bench::act_quant(ctx, nt, cols, reps_for(probe.seconds))?;
        let mut r = record(
            "act_quant",
            "-".into(),
            format!("{cols}"),
            nt,
            (nt * cols * 4) as u64,
            t.seconds,
            if t.timestamps { "timestamps" } else { "wall" },
        );
        r.path = "int8";
        push(r, &mut records);
    }
    let mut ring = StagingRing::new(ctx);
    for dtype in formats(opts, &GPU_FORMATS) {
        let mut last: Option<(usize, usize, GpuMatrix)> = None;
        let mut all = shapes(dtype, opts.large_bytes);
        all.extend(frame_shapes(dtype));
        for (rows, cols, nt) in all {
            if last
                .as_ref()
                .is_none_or(|(r, c, _)| (*r, *c) != (rows, cols))
            {
                drop(last.take()); // free the previous matrix before allocating the next
                let p = synthetic_payload(dtype, rows, cols, 7)?;
                let m = MatRef::new(dtype, rows, cols, &p)?;
                last = Some((
                    rows,
                    cols,
                    GpuMatrix::upload(ctx, &mut ring, &m, ctx.max_binding())?,
                ));
            }
            let Some((_, _, g)) = &last else { continue };
            let base = Plan::for_shape(ctx, rows, cols);
            for path in gpu_paths(ctx, dtype) {
                let plan = base.with_path(path);
                let run = |reps| {
                    gpu_runtime::bench::matmat_path(ctx, g, nt, plan, Epilogue::None, reps, false)
                };
                let probe = run(1)?;
                // A call that alone outlasts --seconds is its own measurement.
                let (t, ran) = if probe.0.seconds >= opts.seconds {
                    probe
                } else {
                    run(reps_for(probe.0.seconds))?
                };
                let bytes = dtype.expected_nbytes(&[rows, cols])? as u64;
                let timing = if t.timestamps { "timestamps" } else { "wall" };
                let mut r = record(
                    "matvec",
                    dtype.name().into(),
                    format!("{rows}x{cols}"),
                    nt,
                    bytes,
                    t.seconds,
                    timing,
                );
                r.path = path_name(ran);
                if h200 && cols == 8192 && nt == 1 {
                    r.llama_cpp = llama_cpp_h200(dtype).map(String::from);
                }
                push(r, &mut records);
            }
        }
        drop(last.take());
        // One expert's fused gate/up at Qwen3.8-Flash-Next's decode shape: [2 x 640, 2560].
        let (rows, cols) = (1280, 2560);
        let p = synthetic_payload(dtype, rows, cols, 7)?;
        let g = GpuMatrix::upload(
            ctx,
            &mut ring,
            &MatRef::new(dtype, rows, cols, &p)?,
            ctx.max_binding(),
        )?;
        let base = Plan::for_shape(ctx, rows, cols);
        for path in gpu_paths(ctx, dtype) {
            let plan = base.with_path(path);
            let run = |reps| {
                gpu_runtime::bench::matmat_path(ctx, &g, 1, plan, Epilogue::SiluGateUp, reps, false)
            };
            let probe = run(1)?;
            let (t, ran) = run(reps_for(probe.0.seconds))?;
            let timing = if t.timestamps { "timestamps" } else { "wall" };
            let mut r = record(
                "gate_up_silu",
                dtype.name().into(),
                format!("{rows}x{cols}"),
                1,
                p.len() as u64,
                t.seconds,
                timing,
            );
            r.path = path_name(ran);
            push(r, &mut records);
        }
        for r in grouped_experts(ctx, opts, dtype, &reps_for)? {
            push(r, &mut records);
        }
    }
    Ok(finish("wgpu", ctx.describe(), records))
}

/// Qwen3.8-Flash-Next's routed experts: 512 of `[2 x 640, 2560]` gate/up and `[2560, 640]`
/// down, top-10 per token row.
const EXPERTS: (usize, usize, usize, usize) = (512, 1280, 2560, 10);

/// DeepSeek-V4-Flash's: 256 of `[2 x 2048, 4096]` and `[4096, 2048]`, top-6.
const DSV4_EXPERTS: (usize, usize, usize, usize) = (256, 4096, 4096, 6);

/// How a benchmarked bank is laid out: one buffer, or split into 8 segments bound as a fixed
/// set or (where the adapter has them) a binding array, as DeepSeek's global bank is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum BankKind {
    One,
    Fixed,
    Array,
}

/// One MoE layer's routed experts through the grouped kernels (gate/up + SiLU, then down, one
/// dispatch each plus the int8 quantisers) at [`EXPERTS`]' shape and, for mxfp4 (the released
/// DeepSeek experts' codec), [`DSV4_EXPERTS`]' in banks of one buffer and of 8 segments; T = 1
/// and 8 (and 256 in one buffer), every path. The bytes are those of the distinct experts the rows chose (what must be
/// read), averaged over 32 id sets the repetitions cycle through, so the chosen experts are not
/// cache-resident from the last repetition. The bank holds fewer experts when `--large` or one
/// binding is smaller. One-buffer banks also at T = 256 (a prompt frame: the slots sorted by
/// expert, each expert's weights read once per 8 of its slots, `ops::experts_tiled`).
fn grouped_experts(
    ctx: &GpuContext,
    opts: &KernelBenchOptions,
    dtype: DType,
    reps_for: &dyn Fn(f64) -> usize,
) -> Result<Vec<BenchRecord>, GpuError> {
    let mut out = grouped_experts_at(ctx, opts, dtype, reps_for, EXPERTS, BankKind::One)?;
    if dtype == DType::Mxfp4 {
        let mut kinds = vec![BankKind::One, BankKind::Fixed];
        if ctx.caps.binding_arrays {
            kinds.push(BankKind::Array);
        }
        for kind in kinds {
            out.extend(grouped_experts_at(
                ctx,
                opts,
                dtype,
                reps_for,
                DSV4_EXPERTS,
                kind,
            )?);
        }
    }
    Ok(out)
}

fn grouped_experts_at(
    ctx: &GpuContext,
    opts: &KernelBenchOptions,
    dtype: DType,
    reps_for: &dyn Fn(f64) -> usize,
    (count, gu_rows, d, k): (usize, usize, usize, usize),
    kind: BankKind,
) -> Result<Vec<BenchRecord>, GpuError> {
    use gpu_runtime::ops::experts::ExpertBank;
    let inter = gu_rows / 2;
    let gu = synthetic_payload(dtype, gu_rows, d, 11)?;
    let dn = synthetic_payload(dtype, d, inter, 13)?;
    let expert_bytes = (gu.len() + dn.len()) as u64;
    let slot = |b: usize| (b as u64).next_multiple_of(16);
    let fit = (ctx.max_binding() / slot(gu.len())).min(ctx.max_binding() / slot(dn.len()));
    let experts = (opts.large_bytes / expert_bytes)
        .clamp(2 * k as u64, count as u64)
        .min(fit) as usize;
    if experts < k {
        return Ok(Vec::new());
    }
    let gu_m = MatRef::new(dtype, gu_rows, d, &gu)?;
    let dn_m = MatRef::new(dtype, d, inter, &dn)?;
    let bank = |m: MatRef<'_>| -> Result<ExpertBank, GpuError> {
        if kind == BankKind::One {
            return ExpertBank::upload(ctx, &vec![m; experts]);
        }
        let (rows, cols) = (m.rows(), m.cols());
        let per = Some(experts.div_ceil(8));
        let mut b = ExpertBank::empty(ctx, dtype, rows, cols, experts, per)?;
        b.fixed = kind == BankKind::Fixed;
        let mut ring = gpu_runtime::staging::StagingRing::new(ctx);
        for e in 0..experts {
            b.write(ctx, &mut ring, e, &m)?;
        }
        ring.flush(ctx)?;
        Ok(b)
    };
    let gate_up = bank(gu_m)?;
    let down = bank(dn_m)?;
    let label = match kind {
        BankKind::One => String::new(),
        BankKind::Fixed => " seg8 fixed".into(),
        BankKind::Array => " seg8 array".into(),
    };
    let mut out = Vec::new();
    let h200 = ctx.info.name.contains("H200");
    // A prompt frame of 256 rows too (one-buffer banks): the expert-major kernels' case.
    let frames: &[usize] = if kind == BankKind::One {
        &[1, 8, 256]
    } else {
        &[1, 8]
    };
    for &nt in frames {
        let (sets, distinct) = expert_id_sets(experts, nt, k, 32);
        let bytes = (distinct * expert_bytes as f64) as u64;
        for path in gpu_paths(ctx, dtype) {
            let run = |reps| {
                gpu_runtime::bench::grouped_experts(ctx, &gate_up, &down, &sets, nt, k, path, reps)
            };
            let probe = run(1)?;
            let (t, ran) = run(reps_for(probe.0.seconds))?;
            let mut r = record(
                "experts",
                dtype.name().into(),
                format!("{experts}x[{gu_rows}x{d}+{d}x{inter}] top{k}{label}"),
                nt,
                bytes,
                t.seconds,
                if t.timestamps { "timestamps" } else { "wall" },
            );
            r.path = path_name(ran);
            r.cache_resident = experts as u64 * expert_bytes <= cache_bytes("wgpu");
            if h200 && dtype == DType::Q4tp && nt == 1 && count == EXPERTS.0 {
                r.llama_cpp = Some("q4_K MUL_MAT_ID 15-17%".into());
            }
            out.push(r);
        }
    }
    Ok(out)
}

/// `sets` sets of `nt * k` expert ids below `experts`, each token row's `k` distinct (a fixed
/// pseudo-random draw), and the mean number of distinct experts per set.
fn expert_id_sets(experts: usize, nt: usize, k: usize, sets: usize) -> (Vec<Vec<u32>>, f64) {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        // splitmix64
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut all = Vec::with_capacity(sets);
    let mut distinct = 0usize;
    for _ in 0..sets {
        let mut set = Vec::with_capacity(nt * k);
        for _ in 0..nt {
            let mut row: Vec<u32> = Vec::with_capacity(k);
            while row.len() < k {
                let e = (next() % experts as u64) as u32;
                if !row.contains(&e) {
                    row.push(e);
                }
            }
            set.extend(row);
        }
        let mut seen = set.clone();
        seen.sort_unstable();
        seen.dedup();
        distinct += seen.len();
        all.push(set);
    }
    (all, distinct as f64 / sets as f64)
}

/// Seconds per call of `f`: one timed first call sizes the measurement to about `seconds` (it
/// is the measurement when it alone takes that long).
fn time_cpu(seconds: f64, f: &mut dyn FnMut()) -> f64 {
    let t0 = Instant::now();
    f();
    let one = t0.elapsed().as_secs_f64();
    if one >= seconds {
        // A call that alone outlasts the budget is its own measurement.
        return one;
    }
    let reps = ((seconds / one.max(1e-7)) as usize).clamp(1, 1000);
    let t0 = Instant::now();
    for _ in 0..reps {
        f();
    }
    t0.elapsed().as_secs_f64() / reps as f64
}

/// Read bandwidth of all cores summing a `bytes` buffer for about `seconds`, in bytes/s (the
/// CPU's ceiling).
pub fn cpu_read_bandwidth(bytes: u64, seconds: f64) -> f64 {
    let buf: Vec<u64> = (0..bytes as usize / 8)
        .into_par_iter()
        .map(|i| i as u64)
        .collect();
    let s = time_cpu(seconds, &mut || {
        black_box(
            buf.par_chunks(1 << 16)
                .map(|c| c.iter().fold(0u64, |a, &b| a ^ b))
                .reduce(|| 0, |a, b| a ^ b),
        );
    });
    buf.len() as f64 * 8.0 / s
}

fn cpu(opts: &KernelBenchOptions, progress: &mut dyn FnMut(&BenchRecord)) -> BenchReport {
    let mut records = Vec::new();
    let buf: Vec<u64> = (0..opts.large_bytes as usize / 8)
        .into_par_iter()
        .map(|i| i as u64)
        .collect();
    let s = time_cpu(opts.seconds, &mut || {
        black_box(
            buf.par_chunks(1 << 16)
                .map(|c| c.iter().fold(0u64, |a, &b| a ^ b))
                .reduce(|| 0, |a, b| a ^ b),
        );
    });
    let bytes = buf.len() as u64 * 8;
    drop(buf);
    let r = record(
        "read_ceiling",
        "-".into(),
        format!("{bytes} B"),
        1,
        bytes,
        s,
        "wall",
    );
    progress(&r);
    records.push(r);
    for dtype in formats(opts, &DType::ALL) {
        let mut last: Option<(usize, usize, Vec<u8>)> = None;
        for (rows, cols, nt) in shapes(dtype, opts.large_bytes) {
            if last
                .as_ref()
                .is_none_or(|(r, c, _)| (*r, *c) != (rows, cols))
            {
                drop(last.take());
                let Ok(p) = synthetic_payload(dtype, rows, cols, 7) else {
                    continue;
                };
                last = Some((rows, cols, p));
            }
            let Some((_, _, p)) = &last else { continue };
            let Ok(m) = MatRef::new(dtype, rows, cols, p) else {
                continue;
            };
            let xs: Vec<f32> = (0..nt * cols)
                .map(|i| ((i % 17) as f32 - 8.0) / 8.0)
                .collect();
            let mut ys = vec![0.0f32; nt * rows];
            let mut paths = vec![ActPath::F32];
            if dtype.is_quantized() {
                paths.push(ActPath::Int8);
            }
            for path in paths {
                let s = time_cpu(opts.seconds, &mut || {
                    let _ = m.matmat_path(path, black_box(&xs), &mut ys);
                });
                let mut r = record(
                    "matvec",
                    dtype.name().into(),
                    format!("{rows}x{cols}"),
                    nt,
                    p.len() as u64,
                    s,
                    "wall",
                );
                r.path = match path {
                    ActPath::F32 => "f32",
                    ActPath::Int8 => "int8",
                };
                progress(&r);
                records.push(r);
            }
        }
        if dtype.is_quantized() {
            for r in cold_experts(opts, dtype) {
                progress(&r);
                records.push(r);
            }
        }
    }
    let device = format!(
        "CPU, {} kernels, {} threads",
        quant_codecs::Isa::detect().name(),
        rayon::current_num_threads()
    );
    finish("cpu", device, records)
}

/// A layer's cold experts on the CPU, as the offload's cold path computes them: `n` distinct
/// experts of Qwen3.8-Flash-Next's shape (`[2 x 640, 2560]` gate/up + SwiGLU, `[2560, 640]`
/// down), one token row each, drawn from a pool of `--large` bytes (past the last-level
/// cache, so their bytes come from memory), on `--act auto`'s path for the format. Three
/// schedules: `each` (every expert's two projections split over rayon's threads in turn, the
/// experts in parallel), `together` (all experts' gate/up rows in one parallel region, then
/// all down rows, on rayon) and `team` (`together` on the threads the cold path keeps spinning
/// between layers, [`quant_codecs::team::Team::from_env`]: what the cold path runs). Calls are
/// 300 us apart, as a layer's are while the GPU runs the rest of the layer, so rayon's threads
/// have gone to sleep each time; the figure is the mean call alone.
fn cold_experts(opts: &KernelBenchOptions, dtype: DType) -> Vec<BenchRecord> {
    use model_core::experts::{Activation, expert_mlp, experts_mlp, experts_mlp_on};
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Schedule {
        Each,
        Together,
        Team,
    }
    use quant_codecs::ops::{ActChoice, act_choice, set_act_choice};
    let (inter, d) = (640, 2560);
    let (Ok(gu), Ok(dn)) = (
        synthetic_payload(dtype, 2 * inter, d, 3),
        synthetic_payload(dtype, d, inter, 4),
    ) else {
        return Vec::new();
    };
    let expert_bytes = (gu.len() + dn.len()) as u64;
    let pool = (opts.large_bytes / expert_bytes).max(16) as usize;
    let gus: Vec<Vec<u8>> = (0..pool).map(|_| gu.clone()).collect();
    let dns: Vec<Vec<u8>> = (0..pool).map(|_| dn.clone()).collect();
    let mats: Vec<(MatRef<'_>, MatRef<'_>)> = gus
        .iter()
        .zip(&dns)
        .filter_map(|(g, n)| {
            Some((
                MatRef::new(dtype, 2 * inter, d, g).ok()?,
                MatRef::new(dtype, d, inter, n).ok()?,
            ))
        })
        .collect();
    let act = Activation::SwiGlu { limit: None };
    let before = act_choice();
    set_act_choice(ActChoice::Auto);
    let x: Vec<f32> = (0..d).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect();
    // The pause between calls (`CORTIQ_BENCH_GAP_US`, default 300; 0: back to back, the
    // threads still awake): the difference is what waking the threads costs.
    let gap = std::env::var("CORTIQ_BENCH_GAP_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300u64);
    // The cold path's default: both regions on a team whose threads spin between calls.
    let team = quant_codecs::team::Team::from_env(false);
    let mut out = Vec::new();
    for n in [5usize, 10] {
        let (sets, _) = expert_id_sets(mats.len(), 1, n, 64);
        for schedule in [Schedule::Each, Schedule::Together, Schedule::Team] {
            let _ = quant_codecs::chain_profile::report();
            let mut total = 0.0;
            let mut calls = 0usize;
            let t_end = Instant::now() + std::time::Duration::from_secs_f64(opts.seconds);
            while calls < sets.len() || Instant::now() < t_end {
                let set = &sets[calls % sets.len()];
                if gap > 0 {
                    std::thread::sleep(std::time::Duration::from_micros(gap));
                }
                let t0 = Instant::now();
                let jobs = || -> Vec<_> {
                    set.iter()
                        .map(|&e| (&mats[e as usize].0, &mats[e as usize].1, x.as_slice()))
                        .collect()
                };
                if schedule == Schedule::Together {
                    black_box(experts_mlp(act, &jobs()));
                } else if schedule == Schedule::Team {
                    black_box(experts_mlp_on(&team, act, &jobs()));
                } else {
                    let y: Vec<Vec<f32>> = set
                        .par_iter()
                        .map(|&e| {
                            let (g, n) = &mats[e as usize];
                            expert_mlp(act, g, n, &x, 1)
                        })
                        .collect();
                    black_box(y);
                }
                total += t0.elapsed().as_secs_f64();
                calls += 1;
            }
            if let Some(line) = quant_codecs::chain_profile::report() {
                eprintln!("cold_experts {} {n}: {line}", dtype.name());
            }
            let mut r = record(
                "cold_experts",
                dtype.name().into(),
                format!("{n}x(1280x2560+2560x640)"),
                1,
                n as u64 * expert_bytes,
                total / calls as f64,
                "wall",
            );
            r.path = match (quant_codecs::ops::act_path(dtype), schedule) {
                (ActPath::Int8, Schedule::Each) => "i8 each",
                (ActPath::Int8, Schedule::Together) => "i8 tog",
                (ActPath::Int8, Schedule::Team) => "i8 team",
                (ActPath::F32, Schedule::Each) => "f32 each",
                (ActPath::F32, Schedule::Together) => "f32 tog",
                (ActPath::F32, Schedule::Team) => "f32 team",
            };
            out.push(r);
        }
    }
    set_act_choice(before);
    out
}

impl BenchReport {
    /// The llama-bench style table.
    pub fn write_text(&self, w: &mut dyn std::io::Write) -> std::io::Result<()> {
        writeln!(w, "backend  {}", self.backend)?;
        writeln!(w, "device   {}", self.device)?;
        writeln!(
            w,
            "{:<13} {:<7} {:<8} {:<24} {:>2} {:>14} {:>12} {:>9} {:>7}  {:<10} llama.cpp",
            "test", "format", "path", "shape", "T", "bytes", "us/call", "GB/s", "% ceil", "timing"
        )?;
        for r in &self.records {
            writeln!(
                w,
                "{:<13} {:<7} {:<8} {:<24} {:>2} {:>14} {:>12.2} {:>9.1} {:>7.1}{} {:<10} {}",
                r.test,
                r.format,
                r.path,
                r.shape,
                r.rows_per_call,
                r.bytes,
                r.us,
                r.gbps,
                r.pct_of_ceiling,
                if r.cache_resident { "*" } else { " " },
                r.timing,
                r.llama_cpp.as_deref().unwrap_or("")
            )?;
        }
        if self.records.iter().any(|r| r.cache_resident) {
            writeln!(
                w,
                "* fits in the last-level cache ({} MiB assumed): it measures the cache, so its \
                 share of the memory read ceiling can pass 100%",
                self.cache_bytes >> 20
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::expert_id_sets;

    #[test]
    fn expert_id_sets_draw_distinct_experts_per_row_and_count_the_distinct_per_set() {
        for (experts, nt, k) in [(512, 1, 10), (512, 8, 10), (20, 8, 10), (10, 3, 10)] {
            let (sets, mean) = expert_id_sets(experts, nt, k, 32);
            assert_eq!(sets.len(), 32);
            let mut total = 0usize;
            for set in &sets {
                assert_eq!(set.len(), nt * k);
                for row in set.chunks(k) {
                    assert!(row.iter().all(|&e| (e as usize) < experts));
                    let uniq: std::collections::BTreeSet<_> = row.iter().collect();
                    assert_eq!(uniq.len(), k, "a row chose an expert twice: {row:?}");
                }
                total += set.iter().collect::<std::collections::BTreeSet<_>>().len();
            }
            assert!((mean - total as f64 / 32.0).abs() < 1e-12);
            // With every expert chosen by each row, a set holds them all.
            if experts == k {
                assert_eq!(mean, k as f64);
            }
        }
        // The sets differ (the repetitions cycle through different experts).
        let (sets, _) = expert_id_sets(512, 1, 10, 32);
        assert_ne!(sets[0], sets[1]);
    }
}
