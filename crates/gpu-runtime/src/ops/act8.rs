//! Activations quantised to int8 on the device (kernels-wgsl's `act_quant`): the input of the
//! int8 matvec path, computed with the same integer rounding as `quant_codecs::act8`, so the
//! CPU reproduces the device's codes exactly (docs/codecs.md, "int8 activations").

use std::sync::Arc;

use kernels_wgsl::ActLayout;
use wgpu::util::DeviceExt;

use crate::ops::matvec::{
    Step, bind_layout, entry, params_buffer, slice_entry, storage_entry, uniform_entry,
};
use crate::{GpuContext, GpuError, GpuMatrix};

/// The device buffers of `nt` quantised activation rows of `cols` values: 8 code words per
/// block in `layout`'s order, and per block `(bits of d, code sum)` (at byte offsets of
/// larger buffers when one quantiser wrote several matrices' activations).
#[derive(Clone)]
pub struct ActBuffers {
    /// Codes, `[nt, cols / 32, 8]` u32 words.
    pub xq: wgpu::Buffer,
    /// Per block `(d bits, sum)`, `[nt, cols / 32]` pairs of u32.
    pub xd: wgpu::Buffer,
    /// Token rows.
    pub nt: usize,
    /// Activations per row (a multiple of 32).
    pub cols: usize,
    /// The codes' order.
    pub layout: ActLayout,
    /// Where these codes start in `xq`, in bytes.
    pub xq_offset: u64,
    /// Where these pairs start in `xd`, in bytes.
    pub xd_offset: u64,
}

impl ActBuffers {
    /// Bytes of the codes.
    pub fn xq_bytes(&self) -> u64 {
        (self.nt * self.cols) as u64
    }

    /// Bytes of the block pairs.
    pub fn xd_bytes(&self) -> u64 {
        (self.nt * self.cols / 32 * 8) as u64
    }
}

impl ActBuffers {
    /// Allocates the buffers (readable back, for tests).
    pub fn new(
        ctx: &GpuContext,
        nt: usize,
        cols: usize,
        layout: ActLayout,
    ) -> Result<ActBuffers, GpuError> {
        if cols == 0 || !cols.is_multiple_of(32) {
            return Err(GpuError::BadLength {
                what: "int8 activation columns (a multiple of 32)",
                expected: cols.next_multiple_of(32).max(32),
                found: cols,
            });
        }
        let blocks = (nt * cols / 32) as u64;
        let buf = |label, size| {
            ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            })
        };
        Ok(ActBuffers {
            xq: buf("act8 codes", blocks * 32),
            xd: buf("act8 scales", blocks * 8),
            nt,
            cols,
            layout,
            xq_offset: 0,
            xd_offset: 0,
        })
    }
}

/// The quantiser's bind group layout: 0 f32 activations, 1 column scales' buffer, 2 params,
/// 3 codes, 4 scales and sums.
pub(crate) fn layout(ctx: &GpuContext) -> (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
    bind_layout(
        ctx,
        "act_quant",
        &[
            storage_entry(0, true),
            storage_entry(1, true),
            uniform_entry(2),
            storage_entry(3, false),
            storage_entry(4, false),
        ],
    )
}

/// The grouped quantiser's layout: [`layout`]'s, and 5 the slots' expert ids.
pub(crate) fn grouped_layout(ctx: &GpuContext) -> (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
    bind_layout(
        ctx,
        "act_quant_grouped",
        &[
            storage_entry(0, true),
            storage_entry(1, true),
            uniform_entry(2),
            storage_entry(3, false),
            storage_entry(4, false),
            storage_entry(5, true),
        ],
    )
}

