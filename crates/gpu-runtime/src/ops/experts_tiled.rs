//! The grouped experts of a long frame expert by expert (kernels-wgsl's [`GroupedTiled`]): a
//! one-workgroup sort puts the frame's slots in tiles of up to [`EXPERT_TILE`] slots of one
//! expert, and the kernel decodes each weight block of an expert once per tile instead of once
//! per slot. At 256 token rows (2,560 slots over 512 experts) the one-slot kernels read each
//! expert's weights about five times.
//!
//! A slot's sum has the one-slot kernel's terms added in block order, but not its lanes'
//! reduction order: a long frame's expert outputs differ from a frame of 8's in the last bits
//! (within the same f64 bound, tested). Frames shorter than [`MIN_SLOTS`] slots (decode steps,
//! verify windows) keep the one-slot kernels; `CORTIQ_MATMAT=plain` keeps them for every frame.

use kernels_wgsl::{Codec, EXPERT_TILE, Epilogue, GroupedTiled, MAX_TILED_EXPERTS, Path, Segments};

use crate::ops::act8::ActBuffers;
use crate::ops::experts::ExpertBank;
use crate::ops::matvec::{Step, entry, matvec_layout, params_buffer, slice_entry};
use crate::{GpuContext, GpuError};

/// Fewest slots that run expert by expert: a frame of 16 token rows at top-8 (the demo
/// model's frame of 64 at top-2).
pub const MIN_SLOTS: usize = 128;

/// The layout: the matvec int8 layout plus 6 the slots' expert ids, 7 the sorted slots, 8 the
/// tile table (the sort writes both; the kernel reads them).
pub(crate) fn layout(ctx: &GpuContext) -> (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
    matvec_layout(
        ctx,
        "grouped_tiled",
        true,
        &[(6, true), (7, false), (8, false)],
    )
}

/// Whether `slots` slots over `bank` (`codec` on activation path `path`, bound as `segments`)
/// run expert by expert.
pub fn applies(
    ctx: &GpuContext,
    bank: &ExpertBank,
    codec: Codec,
    path: Path,
    segments: Segments,
    slots: usize,
    epilogue: Epilogue,
) -> bool {
    let max_dim = ctx.limits.max_compute_workgroups_per_dimension as usize;
    ctx.tiled_matmat
        && path == Path::Int8
        && segments == Segments::One
        && GroupedTiled::supports(codec, epilogue)
        && slots >= MIN_SLOTS
        && bank.count <= MAX_TILED_EXPERTS as usize
        && max_tiles(slots, bank.count) <= max_dim
}

/// Entries of the tile table: enough for any routing (each expert's last tile may be partial).
fn max_tiles(slots: usize, experts: usize) -> usize {
    slots.div_ceil(EXPERT_TILE as usize) + slots.min(experts)
}

/// A frame's slots sorted by expert: what the sort writes and the kernel reads. A layer's
/// gate/up and down projections read the same ids, so the down projection reuses the gate/up's
/// table ([`crate::ops::graph::Graph`] passes it on when nothing ran in between).
#[derive(Debug, Clone)]
pub struct SortedSlots {
    ids: wgpu::Buffer,
    slots: usize,
    experts: usize,
    order: wgpu::Buffer,
    table: wgpu::Buffer,
}

impl SortedSlots {
    /// Whether this table sorts `slots` slots of `ids` over a bank of `experts` slots.
    fn serves(&self, ids: &wgpu::Buffer, slots: usize, experts: usize) -> bool {
        self.ids == *ids && self.slots == slots && self.experts == experts
    }
}

/// The sort (unless `sorted` already holds these slots' table) and the kernel for a frame
/// [`applies`] accepted (shapes and buffers checked, and the activations' quantiser prepared,
/// by the caller); with the table the kernel reads.
#[allow(clippy::too_many_arguments)]
pub(crate) fn prepare(
    ctx: &GpuContext,
    bank: &ExpertBank,
    codec: Codec,
    acts: &ActBuffers,
    ids: &wgpu::Buffer,
    y: &wgpu::Buffer,
    slots: usize,
    x_div: usize,
    epilogue: Epilogue,
    sorted: Option<&SortedSlots>,
) -> Result<(Vec<Step>, SortedSlots), GpuError> {
    let k = GroupedTiled { codec, epilogue };
    let pair = epilogue == Epilogue::SiluGateUp;
    let out_rows = if pair { bank.rows / 2 } else { bank.rows };
    let tiles = max_tiles(slots, bank.count);
    let (bgl, pl) = ctx.grouped_tiled_layout();
    let pipe = |entry_point: &str| {
        ctx.pipelines.get(
            &ctx.device,
            &k.name(),
            &|| k.source(),
            entry_point,
            &[],
            Some(pl),
        )
    };
    let l = &bank.layout;
    let params: [u32; 12] = [
        bank.rows as u32,
        bank.cols as u32,
        out_rows as u32,
        out_rows as u32,
        x_div as u32,
        bank.slot_bytes as u32,
        l.second as u32,
        l.third as u32,
        l.code_stride as u32,
        slots as u32,
        bank.count as u32,
        tiles as u32,
    ];
    let ubuf = params_buffer(ctx, "grouped tiled params", &params);
    let scratch = |label, bytes: usize| {
        ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes as u64,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        })
    };
    let reuse = sorted.filter(|t| t.serves(ids, slots, bank.count)).cloned();
    let sorted = match &reuse {
        Some(t) => t.clone(),
        None => SortedSlots {
            ids: ids.clone(),
            slots,
            experts: bank.count,
            order: scratch("expert-sorted slots", slots * 4),
            table: scratch("expert tiles", tiles * 16),
        },
    };
    let (order, table) = (&sorted.order, &sorted.table);
    let weights = &bank.segments[0];
    let bg = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("grouped tiled"),
        layout: bgl,
        entries: &[
            entry(0, weights),
            entry(1, weights),
            entry(2, &ubuf),
            slice_entry(3, &acts.xq, acts.xq_offset, acts.xq_bytes()),
            entry(4, y),
            slice_entry(5, &acts.xd, acts.xd_offset, acts.xd_bytes()),
            entry(6, ids),
            entry(7, order),
            entry(8, table),
        ],
    });
    let row_tiles = out_rows.div_ceil(k.rows_per_workgroup() as usize);
    let label = format!(
        "grouped tiled {codec:?} {}x{} slots {slots} {epilogue:?}",
        bank.rows, bank.cols
    );
    let mut steps = Vec::new();
    if reuse.is_none() {
        steps.push(Step::new(
            pipe(GroupedTiled::SORT_ENTRY)?,
            vec![(bg.clone(), 1, 1)],
            format!("{label} sort"),
        ));
    }
    steps.push(Step::new(
        pipe(GroupedTiled::ENTRY)?,
        vec![(bg, row_tiles as u32, tiles as u32)],
        label,
    ));
    Ok((steps, sorted))
}
