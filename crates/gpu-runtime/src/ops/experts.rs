//! The grouped-experts matvec: the routed experts of one MoE layer (one dtype and shape) as an
//! [`ExpertBank`], each expert's payload in a slot of `slot_bytes`, and one dispatch computing
//! every (token row, chosen expert) slot with the expert ids read on the device, so a frame
//! reads only the experts its rows chose and nothing crosses the bus to choose them.

use std::sync::Arc;

use kernels_wgsl::{Codec, Epilogue, Matvec, Path, Segments};
use quant_codecs::{DType, Layout, MatRef};

use crate::arena::kernel_codec;
use crate::ops::matvec::{Bufs, Plan, Prepared, Step, bind_matvec};
use crate::staging::StagingRing;
use crate::{GpuContext, GpuError};

/// Routed experts on the device (one layer's, or every layer's in a global bank): slot `s`'s
/// payload at byte `(s % segment_slots) * slot_bytes` of segment `s / segment_slots`. A bank
/// that fits one storage binding is one segment (bound once, as it always was); a larger one is
/// split into segments of at most one binding each, up to [`MAX_SEGMENTS`], bound as a binding
/// array where the adapter has them and as a fixed set of bindings where it does not.
#[derive(Debug)]
pub struct ExpertBank {
    /// The experts' dtype.
    pub dtype: DType,
    /// Rows of each expert matrix.
    pub rows: usize,
    /// Columns of each expert matrix.
    pub cols: usize,
    /// Slots.
    pub count: usize,
    /// Bytes per slot (the payload, padded to 16).
    pub slot_bytes: u64,
    /// One expert's section layout.
    pub layout: Layout,
    /// Slots per segment (the last may hold fewer).
    pub segment_slots: usize,
    /// The segments.
    pub segments: Vec<wgpu::Buffer>,
    /// Bind a segmented bank as a fixed set even where the adapter has binding arrays (to
    /// measure or test that path there; `CORTIQ_BANK_BINDING=fixed` sets it).
    pub fixed: bool,
}

/// Segments a bank may have: the grouped kernels bind 8 or 16 (seed-spec.md §5.4).
pub const MAX_SEGMENTS: usize = 16;

