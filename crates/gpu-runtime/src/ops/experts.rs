//! The grouped-experts matvec: the routed experts of one MoE layer (one dtype and shape) as an
//! [`ExpertBank`], each expert's payload in a slot of `slot_bytes`, and one dispatch computing
//! every (token row, chosen expert) slot with the expert ids read on the device, so a frame
//! reads only the experts its rows chose and nothing crosses the bus to choose them.

use std::sync::Arc;

use kernels_wgsl::{Codec, Epilogue, Matvec, Path};
use quant_codecs::{DType, Layout, MatRef};

use crate::arena::kernel_codec;
use crate::ops::matvec::{Bufs, Plan, Prepared, Step, bind_matvec};
use crate::staging::StagingRing;
use crate::{GpuContext, GpuError};

/// A layer's experts on the device: expert `e`'s payload at byte `e * slot_bytes` of one
/// buffer (one storage binding).
#[derive(Debug)]
pub struct ExpertBank {
    /// The experts' dtype.
    pub dtype: DType,
    /// Rows of each expert matrix.
    pub rows: usize,
    /// Columns of each expert matrix.
    pub cols: usize,
    /// Experts.
    pub count: usize,
    /// Bytes per slot (the payload, padded to 16).
    pub slot_bytes: u64,
    /// One expert's section layout.
    pub layout: Layout,
    /// The slots.
    pub buffer: wgpu::Buffer,
}

impl ExpertBank {
    /// Uploads `experts` (all of one dtype and shape) into one bank; a bank larger than one
    /// storage binding is refused ([`GpuError::BindingTooLarge`]).
    pub fn upload(ctx: &GpuContext, experts: &[MatRef<'_>]) -> Result<ExpertBank, GpuError> {
        let first = experts.first().ok_or(GpuError::BadLength {
            what: "experts in a bank",
            expected: 1,
            found: 0,
        })?;
        let (dtype, rows, cols) = (first.dtype(), first.rows(), first.cols());
        let codec = kernel_codec(dtype).ok_or(GpuError::UnsupportedDtype { dtype })?;
        if cols % codec.col_multiple() != 0 {
            return Err(GpuError::UnsupportedShape {
                dtype,
                rows,
                cols,
                multiple: codec.col_multiple(),
            });
        }
        for m in experts {
            if (m.dtype(), m.rows(), m.cols()) != (dtype, rows, cols) {
                return Err(GpuError::UnsupportedFusion {
                    epilogue: "expert bank",
                    reason: format!(
                        "experts differ: {:?} {}x{} and {:?} {}x{}",
                        dtype,
                        rows,
                        cols,
                        m.dtype(),
                        m.rows(),
                        m.cols()
                    ),
                });
            }
        }
        let layout = Layout::new(dtype, rows, cols)?;
        let slot_bytes = (layout.nbytes as u64).next_multiple_of(16);
        let size = slot_bytes * experts.len() as u64;
        if size > ctx.max_binding() || slot_bytes > u32::MAX as u64 {
            return Err(GpuError::BindingTooLarge {
                dtype,
                cols,
                requested: size,
                max: ctx.max_binding(),
            });
        }
        let buffer = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("expert bank"),
            size,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut ring = StagingRing::new(ctx);
        for (e, m) in experts.iter().enumerate() {
            ring.upload(ctx, &buffer, e as u64 * slot_bytes, m.bytes())?;
        }
        ring.flush(ctx)?;
        Ok(ExpertBank {
            dtype,
            rows,
            cols,
            count: experts.len(),
            slot_bytes,
            layout,
            buffer,
        })
    }

    /// Device bytes held.
    pub fn bytes(&self) -> u64 {
        self.buffer.size()
    }
}

/// The grouped kernels' layouts: the matvec layouts plus binding 6, the slots' expert ids.
pub(crate) fn layout(
    ctx: &GpuContext,
    int8: bool,
) -> (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
    let label = if int8 { "grouped_i8" } else { "grouped" };
    crate::ops::matvec::matvec_layout(ctx, label, int8, Some((6, true)))
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
    let pair = epilogue == Epilogue::SiluGateUp;
    if pair && !bank.rows.is_multiple_of(2) {
        return Err(GpuError::UnsupportedFusion {
            epilogue: "silu gate/up",
            reason: format!("needs an even row count; the experts have {}", bank.rows),
        });
    }
    let codec = kernel_codec(bank.dtype).ok_or(GpuError::UnsupportedDtype { dtype: bank.dtype })?;
    let path = plan.effective_path(ctx, codec, bank.cols);
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
    let plan = plan.for_codec(ctx, codec, 1, true);
    let mut k: Matvec = plan.fused_kernel(codec, 1, epilogue);
    k.grouped = true;
    k.lut_copies = plan.lut_copies(ctx, &k);
    let (bgl, pl) = if int8 {
        ctx.grouped_i8_layout()
    } else {
        ctx.grouped_layout()
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
                &bank.buffer,
                bank.layout.third as u64,
                bank.slot_bytes,
                ids,
                x_div,
            )?);
            Some(acts)
        }
        (true, Some(layout)) => {
            let acts = crate::ops::act8::ActBuffers::new(ctx, x_rows, bank.cols, layout)?;
            steps.push(crate::ops::act8::prepare(ctx, x, &acts, None)?);
            Some(acts)
        }
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
        0,
    ];
    let bufs = Bufs {
        x,
        y,
        acts: acts.as_ref(),
        second: None,
        ids: Some(ids),
        aux: None,
    };
    let bg = bind_matvec(ctx, bgl, &bank.buffer, &params, bufs);
    let label = format!(
        "grouped {codec:?} {}x{} slots {slots} {path:?} {epilogue:?}",
        bank.rows, bank.cols
    );
    steps.push(Step::new(pipe, vec![(bg, n as u32, slots as u32)], label));
    Ok(Prepared::from_steps(steps, path))
}
