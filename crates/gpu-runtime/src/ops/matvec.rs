//! matvec / matmat on resident matrices: `y[t][r] = sum_i W[r, i] * x[t][i]` for up to 8 token
//! rows, each weight chunk decoded once for all of them (kernels-wgsl's `Matvec`).

use std::sync::Arc;

use kernels_wgsl::{Codec, Epilogue, Matvec, Path, Reduce};
use quant_codecs::MAX_BATCH;
use wgpu::util::DeviceExt;

use crate::arena::{GpuMatrix, kernel_codec};
use crate::{GpuContext, GpuError};

/// What output buffers are filled with before a test dispatch, so a row a kernel skips shows.
pub const POISON: f32 = 7.7e30;

/// Most token rows of one matmat: frames longer than [`MAX_BATCH`] (a prompt's prefill) run in
/// tiles of [`MAX_BATCH`] rows, so they must be a multiple of it. (A frame of 512 rows gives a
/// layer's routed experts about ten slots each at the release geometry: each expert's weights
/// are read once for twice the rows of a frame of 256.)
pub const MAX_FRAME_ROWS: usize = 512;

/// How a matvec kernel is specialised for a device and a matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// The reduction variant.
    pub reduce: Reduce,
    /// Lanes per workgroup.
    pub wg: u32,
    /// Lanes per row group.
    pub lanes: u32,
    /// Rows per row group (each activation load serves this many rows).
    pub rows: u32,
    /// The activation path asked for (a codec or device without it runs the f32 path:
    /// [`Plan::effective_path`]).
    pub path: Path,
}

impl Plan {
    /// The subgroup variant where the adapter reports one fixed subgroup size of at most 128
    /// (a row group is then exactly one subgroup), else shared memory with 64 lanes per row.
    /// Tall matrices take 4 rows per row group (fewer activation loads per weight byte), short
    /// ones 1 (more row groups in flight to fill the device).
    pub fn for_matrix(ctx: &GpuContext, rows: usize) -> Plan {
        let (lo, hi) = ctx.caps.subgroup_sizes;
        let rows_per_group = if rows >= 16384 {
            4
        } else if rows >= 4096 {
            2
        } else {
            1
        };
        if ctx.caps.subgroups && lo == hi && hi.is_power_of_two() && (4..=128).contains(&hi) {
            Plan {
                reduce: Reduce::Subgroup,
                wg: hi.max(64),
                lanes: hi,
                rows: rows_per_group,
                path: Path::F32,
            }
        } else {
            Plan {
                reduce: Reduce::SharedMemory,
                wg: 128,
                lanes: 64,
                rows: rows_per_group,
                path: Path::F32,
            }
        }
    }

    /// [`Plan::for_matrix`], with each row split across more lanes (up to a workgroup of 256,
    /// reduced through workgroup memory) while the matrix has too few rows to keep the device's
    /// lanes busy and each lane would still walk a few 16-column chunks
    /// ([`crate::MatvecSplit`]): a 320-row hyper-connection matrix of 10240 columns gets 128
    /// lanes a row instead of one subgroup, so its 20 KB rows are not each read by a single
    /// subgroup's dependent loads.
    pub fn for_shape(ctx: &GpuContext, rows: usize, cols: usize) -> Plan {
        // Lanes in flight that hide the memory latency of a large GPU (an H200 runs 270k).
        let split = ctx.matvec_split;
        let base = Plan::for_matrix(ctx, rows);
        let groups = rows.div_ceil(base.rows as usize);
        let chunks = cols / 16;
        let mut lanes = base.lanes;
        while lanes < 256
            && groups * 2 * lanes as usize <= split.target_lanes
            && chunks >= split.min_chunks * 2 * lanes as usize
        {
            lanes *= 2;
        }
        if lanes == base.lanes {
            base
        } else {
            base.split(lanes)
        }
    }

    /// The same plan with `lanes` lanes per row group in a workgroup of `max(lanes, 64)`,
    /// reduced through workgroup memory (any power of two up to 256).
    pub fn split(self, lanes: u32) -> Plan {
        Plan {
            reduce: Reduce::SharedMemory,
            wg: lanes.max(64),
            lanes,
            ..self
        }
    }

    /// The same plan on another activation path.
    pub fn with_path(self, path: Path) -> Plan {
        Plan { path, ..self }
    }

    /// The fastest path this device has for `codec`: int8 activations for the quantised
    /// codecs, the hardware conversion for f16 where the device has it, f32 otherwise.
    pub fn fastest_path(ctx: &GpuContext, codec: Codec) -> Path {
        if Path::Int8.supports(codec) {
            Path::Int8
        } else if codec == Codec::F16 && ctx.caps.f16_in_f32 {
            Path::HwF16
        } else {
            Path::F32
        }
    }

    /// The path that runs for `codec` and `cols` columns on this device: the plan's, unless the
    /// codec lacks it (int8 for the float codecs, the hardware f16 for all but f16), the device
    /// lacks the f16 conversion, or the int8 path's 32-column blocks do not divide `cols`; then
    /// f32.
    pub fn effective_path(&self, ctx: &GpuContext, codec: Codec, cols: usize) -> Path {
        let ok = self.path.supports(codec)
            && match self.path {
                Path::F32 => true,
                Path::HwF16 => ctx.caps.f16_in_f32,
                Path::Int8 => cols.is_multiple_of(32),
            };
        if ok { self.path } else { Path::F32 }
    }

