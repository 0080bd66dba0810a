//! What every model's device encoding shares: the [`Device`] (context, the weight arena the
//! model's matrices live in, the activation path per dtype) and [`Enc`], the graph a frame is
//! recorded into over the model's own scratch buffers. Each model crate keeps its scratch (the
//! intermediates of its blocks) and its frame driver; the matrices, the op kernels and the
//! path choice are the same for all of them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use gpu_runtime::ops::experts::ExpertBank;
use gpu_runtime::ops::graph::{self, Graph, Member, lanes_grid};
use gpu_runtime::{Epilogue, GpuContext, GpuError, GpuMatrix, Path, WeightArena};
use kernels_wgsl::Op;
use quant_codecs::ops::ActChoice;
use quant_codecs::{ActPath, DType};

use crate::bind::Mat;

/// How an RMSNorm applies its weight `w` (the op's `wmode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormWeight {
    /// `x / rms(x) * (1 + w)` (Qwen's norms).
    OnePlus = 0,
    /// `x / rms(x) * w` (DeepSeek's).
    Plain = 1,
    /// `x / rms(x)`.
    None = 2,
}

/// Two matrices of one shape that read the same input, on the device ([`Device::two`]).
#[derive(Clone)]
pub enum TwoMats {
    /// Both as one matrix (`[a; b]`): one dispatch, and with `table` (q8_2f: both halves'
    /// column scales) one quantiser dispatch for both halves' activations.
    One {
        /// The rows of both.
        m: Arc<GpuMatrix>,
        /// The column-scale table of the shared quantiser.
        table: Option<wgpu::Buffer>,
    },
    /// Each its own matrix.
    Apart(Arc<GpuMatrix>, Arc<GpuMatrix>),
}

impl TwoMats {
    /// Rows of each.
    pub fn rows(&self) -> usize {
        match self {
            TwoMats::One { m, .. } => m.rows / 2,
            TwoMats::Apart(a, _) => a.rows,
        }
    }
}

/// The device a model lives on, and its resident weights.
pub struct Device {
    /// The context.
    pub ctx: Arc<GpuContext>,
    arena: WeightArena,
    uid: u64,
    bank_bytes: AtomicU64,
    /// Shared quantisers' column-scale tables, by their matrices (addresses of the pinned
    /// matrices, which live as long as the model).
    tables: Mutex<HashMap<Vec<usize>, Option<wgpu::Buffer>>>,
    /// [`Device::two`]'s results by the two matrices' names (the model's front and its MoE
    /// layers ask for the shared expert's pair; it is concatenated once).
    twos: Mutex<HashMap<(String, String), TwoMats>>,
    /// A one-float buffer bound where an op's weight is not read (an unweighted norm).
    unit: wgpu::Buffer,
}

impl Device {
    /// A device with an empty arena under the context's VRAM budget; `uid` keys this model's
    /// matrices.
    pub fn new(ctx: Arc<GpuContext>, uid: u64) -> Device {
        let arena = WeightArena::new(&ctx);
        let unit = graph::upload_f32(&ctx, "unit", &[1.0]);
        Device {
            ctx,
            arena,
            uid,
            bank_bytes: AtomicU64::new(0),
            tables: Mutex::new(HashMap::new()),
            twos: Mutex::new(HashMap::new()),
            unit,
        }
    }

    /// The column-scale table of q8_2f matrices read through one shared quantiser (made once;
    /// `None` where they cannot share one).
    pub fn col_scale_table(&self, mats: &[&GpuMatrix]) -> Option<wgpu::Buffer> {
        let key: Vec<usize> = mats
            .iter()
            .map(|m| *m as *const GpuMatrix as usize)
            .collect();
        let mut tables = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        tables
            .entry(key)
            .or_insert_with(|| gpu_runtime::ops::act8::col_scale_table(&self.ctx, mats))
            .clone()
    }