impl ExpertBank {
    /// Uploads `experts` (all of one dtype and shape) into a bank of as many slots, in one
    /// segment when it fits one storage binding.
    pub fn upload(ctx: &GpuContext, experts: &[MatRef<'_>]) -> Result<ExpertBank, GpuError> {
        let first = experts.first().ok_or(GpuError::BadLength {
            what: "experts in a bank",
            expected: 1,
            found: 0,
        })?;
        let bank = ExpertBank::empty(
            ctx,
            first.dtype(),
            first.rows(),
            first.cols(),
            experts.len(),
            None,
        )?;
        let mut ring = StagingRing::new(ctx);
        for (e, m) in experts.iter().enumerate() {
            bank.write(ctx, &mut ring, e, m)?;
        }
        ring.flush(ctx)?;
        Ok(bank)
    }

    /// The most slots a bank of `rows x cols` experts of `dtype` can have on `ctx`: as many
    /// segments as it binds ([`MAX_SEGMENTS`] with binding arrays, else what a fixed set of
    /// bindings leaves), each as many slots as one storage binding holds (a 2 GiB binding
    /// limit caps a bank of DeepSeek-V4-Flash's 8.9 MB FP4 gate/up matrices at 3,840 slots: 16 segments of 240).
    pub fn capacity(ctx: &GpuContext, dtype: DType, rows: usize, cols: usize) -> usize {
        let Ok(layout) = Layout::new(dtype, rows, cols) else {
            return 0;
        };
        let slot_bytes = (layout.nbytes as u64).next_multiple_of(16);
        let fit = (ctx.max_binding() / slot_bytes.max(1)) as usize;
        let bindings = ctx.limits.max_storage_buffers_per_shader_stage as usize;
        let segments = (1..=MAX_SEGMENTS)
            .rev()
            .find(|&n| {
                ctx.caps.binding_arrays
                    || n == 1
                    || Segments::bound(n).count() as usize + 4 <= bindings
            })
            .unwrap_or(1);
        fit * segments
    }

    /// A bank of `slots` slots for `rows x cols` experts of `dtype`, contents undefined:
    /// segments of `segment_slots` slots (tests force small ones), else of as many as one
    /// storage binding holds. More than [`MAX_SEGMENTS`] segments, or more storage bindings
    /// than the adapter has for a fixed set, is refused ([`GpuError::BindingTooLarge`]).
    pub fn empty(
        ctx: &GpuContext,
        dtype: DType,
        rows: usize,
        cols: usize,
        slots: usize,
        segment_slots: Option<usize>,
    ) -> Result<ExpertBank, GpuError> {
        let codec = kernel_codec(dtype).ok_or(GpuError::UnsupportedDtype { dtype })?;
        if !cols.is_multiple_of(codec.col_multiple()) {
            return Err(GpuError::UnsupportedShape {
                dtype,
                rows,
                cols,
                multiple: codec.col_multiple(),
            });
        }
        let layout = Layout::new(dtype, rows, cols)?;
        let slot_bytes = (layout.nbytes as u64).next_multiple_of(16);
        let too_large = |requested: u64| GpuError::BindingTooLarge {
            dtype,
            cols,
            requested,
            max: ctx.max_binding() * MAX_SEGMENTS as u64,
        };
        let fit = (ctx.max_binding() / slot_bytes) as usize;
        let per = segment_slots.unwrap_or(fit).min(fit).max(1);
        let slots = slots.max(1);
        let n = slots.div_ceil(per);
        let bindings = ctx.limits.max_storage_buffers_per_shader_stage as usize;
        // A fixed set binds every segment apart, beside x, y, the ids and the int8 scales.
        let fixed_ok = ctx.caps.binding_arrays
            || n == 1
            || Segments::bound(n).count() as usize + 4 <= bindings;
        if slot_bytes > u32::MAX as u64 || n > MAX_SEGMENTS || !fixed_ok {
            return Err(too_large(slot_bytes * slots as u64));
        }
        let segments = (0..n)
            .map(|i| {
                let here = per.min(slots - i * per);
                ctx.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("expert bank"),
                    size: slot_bytes * here as u64,
                    usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                })
            })
            .collect();
        Ok(ExpertBank {
            dtype,
            rows,
            cols,
            count: slots,
            slot_bytes,
            layout,
            segment_slots: per,
            segments,
            fixed: std::env::var("CORTIQ_BANK_BINDING").is_ok_and(|v| v == "fixed"),
        })
    }

    /// Where slot `slot` lives: its segment and the byte offset there.
    pub fn slot_at(&self, slot: usize) -> (&wgpu::Buffer, u64) {
        let seg = slot / self.segment_slots;
        let local = slot - seg * self.segment_slots;
        (&self.segments[seg], local as u64 * self.slot_bytes)
    }

    /// Uploads expert `m` into slot `slot` through `ring` (flushed by the caller).
    pub fn write(
        &self,
        ctx: &GpuContext,
        ring: &mut StagingRing,
        slot: usize,
        m: &MatRef<'_>,
    ) -> Result<(), GpuError> {
        if (m.dtype(), m.rows(), m.cols()) != (self.dtype, self.rows, self.cols) {
            return Err(GpuError::UnsupportedFusion {
                epilogue: "expert bank",
                reason: format!(
                    "experts differ: {:?} {}x{} and {:?} {}x{}",
                    self.dtype,
                    self.rows,
                    self.cols,
                    m.dtype(),
                    m.rows(),
                    m.cols()
                ),
            });
        }
        if slot >= self.count {
            return Err(GpuError::BadLength {
                what: "expert bank slot",
                expected: self.count,
                found: slot,
            });
        }
        let (buffer, at) = self.slot_at(slot);
        ring.upload(ctx, buffer, at, m.bytes())
    }

    /// Device bytes held.
    pub fn bytes(&self) -> u64 {
        self.segments.iter().map(wgpu::Buffer::size).sum()
    }

    /// How the grouped kernels bind this bank on `ctx`.
    pub fn binding(&self, ctx: &GpuContext) -> Segments {
        let n = self.segments.len();
        if n == 1 {
            return Segments::One;
        }
        match Segments::bound(n) {
            Segments::Fixed(k) if ctx.caps.binding_arrays && !self.fixed => Segments::Array(k),
            s => s,
        }
    }
}

