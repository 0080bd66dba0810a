//! A recorded forward: the dispatches of one frame (matvecs and op kernels, with their
//! pipelines, parameter uniforms and bind groups built once) replayed into one compute pass per
//! token, so the steady-state decode loop creates no buffer and no bind group; and the taps a
//! traced run copies out between dispatches.

use std::sync::Arc;

use kernels_wgsl::{Epilogue, FRAME_WORDS, OP_STORAGE, OP_WG, Op, Path};
use wgpu::util::DeviceExt;

use crate::arena::GpuMatrix;
use crate::ops::matvec::{self, Plan, Step, bind_layout, entry, storage_entry, uniform_entry};
use crate::{GpuContext, GpuError};

/// An intermediate a traced run reads back: `count` f32 at float `offset` of `buffer`, reported
/// as `name` of `layer`.
#[derive(Debug, Clone)]
pub struct Tap {
    /// The trace name.
    pub name: &'static str,
    /// The layer index.
    pub layer: usize,
    /// Where it lives.
    pub buffer: wgpu::Buffer,
    /// First float.
    pub offset: usize,
    /// Floats.
    pub count: usize,
}

enum Item {
    Step(Step),
    Tap(Tap),
    /// The end of a named stage (what a profiled recording times separately).
    Mark(&'static str),
}

/// A profiled recording: one timestamp pair per stage, resolved into a buffer to read after
/// the submission.
pub struct Profile {
    names: Vec<&'static str>,
    _resolve: wgpu::Buffer,
    read: wgpu::Buffer,
}

impl Profile {
    /// Seconds per stage, in recording order (after the submission has run).
    pub fn read(&self, ctx: &GpuContext) -> Result<Vec<(&'static str, f64)>, GpuError> {
        let raw = crate::readback::read_mapped(ctx, &self.read, self.names.len() * 4)?;
        let ticks: &[u64] = bytemuck::cast_slice(&raw);
        let period = ctx.queue.get_timestamp_period() as f64 * 1e-9;
        Ok(self
            .names
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let dt = ticks[2 * i + 1].saturating_sub(ticks[2 * i]);
                (n, dt as f64 * period)
            })
            .collect())
    }
}

/// The dispatches of one frame, in order.
#[derive(Default)]
pub struct Graph {
    items: Vec<Item>,
    dispatches: usize,
}

/// The op kernels' layout: 0 the op's parameters, 1 the frame, 2..=9 storage.
pub(crate) fn op_layout(ctx: &GpuContext) -> (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
    let mut entries = vec![uniform_entry(0), uniform_entry(1)];
    entries.extend((0..OP_STORAGE).map(|i| storage_entry(2 + i, false)));
    bind_layout(ctx, "op", &entries)
}

/// One 16-byte buffer per storage binding, bound where an op leaves a binding unused (each
/// binding its own, so no buffer is bound writable twice).
pub(crate) fn op_dummies(ctx: &GpuContext) -> Vec<wgpu::Buffer> {
    (0..OP_STORAGE)
        .map(|_| storage(ctx, "op dummy", 4))
        .collect()
}

/// A zeroed device buffer of `floats` f32 (storage, copy source and destination).
pub fn storage(ctx: &GpuContext, label: &str, floats: usize) -> wgpu::Buffer {
    ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size: (floats.max(4) * 4) as u64,
        usage: wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_SRC
            | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    })
}

/// A storage buffer holding `data`.
pub fn upload_f32(ctx: &GpuContext, label: &str, data: &[f32]) -> wgpu::Buffer {
    let mut padded = data.to_vec();
    padded.resize(data.len().max(4), 0.0);
    ctx.device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents: bytemuck::cast_slice(&padded),
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
        })
}

/// The uniform every op reads its frame values from (`past`, `nb_lo`, `nb_hi`), written once
/// per frame with [`write_frame`].
pub fn frame_buffer(ctx: &GpuContext) -> wgpu::Buffer {
    ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("frame"),
        size: (FRAME_WORDS * 4) as u64,
        usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    })
}