    /// Uploads (once) and pins a matrix. One whose columns its codec's kernel cannot tile (a
    /// low-rank projection narrower than a 16-byte chunk of q8_2f) goes up decoded to f32:
    /// exact, and small by construction.
    pub fn mat(&self, m: &Mat<'_>) -> Result<Arc<GpuMatrix>, GpuError> {
        let codec = gpu_runtime::arena::kernel_codec(m.dtype())
            .ok_or(GpuError::UnsupportedDtype { dtype: m.dtype() })?;
        let g = if m.cols().is_multiple_of(codec.col_multiple()) {
            self.arena.get_or_upload(&self.ctx, self.uid, m.name(), m)?
        } else {
            let mut f = vec![0f32; m.rows() * m.cols()];
            m.dequantize(&mut f)?;
            let bytes: Vec<u8> = bytemuck::cast_slice(&f).to_vec();
            let f32m = quant_codecs::MatRef::new(DType::F32, m.rows(), m.cols(), &bytes)?;
            self.arena
                .get_or_upload(&self.ctx, self.uid, m.name(), &f32m)?
        };
        self.arena.pin(self.uid, m.name(), true);
        Ok(g)
    }

    /// Two matrices of one shape that read the same input ([`TwoMats`]): one matrix of both
    /// rows where a kernel can read them so (codecs without column scales; q8_2f on the int8
    /// path, whose shared quantiser scales each half's activations by its own), else apart.
    pub fn two(&self, a: &Mat<'_>, b: &Mat<'_>) -> Result<TwoMats, GpuError> {
        let key = (a.name().to_string(), b.name().to_string());
        let twos = || self.twos.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = twos().get(&key) {
            return Ok(t.clone());
        }
        let t = self.two_uncached(a, b)?;
        twos().insert(key, t.clone());
        Ok(t)
    }

    fn two_uncached(&self, a: &Mat<'_>, b: &Mat<'_>) -> Result<TwoMats, GpuError> {
        let (dtype, rows, cols) = (a.dtype(), a.rows(), a.cols());
        let codec =
            gpu_runtime::arena::kernel_codec(dtype).ok_or(GpuError::UnsupportedDtype { dtype })?;
        let same = b.dtype() == dtype && b.rows() == rows && b.cols() == cols;
        let tiles = cols.is_multiple_of(codec.col_multiple());
        let table = match dtype {
            DType::Q8_2f if self.path(dtype) == Path::Int8 && cols.is_multiple_of(32) => {
                gpu_runtime::ops::act8::col_scale_table_host(&self.ctx, &[a.mat(), b.mat()])
            }
            _ => None,
        };
        if same && tiles && (dtype != DType::Q8_2f || table.is_some()) {
            let bytes = quant_codecs::concat_rows(&[*a.mat(), *b.mat()])?;
            let m = quant_codecs::MatRef::new(dtype, 2 * rows, cols, &bytes)?;
            let name = format!("{}+{}", a.name(), b.name());
            let m = self.mat(&Mat::new(name, usize::MAX, m))?;
            if m.parts.len() == 1 {
                return Ok(TwoMats::One { m, table });
            }
        }
        Ok(TwoMats::Apart(self.mat(a)?, self.mat(b)?))
    }

    /// A small f32 vector (norm weights, conv kernels) as a storage buffer.
    pub fn vec(&self, label: &str, v: &[f32]) -> wgpu::Buffer {
        graph::upload_f32(&self.ctx, label, v)
    }

    /// A small u32 table (an expert -> slot map) as a storage buffer.
    pub fn words(&self, label: &str, v: &[u32]) -> wgpu::Buffer {
        graph::upload_words(&self.ctx, label, v)
    }

    /// The VRAM budget the weights live within.
    pub fn budget(&self) -> u64 {
        self.arena.budget()
    }