    /// The plan a kernel of `codec` and `nt` token rows runs under. mxfp4 on the int8 path
    /// reads its byte table from workgroup memory; where the table is copied per lane
    /// ([`Plan::lut_copies`]) it takes 16-32 KB of it, so the workgroup grows to keep warps
    /// resident per KB (H200, docs/perf.md: the 246724x8192 matvec at 32 copies ran at 34%,
    /// 56% and 68% of the read ceiling with 256, 512 and 1024 lanes; a grid that walks row
    /// groups so each workgroup fills the table once ran no faster, so the fill is not what
    /// costs). Other kernels: unchanged.
    pub fn for_codec(self, ctx: &GpuContext, codec: Codec, nt: usize, grouped: bool) -> Plan {
        if codec != Codec::Mxfp4 || self.path != Path::Int8 {
            return self;
        }
        let want = match (grouped, self.rows >= 4 && nt == 1) {
            (true, _) => 512,
            (false, true) => 1024,
            (false, false) => return self,
        };
        // The largest power of two the device allows per workgroup, up to 1024.
        let cap = ctx
            .limits
            .max_compute_invocations_per_workgroup
            .clamp(1, 1024);
        let cap = 1 << (31 - cap.leading_zeros());
        Plan {
            wg: self.wg.max(want.min(cap)),
            ..self
        }
    }

    /// Copies of mxfp4's int8 byte table for kernel `k` under this plan (see
    /// [`Plan::for_codec`]). Measured on the H200 against one copy (docs/perf.md, % of the
    /// read ceiling): tall matrices (4 rows per row group) at one token row 32 copies
    /// (246724x8192 51.7% -> 67.6%, 248320x2560 45.3% -> 49.0%); the grouped experts 16 (T=1
    /// 16.9% -> 19.5%, T=8 34.4% -> 36.8%); 8 token rows (at most 3% faster with copies, 10%
    /// only with a grid that walks row groups) and shorter matrices (10240x2560 29.2% ->
    /// 23.2%) keep one. Fewer where the device's workgroup memory is smaller.
    pub fn lut_copies(&self, ctx: &GpuContext, k: &Matvec) -> u32 {
        if !k.has_lut() {
            return 1;
        }
        let want = if k.grouped {
            16
        } else if self.rows >= 4 && k.nt == 1 {
            32
        } else {
            1
        };
        let limit = ctx.limits.max_compute_workgroup_storage_size;
        let mut copies = want;
        while copies > 1
            && (Matvec {
                lut_copies: copies,
                ..*k
            })
            .workgroup_bytes(self.wg)
                > limit
        {
            copies /= 2;
        }
        copies
    }

    /// The same plan with the shared-memory reduction (tests run both variants).
    pub fn shared_memory(self) -> Plan {
        Plan {
            reduce: Reduce::SharedMemory,
            wg: 128,
            lanes: 64,
            ..self
        }
    }

    /// The override constants of the pipeline.
    pub fn constants(&self) -> [(&'static str, f64); 2] {
        [("WG", self.wg as f64), ("LANES", self.lanes as f64)]
    }

    /// The kernel for `codec` and `nt` token rows under this plan.
    pub fn kernel(&self, codec: kernels_wgsl::Codec, nt: usize) -> Matvec {
        self.fused_kernel(codec, nt, Epilogue::None)
    }

    /// The kernel for `codec`, `nt` token rows and a fused `epilogue` under this plan (the
    /// gate/up pair always takes 2 rows per row group: a gate row and its up row).
    pub fn fused_kernel(
        &self,
        codec: kernels_wgsl::Codec,
        nt: usize,
        epilogue: Epilogue,
    ) -> Matvec {
        Matvec {
            codec,
            reduce: self.reduce,
            nt: nt as u32,
            rows: self.rows_for(epilogue),
            epilogue,
            path: self.path,
            grouped: false,
            segments: kernels_wgsl::Segments::One,
            lut_copies: 1,
        }
    }

    /// Matrix rows per row group for `epilogue` (the kernels built for it: silu takes 1 or 4,
    /// the gate/up pair 2, a gate row and its up row).
    pub fn rows_for(&self, epilogue: Epilogue) -> u32 {
        match epilogue {
            e if e.is_pair() => 2,
            Epilogue::Silu if self.rows == 2 => 1,
            _ => self.rows,
        }
    }
}

pub(crate) fn storage_entry(binding: u32, read_only: bool) -> wgpu::BindGroupLayoutEntry {
    wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Storage { read_only },
            has_dynamic_offset: false,
            min_binding_size: None,
        },
        count: None,
    }
}

pub(crate) fn uniform_entry(binding: u32) -> wgpu::BindGroupLayoutEntry {
    wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Uniform,
            has_dynamic_offset: false,
            min_binding_size: None,
        },
        count: None,
    }
}

pub(crate) fn entry(binding: u32, buffer: &wgpu::Buffer) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry {
        binding,
        resource: buffer.as_entire_binding(),
    }
}

/// `size` bytes of `buffer` from byte `offset` at `binding`.
pub(crate) fn slice_entry(
    binding: u32,
    buffer: &wgpu::Buffer,
    offset: u64,
    size: u64,
) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry {
        binding,
        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer,
            offset,
            size: std::num::NonZeroU64::new(size),
        }),
    }
}

/// A kernel's 12-word parameter uniform.
pub(crate) fn params_buffer(ctx: &GpuContext, label: &str, params: &[u32; 12]) -> wgpu::Buffer {
    ctx.device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents: bytemuck::cast_slice(params),
            usage: wgpu::BufferUsages::UNIFORM,
        })
}

/// An explicit bind group layout and its pipeline layout: explicit, because an automatic
/// layout drops bindings an entry point does not touch (the f16 kernel never reads binding 1),
/// and pipelines sharing a name and constants must share a layout.
pub(crate) fn bind_layout(
    ctx: &GpuContext,
    label: &str,
    entries: &[wgpu::BindGroupLayoutEntry],
) -> (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
    let bgl = ctx
        .device
        .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some(label),
            entries,
        });
    let pl = ctx
        .device
        .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(label),
            bind_group_layouts: &[Some(&bgl)],
            immediate_size: 0,
        });
    (bgl, pl)
}