/// The grouped experts' q8_2f quantiser: slot `s` of `slots` quantises row `s / x_div` of `x`
/// (`[x_rows, cols]` f32), scaled by the column scales of its expert `ids[s]` (at
/// `ids[s] * slot_bytes + col_offset` bytes of `bank`), into code row `s` of `acts` (which
/// holds `slots` rows).
#[allow(clippy::too_many_arguments)]
pub fn prepare_grouped(
    ctx: &GpuContext,
    x: &wgpu::Buffer,
    acts: &ActBuffers,
    bank: &wgpu::Buffer,
    col_offset: u64,
    slot_bytes: u64,
    ids: &wgpu::Buffer,
    x_div: usize,
) -> Result<Step, GpuError> {
    let slots = acts.nt;
    let x_rows = slots.div_ceil(x_div.max(1));
    let need = (x_rows * acts.cols * 4) as u64;
    if x.size() < need {
        return Err(GpuError::BadLength {
            what: "x buffer bytes",
            expected: need as usize,
            found: x.size() as usize,
        });
    }
    let (bgl, pl) = ctx.act_quant_grouped_layout();
    let pipe = ctx.pipelines.get(
        &ctx.device,
        "act_quant",
        &kernels_wgsl::act_quant_source,
        kernels_wgsl::ACT_QUANT_GROUPED_ENTRY,
        &[],
        Some(pl),
    )?;
    let n = (slots * acts.cols / 32).div_ceil(kernels_wgsl::ACT_QUANT_BLOCKS as usize);
    let max_dim = ctx.limits.max_compute_workgroups_per_dimension as usize;
    let wg_x = n.min(max_dim);
    let wg_y = n.div_ceil(wg_x);
    let params: [u32; 12] = [
        acts.cols as u32,
        1,
        acts.layout as u32,
        col_offset as u32,
        wg_x as u32,
        0,
        0,
        0,
        slots as u32,
        x_div.max(1) as u32,
        slot_bytes as u32,
        acts.layout as u32,
    ];
    let ubuf = params_buffer(ctx, "act_quant_grouped params", &params);
    let bg = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("act_quant_grouped"),
        layout: bgl,
        entries: &[
            entry(0, x),
            entry(1, bank),
            entry(2, &ubuf),
            slice_entry(3, &acts.xq, acts.xq_offset, acts.xq_bytes()),
            slice_entry(4, &acts.xd, acts.xd_offset, acts.xd_bytes()),
            entry(5, ids),
        ],
    });
    let label = format!("act_quant grouped {} slots {slots}", acts.cols);
    Ok(Step::new(pipe, vec![(bg, wg_x as u32, wg_y as u32)], label))
}

fn pipeline(ctx: &GpuContext) -> Result<Arc<wgpu::ComputePipeline>, GpuError> {
    let (_, pl) = ctx.act_quant_layout();
    ctx.pipelines.get(
        &ctx.device,
        "act_quant",
        &kernels_wgsl::act_quant_source,
        kernels_wgsl::ACT_QUANT_ENTRY,
        &[],
        Some(pl),
    )
}

/// The dispatch that quantises `x` (`[acts.nt, acts.cols]` f32) into `acts`; for q8_2f,
/// `col_scales` is the payload buffer and the byte offset of its f16 column scales, which
/// multiply the activations first.
pub fn prepare(
    ctx: &GpuContext,
    x: &wgpu::Buffer,
    acts: &ActBuffers,
    col_scales: Option<(&wgpu::Buffer, u64)>,
) -> Result<Step, GpuError> {
    let need = (acts.nt * acts.cols * 4) as u64;
    if x.size() < need {
        return Err(GpuError::BadLength {
            what: "x buffer bytes",
            expected: need as usize,
            found: x.size() as usize,
        });
    }
    let col = col_scales.map(|(b, off)| (b, off as u32, 0u32));
    quantiser_step(ctx, x, acts, col, 1, [0, 0], acts.layout as u32)
}

/// The one dispatch quantising `x` for `members` q8_2f matrices of `cols` columns, each with
/// its own column scales: `table` holds them one after another (f16, `2 * cols` bytes each).
/// Returns the step and each member's activations (views of two shared buffers at
/// offsets the device's binding alignment allows).
pub fn prepare_shared(
    ctx: &GpuContext,
    x: &wgpu::Buffer,
    nt: usize,
    cols: usize,
    layout: ActLayout,
    table: &wgpu::Buffer,
    members: usize,
) -> Result<(Step, Vec<ActBuffers>), GpuError> {
    prepare_shared_layouts(ctx, x, nt, cols, &vec![layout; members], table, false)
}

