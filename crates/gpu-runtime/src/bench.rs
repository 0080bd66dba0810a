//! Device timing for `cortiq bench kernels`: the read-bandwidth ceiling, the per-dispatch
//! launch floor, and matvec/matmat throughput, timed with GPU timestamps around one compute
//! pass of many dispatches where the device has them (wall clock around submit-and-wait
//! otherwise).

use std::time::Instant;

use wgpu::util::DeviceExt;

use crate::ops::matvec::{self, Plan};
use crate::{GpuContext, GpuError, GpuMatrix};

/// One timing.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Seconds per repetition.
    pub seconds: f64,
    /// Whether GPU timestamps measured it (else the wall clock).
    pub timestamps: bool,
}

/// Runs `record` `reps` times inside one compute pass and returns the time per repetition.
pub fn time_pass(
    ctx: &GpuContext,
    reps: usize,
    record: &dyn Fn(&mut wgpu::ComputePass<'_>),
) -> Result<Timing, GpuError> {
    // Warm-up: pipelines compiled, caches touched.
    let mut enc = ctx.device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        record(&mut pass);
    }
    ctx.queue.submit([enc.finish()]);
    ctx.wait();
    let ts = ctx.caps.timestamps.then(|| {
        let set = ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("bench"),
            ty: wgpu::QueryType::Timestamp,
            count: 2,
        });
        let resolve = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("timestamps"),
            size: 16,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        (set, resolve)
    });
    let mut enc = ctx.device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("bench"),
            timestamp_writes: ts
                .as_ref()
                .map(|(set, _)| wgpu::ComputePassTimestampWrites {
                    query_set: set,
                    beginning_of_pass_write_index: Some(0),
                    end_of_pass_write_index: Some(1),
                }),
        });
        for _ in 0..reps {
            record(&mut pass);
        }
    }
    if let Some((set, resolve)) = &ts {
        enc.resolve_query_set(set, 0..2, resolve, 0);
    }
    let t0 = Instant::now();
    ctx.queue.submit([enc.finish()]);
    ctx.wait();
    let wall = t0.elapsed().as_secs_f64();
    if let Some((_, resolve)) = &ts {
        let raw = crate::readback::read_f32(ctx, resolve, 0, 4)?;
        let ticks: Vec<u64> = bytemuck::cast_slice::<f32, u64>(&raw).to_vec();
        let ns = ticks[1].saturating_sub(ticks[0]) as f64 * ctx.queue.get_timestamp_period() as f64;
        if ns > 0.0 {
            return Ok(Timing {
                seconds: ns * 1e-9 / reps as f64,
                timestamps: true,
            });
        }
    }
    Ok(Timing {
        seconds: wall / reps as f64,
        timestamps: false,
    })
}

pub(crate) fn read_bw_pipeline(
    ctx: &GpuContext,
    entry: &str,
) -> Result<std::sync::Arc<wgpu::ComputePipeline>, GpuError> {
    ctx.pipelines.get(
        &ctx.device,
        "read_bw",
        &|| kernels_wgsl::READ_BW.to_string(),
        entry,
        &[("WG", 256.0)],
        None,
    )
}

/// Read bandwidth of a plain grid-stride kernel over `bytes` (capped at one binding), in bytes
/// per second: the ceiling every matvec figure is compared with.
pub fn read_ceiling(ctx: &GpuContext, bytes: u64, reps: usize) -> Result<(f64, Timing), GpuError> {
    let bytes = bytes.min(ctx.max_binding()) & !15;
    let src = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("read_bw src"),
        size: bytes,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    let groups = 4096u32.min(ctx.limits.max_compute_workgroups_per_dimension);
    let lanes = groups * 256;
    let dst = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("read_bw dst"),
        size: lanes as u64 * 4,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    let params = [(bytes / 16) as u32, lanes];
    let ubuf = ctx
        .device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("read_bw params"),
            contents: bytemuck::cast_slice(&params),
            usage: wgpu::BufferUsages::UNIFORM,
        });
    let pipe = read_bw_pipeline(ctx, "read_bw")?;
    let bg = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("read_bw"),
        layout: &pipe.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry {
                binding: 0,
                resource: src.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 1,
                resource: dst.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 2,
                resource: ubuf.as_entire_binding(),
            },
        ],
    });
    let t = time_pass(ctx, reps, &|pass| {
        pass.set_pipeline(&pipe);
        pass.set_bind_group(0, &bg, &[]);
        pass.dispatch_workgroups(groups, 1, 1);
    })?;
    Ok((bytes as f64 / t.seconds, t))
}

/// Time per dispatch of a one-lane kernel: the launch-overhead floor.
pub fn launch_floor(ctx: &GpuContext, reps: usize) -> Result<Timing, GpuError> {
    let dst = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("tiny"),
        size: 16,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    time_read_bw_entry(ctx, "tiny", &dst, reps)
}