/// A matvec layout: 0 and 1 the weights (chunks, words), 2 params, 3 activations (the int8
/// path's codes), 4 y; on the int8 path 5 the codes' block scales and sums; then `extra`
/// (binding, read-only).
pub(crate) fn matvec_layout(
    ctx: &GpuContext,
    label: &str,
    int8: bool,
    extra: &[(u32, bool)],
) -> (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
    let mut entries = vec![
        storage_entry(0, true),
        storage_entry(1, true),
        uniform_entry(2),
        storage_entry(3, true),
        storage_entry(4, false),
    ];
    if int8 {
        entries.push(storage_entry(5, true));
    }
    for &(binding, read_only) in extra {
        entries.push(storage_entry(binding, read_only));
    }
    bind_layout(ctx, label, &entries)
}

/// The f32 paths' layout.
pub(crate) fn layout(ctx: &GpuContext) -> (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
    matvec_layout(ctx, "matvec", false, &[])
}

/// The int8 path's layout.
pub(crate) fn i8_layout(ctx: &GpuContext) -> (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
    matvec_layout(ctx, "matvec_i8", true, &[])
}

/// [`layout`] or [`i8_layout`] with binding 7, the auxiliary buffer of the epilogues that
/// have one.
pub(crate) fn aux_layout(
    ctx: &GpuContext,
    int8: bool,
) -> (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
    matvec_layout(ctx, "matvec_aux", int8, &[(7, false)])
}

/// The pipeline for `m`'s codec, `nt` token rows, under `plan`.
pub fn pipeline(
    ctx: &GpuContext,
    m: &GpuMatrix,
    nt: usize,
    plan: Plan,
    epilogue: Epilogue,
) -> Result<Arc<wgpu::ComputePipeline>, GpuError> {
    let codec = kernel_codec(m.dtype).ok_or(GpuError::UnsupportedDtype { dtype: m.dtype })?;
    let plan = plan.with_path(plan.effective_path(ctx, codec, m.cols));
    codec_pipeline(ctx, codec, nt, plan, epilogue)
}

/// The pipeline for `codec`, `nt` token rows and `epilogue` under `plan` (its path as given),
/// with the path's bind-group layout: the one every matvec dispatch (and `cortiq doctor`'s
/// report) uses.
pub fn codec_pipeline(
    ctx: &GpuContext,
    codec: kernels_wgsl::Codec,
    nt: usize,
    plan: Plan,
    epilogue: Epilogue,
) -> Result<Arc<wgpu::ComputePipeline>, GpuError> {
    let plan = plan.for_codec(ctx, codec, nt, false);
    let mut k = plan.fused_kernel(codec, nt, epilogue);
    k.lut_copies = plan.lut_copies(ctx, &k);
    let int8 = plan.path == Path::Int8;
    let (_, pl) = if epilogue.folds_norm() {
        ctx.norm_layout()
    } else if epilogue.has_aux() {
        ctx.aux_layout(int8)
    } else if int8 {
        ctx.i8_layout()
    } else {
        ctx.matvec_layout()
    };
    ctx.pipelines.get(
        &ctx.device,
        &k.name(),
        &|| k.source(),
        Matvec::ENTRY,
        &plan.constants(),
        Some(pl),
    )
}

/// One pipeline's dispatches: a bind group and grid each.
pub struct Step {
    pipe: Arc<wgpu::ComputePipeline>,
    groups: Vec<(wgpu::BindGroup, u32, u32)>,
    /// The grid's z: tiles of [`MAX_BATCH`] token rows (1 unless a frame is longer).
    tiles: u32,
    label: String,
}

impl Step {
    /// `label` names the kernel and its shape in a per-dispatch profile.
    pub(crate) fn new(
        pipe: Arc<wgpu::ComputePipeline>,
        groups: Vec<(wgpu::BindGroup, u32, u32)>,
        label: String,
    ) -> Step {
        Step {
            pipe,
            groups,
            tiles: 1,
            label,
        }
    }

    /// The same dispatches over `tiles` tiles of token rows (the grid's z).
    pub(crate) fn with_tiles(self, tiles: u32) -> Step {
        Step { tiles, ..self }
    }

    /// The kernel and shape this step runs.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Records the dispatches into an open compute pass.
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>) {
        pass.set_pipeline(&self.pipe);
        for (bg, gx, gy) in &self.groups {
            pass.set_bind_group(0, bg, &[]);
            pass.dispatch_workgroups(*gx, *gy, self.tiles);
        }
    }
}

/// A matmat ready to record: on the int8 path the activation quantiser, then the matvec with
/// one bind group per part of the matrix.
pub struct Prepared {
    steps: Vec<Step>,
    /// How many of `steps` quantise the activations (they come first).
    quant: usize,
    /// The path that runs.
    pub path: Path,
}

impl Prepared {
    /// Records the dispatches into an open compute pass (wgpu orders them: the quantiser's
    /// writes are visible to the matvec).
    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>) {
        for s in &self.steps {
            s.record(pass);
        }
    }

    /// Records only the matvec, every step of it (a split tiled matmat's reduce too), the
    /// activations already quantised by an earlier recording: what a forward sharing one
    /// quantised input among several matrices does.
    pub fn record_matvec(&self, pass: &mut wgpu::ComputePass<'_>) {
        for s in &self.steps[self.quant..] {
            s.record(pass);
        }
    }

    /// `steps`, of which the first `quant` quantise the activations.
    pub(crate) fn from_steps(steps: Vec<Step>, quant: usize, path: Path) -> Prepared {
        Prepared { steps, quant, path }
    }

    /// The steps, in order (what a [`crate::ops::graph::Graph`] keeps).
    pub fn into_steps(self) -> Vec<Step> {
        self.steps
    }

    /// Dispatches per recording.
    pub fn dispatches(&self) -> usize {
        self.steps.iter().map(|s| s.groups.len()).sum()
    }
}

/// Builds the pipeline and bind groups of `y = W x` for `nt` token rows: `x` holds `[nt, cols]`
/// f32, `y` receives `[nt, rows]` f32.
pub fn prepare(
    ctx: &GpuContext,
    m: &GpuMatrix,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    nt: usize,
    plan: Plan,
) -> Result<Prepared, GpuError> {
    prepare_fused(ctx, m, x, y, nt, plan, Epilogue::None)
}