/// [`prepare_shared`] with a layout per member: the first member's may differ from the
/// others', which must agree (the kernel's `mode0` and `mode`). With `first_unscaled` the
/// first member (a q4tp, q2tp or mxfp4 matrix: no column scales) is quantised as its own
/// quantiser would (its row of `table`, a placeholder of unit scales, is not read).
pub fn prepare_shared_layouts(
    ctx: &GpuContext,
    x: &wgpu::Buffer,
    nt: usize,
    cols: usize,
    layouts: &[ActLayout],
    table: &wgpu::Buffer,
    first_unscaled: bool,
) -> Result<(Step, Vec<ActBuffers>), GpuError> {
    let members = layouts.len();
    let (Some(&first), rest) = (layouts.first(), layouts.get(1..).unwrap_or(&[])) else {
        return Err(GpuError::BadLength {
            what: "shared quantiser members",
            expected: 1,
            found: 0,
        });
    };
    let layout = rest.first().copied().unwrap_or(first);
    if rest.iter().any(|&l| l != layout) {
        return Err(GpuError::UnsupportedFusion {
            epilogue: "shared quantiser",
            reason: format!("members after the first need one layout; they have {rest:?}"),
        });
    }
    let need = (nt * cols * 4) as u64;
    if x.size() < need {
        return Err(GpuError::BadLength {
            what: "x buffer bytes",
            expected: need as usize,
            found: x.size() as usize,
        });
    }
    let one = ActBuffers::new(ctx, nt, cols, layout)?;
    let align = u64::from(ctx.limits.min_storage_buffer_offset_alignment).max(4);
    let (qs, ds) = (
        one.xq_bytes().next_multiple_of(align),
        one.xd_bytes().next_multiple_of(align),
    );
    let buf = |label, size| {
        ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
    };
    let (xq, xd) = (
        buf("act8 codes (shared)", qs * members as u64),
        buf("act8 scales (shared)", ds * members as u64),
    );
    let all = ActBuffers {
        xq: xq.clone(),
        xd: xd.clone(),
        ..one
    };
    let strides = [(qs / 4) as u32, (ds / 8) as u32];
    let col = Some((table, 0u32, (2 * cols) as u32));
    let mode0 = first as u32 | if first_unscaled { 1 << 31 } else { 0 };
    let step = quantiser_step(ctx, x, &all, col, members, strides, mode0)?;
    let views = layouts
        .iter()
        .zip(0u64..)
        .map(|(&layout, m)| ActBuffers {
            xq_offset: m * qs,
            xd_offset: m * ds,
            layout,
            ..all.clone()
        })
        .collect();
    Ok((step, views))
}

/// The quantiser dispatch: `col` the column scales' buffer, byte offset and per-member stride;
/// `strides` the members' distance in code words and block pairs.
fn quantiser_step(
    ctx: &GpuContext,
    x: &wgpu::Buffer,
    acts: &ActBuffers,
    col: Option<(&wgpu::Buffer, u32, u32)>,
    members: usize,
    strides: [u32; 2],
    mode0: u32,
) -> Result<Step, GpuError> {
    let pipe = pipeline(ctx)?;
    // ACT_QUANT_BLOCKS blocks of the members' a workgroup.
    let n = (members * acts.nt * acts.cols / 32).div_ceil(kernels_wgsl::ACT_QUANT_BLOCKS as usize);
    let max_dim = ctx.limits.max_compute_workgroups_per_dimension as usize;
    let wg_x = n.min(max_dim);
    let wg_y = n.div_ceil(wg_x);
    let params: [u32; 12] = [
        acts.cols as u32,
        acts.nt as u32,
        acts.layout as u32,
        col.map_or(u32::MAX, |(_, off, _)| off),
        wg_x as u32,
        col.map_or(0, |(_, _, stride)| stride),
        strides[0],
        strides[1],
        members as u32,
        0,
        0,
        mode0,
    ];
    let ubuf = params_buffer(ctx, "act_quant params", &params);
    let (bgl, _) = ctx.act_quant_layout();
    let bg = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("act_quant"),
        layout: bgl,
        entries: &[
            entry(0, x),
            entry(1, col.map_or(x, |(b, _, _)| b)),
            entry(2, &ubuf),
            entry(3, &acts.xq),
            entry(4, &acts.xd),
        ],
    });
    let label = format!("act_quant {} T{} x{members}", acts.cols, acts.nt);
    Ok(Step::new(pipe, vec![(bg, wg_x as u32, wg_y as u32)], label))
}