/// A bind group of a one-binding `read_bw` entry's pipeline: `dst` at binding 1.
fn dst_group(
    ctx: &GpuContext,
    pipe: &wgpu::ComputePipeline,
    dst: &wgpu::Buffer,
) -> wgpu::BindGroup {
    ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("tiny"),
        layout: &pipe.get_bind_group_layout(0),
        entries: &[wgpu::BindGroupEntry {
            binding: 1,
            resource: dst.as_entire_binding(),
        }],
    })
}

/// Time per dispatch of one workgroup of `read_bw`'s `entry`, `dst` its only binding (1).
fn time_read_bw_entry(
    ctx: &GpuContext,
    entry: &str,
    dst: &wgpu::Buffer,
    reps: usize,
) -> Result<Timing, GpuError> {
    let pipe = read_bw_pipeline(ctx, entry)?;
    let bg = dst_group(ctx, &pipe, dst);
    time_pass(ctx, reps, &|pass| {
        pass.set_pipeline(&pipe);
        pass.set_bind_group(0, &bg, &[]);
        pass.dispatch_workgroups(1, 1, 1);
    })
}

/// What a chain's dispatch step costs beyond [`launch_floor`] for one thing a real kernel has
/// (`bench kernels` prints each beside the floor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloorVariant {
    /// Its index read from a uniform buffer of its own (as each of a model's recorded
    /// dispatches reads its own parameters): `DISTINCT` buffers taken in turn.
    Uniform,
    /// Its index pushed as immediates with the dispatch (wgpu's `IMMEDIATES`).
    Immediate,
    /// 4 KiB of workgroup memory in a workgroup of 256 lanes (zeroed first where the pipeline
    /// asks for it).
    WorkgroupMemory,
    /// Two pipelines in turn (the same one-lane kernel compiled twice), as a chain of
    /// different kernels switches pipelines at every step.
    Alternate,
    /// Each dispatch writing a buffer of its own (`DISTINCT` in turn) that the command buffer
    /// has not used before: wgpu then puts no barrier between the dispatches, and the device
    /// may run them side by side (what a model's independent dispatches get from outputs of
    /// their own).
    Fresh,
}

impl FloorVariant {
    /// The name `bench kernels` prints.
    pub fn name(self) -> &'static str {
        match self {
            FloorVariant::Uniform => "1 lane, own uniform",
            FloorVariant::Immediate => "1 lane, immediates",
            FloorVariant::WorkgroupMemory => "256 lanes, 4 KiB workgroup memory",
            FloorVariant::Fresh => "1 lane, own output (no barrier)",
            FloorVariant::Alternate => "1 lane, two pipelines in turn",
        }
    }
}

/// Distinct uniform bindings [`FloorVariant::Uniform`] cycles through (a decoded token of the
/// release model records about this many dispatches).
const DISTINCT: usize = 1024;