/// Rows of the output of `m` under `epilogue`: the gate/up pair writes one row per pair.
pub fn out_rows(m: &GpuMatrix, epilogue: Epilogue) -> usize {
    match epilogue {
        e if e.is_pair() => m.rows / 2,
        _ => m.rows,
    }
}

/// [`prepare`] with a fused epilogue: `y = silu(W x)`, or for a `[gate; up]` matrix of
/// `2 * half` rows, `y = silu(gate x) * (up x)` (`[nt, half]`).
pub fn prepare_fused(
    ctx: &GpuContext,
    m: &GpuMatrix,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    nt: usize,
    plan: Plan,
    epilogue: Epilogue,
) -> Result<Prepared, GpuError> {
    prepare_inner(ctx, m, x, y, nt, plan, epilogue, None, None, None)
}

/// The hyper-connection epilogues' second buffer and the site's stream count H (for
/// [`Epilogue::MoeOut`]: the routed slots' buffer and the slots a token row, K).
#[derive(Clone, Copy)]
pub struct Aux<'a> {
    /// [`Epilogue::HcFront`]: receives the injection weights `[nt, H]`;
    /// [`Epilogue::HcReadout`]: holds the normalised streams `[nt, H * D]`;
    /// [`Epilogue::MoeOut`]: holds the slots' outputs `[nt K, rows]`, their weights `[nt, K]`
    /// and the gates `[nt]` ([`moe_out_offsets`]).
    pub buffer: &'a wgpu::Buffer,
    /// H (K).
    pub streams: usize,
    /// The folded norm's buffers ([`Epilogue::HcFrontNorm`], [`Epilogue::HcReadoutNorm`]).
    pub norm: Option<FoldedNorm<'a>>,
}

/// A hyper-connection site's norm folded into its front and read-out
/// ([`Epilogue::HcFrontNorm`], [`Epilogue::HcReadoutNorm`]; the streams, raw, are the front's
/// `x` and the read-out's auxiliary buffer).
#[derive(Clone, Copy)]
pub struct FoldedNorm<'a> {
    /// The block output not yet injected `[nt, D]` and its injection weights `[nt, H]`, or
    /// none (the streams are up to date).
    pub pending: Option<(&'a wgpu::Buffer, &'a wgpu::Buffer)>,
    /// The norm's weight `[H * D]`, applied as `1 + w`.
    pub weight: &'a wgpu::Buffer,
    /// Each token row's streams' `1 / rms` `[nt, H]`: the front writes it, the read-out reads it.
    pub rstd: &'a wgpu::Buffer,
    /// The norm's epsilon.
    pub eps: f32,
}

/// Whether the device takes the folded norm's epilogues: nine storage buffers in one dispatch.
pub fn folds_norm(ctx: &GpuContext) -> bool {
    ctx.limits.max_storage_buffers_per_shader_stage >= 9
}

/// The folded norm's layout: [`layout`] with 5 the pending block output, 6 the norm's weight,
/// 7 the auxiliary buffer, 8 the pending injection weights, 9 the `1 / rms`.
pub(crate) fn norm_layout(ctx: &GpuContext) -> (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
    let extra = [(5, true), (6, true), (7, false), (8, true), (9, false)];
    matvec_layout(ctx, "matvec_hcnorm", false, &extra)
}

/// Where [`Epilogue::MoeOut`]'s slot weights and gates start in its auxiliary buffer (floats),
/// for a frame of `nt` token rows of `k` slots each of `d` outputs: right after the slots'
/// outputs, then after the weights.
pub fn moe_out_offsets(nt: usize, k: usize, d: usize) -> (usize, usize) {
    let weights = nt * k * d;
    (weights, weights + nt * k)
}

/// [`prepare_fused`] with a hyper-connection epilogue ([`Epilogue::HcFront`]: `y` receives
/// the low-rank activations `[nt, rows - H]`; [`Epilogue::HcReadout`]: `m`'s rows interleaved
/// by stream, `y` receives `[nt, rows / H]`, each row group holding one column's H rows).
/// `acts`: pre-quantised activations on the int8 path, as [`prepare_with_acts`].
#[allow(clippy::too_many_arguments)]
pub fn prepare_aux(
    ctx: &GpuContext,
    m: &GpuMatrix,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    aux: Aux<'_>,
    nt: usize,
    plan: Plan,
    epilogue: Epilogue,
) -> Result<Prepared, GpuError> {
    prepare_inner(ctx, m, x, y, nt, plan, epilogue, None, Some(aux), None)
}

/// A two-matrix epilogue ([`Epilogue::GateUpTwo`], [`Epilogue::PairTwo`]) over `m`, the two
/// matrices' rows uploaded as one. `acts`: the two members of a shared quantiser (the first
/// matrix's then the second's, each quantised with its own column scales: q8_2f on the int8
/// path); without them both halves read the same activations (codecs without column scales).
/// `aux` receives the second half for [`Epilogue::PairTwo`].
#[allow(clippy::too_many_arguments)]
pub fn prepare_two(
    ctx: &GpuContext,
    m: &GpuMatrix,
    x: &wgpu::Buffer,
    acts: Option<[&crate::ops::act8::ActBuffers; 2]>,
    y: &wgpu::Buffer,
    aux: Option<&wgpu::Buffer>,
    nt: usize,
    plan: Plan,
    epilogue: Epilogue,
) -> Result<Prepared, GpuError> {
    let aux = aux.map(|buffer| Aux {
        buffer,
        streams: 0,
        norm: None,
    });
    let (plan, first, second) = match acts {
        Some([a, b]) => (plan.with_path(Path::Int8), Some(a), Some(b)),
        None => (plan, None, None),
    };
    prepare_inner(ctx, m, x, y, nt, plan, epilogue, first, aux, second)
}