/// The grouped kernels over a segmented bank: binding 2 params, 3 x (the int8 path's codes),
/// 4 y, 5 the int8 path's block scales, 6 the slots' ids; the segments at 8 (an array) or
/// 8.. (a fixed set).
pub(crate) fn segmented_layout(
    ctx: &GpuContext,
    int8: bool,
    segments: Segments,
) -> (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
    use crate::ops::matvec::{bind_layout, storage_entry, uniform_entry};
    // wgpu refuses a layout with both a binding array and a uniform buffer: beside the
    // array the parameters are a read-only storage buffer.
    let params = match segments {
        Segments::Array(_) => storage_entry(2, true),
        _ => uniform_entry(2),
    };
    let mut entries = vec![
        params,
        storage_entry(3, true),
        storage_entry(4, false),
        storage_entry(6, true),
    ];
    if int8 {
        entries.push(storage_entry(5, true));
    }
    match segments {
        Segments::Array(n) => {
            let mut e = storage_entry(8, true);
            e.count = std::num::NonZeroU32::new(n);
            entries.push(e);
        }
        s => entries.extend((0..s.count()).map(|i| storage_entry(8 + i, true))),
    }
    bind_layout(ctx, "grouped_segmented", &entries)
}

/// The grouped kernels' layouts: the matvec layouts plus binding 6, the slots' expert ids.
pub(crate) fn layout(
    ctx: &GpuContext,
    int8: bool,
) -> (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
    let label = if int8 { "grouped_i8" } else { "grouped" };
    crate::ops::matvec::matvec_layout(ctx, label, int8, &[(6, true)])
}

/// Builds `y[s] = W_{ids[s]} x[s / x_div]` (with `epilogue`) for `slots` slots: `x` holds
/// `x_rows` rows of `cols` f32, `ids` `slots` expert ids, `y` receives `[slots, out_rows]`.
/// On the int8 path the `x_rows` rows are quantised once by a step of their own; q8_2f, whose
/// column scales are folded into the activations per matrix, quantises each slot's row with
/// its expert's scales (`slots` rows).
#[allow(clippy::too_many_arguments)]
pub fn prepare_grouped(
    ctx: &GpuContext,
    bank: &ExpertBank,
    x: &wgpu::Buffer,
    x_rows: usize,
    ids: &wgpu::Buffer,
    y: &wgpu::Buffer,
    slots: usize,
    x_div: usize,
    plan: Plan,
    epilogue: Epilogue,
) -> Result<Prepared, GpuError> {
    let g = Grouped {
        x,
        x_rows,
        ids,
        y,
        slots,
        x_div,
        pre: None,
    };
    Ok(prepare_grouped_sorted(ctx, bank, g, plan, epilogue, None)?.0)
}

/// A grouped call's buffers and shape (see [`prepare_grouped`]).
pub(crate) struct Grouped<'a> {
    pub x: &'a wgpu::Buffer,
    pub x_rows: usize,
    pub ids: &'a wgpu::Buffer,
    pub y: &'a wgpu::Buffer,
    pub slots: usize,
    pub x_div: usize,
    /// `x` already quantised (a shared quantiser's member), used where the int8 path runs
    /// with one quantiser for all slots in this layout (not q8_2f's per-expert scales).
    pub pre: Option<&'a crate::ops::act8::ActBuffers>,
}