    /// One layer's routed experts as a bank (one binding), within the VRAM budget.
    pub fn bank(&self, experts: &[&Mat<'_>]) -> Result<ExpertBank, GpuError> {
        let mats: Vec<quant_codecs::MatRef<'_>> = experts.iter().map(|m| *m.mat()).collect();
        let need: u64 = mats.iter().map(|m| m.bytes().len() as u64).sum();
        let used = self.resident_bytes();
        if used + need > self.arena.budget() {
            return Err(GpuError::UnsupportedFusion {
                epilogue: "expert bank",
                reason: format!(
                    "{} MiB more would pass the VRAM budget of {} MiB",
                    need >> 20,
                    self.arena.budget() >> 20
                ),
            });
        }
        let bank = ExpertBank::upload(&self.ctx, &mats)?;
        self.bank_bytes.fetch_add(bank.bytes(), Ordering::Relaxed);
        Ok(bank)
    }

    /// An empty bank of `slots` slots for `rows x cols` experts of `dtype` (a global bank,
    /// filled slot by slot), within the VRAM budget; `segment_slots` forces small segments.
    pub fn empty_bank(
        &self,
        dtype: quant_codecs::DType,
        (rows, cols): (usize, usize),
        slots: usize,
        segment_slots: Option<usize>,
    ) -> Result<ExpertBank, GpuError> {
        let bank = ExpertBank::empty(&self.ctx, dtype, rows, cols, slots, segment_slots)?;
        if self.resident_bytes() + bank.bytes() > self.arena.budget() {
            return Err(GpuError::UnsupportedFusion {
                epilogue: "expert bank",
                reason: format!(
                    "{} MiB more would pass the VRAM budget of {} MiB",
                    bank.bytes() >> 20,
                    self.arena.budget() >> 20
                ),
            });
        }
        self.bank_bytes.fetch_add(bank.bytes(), Ordering::Relaxed);
        Ok(bank)
    }

    /// Device bytes the weights hold.
    pub fn resident_bytes(&self) -> u64 {
        self.arena.resident_bytes() + self.bank_bytes.load(Ordering::Relaxed)
    }

    /// The activation path of a matrix of `dtype`. Float weights have no int8 path: f16 takes
    /// the hardware conversion where the device has it (exact either way). Quantised weights
    /// follow `--act`: `f32` and `int8` as the CPU does (so the CPU forward stays the
    /// device's witness), and `auto` int8 for every quantised codec, q8_2f included: on the
    /// device its int8 matvec is 2.5-3x its f32 path at decode shapes (docs/perf.md), where
    /// the CPU's `auto` keeps q8_2f on f32 (there the int8 call costs more than it saves).
    pub fn path(&self, dtype: DType) -> Path {
        match dtype {
            DType::F16 if self.ctx.caps.f16_in_f32 => Path::HwF16,
            DType::F16 | DType::BF16 | DType::F32 => Path::F32,
            _ if quant_codecs::ops::act_choice() == ActChoice::Auto => Path::Int8,
            _ => match quant_codecs::ops::act_path(dtype) {
                ActPath::Int8 => Path::Int8,
                ActPath::F32 => Path::F32,
            },
        }
    }
}

/// One sequence's part of a frame: its frame uniform (its position, and its first row in the
/// activation buffers), its cache for the block being encoded, and its rows. A frame of one
/// sequence has one part; a batched decode step has a part per sequence, and the blocks run
/// their row-wise work (projections) once over every row and their sequence work (conv,
/// recurrence, attention over the caches) once per part.
pub struct Part<'a, S> {
    /// The sequence's frame uniform.
    pub frame: &'a wgpu::Buffer,
    /// The sequence's cache for this block.
    pub state: &'a S,
    /// Its rows in the frame.
    pub rows: usize,
}

/// A frame being recorded: the graph, the device, the scratch, the frame uniform, the rows.
pub struct Enc<'a, S> {
    /// The graph.
    pub g: &'a mut Graph,
    /// The device.
    pub dev: &'a Device,
    /// The scratch buffers (the model's own).
    pub s: &'a S,
    /// The frame uniform.
    pub frame: &'a wgpu::Buffer,
    /// Token rows.
    pub nt: usize,
    /// Whether the intermediates are tapped for a trace.
    pub traced: bool,
}