/// [`prepare_fused`] on the int8 path with activations a shared quantiser has written
/// (`act8::prepare_shared`): no quantiser step of its own. `x` is what they were quantised
/// from (checked for size only).
#[allow(clippy::too_many_arguments)]
pub fn prepare_with_acts(
    ctx: &GpuContext,
    m: &GpuMatrix,
    x: &wgpu::Buffer,
    acts: &crate::ops::act8::ActBuffers,
    y: &wgpu::Buffer,
    nt: usize,
    plan: Plan,
    epilogue: Epilogue,
) -> Result<Prepared, GpuError> {
    if acts.nt != nt || acts.cols != m.cols {
        return Err(GpuError::BadLength {
            what: "pre-quantised activations (token rows x columns)",
            expected: nt * m.cols,
            found: acts.nt * acts.cols,
        });
    }
    prepare_inner(
        ctx,
        m,
        x,
        y,
        nt,
        plan.with_path(Path::Int8),
        epilogue,
        Some(acts),
        None,
        None,
    )
}

#[allow(clippy::too_many_arguments)]
fn prepare_inner(
    ctx: &GpuContext,
    m: &GpuMatrix,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    nt: usize,
    plan: Plan,
    epilogue: Epilogue,
    pre: Option<&crate::ops::act8::ActBuffers>,
    aux: Option<Aux<'_>>,
    second: Option<&crate::ops::act8::ActBuffers>,
) -> Result<Prepared, GpuError> {
    let pair = epilogue.is_pair();
    let plan = check_aux(m, nt, plan, epilogue, aux)?;
    if pair && (!m.rows.is_multiple_of(2) || m.parts.len() != 1) {
        return Err(GpuError::UnsupportedFusion {
            epilogue: epilogue.suffix(),
            reason: format!(
                "needs an even row count in one binding; the matrix has {} rows in {} part(s)",
                m.rows,
                m.parts.len()
            ),
        });
    }
    let y_rows = match (epilogue, aux) {
        (Epilogue::HcFront | Epilogue::HcFrontNorm, Some(a)) => m.rows - a.streams,
        (Epilogue::HcReadout | Epilogue::HcReadoutNorm, Some(a)) => m.rows / a.streams,
        _ => out_rows(m, epilogue),
    };
    if nt == 0 || (nt > MAX_BATCH && !nt.is_multiple_of(MAX_BATCH)) || nt > MAX_FRAME_ROWS {
        return Err(GpuError::BadLength {
            what: "token rows (1..=8, or a multiple of 8 up to 512)",
            expected: MAX_BATCH,
            found: nt,
        });
    }
    // A longer frame runs the 8-row kernel on each tile of 8 rows (the grid's z).
    let (tiles, nt_kernel) = if nt > MAX_BATCH {
        (nt / MAX_BATCH, MAX_BATCH)
    } else {
        (1, nt)
    };
    let need_x = (nt * m.cols * 4) as u64;
    let need_y = (nt * y_rows * 4) as u64;
    if x.size() < need_x {
        return Err(GpuError::BadLength {
            what: "x buffer bytes",
            expected: need_x as usize,
            found: x.size() as usize,
        });
    }
    if y.size() < need_y {
        return Err(GpuError::BadLength {
            what: "y buffer bytes",
            expected: need_y as usize,
            found: y.size() as usize,
        });
    }
    let codec = kernel_codec(m.dtype).ok_or(GpuError::UnsupportedDtype { dtype: m.dtype })?;
    let plan = plan
        .with_path(plan.effective_path(ctx, codec, m.cols))
        .for_codec(ctx, codec, nt_kernel, false);
    let mut steps = Vec::new();
    let acts = match (plan.path, codec.act_layout()) {
        (Path::Int8, Some(layout)) if pre.is_some_and(|p| p.layout == layout) => pre.cloned(),
        (Path::Int8, Some(layout)) => {
            let acts = crate::ops::act8::ActBuffers::new(ctx, nt, m.cols, layout)?;
            let first = &m.parts[0];
            let col_scales =
                (codec == Codec::Q8_2f).then_some((&first.buffer, first.layout.third as u64));
            steps.push(crate::ops::act8::prepare(ctx, x, &acts, col_scales)?);
            Some(acts)
        }
        _ => None,
    };
    // The second member's distance in code blocks and block pairs (two-matrix epilogues).
    let members = match (epilogue.has_members(), acts.as_ref(), second) {
        (true, Some(a), Some(b)) if b.xq_offset >= a.xq_offset && b.xd_offset >= a.xd_offset => {
            Some((
                (b.xq_offset - a.xq_offset) / 32,
                (b.xd_offset - a.xd_offset) / 8,
            ))
        }
        // Without column scales both halves read the same activations.
        (true, _, None) if codec != Codec::Q8_2f => Some((0, 0)),
        (true, ..) => {
            return Err(GpuError::UnsupportedFusion {
                epilogue: epilogue.suffix(),
                reason: "q8_2f's two matrices need a shared quantiser's two members (int8 path)"
                    .into(),
            });
        }
        (false, ..) => None,
    };
    let streams = aux.map(|a| a.streams);
    let moe_out = aux
        .filter(|_| epilogue == Epilogue::MoeOut)
        .map(|a| moe_out_offsets(nt, a.streams, m.rows));
    let norm = aux.and_then(|a| a.norm);
    if crate::ops::tiled::applies(ctx, m, codec, plan.path, nt, epilogue, streams) {
        let tiled = crate::ops::tiled::Operands {
            x,
            acts: acts.as_ref(),
            y,
            aux,
        };
        let quant = steps.len();
        steps.extend(crate::ops::tiled::prepare(
            ctx, m, tiled, nt, plan.path, epilogue, y_rows,
        )?);
        return Ok(Prepared::from_steps(steps, quant, plan.path));
    }
    if epilogue.folds_norm() && (!codec.is_float() || plan.path == Path::Int8) {
        return Err(GpuError::UnsupportedFusion {
            epilogue: epilogue.suffix(),
            reason: format!("a float codec on an f32 path; {codec:?} on {:?}", plan.path),
        });
    }
    let pipe = codec_pipeline(ctx, codec, nt_kernel, plan, epilogue)?;
    let (bgl, _) = if epilogue.folds_norm() {
        ctx.norm_layout()
    } else if aux.is_some() {
        ctx.aux_layout(acts.is_some())
    } else if acts.is_some() {
        ctx.i8_layout()
    } else {
        ctx.matvec_layout()
    };
    // Output rows per row group: the pair's two matrix rows make one output row.
    let rows_per_group = if pair { 1 } else { plan.rows_for(epilogue) };
    let rows_per_wg = (plan.wg / plan.lanes * rows_per_group) as usize;
    let max_dim = ctx.limits.max_compute_workgroups_per_dimension as usize;
    let mut groups = Vec::with_capacity(m.parts.len());
    for part in &m.parts {
        let n = if pair { part.rows / 2 } else { part.rows }.div_ceil(rows_per_wg);
        let wg_x = n.min(max_dim);
        let wg_y = n.div_ceil(wg_x);
        let l = &part.layout;
        let params: [u32; 12] = [
            part.rows as u32,
            m.cols as u32,
            part.row_start as u32,
            y_rows as u32,
            l.second as u32,
            l.third as u32,
            l.code_stride as u32,
            wg_x as u32,
            match (epilogue, aux) {
                (Epilogue::HcFront | Epilogue::HcFrontNorm, Some(a)) => {
                    (part.rows - a.streams) as u32
                }
                (Epilogue::MoeOut, Some(a)) => a.streams as u32,
                _ => (part.rows / 2) as u32,
            },
            // The folded norm: whether a block output is pending, and the norm's epsilon.
            match norm {
                Some(n) => u32::from(n.pending.is_some()),
                None => moe_out.map_or(members.map_or(0, |m| m.0 as u32), |o| o.0 as u32),
            },
            match norm {
                Some(n) => n.eps.to_bits(),
                None => moe_out.map_or(members.map_or(0, |m| m.1 as u32), |o| o.1 as u32),
            },
            aux.map_or(0, |a| (a.streams as f32).to_bits()),
        ];
        let bufs = Bufs {
            x,
            y,
            acts: acts.as_ref(),
            second: second.filter(|_| members.is_some_and(|m| m != (0, 0))),
            ids: None,
            aux: aux.map(|a| a.buffer),
            norm,
        };
        let bg = bind_matvec(ctx, bgl, &part.buffer, &params, bufs);
        groups.push((bg, wg_x as u32, wg_y as u32));
    }
    let label = format!(
        "matvec {codec:?} {}x{} T{nt} {:?} {epilogue:?} l{}",
        m.rows, m.cols, plan.path, plan.lanes
    );
    let quant = steps.len();
    steps.push(Step::new(pipe, groups, label).with_tiles(tiles as u32));
    Ok(Prepared::from_steps(steps, quant, plan.path))
}

