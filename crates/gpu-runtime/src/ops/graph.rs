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
    /// Where the host takes part (see [`Break`]).
    Break(Break),
}

/// A point in a frame where the host takes part: the frame driver submits the dispatches
/// before it, and does its part at the break (a model whose routed experts do not all fit in
/// VRAM reads a layer's cold experts back at [`Break::Read`] and writes their outputs at
/// [`Break::Write`], the GPU computing the resident ones in between).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Break {
    /// Read something of layer `.0` back.
    Read(usize),
    /// Write something of layer `.0` up before the dispatches that follow.
    Write(usize),
}

/// The dispatches between two breaks (or the graph's ends): item range `items`, ended by
/// `end` (`None`: the end of the graph).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span {
    /// The items.
    pub items: std::ops::Range<usize>,
    /// The break that ends it.
    pub end: Option<Break>,
}

/// What a profiled recording times: each stage (the dispatches between two marks), each
/// dispatch step (named `stage: kernel shape`), or all of it in one pass (named `all`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Granularity {
    /// A timed compute pass per stage.
    Stage,
    /// A timed compute pass per step: slower (a pass boundary per dispatch), for which kernels
    /// the stage time is made of.
    Dispatch,
    /// One timed pass of every step, as the recording runs unprofiled: the GPU's busy time with
    /// no pass boundaries added (a stage profile's passes add several microseconds each).
    Whole,
    /// Per kernel, a pass of every step (named `all`) and one of every step but that kernel's
    /// (named as [`Granularity::Dispatch`] names it, `stage: kernel shape`), after a first
    /// pass of every step (`warm-up`: the first pass of a recording runs slower, by about a
    /// tenth of a millisecond on an H100): the `all` passes' mean less a kernel's pass is what
    /// the chain would save if that kernel were free. The outputs of such a pass are wrong
    /// (its steps read what the left-out ones did not write); its time is the rest of the
    /// chain's.
    Without,
}

/// A profiled recording: one timestamp pair per timed pass, resolved into a buffer to read
/// after the submission.
pub struct Profile {
    names: Vec<String>,
    _resolve: wgpu::Buffer,
    read: wgpu::Buffer,
}

impl Profile {
    /// Seconds per timed pass, in recording order (after the submission has run): from the
    /// end of the previous pass to the end of this one (the first: from its beginning). A
    /// pass's beginning timestamp can be written before the previous pass has drained, which
    /// would charge that drain to this pass twice; end to end, the passes add up to the span.
    pub fn read(&self, ctx: &GpuContext) -> Result<Vec<(String, f64)>, GpuError> {
        let raw = crate::readback::read_mapped(ctx, &self.read, self.names.len() * 4)?;
        let ticks: &[u64] = bytemuck::cast_slice(&raw);
        let period = ctx.queue.get_timestamp_period() as f64 * 1e-9;
        Ok(self
            .names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let from = if i == 0 { ticks[0] } else { ticks[2 * i - 1] };
                let dt = ticks[2 * i + 1].saturating_sub(from);
                (n.clone(), dt as f64 * period)
            })
            .collect())
    }
}

/// The dispatches of one frame, in order.
#[derive(Default)]
pub struct Graph {
    items: Vec<Item>,
    dispatches: usize,
    /// The last grouped call's expert-sorted slots and the item count after it: a grouped
    /// call right after it over the same ids reuses the table.
    sorted: Option<(usize, crate::ops::experts_tiled::SortedSlots)>,
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
    upload_words(ctx, label, bytemuck::cast_slice(data))
}

/// A storage buffer holding the words `data` (at least 4 words: short ones padded with zeros).
pub fn upload_words(ctx: &GpuContext, label: &str, data: &[u32]) -> wgpu::Buffer {
    let mut padded = data.to_vec();
    padded.resize(data.len().max(4), 0);
    ctx.device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents: bytemuck::cast_slice(&padded),
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
        })
}

/// The uniform every op reads its frame values from (`past`, `nb_lo`, `nb_hi`, `row0`),
/// written once per frame with [`write_frame`].
pub fn frame_buffer(ctx: &GpuContext) -> wgpu::Buffer {
    ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("frame"),
        size: (FRAME_WORDS * 4) as u64,
        usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    })
}