impl<'a, S> Enc<'a, S> {
    /// Records what `f` encodes with `frame` as the ops' frame uniform (a sequence's own, for
    /// its part of a batched frame).
    pub fn with_frame<R>(&mut self, frame: &'a wgpu::Buffer, f: impl FnOnce(&mut Self) -> R) -> R {
        let saved = std::mem::replace(&mut self.frame, frame);
        let out = f(self);
        self.frame = saved;
        out
    }

    /// `y_i = W_i x` over `nt` rows for matrices that read the same `x`: q8_2f matrices on
    /// the int8 path share one quantiser dispatch (each still applies its own column scales);
    /// any other mix runs [`Enc::matvec`] on each.
    pub fn matvecs(
        &mut self,
        mats: &[(&GpuMatrix, &wgpu::Buffer)],
        x: &wgpu::Buffer,
        nt: usize,
    ) -> Result<(), GpuError> {
        let shareable = mats.len() >= 2
            && mats.iter().all(|(m, _)| {
                m.dtype == DType::Q8_2f
                    && self.dev.path(m.dtype) == Path::Int8
                    && m.cols.is_multiple_of(32)
            });
        let ms: Vec<&GpuMatrix> = mats.iter().map(|(m, _)| *m).collect();
        if let Some(table) = shareable.then(|| self.dev.col_scale_table(&ms)).flatten() {
            return self.g.matvecs_shared(&self.dev.ctx, mats, x, nt, &table);
        }
        for (m, y) in mats {
            self.matvec(m, x, y, nt, Epilogue::None)?;
        }
        Ok(())
    }

    /// `y = W x` over `nt` rows on the dtype's path.
    pub fn matvec(
        &mut self,
        m: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        nt: usize,
        epilogue: Epilogue,
    ) -> Result<(), GpuError> {
        let path = self.dev.path(m.dtype);
        self.g.matvec(&self.dev.ctx, m, x, y, nt, path, epilogue)
    }

    /// [`Enc::matvec`] with a hyper-connection epilogue over `h` streams and its auxiliary
    /// buffer `aux` (see `gpu_runtime::ops::matvec::prepare_aux`).
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_aux(
        &mut self,
        m: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        aux: &wgpu::Buffer,
        h: usize,
        nt: usize,
        epilogue: Epilogue,
    ) -> Result<(), GpuError> {
        self.matvec_with(m, x, y, aux, h, nt, epilogue, None)
    }

    /// [`Enc::matvec_aux`] with a hyper-connection site's norm folded in
    /// ([`Epilogue::HcFrontNorm`], [`Epilogue::HcReadoutNorm`]; see
    /// `gpu_runtime::ops::matvec::FoldedNorm`).
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_norm(
        &mut self,
        m: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        aux: &wgpu::Buffer,
        h: usize,
        nt: usize,
        epilogue: Epilogue,
        norm: gpu_runtime::ops::matvec::FoldedNorm<'_>,
    ) -> Result<(), GpuError> {
        self.matvec_with(m, x, y, aux, h, nt, epilogue, Some(norm))
    }

    #[allow(clippy::too_many_arguments)]
    fn matvec_with(
        &mut self,
        m: &GpuMatrix,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        aux: &wgpu::Buffer,
        h: usize,
        nt: usize,
        epilogue: Epilogue,
        norm: Option<gpu_runtime::ops::matvec::FoldedNorm<'_>>,
    ) -> Result<(), GpuError> {
        let path = self.dev.path(m.dtype);
        let aux = gpu_runtime::ops::matvec::Aux {
            buffer: aux,
            streams: h,
            norm,
        };
        self.g
            .matvec_aux(&self.dev.ctx, m, x, y, aux, nt, path, epilogue)
    }