/// A matvec dispatch's buffers besides the weights: the activations (`x`, or the int8 codes
/// and block scales of `acts`), `y`, the grouped kernels' slot expert ids (binding 6) and the
/// hyper-connection epilogues' auxiliary buffer (binding 7).
pub(crate) struct Bufs<'a> {
    pub x: &'a wgpu::Buffer,
    pub y: &'a wgpu::Buffer,
    pub acts: Option<&'a crate::ops::act8::ActBuffers>,
    /// A second member after `acts` in the same buffers: the bindings cover both.
    pub second: Option<&'a crate::ops::act8::ActBuffers>,
    pub ids: Option<&'a wgpu::Buffer>,
    pub aux: Option<&'a wgpu::Buffer>,
    /// The folded norm's buffers (bindings 5, 6, 8, 9).
    pub norm: Option<FoldedNorm<'a>>,
}

/// Checks a hyper-connection epilogue's matrix and buffer, and returns the plan it runs under
/// (the read-out's row groups are exactly a column's H stream rows).
fn check_aux(
    m: &GpuMatrix,
    nt: usize,
    plan: Plan,
    epilogue: Epilogue,
    aux: Option<Aux<'_>>,
) -> Result<Plan, GpuError> {
    let name = match epilogue {
        Epilogue::HcFront => "hyper-connection front",
        Epilogue::HcReadout => "hyper-connection read-out",
        Epilogue::HcFrontNorm => "hyper-connection front with the norm",
        Epilogue::HcReadoutNorm => "hyper-connection read-out with the norm",
        Epilogue::PairTwo => "two-matrix pair",
        Epilogue::MoeOut => "MoE output",
        _ if aux.is_some() => {
            return Err(GpuError::UnsupportedFusion {
                epilogue: epilogue.suffix(),
                reason: "an auxiliary buffer for an epilogue that reads none".into(),
            });
        }
        _ => return Ok(plan),
    };
    let fail = |reason: String| {
        Err(GpuError::UnsupportedFusion {
            epilogue: name,
            reason,
        })
    };
    let Some(a) = aux else {
        return fail("needs its auxiliary buffer".into());
    };
    if m.parts.len() != 1 {
        return fail(format!(
            "needs the matrix in one binding; it has {} parts",
            m.parts.len()
        ));
    }
    let h = a.streams;
    if epilogue.folds_norm() != a.norm.is_some() {
        return fail("the folded norm's buffers go with its epilogues only".into());
    }
    // The folded norm: H streams of D columns, D a whole number of 8-column chunks (so no
    // chunk straddles two streams) in a vec4 accumulator's four components.
    let streams_of = |width: usize| {
        (1..=4).contains(&h) && width.is_multiple_of(h) && (width / h).is_multiple_of(8)
    };
    let (fits, floats) = match epilogue {
        Epilogue::PairTwo => (true, nt * (m.rows / 2)),
        Epilogue::HcFront => (h >= 1 && h < m.rows, nt * h),
        Epilogue::HcFrontNorm => (h < m.rows && streams_of(m.cols), nt * h),
        Epilogue::HcReadoutNorm => (streams_of(m.rows), nt * m.rows),
        Epilogue::MoeOut => (h >= 1, nt * h * m.rows + nt * h + nt),
        _ => (
            (1..=4).contains(&h) && m.rows.is_multiple_of(h),
            nt * m.rows,
        ),
    };
    if !fits {
        return fail(format!(
            "{h} streams do not fit a matrix of {} rows",
            m.rows
        ));
    }
    if a.buffer.size() < (floats * 4) as u64 {
        return Err(GpuError::BadLength {
            what: "auxiliary buffer bytes",
            expected: floats * 4,
            found: a.buffer.size() as usize,
        });
    }
    if let Some(n) = a.norm {
        let d = if epilogue == Epilogue::HcFrontNorm {
            m.cols / h
        } else {
            m.rows / h
        };
        let mut need = vec![
            ("norm weight bytes", n.weight, h * d),
            ("1 / rms bytes", n.rstd, nt * h),
        ];
        if let Some((blk, inj)) = n.pending {
            need.extend([
                ("pending block output bytes", blk, nt * d),
                ("pending injection weight bytes", inj, nt * h),
            ]);
        }
        for (what, b, floats) in need {
            if b.size() < (floats * 4) as u64 {
                return Err(GpuError::BadLength {
                    what,
                    expected: floats * 4,
                    found: b.size() as usize,
                });
            }
        }
    }
    Ok(match epilogue {
        Epilogue::HcReadout | Epilogue::HcReadoutNorm => Plan {
            rows: h as u32,
            ..plan
        },
        _ => plan,
    })
}