/// [`prepare_grouped`], reusing `sorted` where the frame runs expert by expert and it holds
/// these slots' table; with the table the expert-major kernel reads (none on the one-slot
/// kernels).
pub(crate) fn prepare_grouped_sorted(
    ctx: &GpuContext,
    bank: &ExpertBank,
    g: Grouped<'_>,
    plan: Plan,
    epilogue: Epilogue,
    sorted: Option<&crate::ops::experts_tiled::SortedSlots>,
) -> Result<(Prepared, Option<crate::ops::experts_tiled::SortedSlots>), GpuError> {
    let Grouped {
        x,
        x_rows,
        ids,
        y,
        slots,
        x_div,
        pre,
    } = g;
    // The activations quantised once for all slots: `pre` where it holds them in this
    // layout, else a quantiser step of this call's own.
    let quantised = |layout,
                     steps: &mut Vec<Step>|
     -> Result<crate::ops::act8::ActBuffers, GpuError> {
        if let Some(p) = pre.filter(|p| p.layout == layout && p.nt == x_rows && p.cols == bank.cols)
        {
            return Ok(p.clone());
        }
        let acts = crate::ops::act8::ActBuffers::new(ctx, x_rows, bank.cols, layout)?;
        steps.push(crate::ops::act8::prepare(ctx, x, &acts, None)?);
        Ok(acts)
    };
    let pair = epilogue == Epilogue::SiluGateUp;
    if pair && !bank.rows.is_multiple_of(2) {
        return Err(GpuError::UnsupportedFusion {
            epilogue: "silu gate/up",
            reason: format!("needs an even row count; the experts have {}", bank.rows),
        });
    }
    let codec = kernel_codec(bank.dtype).ok_or(GpuError::UnsupportedDtype { dtype: bank.dtype })?;
    let segments = bank.binding(ctx);
    let mut path = plan.effective_path(ctx, codec, bank.cols);
    // q8_2f's int8 path quantises each slot's activations with its expert's column scales,
    // read from a bank of one buffer: a segmented q8_2f bank runs the f32 path.
    if segments != Segments::One && codec == Codec::Q8_2f && path == Path::Int8 {
        path = Path::F32;
    }
    let mut plan = plan.with_path(path);
    if path == Path::Int8 {
        // An expert row at decode shapes is only 20-80 int8 blocks: with a subgroup per row
        // most lanes load one or two blocks, or none (the down projection's 640 columns).
        // Eight lanes per row, and four rows per row group for the plain (down) kernel,
        // measured best of the splits tried on the H200 (docs/perf.md, grouped experts: T=8
        // q4tp 36.7% -> 52.8% of the read ceiling); the float paths, whose rows are 2-4x
        // more bytes, keep the caller's plan (f16 T=8 72% either way, T=1 71% -> 48%).
        // A decode step's ten slots fill the device less: 16 lanes per gate/up row and two
        // rows per down row group measured best there (H200, 2026-12-03: T=1 q4tp 20.9% ->
        // 25.4% of the read ceiling, q2tp 12.6% -> 13.9%, mxfp4 19.3% -> 20.7%; 32 lanes or
        // one row were slower for all three). Lanes per row set the order a row's sum is
        // reduced in, so they must not depend on the slot count (a decode step and the same
        // token in a verify frame give the same bits: MTP's exactness); only rows per row
        // group, which changes no sum, does. q2tp keeps 8 gate/up lanes (16 cost its T=8
        // 32.3% -> 28.9% on 2026-12-02).
        let gl = if codec == Codec::Q2tp { 8 } else { 16 };
        let dr = if slots <= 16 { 2 } else { 4 };
        plan = plan.split(if pair { gl } else { 8 });
        plan.rows = if pair { plan.rows } else { dr };
    }
    let out_rows = if pair { bank.rows / 2 } else { bank.rows };
    let need = [
        ("x buffer bytes", x_rows * bank.cols * 4, x.size()),
        ("y buffer bytes", slots * out_rows * 4, y.size()),
        ("ids buffer bytes", slots * 4, ids.size()),
    ];
    for (what, expected, found) in need {
        if found < expected as u64 {
            return Err(GpuError::BadLength {
                what,
                expected,
                found: found as usize,
            });
        }
    }
    if slots == 0 || x_div == 0 || slots.div_ceil(x_div) > x_rows {
        return Err(GpuError::BadLength {
            what: "slots per activation row",
            expected: x_rows * x_div.max(1),
            found: slots,
        });
    }
    let int8 = path == Path::Int8;
    if crate::ops::experts_tiled::applies(ctx, bank, codec, path, segments, slots, epilogue)
        && let Some(layout) = codec.act_layout()
    {
        let mut steps = Vec::new();
        let acts = quantised(layout, &mut steps)?;
        let quant = steps.len();
        let (kernel, sorted) = crate::ops::experts_tiled::prepare(
            ctx, bank, codec, &acts, ids, y, slots, x_div, epilogue, sorted,
        )?;
        steps.extend(kernel);
        return Ok((Prepared::from_steps(steps, quant, path), Some(sorted)));
    }
    let plan = plan.for_codec(ctx, codec, 1, true);
    let mut k: Matvec = plan.fused_kernel(codec, 1, epilogue);
    k.grouped = true;
    k.segments = segments;
    k.lut_copies = plan.lut_copies(ctx, &k);
    let seg_layout;
    let (bgl, pl) = if segments != Segments::One {
        seg_layout = ctx.segmented_layout(int8, segments);
        (&seg_layout.0, &seg_layout.1)
    } else if int8 {
        let (a, b) = ctx.grouped_i8_layout();
        (a, b)
    } else {
        let (a, b) = ctx.grouped_layout();
        (a, b)
    };
    let pipe: Arc<wgpu::ComputePipeline> = ctx.pipelines.get(
        &ctx.device,
        &k.name(),
        &|| k.source(),
        Matvec::ENTRY,
        &plan.constants(),
        Some(pl),
    )?;
    let mut steps = Vec::new();
    let acts = match (int8, codec.act_layout()) {
        // q8_2f's column scales enter before quantising and differ per expert: each slot's
        // activations are quantised with its own expert's.
        (true, Some(layout)) if codec == Codec::Q8_2f => {
            let acts = crate::ops::act8::ActBuffers::new(ctx, slots, bank.cols, layout)?;
            steps.push(crate::ops::act8::prepare_grouped(
                ctx,
                x,
                &acts,
                &bank.segments[0],
                bank.layout.third as u64,
                bank.slot_bytes,
                ids,
                x_div,
            )?);
            Some(acts)
        }
        (true, Some(layout)) => Some(quantised(layout, &mut steps)?),
        _ => None,
    };
    let rows_per_group = if pair { 1 } else { plan.rows_for(epilogue) };
    let rows_per_wg = (plan.wg / plan.lanes * rows_per_group) as usize;
    let n = out_rows.div_ceil(rows_per_wg);
    let max_dim = ctx.limits.max_compute_workgroups_per_dimension as usize;
    if n > max_dim || slots > max_dim {
        return Err(GpuError::BadLength {
            what: "grouped workgroups per dimension",
            expected: max_dim,
            found: n.max(slots),
        });
    }
    let l = &bank.layout;
    let params: [u32; 12] = [
        bank.rows as u32,
        bank.cols as u32,
        0,
        out_rows as u32,
        l.second as u32,
        l.third as u32,
        l.code_stride as u32,
        n as u32,
        (bank.rows / 2) as u32,
        bank.slot_bytes as u32,
        x_div as u32,
        // The segmented kernels' slots per segment (P.a).
        bank.segment_slots as u32,
    ];
    let bufs = Bufs {
        x,
        y,
        acts: acts.as_ref(),
        second: None,
        ids: Some(ids),
        aux: None,
        norm: None,
    };
    let bg = if segments == Segments::One {
        bind_matvec(ctx, bgl, &bank.segments[0], &params, bufs)
    } else {
        bind_segmented(ctx, bgl, bank, segments, &params, bufs)
    };
    let label = format!(
        "grouped {codec:?} {}x{} slots {slots} {path:?} {epilogue:?}",
        bank.rows, bank.cols
    );
    let quant = steps.len();
    steps.push(Step::new(pipe, vec![(bg, n as u32, slots as u32)], label));
    Ok((Prepared::from_steps(steps, quant, path), None))
}