/// [`launch_floor`] for `variant`, with the counter its dispatches add to (each adds 1, the
/// workgroup-memory variant 5, once for the warm-up and once for each of `reps`); `None` where
/// the device lacks what the variant needs.
pub fn launch_floor_variant(
    ctx: &GpuContext,
    variant: FloorVariant,
    reps: usize,
) -> Result<Option<(Timing, u32)>, GpuError> {
    let dst = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("tiny"),
        size: 16,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let timing = match variant {
        FloorVariant::Uniform => {
            let align = ctx.limits.min_uniform_buffer_offset_alignment.max(16) as u64;
            let ubuf = ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("tiny uniforms"),
                size: align * DISTINCT as u64,
                usage: wgpu::BufferUsages::UNIFORM,
                mapped_at_creation: false,
            });
            let pipe = read_bw_pipeline(ctx, "tiny_u")?;
            let groups: Vec<wgpu::BindGroup> = (0..DISTINCT as u64)
                .map(|i| {
                    ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: Some("tiny_u"),
                        layout: &pipe.get_bind_group_layout(0),
                        entries: &[
                            wgpu::BindGroupEntry {
                                binding: 1,
                                resource: dst.as_entire_binding(),
                            },
                            wgpu::BindGroupEntry {
                                binding: 2,
                                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                                    buffer: &ubuf,
                                    offset: i * align,
                                    size: std::num::NonZeroU64::new(16),
                                }),
                            },
                        ],
                    })
                })
                .collect();
            let at = std::cell::Cell::new(0usize);
            time_pass(ctx, reps, &|pass| {
                pass.set_pipeline(&pipe);
                pass.set_bind_group(0, &groups[at.get() % DISTINCT], &[]);
                at.set(at.get() + 1);
                pass.dispatch_workgroups(1, 1, 1);
            })?
        }
        FloorVariant::Immediate => {
            if !ctx.device.features().contains(wgpu::Features::IMMEDIATES)
                || ctx.limits.max_immediate_size < 16
            {
                return Ok(None);
            }
            let entries = [crate::ops::matvec::storage_entry(0, false)];
            let bgl = ctx
                .device
                .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                    label: Some("tiny_i"),
                    entries: &entries,
                });
            let layout = ctx
                .device
                .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                    label: Some("tiny_i"),
                    bind_group_layouts: &[Some(&bgl)],
                    immediate_size: 16,
                });
            let pipe = ctx.pipelines.get(
                &ctx.device,
                "launch_floor_imm",
                &|| kernels_wgsl::LAUNCH_FLOOR_IMM.to_string(),
                "tiny_i",
                &[],
                Some(&layout),
            )?;
            let bg = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("tiny_i"),
                layout: &bgl,
                entries: &[wgpu::BindGroupEntry {
                    binding: 0,
                    resource: dst.as_entire_binding(),
                }],
            });
            time_pass(ctx, reps, &|pass| {
                pass.set_pipeline(&pipe);
                pass.set_bind_group(0, &bg, &[]);
                pass.set_immediates(0, &[0u8; 16]);
                pass.dispatch_workgroups(1, 1, 1);
            })?
        }
        FloorVariant::WorkgroupMemory => time_read_bw_entry(ctx, "tiny_wg", &dst, reps)?,
        FloorVariant::Fresh => return fresh_floor(ctx, reps).map(Some),
        FloorVariant::Alternate => {
            let pipes = [
                read_bw_pipeline(ctx, "tiny")?,
                read_bw_pipeline(ctx, "tiny_b")?,
            ];
            let groups = pipes.each_ref().map(|p| dst_group(ctx, p, &dst));
            let at = std::cell::Cell::new(0usize);
            time_pass(ctx, reps, &|pass| {
                let i = at.get() % 2;
                at.set(at.get() + 1);
                pass.set_pipeline(&pipes[i]);
                pass.set_bind_group(0, &groups[i], &[]);
                pass.dispatch_workgroups(1, 1, 1);
            })?
        }
    };
    let count = crate::readback::read_f32(ctx, &dst, 0, 1)?[0].to_bits();
    Ok(Some((timing, count)))
}

/// [`FloorVariant::Fresh`]: the one-lane kernel over `DISTINCT` buffers in turn (the warm-up
/// uses one, the timed pass the next `reps`, none twice while `reps < DISTINCT`), and the sum
/// of their counters.
fn fresh_floor(ctx: &GpuContext, reps: usize) -> Result<(Timing, u32), GpuError> {
    let pipe = read_bw_pipeline(ctx, "tiny")?;
    let bufs: Vec<wgpu::Buffer> = (0..DISTINCT)
        .map(|_| {
            ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("tiny (own)"),
                size: 16,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            })
        })
        .collect();
    let groups: Vec<wgpu::BindGroup> = bufs.iter().map(|b| dst_group(ctx, &pipe, b)).collect();
    let at = std::cell::Cell::new(0usize);
    let timing = time_pass(ctx, reps, &|pass| {
        pass.set_pipeline(&pipe);
        pass.set_bind_group(0, &groups[at.get() % DISTINCT], &[]);
        at.set(at.get() + 1);
        pass.dispatch_workgroups(1, 1, 1);
    })?;
    let used = at.get().min(DISTINCT);
    let gather = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("tiny counters"),
        size: (used * 4) as u64,
        usage: wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_DST
            | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let mut enc = ctx.device.create_command_encoder(&Default::default());
    for (i, b) in bufs.iter().take(used).enumerate() {
        enc.copy_buffer_to_buffer(b, 0, &gather, (i * 4) as u64, 4);
    }
    ctx.queue.submit([enc.finish()]);
    let words = crate::readback::read_f32(ctx, &gather, 0, used)?;
    Ok((timing, words.iter().map(|w| w.to_bits()).sum()))
}

/// Time of one matmat over `m` with `nt` token rows (activations and outputs on the device).
pub fn matmat(
    ctx: &GpuContext,
    m: &GpuMatrix,
    nt: usize,
    plan: Plan,
    reps: usize,
) -> Result<Timing, GpuError> {
    matmat_fused(ctx, m, nt, plan, crate::Epilogue::None, reps)
}

/// [`matmat`] with a fused epilogue.
pub fn matmat_fused(
    ctx: &GpuContext,
    m: &GpuMatrix,
    nt: usize,
    plan: Plan,
    epilogue: crate::Epilogue,
    reps: usize,
) -> Result<Timing, GpuError> {
    matmat_path(ctx, m, nt, plan, epilogue, reps, true).map(|(t, _)| t)
}