/// The bind group of a matvec dispatch: the weights (as chunks and as words), its parameter
/// uniform and `b`.
pub(crate) fn bind_matvec(
    ctx: &GpuContext,
    bgl: &wgpu::BindGroupLayout,
    weights: &wgpu::Buffer,
    params: &[u32; 12],
    b: Bufs<'_>,
) -> wgpu::BindGroup {
    let Bufs {
        x,
        y,
        acts,
        second,
        ids,
        aux,
        norm,
    } = b;
    // Bytes of the codes and pairs bound: through the second member's where there is one.
    let spans = acts.map(|a| match second {
        Some(b) => (
            b.xq_offset + b.xq_bytes() - a.xq_offset,
            b.xd_offset + b.xd_bytes() - a.xd_offset,
        ),
        None => (a.xq_bytes(), a.xd_bytes()),
    });
    let ubuf = params_buffer(ctx, "matvec params", params);
    let mut entries = vec![
        entry(0, weights),
        entry(1, weights),
        entry(2, &ubuf),
        match acts {
            Some(a) => slice_entry(3, &a.xq, a.xq_offset, spans.map_or(0, |s| s.0)),
            None => entry(3, x),
        },
        entry(4, y),
    ];
    if let Some(a) = acts {
        entries.push(slice_entry(5, &a.xd, a.xd_offset, spans.map_or(0, |s| s.1)));
    }
    if let Some(ids) = ids {
        entries.push(entry(6, ids));
    }
    if let Some(aux) = aux {
        entries.push(entry(7, aux));
    }
    if let Some(n) = norm {
        // Nothing pending: the weight stands in for the buffers not read.
        let (blk, inj) = n.pending.unwrap_or((n.weight, n.weight));
        entries.extend([
            entry(5, blk),
            entry(6, n.weight),
            entry(8, inj),
            entry(9, n.rstd),
        ]);
    }
    ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("matvec"),
        layout: bgl,
        entries: &entries,
    })
}

/// Encodes `y = W x` (see [`prepare`]) in a compute pass of its own.
pub fn encode(
    ctx: &GpuContext,
    enc: &mut wgpu::CommandEncoder,
    m: &GpuMatrix,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    nt: usize,
    plan: Plan,
) -> Result<(), GpuError> {
    let p = prepare(ctx, m, x, y, nt, plan)?;
    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
        label: Some("matvec"),
        timestamp_writes: None,
    });
    p.record(&mut pass);
    Ok(())
}

/// Uploads `xs` (`[nt, cols]`), runs the matmat, reads `[nt, rows]` back. Output rows are
/// poisoned first, so a kernel that skips a row cannot pass a comparison.
pub fn matmat(
    ctx: &GpuContext,
    m: &GpuMatrix,
    xs: &[f32],
    plan: Plan,
) -> Result<Vec<f32>, GpuError> {
    matmat_fused(ctx, m, xs, plan, Epilogue::None)
}

/// [`matmat`] with a fused epilogue (see [`prepare_fused`]); returns `[nt, out_rows]`.
pub fn matmat_fused(
    ctx: &GpuContext,
    m: &GpuMatrix,
    xs: &[f32],
    plan: Plan,
    epilogue: Epilogue,
) -> Result<Vec<f32>, GpuError> {
    let nt = xs.len() / m.cols.max(1);
    if nt * m.cols != xs.len() || nt == 0 {
        return Err(GpuError::BadLength {
            what: "x (a whole number of rows of cols values)",
            expected: m.cols,
            found: xs.len(),
        });
    }
    let rows = out_rows(m, epilogue);
    let x = ctx
        .device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("x"),
            contents: bytemuck::cast_slice(xs),
            usage: wgpu::BufferUsages::STORAGE,
        });
    let poison = vec![POISON; nt * rows];
    let y = ctx
        .device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("y"),
            contents: bytemuck::cast_slice(&poison),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        });
    let p = prepare_fused(ctx, m, &x, &y, nt, plan, epilogue)?;
    let mut enc = ctx
        .device
        .create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("matmat"),
        });
    {
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("matvec fused"),
            timestamp_writes: None,
        });
        p.record(&mut pass);
    }
    ctx.queue.submit([enc.finish()]);
    crate::readback::read_f32(ctx, &y, 0, nt * rows)
}

/// [`matmat_fused`] with a hyper-connection epilogue over `streams` streams: `aux_in` is the
/// auxiliary buffer's contents going in (the read-out's normalised streams; poison for the
/// front); returns `y` (`[nt, y_rows]`, poisoned first) and the auxiliary buffer after.
pub fn matmat_aux(
    ctx: &GpuContext,
    m: &GpuMatrix,
    xs: &[f32],
    aux_in: &[f32],
    streams: usize,
    plan: Plan,
    epilogue: Epilogue,
) -> Result<(Vec<f32>, Vec<f32>), GpuError> {
    let (ys, auxs, _) = run_aux(ctx, m, xs, aux_in, streams, None, plan, epilogue)?;
    Ok((ys, auxs))
}