/// The bind group of a grouped kernel over a segmented bank ([`segmented_layout`]).
fn bind_segmented(
    ctx: &GpuContext,
    bgl: &wgpu::BindGroupLayout,
    bank: &ExpertBank,
    segments: Segments,
    params: &[u32; 12],
    b: Bufs<'_>,
) -> wgpu::BindGroup {
    use crate::ops::matvec::{entry, params_buffer, slice_entry};
    let ubuf = match segments {
        Segments::Array(_) => {
            use wgpu::util::DeviceExt;
            ctx.device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("grouped params"),
                    contents: bytemuck::cast_slice(params),
                    usage: wgpu::BufferUsages::STORAGE,
                })
        }
        _ => params_buffer(ctx, "grouped params", params),
    };
    let mut entries = vec![
        entry(2, &ubuf),
        match b.acts {
            Some(a) => slice_entry(3, &a.xq, a.xq_offset, a.xq_bytes()),
            None => entry(3, b.x),
        },
        entry(4, b.y),
    ];
    if let Some(a) = b.acts {
        entries.push(slice_entry(5, &a.xd, a.xd_offset, a.xd_bytes()));
    }
    if let Some(ids) = b.ids {
        entries.push(entry(6, ids));
    }
    // Bindings past the bank's segments repeat its first (the kernel never reads them).
    let seg = |i: usize| &bank.segments[if i < bank.segments.len() { i } else { 0 }];
    let array: Vec<wgpu::BufferBinding<'_>> = match segments {
        Segments::Array(n) => (0..n as usize)
            .map(|i| seg(i).as_entire_buffer_binding())
            .collect(),
        _ => Vec::new(),
    };
    match segments {
        Segments::Array(_) => entries.push(wgpu::BindGroupEntry {
            binding: 8,
            resource: wgpu::BindingResource::BufferArray(&array),
        }),
        s => entries.extend((0..s.count()).map(|i| entry(8 + i, seg(i as usize)))),
    }
    ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("grouped (segmented)"),
        layout: bgl,
        entries: &entries,
    })
}