    /// Matrices and two-matrix pairs that read the same `x`, q8_2f on the int8 path, with one
    /// quantiser for all (`table`: their column scales in member order; see
    /// `Graph::matvecs_members`).
    pub fn matvecs_members(
        &mut self,
        items: &[Member<'_>],
        x: &wgpu::Buffer,
        nt: usize,
        table: &wgpu::Buffer,
    ) -> Result<(), GpuError> {
        self.g.matvecs_members(&self.dev.ctx, items, x, nt, table)
    }

    /// A two-matrix epilogue over `m` (see `Graph::matvec_two`): `y` the first half's
    /// output (or the gate/up product), `aux` the second half's ([`Epilogue::PairTwo`]).
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_two(
        &mut self,
        m: &GpuMatrix,
        table: Option<&wgpu::Buffer>,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        aux: Option<&wgpu::Buffer>,
        nt: usize,
        epilogue: Epilogue,
    ) -> Result<(), GpuError> {
        let path = self.dev.path(m.dtype);
        let ctx = &self.dev.ctx;
        self.g
            .matvec_two(ctx, m, x, y, aux, nt, path, epilogue, table)
    }

    /// The grouped-experts matvec over `slots` slots of `bank` (activation row `s / x_div`).
    #[allow(clippy::too_many_arguments)]
    pub fn grouped(
        &mut self,
        bank: &ExpertBank,
        x: &wgpu::Buffer,
        x_rows: usize,
        ids: &wgpu::Buffer,
        y: &wgpu::Buffer,
        slots: usize,
        x_div: usize,
        epilogue: Epilogue,
    ) -> Result<(), GpuError> {
        let path = self.dev.path(bank.dtype);
        self.g.grouped(
            &self.dev.ctx,
            bank,
            x,
            x_rows,
            ids,
            y,
            slots,
            x_div,
            path,
            epilogue,
        )
    }

    /// An op kernel over `grid` workgroups.
    pub fn op(
        &mut self,
        op: Op,
        params: &[u32],
        bufs: &[&wgpu::Buffer],
        grid: (u32, u32),
    ) -> Result<(), GpuError> {
        self.g.op(&self.dev.ctx, op, params, self.frame, bufs, grid)
    }

    /// [`Enc::op`] with override `constants`.
    pub fn op_with(
        &mut self,
        op: Op,
        constants: &[(&str, f64)],
        params: &[u32],
        bufs: &[&wgpu::Buffer],
        grid: (u32, u32),
    ) -> Result<(), GpuError> {
        let ctx = &self.dev.ctx;
        self.g
            .op_with(ctx, op, constants, params, self.frame, bufs, grid)
    }

    /// An elementwise op over `n` lanes (its params end with the grid's x width).
    pub fn op_lanes(
        &mut self,
        op: Op,
        params: &[u32],
        bufs: &[&wgpu::Buffer],
        n: usize,
    ) -> Result<(), GpuError> {
        let grid = lanes_grid(&self.dev.ctx, n);
        let mut p = params.to_vec();
        p.push(grid.0);
        self.op(op, &p, bufs, grid)
    }

    /// `map` mode `mode` over `n` values.
    pub fn map(
        &mut self,
        mode: u32,
        a: u32,
        x: &wgpu::Buffer,
        x2: &wgpu::Buffer,
        y: &wgpu::Buffer,
        n: usize,
    ) -> Result<(), GpuError> {
        self.op_lanes(Op::Map, &[n as u32, mode, a], &[x, x2, y], n)
    }

    /// RMSNorm of `groups` groups of `group` values of `x` into `y` with the weight `w` (and
    /// its length, applied periodically) as `kind` says.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_kind(
        &mut self,
        x: &wgpu::Buffer,
        (w, w_len): (&wgpu::Buffer, usize),
        y: &wgpu::Buffer,
        groups: usize,
        group: usize,
        eps: f32,
        kind: NormWeight,
    ) -> Result<(), GpuError> {
        let p = [
            groups as u32,
            group as u32,
            w_len.max(1) as u32,
            eps.to_bits(),
            0,
            1,
            kind as u32,
        ];
        self.op(Op::RmsNorm, &p, &[x, w, y], (groups as u32, 1))
    }