/// Writes the frame values (queued: they take effect at the next submission): the tokens
/// before the frame, the complete indexer blocks before and after it, and the sequence's first
/// row in the activation buffers (0 but in a frame that batches several sequences' rows).
pub fn write_frame(
    ctx: &GpuContext,
    frame: &wgpu::Buffer,
    past: u32,
    blocks: (u32, u32),
    row0: u32,
) {
    let words = [past, blocks.0, blocks.1, row0];
    ctx.queue
        .write_buffer(frame, 0, bytemuck::cast_slice(&words));
}

/// A 1-D count of `n` lanes as a grid of `OP_WG`-lane workgroups `(x, y)`, and `x`.
pub fn lanes_grid(ctx: &GpuContext, n: usize) -> (u32, u32) {
    let groups = n.div_ceil(OP_WG as usize).max(1);
    let max = ctx.limits.max_compute_workgroups_per_dimension as usize;
    let x = groups.min(max);
    (x as u32, groups.div_ceil(x) as u32)
}

/// One matvec of [`Graph::matvecs_members`]: its matrix (two matrices' rows for a two-matrix
/// epilogue), output, the second half's output ([`Epilogue::PairTwo`]) and epilogue.
pub struct Member<'a> {
    /// The matrix.
    pub m: &'a GpuMatrix,
    /// Its output.
    pub y: &'a wgpu::Buffer,
    /// The second half's output, for [`Epilogue::PairTwo`].
    pub aux: Option<&'a wgpu::Buffer>,
    /// The epilogue.
    pub epilogue: Epilogue,
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Graph {
        Graph::default()
    }

    /// Appends a prepared call's steps, counting its dispatches.
    fn push_prepared(&mut self, p: matvec::Prepared) {
        self.dispatches += p.dispatches();
        self.items
            .extend(p.into_steps().into_iter().map(Item::Step));
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
        let plan = Plan::for_shape(ctx, m.rows, m.cols).with_path(path);
        let p = matvec::prepare_fused(ctx, m, x, y, nt, plan, epilogue)?;
        self.push_prepared(p);
        Ok(())
    }

    /// [`Graph::matvec`] with a hyper-connection epilogue and its auxiliary buffer (see
    /// [`matvec::prepare_aux`]).
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_aux(
        &mut self,
        ctx: &GpuContext,
        m: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        aux: matvec::Aux<'_>,
        nt: usize,
        path: Path,
        epilogue: Epilogue,
    ) -> Result<(), GpuError> {
        let plan = Plan::for_shape(ctx, m.rows, m.cols).with_path(path);
        let p = matvec::prepare_aux(ctx, m, x, y, aux, nt, plan, epilogue)?;
        self.push_prepared(p);
        Ok(())
    }

    /// A two-matrix epilogue over `m` (two matrices' rows uploaded as one; see
    /// [`matvec::prepare_two`]): with `table` (the two q8_2f matrices' column scales, as
    /// [`crate::ops::act8::col_scale_table`] lays them out) one quantiser dispatch makes both
    /// members, then one matvec dispatch.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_two(
        &mut self,
        ctx: &GpuContext,
        m: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        aux: Option<&wgpu::Buffer>,
        nt: usize,
        path: Path,
        epilogue: Epilogue,
        table: Option<&wgpu::Buffer>,
    ) -> Result<(), GpuError> {
        let plan = Plan::for_shape(ctx, m.rows, m.cols).with_path(path);
        let p = match table {
            Some(table) => {
                let layout = kernels_wgsl::Codec::Q8_2f
                    .act_layout()
                    .expect("q8_2f has an int8 layout");
                let (step, acts) =
                    crate::ops::act8::prepare_shared(ctx, x, nt, m.cols, layout, table, 2)?;
                self.items.push(Item::Step(step));
                self.dispatches += 1;
                let acts = [&acts[0], &acts[1]];
                matvec::prepare_two(ctx, m, x, Some(acts), y, aux, nt, plan, epilogue)?
            }
            None => matvec::prepare_two(ctx, m, x, None, y, aux, nt, plan, epilogue)?,
        };
        self.push_prepared(p);
        Ok(())
    }

    /// A two-matrix epilogue over `m` on the two members `acts` of a shared quantiser that ran
    /// before (see [`Graph::matvec_two`]).
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_two_acts(
        &mut self,
        ctx: &GpuContext,
        m: &GpuMatrix,
        x: &wgpu::Buffer,
        acts: [&crate::ops::act8::ActBuffers; 2],
        y: &wgpu::Buffer,
        aux: Option<&wgpu::Buffer>,
        nt: usize,
        epilogue: Epilogue,
    ) -> Result<(), GpuError> {
        let plan = Plan::for_shape(ctx, m.rows, m.cols).with_path(Path::Int8);
        let p = matvec::prepare_two(ctx, m, x, Some(acts), y, aux, nt, plan, epilogue)?;
        self.push_prepared(p);
        Ok(())
    }

    /// One quantiser dispatch for the members `layouts` of `x` (`nt` rows of `cols`), their
    /// column scales in `table`, the first member without any with `first_unscaled` (see
    /// [`crate::ops::act8::prepare_shared_layouts`]): the members' activations, for calls that
    /// take them ([`Graph::grouped_acts`], [`Graph::matvec_two_acts`]).
    #[allow(clippy::too_many_arguments)]
    pub fn quantise_shared(
        &mut self,
        ctx: &GpuContext,
        x: &wgpu::Buffer,
        nt: usize,
        cols: usize,
        layouts: &[kernels_wgsl::ActLayout],
        table: &wgpu::Buffer,
        first_unscaled: bool,
    ) -> Result<Vec<crate::ops::act8::ActBuffers>, GpuError> {
        let (step, acts) = crate::ops::act8::prepare_shared_layouts(
            ctx,
            x,
            nt,
            cols,
            layouts,
            table,
            first_unscaled,
        )?;
        self.items.push(Item::Step(step));
        self.dispatches += 1;
        Ok(acts)
    }

    /// `y_i = W_i x` for q8_2f matrices `mats` that read the same `x`, on the int8 path with
    /// one quantiser dispatch for all of them (their column scales from `table`, built by
    /// [`crate::ops::act8::col_scale_table`]) instead of one each.
    pub fn matvecs_shared(
        &mut self,
        ctx: &GpuContext,
        mats: &[(&GpuMatrix, &wgpu::Buffer)],
        x: &wgpu::Buffer,
        nt: usize,
        table: &wgpu::Buffer,
    ) -> Result<(), GpuError> {
        let items: Vec<Member<'_>> = mats
            .iter()
            .map(|&(m, y)| Member {
                m,
                y,
                aux: None,
                epilogue: Epilogue::None,
            })
            .collect();
        self.matvecs_members(ctx, &items, x, nt, table)
    }

    /// [`Graph::matvecs_shared`] over matrices and two-matrix pairs ([`Epilogue::PairTwo`],
    /// [`Epilogue::GateUpTwo`], which take two members each), q8_2f on the int8 path: one
    /// quantiser dispatch makes every member (`table`: their column scales in item order),
    /// then one matvec dispatch per item.
    pub fn matvecs_members(
        &mut self,
        ctx: &GpuContext,
        items: &[Member<'_>],
        x: &wgpu::Buffer,
        nt: usize,
        table: &wgpu::Buffer,
    ) -> Result<(), GpuError> {
        let Some(first) = items.first() else {
            return Ok(());
        };
        let layout = kernels_wgsl::Codec::Q8_2f
            .act_layout()
            .expect("q8_2f has an int8 layout");
        let width = |i: &Member<'_>| if i.epilogue.has_members() { 2 } else { 1 };
        let members = items.iter().map(width).sum();
        let (step, acts) =
            crate::ops::act8::prepare_shared(ctx, x, nt, first.m.cols, layout, table, members)?;
        self.items.push(Item::Step(step));
        self.dispatches += 1;
        let mut at = 0;
        for i in items {
            let plan = Plan::for_shape(ctx, i.m.rows, i.m.cols);
            let p = if i.epilogue.has_members() {
                let two = Some([&acts[at], &acts[at + 1]]);
                matvec::prepare_two(ctx, i.m, x, two, i.y, i.aux, nt, plan, i.epilogue)?
            } else {
                matvec::prepare_with_acts(ctx, i.m, x, &acts[at], i.y, nt, plan, i.epilogue)?
            };
            at += width(i);
            self.push_prepared(p);
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
        let g = crate::ops::experts::Grouped {
            x,
            x_rows,
            ids,
            y,
            slots,
            x_div,
            pre: None,
        };
        self.grouped_call(ctx, bank, g, path, epilogue)
    }

    /// [`Graph::grouped`] on activations a shared quantiser has written (`acts`, in the
    /// bank's codec's int8 layout; where they do not apply the call quantises `x` itself).
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_acts(
        &mut self,
        ctx: &GpuContext,
        bank: &crate::ops::experts::ExpertBank,
        x: &wgpu::Buffer,
        acts: &crate::ops::act8::ActBuffers,
        ids: &wgpu::Buffer,
        y: &wgpu::Buffer,
        slots: usize,
        x_div: usize,
        path: Path,
        epilogue: Epilogue,
    ) -> Result<(), GpuError> {
        let g = crate::ops::experts::Grouped {
            x,
            x_rows: acts.nt,
            ids,
            y,
            slots,
            x_div,
            pre: Some(acts),
        };
        self.grouped_call(ctx, bank, g, path, epilogue)
    }

    fn grouped_call(
        &mut self,
        ctx: &GpuContext,
        bank: &crate::ops::experts::ExpertBank,
        g: crate::ops::experts::Grouped<'_>,
        path: Path,
        epilogue: Epilogue,
    ) -> Result<(), GpuError> {
        let plan = Plan::for_matrix(ctx, bank.rows).with_path(path);
        // The table of a grouped call just before this one (nothing ran in between to change
        // the ids): the gate/up's, for the down projection.
        let sorted = self
            .sorted
            .as_ref()
            .filter(|(at, _)| *at == self.items.len())
            .map(|(_, t)| t);
        let (p, sorted) =
            crate::ops::experts::prepare_grouped_sorted(ctx, bank, g, plan, epilogue, sorted)?;
        self.push_prepared(p);
        self.sorted = sorted.map(|t| (self.items.len(), t));
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
        self.op_with(ctx, op, &[], params, frame, bufs, grid)
    }

    /// [`Graph::op`] with the module's override `constants` set (a pipeline per set).
    #[allow(clippy::too_many_arguments)]
    pub fn op_with(
        &mut self,
        ctx: &GpuContext,
        op: Op,
        constants: &[(&str, f64)],
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
            constants,
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
        self.items.push(Item::Step(Step::new(
            pipe,
            vec![(bg, grid.0, grid.1)],
            op.name().to_string(),
        )));
        self.dispatches += 1;
        Ok(())
    }

    /// Reads every byte of `src` once (an L2 prefetch of a matrix a later dispatch reads), its
    /// output `out` (16 bytes, never written in practice): recorded after a latency-bound
    /// dispatch, with an `out` this command buffer has not used, it runs beside that dispatch
    /// (wgpu puts no barrier before it; the next barrier waits for it).
    pub fn prefetch(
        &mut self,
        ctx: &GpuContext,
        src: &wgpu::Buffer,
        out: &wgpu::Buffer,
    ) -> Result<(), GpuError> {
        let pipe = crate::bench::read_bw_pipeline(ctx, "prefetch")?;
        let words = (src.size() / 16).min(u64::from(u32::MAX)) as u32;
        // One word a lane, up to 4096 workgroups (a grid-stride walk beyond).
        let groups = words
            .div_ceil(256)
            .clamp(1, 4096)
            .min(ctx.limits.max_compute_workgroups_per_dimension);
        let params = [words, groups * 256];
        let ubuf = ctx
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("prefetch params"),
                contents: bytemuck::cast_slice(&params),
                usage: wgpu::BufferUsages::UNIFORM,
            });
        let bg = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("prefetch"),
            layout: &pipe.get_bind_group_layout(0),
            entries: &[entry(0, src), entry(1, out), entry(2, &ubuf)],
        });
        let label = format!("prefetch {} KB", src.size() >> 10);
        self.items
            .push(Item::Step(Step::new(pipe, vec![(bg, groups, 1)], label)));
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

    /// Ends a span where the host takes part (see [`Break`]).
    pub fn brk(&mut self, b: Break) {
        self.items.push(Item::Break(b));
    }

    /// Whether the host takes part between the dispatches (the graph has breaks).
    pub fn has_breaks(&self) -> bool {
        self.items.iter().any(|i| matches!(i, Item::Break(_)))
    }

    /// The spans between breaks, in order (one span for a graph without breaks).
    pub fn spans(&self) -> Vec<Span> {
        let mut out = Vec::new();
        let mut from = 0;
        for (i, item) in self.items.iter().enumerate() {
            if let Item::Break(b) = item {
                out.push(Span {
                    items: from..i,
                    end: Some(*b),
                });
                from = i + 1;
            }
        }
        out.push(Span {
            items: from..self.items.len(),
            end: None,
        });
        out
    }

    /// Records every dispatch with a compute pass per stage (or per step, `granularity`), each
    /// timed by a pair of GPU timestamps (`None` without timestamp queries: record it plainly
    /// then).
    pub fn record_profiled(
        &self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        granularity: Granularity,
    ) -> Option<Profile> {
        if !ctx.caps.timestamps {
            return None;
        }
        // The timed passes: a name and the steps it records.
        let mut passes: Vec<(String, Vec<&Step>)> = Vec::new();
        if granularity == Granularity::Without {
            passes = self.passes_without();
        }
        let mut open: Vec<&Step> = Vec::new();
        for item in &self.items {
            match item {
                _ if granularity == Granularity::Without => {}
                Item::Step(s) => open.push(s),
                Item::Tap(_) | Item::Break(_) => {}
                Item::Mark(_) if granularity == Granularity::Whole => {}
                Item::Mark(name) => {
                    let steps = std::mem::take(&mut open);
                    if granularity == Granularity::Stage {
                        passes.push((name.to_string(), steps));
                    } else {
                        for s in steps {
                            passes.push((format!("{name}: {}", s.label()), vec![s]));
                        }
                    }
                }
            }
        }
        if !open.is_empty() {
            match granularity {
                Granularity::Stage => passes.push(("tail".into(), open)),
                Granularity::Whole => passes.push(("all".into(), open)),
                Granularity::Without => unreachable!("no step is left open"),
                Granularity::Dispatch => {
                    for s in open {
                        passes.push((format!("tail: {}", s.label()), vec![s]));
                    }
                }
            }
        }
        // A query set holds at most 4096 queries: 2048 passes each.
        const PER_SET: usize = 2048;
        let sets: Vec<wgpu::QuerySet> = (0..passes.len().div_ceil(PER_SET))
            .map(|i| {
                let n = (passes.len() - i * PER_SET).min(PER_SET);
                ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("timed passes"),
                    ty: wgpu::QueryType::Timestamp,
                    count: (2 * n) as u32,
                })
            })
            .collect();
        for (i, (name, steps)) in passes.iter().enumerate() {
            let q = (2 * (i % PER_SET)) as u32;
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(name),
                timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                    query_set: &sets[i / PER_SET],
                    beginning_of_pass_write_index: Some(q),
                    end_of_pass_write_index: Some(q + 1),
                }),
            });
            for s in steps {
                s.record(&mut pass);
            }
        }
        let bytes = (passes.len().max(1) * 16) as u64;
        let resolve = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("pass timestamps"),
            size: bytes,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let read = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("pass timestamps read"),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        for (i, set) in sets.iter().enumerate() {
            let n = (passes.len() - i * PER_SET).min(PER_SET);
            enc.resolve_query_set(set, 0..(2 * n) as u32, &resolve, (i * PER_SET * 16) as u64);
        }
        enc.copy_buffer_to_buffer(&resolve, 0, &read, 0, bytes);
        Some(Profile {
            names: passes.into_iter().map(|(n, _)| n).collect(),
            _resolve: resolve,
            read,
        })
    }

    /// [`Granularity::Without`]'s passes: every step (the warm-up), then every step and every
    /// step but one kernel's, for each kernel in the order it first runs.
    fn passes_without(&self) -> Vec<(String, Vec<&Step>)> {
        let mut keyed: Vec<(String, &Step)> = Vec::new();
        let mut open: Vec<&Step> = Vec::new();
        for item in &self.items {
            match item {
                Item::Step(s) => open.push(s),
                Item::Mark(name) => {
                    keyed.extend(
                        open.drain(..)
                            .map(|s| (format!("{name}: {}", s.label()), s)),
                    );
                }
                Item::Tap(_) | Item::Break(_) => {}
            }
        }
        keyed.extend(open.drain(..).map(|s| (format!("tail: {}", s.label()), s)));
        let mut kernels: Vec<&str> = Vec::new();
        for (k, _) in &keyed {
            if !kernels.contains(&k.as_str()) {
                kernels.push(k);
            }
        }
        let all: Vec<&Step> = keyed.iter().map(|(_, s)| *s).collect();
        let mut passes = vec![("warm-up".to_string(), all.clone())];
        for k in kernels {
            let rest = keyed.iter().filter(|(key, _)| key != k).map(|(_, s)| *s);
            passes.push(("all".to_string(), all.clone()));
            passes.push((k.to_string(), rest.collect()));
        }
        passes
    }

    /// Dispatches per replay.
    pub fn dispatches(&self) -> usize {
        self.dispatches
    }

    /// Records every dispatch into `enc`, in one compute pass unless `taps` asks for the
    /// intermediates: then each tap ends the pass and copies its range into a new readback
    /// buffer, returned in order with the tap. A graph with breaks is recorded span by span
    /// ([`Graph::record_span`]) by a driver that does the host's part at each.
    pub fn record(
        &self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        taps: Option<&mut Vec<(Tap, wgpu::Buffer)>>,
    ) {
        debug_assert!(!self.has_breaks(), "a graph with breaks recorded whole");
        self.record_span(ctx, enc, 0..self.items.len(), taps);
    }

    /// [`Graph::record`] of the items in `range` (a [`Span`]'s).
    pub fn record_span(
        &self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        range: std::ops::Range<usize>,
        taps: Option<&mut Vec<(Tap, wgpu::Buffer)>>,
    ) {
        self.record_span_stamped(ctx, enc, range, taps, None)
    }

    /// [`Graph::record_span`], writing the pass's beginning and end into queries `at` and
    /// `at + 1` of `stamps` when given (and the span is not traced).
    pub fn record_span_stamped(
        &self,
        ctx: &GpuContext,
        enc: &mut wgpu::CommandEncoder,
        range: std::ops::Range<usize>,
        taps: Option<&mut Vec<(Tap, wgpu::Buffer)>>,
        stamps: Option<(&wgpu::QuerySet, u32)>,
    ) {
        let items = &self.items[range];
        let Some(taps) = taps else {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("forward"),
                timestamp_writes: stamps.map(|(query_set, at)| wgpu::ComputePassTimestampWrites {
                    query_set,
                    beginning_of_pass_write_index: Some(at),
                    end_of_pass_write_index: Some(at + 1),
                }),
            });
            for item in items {
                if let Item::Step(s) = item {
                    s.record(&mut pass);
                }
            }
            return;
        };
        let mut i = 0;
        while i < items.len() {
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("forward (traced)"),
                    timestamp_writes: None,
                });
                loop {
                    match items.get(i) {
                        Some(Item::Step(s)) => s.record(&mut pass),
                        Some(Item::Mark(_) | Item::Break(_)) => {}
                        _ => break,
                    }
                    i += 1;
                }
            }
            while let Some(Item::Tap(t)) = items.get(i) {
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