/// Writes the frame values (queued: they take effect at the next submission).
pub fn write_frame(ctx: &GpuContext, frame: &wgpu::Buffer, past: u32, nb_lo: u32, nb_hi: u32) {
    ctx.queue
        .write_buffer(frame, 0, bytemuck::cast_slice(&[past, nb_lo, nb_hi, 0u32]));
}

/// A 1-D count of `n` lanes as a grid of `OP_WG`-lane workgroups `(x, y)`, and `x`.
pub fn lanes_grid(ctx: &GpuContext, n: usize) -> (u32, u32) {
    let groups = n.div_ceil(OP_WG as usize).max(1);
    let max = ctx.limits.max_compute_workgroups_per_dimension as usize;
    let x = groups.min(max);
    (x as u32, groups.div_ceil(x) as u32)
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Graph {
        Graph::default()
    }

    /// `y = W x` (with `epilogue`) over `nt` token rows on `path` (or the f32 path where the
    /// codec or the device lacks it); int8 activations are quantised by a step of their own.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec(
        &mut self,
        ctx: &GpuContext,
        m: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        nt: usize,
        path: Path,
        epilogue: Epilogue,
    ) -> Result<(), GpuError> {
        let plan = Plan::for_matrix(ctx, m.rows).with_path(path);
        let p = matvec::prepare_fused(ctx, m, x, y, nt, plan, epilogue)?;
        self.dispatches += p.dispatches();
        for s in p.into_steps() {
            self.items.push(Item::Step(s));
        }
        Ok(())
    }

    /// The grouped-experts matvec (see [`crate::ops::experts::prepare_grouped`]).
    #[allow(clippy::too_many_arguments)]
    pub fn grouped(
        &mut self,
        ctx: &GpuContext,
        bank: &crate::ops::experts::ExpertBank,
        x: &wgpu::Buffer,
        x_rows: usize,
        ids: &wgpu::Buffer,
        y: &wgpu::Buffer,
        slots: usize,
        x_div: usize,
        path: Path,
        epilogue: Epilogue,
    ) -> Result<(), GpuError> {
        let plan = Plan::for_matrix(ctx, bank.rows).with_path(path);
        let p = crate::ops::experts::prepare_grouped(
            ctx, bank, x, x_rows, ids, y, slots, x_div, plan, epilogue,
        )?;
        self.dispatches += p.dispatches();
        for s in p.into_steps() {
            self.items.push(Item::Step(s));
        }
        Ok(())
    }

    /// Op `op` with `params` (at most [`Op::PARAM_WORDS`] words), the frame uniform, storage
    /// `bufs` at bindings 2.. in order, over a `grid` of workgroups.
    pub fn op(
        &mut self,
        ctx: &GpuContext,
        op: Op,
        params: &[u32],
        frame: &wgpu::Buffer,
        bufs: &[&wgpu::Buffer],
        grid: (u32, u32),
    ) -> Result<(), GpuError> {
        assert!(params.len() <= Op::PARAM_WORDS && bufs.len() <= OP_STORAGE as usize);
        let (bgl, pl) = ctx.op_layout();
        let pipe: Arc<wgpu::ComputePipeline> = ctx.pipelines.get(
            &ctx.device,
            &format!("op_{}", op.name()),
            &|| op.source(),
            Op::ENTRY,
            &[],
            Some(pl),
        )?;
        let mut words = [0u32; Op::PARAM_WORDS];
        words[..params.len()].copy_from_slice(params);
        let ubuf = ctx
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(op.name()),
                contents: bytemuck::cast_slice(&words),
                usage: wgpu::BufferUsages::UNIFORM,
            });
        let dummies = ctx.op_dummies();
        let mut entries = vec![entry(0, &ubuf), entry(1, frame)];
        for (i, dummy) in dummies.iter().enumerate() {
            entries.push(entry(2 + i as u32, bufs.get(i).copied().unwrap_or(dummy)));
        }
        let bg = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(op.name()),
            layout: bgl,
            entries: &entries,
        });
        self.items
            .push(Item::Step(Step::new(pipe, vec![(bg, grid.0, grid.1)])));
        self.dispatches += 1;
        Ok(())
    }

    /// Reads `count` floats at float `offset` of `buffer` back after the dispatches so far, in
    /// a traced run.
    pub fn tap(
        &mut self,
        name: &'static str,
        layer: usize,
        buffer: &wgpu::Buffer,
        offset: usize,
        count: usize,
    ) {
        self.items.push(Item::Tap(Tap {
            name,
            layer,
            buffer: buffer.clone(),
            offset,
            count,
        }));
    }

    /// Ends a named stage: a profiled recording times the dispatches since the previous mark.
    pub fn mark(&mut self, stage: &'static str) {
        self.items.push(Item::Mark(stage));
    }

    /// Records every dispatch with a compute pass per stage, each timed by a pair of GPU
    /// timestamps (`None` without timestamp queries: record it plainly then).
    pub fn record_profiled(
        &self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
    ) -> Option<Profile> {
        if !ctx.caps.timestamps {
            return None;
        }
        let mut names: Vec<&'static str> = self
            .items
            .iter()
            .filter_map(|i| match i {
                Item::Mark(n) => Some(*n),
                _ => None,
            })
            .collect();
        if !matches!(self.items.last(), Some(Item::Mark(_))) {
            names.push("tail");
        }
        let count = (2 * names.len()) as u32;
        let set = ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("stages"),
            ty: wgpu::QueryType::Timestamp,
            count,
        });
        let mut seg = 0u32;
        let mut i = 0;
        while i < self.items.len() {
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some(names[seg as usize]),
                    timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                        query_set: &set,
                        beginning_of_pass_write_index: Some(2 * seg),
                        end_of_pass_write_index: Some(2 * seg + 1),
                    }),
                });
                while i < self.items.len() {
                    match &self.items[i] {
                        Item::Step(s) => s.record(&mut pass),
                        Item::Tap(_) => {}
                        Item::Mark(_) => {
                            i += 1;
                            break;
                        }
                    }
                    i += 1;
                }
            }
            seg += 1;
        }
        let bytes = count as u64 * 8;
        let resolve = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("stage timestamps"),
            size: bytes,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let read = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("stage timestamps read"),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        enc.resolve_query_set(&set, 0..seg.min(count / 2) * 2, &resolve, 0);
        enc.copy_buffer_to_buffer(&resolve, 0, &read, 0, bytes);
        names.truncate(seg as usize);
        Some(Profile {
            names,
            _resolve: resolve,
            read,
        })
    }

    /// Dispatches per replay.
    pub fn dispatches(&self) -> usize {
        self.dispatches
    }

    /// Records every dispatch into `enc`, in one compute pass unless `taps` asks for the
    /// intermediates: then each tap ends the pass and copies its range into a new readback
    /// buffer, returned in order with the tap.
    pub fn record(
        &self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        taps: Option<&mut Vec<(Tap, wgpu::Buffer)>>,
    ) {
        let Some(taps) = taps else {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("forward"),
                timestamp_writes: None,
            });
            for item in &self.items {
                if let Item::Step(s) = item {
                    s.record(&mut pass);
                }
            }
            return;
        };
        let mut i = 0;
        while i < self.items.len() {
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("forward (traced)"),
                    timestamp_writes: None,
                });
                loop {
                    match self.items.get(i) {
                        Some(Item::Step(s)) => s.record(&mut pass),
                        Some(Item::Mark(_)) => {}
                        _ => break,
                    }
                    i += 1;
                }
            }
            while let Some(Item::Tap(t)) = self.items.get(i) {
                let bytes = (t.count * 4) as u64;
                let dst = ctx.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(t.name),
                    size: bytes.max(4),
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                enc.copy_buffer_to_buffer(&t.buffer, (t.offset * 4) as u64, &dst, 0, bytes);
                taps.push((t.clone(), dst));
                i += 1;
            }
        }
    }
}