/// Uploads `xs` (`[nt, cols]`), quantises it on the device and reads back the code words and
/// the per-block `(d bits, sum)` pairs (what the CPU's `act8` must reproduce).
pub fn quantize(
    ctx: &GpuContext,
    xs: &[f32],
    cols: usize,
    layout: ActLayout,
) -> Result<(Vec<u32>, Vec<[u32; 2]>), GpuError> {
    let nt = xs.len() / cols.max(1);
    if nt == 0 || nt * cols != xs.len() {
        return Err(GpuError::BadLength {
            what: "x (a whole number of rows of cols values)",
            expected: cols,
            found: xs.len(),
        });
    }
    let x = ctx
        .device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("x"),
            contents: bytemuck::cast_slice(xs),
            usage: wgpu::BufferUsages::STORAGE,
        });
    let acts = ActBuffers::new(ctx, nt, cols, layout)?;
    let step = prepare(ctx, &x, &acts, None)?;
    let mut enc = ctx.device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        step.record(&mut pass);
    }
    ctx.queue.submit([enc.finish()]);
    let blocks = nt * cols / 32;
    let q = crate::readback::read_f32(ctx, &acts.xq, 0, blocks * 8)?;
    let d = crate::readback::read_f32(ctx, &acts.xd, 0, blocks * 2)?;
    let q = q.iter().map(|v| v.to_bits()).collect();
    let d = d
        .chunks_exact(2)
        .map(|p| [p[0].to_bits(), p[1].to_bits()])
        .collect();
    Ok((q, d))
}

/// The column scales of q8_2f matrices `mats` (all of `cols` columns), one after another in a
/// new device buffer (copied on the device from their payloads): the table
/// [`prepare_shared`] reads. `None` where a matrix is not q8_2f, the widths differ, or a
/// payload's scales do not start on a 4-byte boundary (a buffer copy's granularity).
pub fn col_scale_table(ctx: &GpuContext, mats: &[&GpuMatrix]) -> Option<wgpu::Buffer> {
    let cols = mats.first()?.cols;
    let bytes = (2 * cols) as u64;
    let fits = |m: &&GpuMatrix| {
        m.dtype == quant_codecs::DType::Q8_2f
            && m.cols == cols
            && (m.parts[0].layout.third as u64).is_multiple_of(4)
            && bytes.is_multiple_of(4)
    };
    if !mats.iter().all(fits) {
        return None;
    }
    let table = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("q8_2f column scales (shared quantiser)"),
        size: bytes * mats.len() as u64,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut enc = ctx
        .device
        .create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("column scale table"),
        });
    for (i, m) in mats.iter().enumerate() {
        let p = &m.parts[0];
        enc.copy_buffer_to_buffer(
            &p.buffer,
            p.layout.third as u64,
            &table,
            i as u64 * bytes,
            bytes,
        );
    }
    ctx.queue.submit([enc.finish()]);
    Some(table)
}

/// [`col_scale_table`] from the host payloads of q8_2f matrices `mats` (all of one width):
/// for matrices that go up concatenated ([`quant_codecs::concat_rows`]), whose device payload
/// carries only the first one's column scales. `None` where one is not q8_2f, the widths
/// differ, or the scales are not whole words.
pub fn col_scale_table_host(
    ctx: &GpuContext,
    mats: &[&quant_codecs::MatRef<'_>],
) -> Option<wgpu::Buffer> {
    col_scale_table_host_units(ctx, 0, mats)
}

/// [`col_scale_table_host`] after `units` rows of f16 ones: placeholders for members without
/// column scales (a MoE block's routed experts quantised with its shared expert's two
/// matrices, [`prepare_shared_layouts`]).
pub fn col_scale_table_host_units(
    ctx: &GpuContext,
    units: usize,
    mats: &[&quant_codecs::MatRef<'_>],
) -> Option<wgpu::Buffer> {
    let cols = mats.first()?.cols();
    let fits = |m: &&quant_codecs::MatRef<'_>| {
        m.dtype() == quant_codecs::DType::Q8_2f && m.cols() == cols && cols.is_multiple_of(2)
    };
    if !mats.iter().all(fits) {
        return None;
    }
    let mut bytes = Vec::with_capacity(2 * cols * (units + mats.len()));
    for _ in 0..units * cols {
        // f16 1.0.
        bytes.extend_from_slice(&0x3c00u16.to_le_bytes());
    }
    for m in mats {
        bytes.extend_from_slice(&m.bytes()[m.layout().third..m.layout().third + 2 * cols]);
    }
    Some(
        ctx.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("q8_2f column scales (shared quantiser, from the host)"),
                contents: &bytes,
                usage: wgpu::BufferUsages::STORAGE,
            }),
    )
}