/// What [`matmat_norm`] reads back: `y`, the auxiliary buffer, the `1 / rms` buffer.
pub type NormOutputs = (Vec<f32>, Vec<f32>, Vec<f32>);

/// A folded norm's inputs for [`matmat_norm`]: the pending block output and its injection
/// weights (or none), the norm's weight and epsilon, the `1 / rms` buffer going in.
pub struct NormInputs<'a> {
    /// `[nt, D]` and `[nt, H]`.
    pub pending: Option<(&'a [f32], &'a [f32])>,
    /// `[H * D]`.
    pub weight: &'a [f32],
    /// `[nt, H]` (poison for the front).
    pub rstd: &'a [f32],
    /// Epsilon.
    pub eps: f32,
}

/// [`matmat_aux`] with the norm folded in ([`Epilogue::HcFrontNorm`]: `xs` the raw streams,
/// `aux_in` poison for the injection weights; [`Epilogue::HcReadoutNorm`]: `xs` the low-rank
/// activations, `aux_in` the raw streams): returns `y`, the auxiliary buffer and the `1 / rms`
/// buffer after.
#[allow(clippy::too_many_arguments)]
pub fn matmat_norm(
    ctx: &GpuContext,
    m: &GpuMatrix,
    xs: &[f32],
    aux_in: &[f32],
    streams: usize,
    norm: NormInputs<'_>,
    plan: Plan,
    epilogue: Epilogue,
) -> Result<NormOutputs, GpuError> {
    run_aux(ctx, m, xs, aux_in, streams, Some(norm), plan, epilogue)
}

#[allow(clippy::too_many_arguments)]
fn run_aux(
    ctx: &GpuContext,
    m: &GpuMatrix,
    xs: &[f32],
    aux_in: &[f32],
    streams: usize,
    norm: Option<NormInputs<'_>>,
    plan: Plan,
    epilogue: Epilogue,
) -> Result<NormOutputs, GpuError> {
    let nt = xs.len() / m.cols.max(1);
    let y_rows = match epilogue {
        Epilogue::HcFront | Epilogue::HcFrontNorm => m.rows.saturating_sub(streams),
        Epilogue::MoeOut => m.rows,
        _ => m.rows / streams.max(1),
    };
    let init = |label: &str, data: &[f32]| {
        ctx.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents: bytemuck::cast_slice(data),
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            })
    };
    let x = init("x", xs);
    let y = init("y", &vec![POISON; (nt * y_rows).max(1)]);
    let a = init("aux", aux_in);
    let bufs = norm.as_ref().map(|n| {
        (
            n.pending.map(|(b, i)| (init("blk", b), init("inj", i))),
            init("norm weight", n.weight),
            init("rstd", n.rstd),
        )
    });
    let folded = match (&bufs, &norm) {
        (Some((pending, weight, rstd)), Some(n)) => Some(FoldedNorm {
            pending: pending.as_ref().map(|(b, i)| (b, i)),
            weight,
            rstd,
            eps: n.eps,
        }),
        _ => None,
    };
    let aux = Aux {
        buffer: &a,
        streams,
        norm: folded,
    };
    let p = prepare_aux(ctx, m, &x, &y, aux, nt, plan, epilogue)?;
    let mut enc = ctx
        .device
        .create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("matmat aux"),
        });
    {
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("matvec aux"),
            timestamp_writes: None,
        });
        p.record(&mut pass);
    }
    ctx.queue.submit([enc.finish()]);
    let ys = crate::readback::read_f32(ctx, &y, 0, nt * y_rows)?;
    let auxs = crate::readback::read_f32(ctx, &a, 0, aux_in.len())?;
    let rstd = match (&bufs, &norm) {
        (Some((_, _, r)), Some(n)) => crate::readback::read_f32(ctx, r, 0, n.rstd.len())?,
        _ => Vec::new(),
    };
    Ok((ys, auxs, rstd))
}

/// Which kernel ran in [`matmat_or_cpu`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ran {
    /// The GPU kernel.
    Gpu,
    /// The CPU kernel, and why the GPU one did not run.
    Cpu(String),
}

/// `ys = W xs` on the GPU when there is one and it takes this matrix, else with quant-codecs'
/// CPU kernel: a dtype or shape the kernels do not read, a matrix over the VRAM budget, or a
/// pipeline the driver rejects becomes a logged warning and the CPU result, never a failure.
/// `uid` and `name` key the matrix in the arena.
pub fn matmat_or_cpu(
    gpu: Option<(&GpuContext, &crate::WeightArena)>,
    uid: u64,
    name: &str,
    m: &quant_codecs::MatRef<'_>,
    xs: &[f32],
) -> Result<(Vec<f32>, Ran), quant_codecs::CodecError> {
    let nt = xs.len() / m.cols().max(1);
    let cpu = |why: String| -> Result<(Vec<f32>, Ran), quant_codecs::CodecError> {
        let mut ys = vec![0.0f32; nt * m.rows()];
        m.matmat(xs, &mut ys)?;
        Ok((ys, Ran::Cpu(why)))
    };
    let Some((ctx, arena)) = gpu else {
        return cpu("no GPU".into());
    };
    let gpu_result = arena
        .get_or_upload(ctx, uid, name, m)
        .and_then(|g| matmat(ctx, &g, xs, Plan::for_matrix(ctx, m.rows())));
    match gpu_result {
        Ok(ys) => Ok((ys, Ran::Gpu)),
        Err(GpuError::Codec(e)) => Err(e),
        // The CPU kernel reports a wrong activation length with its own error.
        Err(e @ GpuError::BadLength { .. }) => cpu(e.to_string()),
        Err(e) => {
            tracing::warn!("{name}: GPU matvec unavailable ({e}); running the CPU kernel");
            cpu(e.to_string())
        }
    }
}