/// [`matmat_fused`] on the plan's path, reporting the path that ran; on the int8 path,
/// `with_quant` false times the matvec alone (its activations quantised once beforehand, as a
/// forward shares one quantised input among several matrices).
pub fn matmat_path(
    ctx: &GpuContext,
    m: &GpuMatrix,
    nt: usize,
    plan: Plan,
    epilogue: crate::Epilogue,
    reps: usize,
    with_quant: bool,
) -> Result<(Timing, crate::Path), GpuError> {
    let x = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("x"),
        size: (nt * m.cols * 4) as u64,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    let y = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("y"),
        size: (nt * matvec::out_rows(m, epilogue) * 4) as u64,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    let p = matvec::prepare_fused(ctx, m, &x, &y, nt, plan, epilogue)?;
    if with_quant {
        return Ok((time_pass(ctx, reps, &|pass| p.record(pass))?, p.path));
    }
    // Quantise once (time_pass's warm-up runs the first recording), then the matvec alone.
    let mut enc = ctx.device.create_command_encoder(&Default::default());
    {
        let mut pass = enc.begin_compute_pass(&Default::default());
        p.record(&mut pass);
    }
    ctx.queue.submit([enc.finish()]);
    Ok((time_pass(ctx, reps, &|pass| p.record_matvec(pass))?, p.path))
}

/// Time of quantising `nt` rows of `cols` activations to int8 (the int8 path's extra dispatch).
pub fn act_quant(
    ctx: &GpuContext,
    nt: usize,
    cols: usize,
    reps: usize,
) -> Result<Timing, GpuError> {
    let x = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("x"),
        size: (nt * cols * 4) as u64,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    let acts = crate::ops::act8::ActBuffers::new(ctx, nt, cols, crate::ActLayout::Pairs)?;
    let step = crate::ops::act8::prepare(ctx, &x, &acts, None)?;
    time_pass(ctx, reps, &|pass| step.record(pass))
}

/// Time of one MoE layer's routed experts through the grouped kernels, as the forward runs
/// them: gate/up with SiLU over `nt * k` slots (expert ids read on the device), then down over
/// the slots (each step with its own activation quantiser on the int8 path). `id_sets` holds
/// sets of `nt * k` expert ids (token row `t`'s experts at `t * k ..`); the repetitions cycle
/// through them, so with enough sets the experts read are not still in the cache from the last
/// repetition, as in a forward whose layers each read their own experts. Returns the time per
/// repetition and the path that ran.
#[allow(clippy::too_many_arguments)]
pub fn grouped_experts(
    ctx: &GpuContext,
    gate_up: &crate::ops::experts::ExpertBank,
    down: &crate::ops::experts::ExpertBank,
    id_sets: &[Vec<u32>],
    nt: usize,
    k: usize,
    path: crate::Path,
    reps: usize,
) -> Result<(Timing, crate::Path), GpuError> {
    let slots = nt * k;
    let buffer = |label, bytes: usize| {
        ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes.max(16) as u64,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        })
    };
    let x = buffer("x", nt * gate_up.cols * 4);
    let mid = buffer("expert mid", slots * gate_up.rows / 2 * 4);
    let out = buffer("expert out", slots * down.rows * 4);
    let mut steps = Vec::with_capacity(id_sets.len());
    let mut ran = path;
    for set in id_sets {
        if set.len() != slots
            || set
                .iter()
                .any(|&e| e as usize >= gate_up.count.min(down.count))
        {
            return Err(GpuError::BadLength {
                what: "expert ids per set (each below the bank's expert count)",
                expected: slots,
                found: set.len(),
            });
        }
        let ids = ctx
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("expert ids"),
                contents: bytemuck::cast_slice(set),
                usage: wgpu::BufferUsages::STORAGE,
            });
        let plan = |rows| Plan::for_matrix(ctx, rows).with_path(path);
        let gu = crate::ops::experts::prepare_grouped(
            ctx,
            gate_up,
            &x,
            nt,
            &ids,
            &mid,
            slots,
            k,
            plan(gate_up.rows),
            crate::Epilogue::SiluGateUp,
        )?;
        let dn = crate::ops::experts::prepare_grouped(
            ctx,
            down,
            &mid,
            slots,
            &ids,
            &out,
            slots,
            1,
            plan(down.rows),
            crate::Epilogue::None,
        )?;
        ran = gu.path;
        steps.push((gu, dn));
    }
    let next = std::cell::Cell::new(0usize);
    let t = time_pass(ctx, reps, &|pass| {
        let i = next.get();
        next.set((i + 1) % steps.len());
        steps[i].0.record(pass);
        steps[i].1.record(pass);
    })?;
    Ok((t, ran))
}