    /// Unweighted RMSNorm of `groups` groups of `group` values of `x` into `y`.
    pub fn rms_norm_unweighted(
        &mut self,
        x: &wgpu::Buffer,
        y: &wgpu::Buffer,
        groups: usize,
        group: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        let unit = (&self.dev.unit, 1);
        self.rms_norm_kind(x, unit, y, groups, group, eps, NormWeight::None)
    }

    /// (1+w) RMSNorm of `groups` groups of `group` values of `x` into `y`; `w` is the weight
    /// and its length (applied periodically).
    pub fn rms_norm(
        &mut self,
        x: &wgpu::Buffer,
        (w, w_len): &(wgpu::Buffer, usize),
        y: &wgpu::Buffer,
        groups: usize,
        group: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        let p = [
            groups as u32,
            group as u32,
            *w_len as u32,
            eps.to_bits(),
            0,
            1,
        ];
        self.op(Op::RmsNorm, &p, &[x, w, y], (groups as u32, 1))
    }

    /// [`Enc::rms_norm`] of H-stream rows (`groups` = rows x `h`) after injecting `blk`
    /// (`[rows, group]`) with the weights `inj` (`[groups]`) into `x` in place:
    /// `x[g] += inj[g] * blk[g / h]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_injected(
        &mut self,
        x: &wgpu::Buffer,
        (w, w_len): &(wgpu::Buffer, usize),
        y: &wgpu::Buffer,
        groups: usize,
        group: usize,
        eps: f32,
        blk: &wgpu::Buffer,
        inj: &wgpu::Buffer,
        h: usize,
    ) -> Result<(), GpuError> {
        let p = [
            groups as u32,
            group as u32,
            *w_len as u32,
            eps.to_bits(),
            1,
            h as u32,
        ];
        self.op(Op::RmsNorm, &p, &[x, w, y, blk, inj], (groups as u32, 1))
    }

    /// Taps `rows * width` floats of `buf` as `name` of `layer` when tracing.
    pub fn tap(&mut self, name: &'static str, layer: usize, buf: &wgpu::Buffer, n: usize) {
        if self.traced {
            self.g.tap(name, layer, buf, 0, n);
        }
    }
}

/// A buffer the host maps to read `floats` values back (a frame's logits, a token).
pub fn readback_buffer(ctx: &GpuContext, floats: usize) -> wgpu::Buffer {
    ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("readback"),
        size: (floats.max(4) * 4) as u64,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    })
}

/// A traced forward's taps gathered over its frames: per tap position, its name, layer and
/// rows so far (each frame's taps come in the same order; a frame without a head has fewer).
#[derive(Default)]
pub struct Traces(Vec<(&'static str, usize, Vec<f32>)>);

impl Traces {
    /// Reads one frame's `taps` back and appends their rows.
    pub fn add(
        &mut self,
        ctx: &GpuContext,
        taps: Vec<(graph::Tap, wgpu::Buffer)>,
    ) -> Result<(), GpuError> {
        for (j, (tap, buf)) in taps.into_iter().enumerate() {
            let data = gpu_runtime::readback::read_mapped(ctx, &buf, tap.count)?;
            match self.0.get_mut(j) {
                Some(t) if t.0 == tap.name && t.1 == tap.layer => t.2.extend(data),
                _ => self.0.push((tap.name, tap.layer, data)),
            }
        }
        Ok(())
    }

    /// Hands every intermediate to `trace`, in order.
    pub fn emit(&self, trace: &mut crate::Trace<'_>) {
        for (name, layer, data) in &self.0 {
            trace(name, *layer, data);
        }
    }
}
