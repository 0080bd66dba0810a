//! The deepseek_v4 device forward ([`GpuModel`]): every weight but the embedding uploaded
//! once (the routed experts as one bank per layer and matrix), the sequence's caches
//! ([`GpuState`]: window rings, compressor rings and entries, indexer keys) preallocated on
//! the device for the context, and each frame of up to 8 token rows recorded once per
//! (rows, head) into a [`Graph`] replayed for every later frame of that shape: the position
//! goes up in the frame uniform, the host writes the embedding rows and token ids and reads
//! back the logits. Block by block it is the CPU forward ([`crate::forward`]): the same trace
//! names, compared in the tests.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use gpu_runtime::ops::graph::{self, Graph, Tap};
use gpu_runtime::{Epilogue, GpuContext, GpuError, GpuMatrix, readback};
use model_core::device::readback_buffer;
use model_core::trace::{
    ATTN_INPUT, ATTN_OUT, ATTN_STREAMS, HEAD_OUT, LAYER_OUT, LOGITS, MLP_INPUT, MOE_OUT,
};
use model_core::{CausalLm, Trace, check_tokens};
use quant_codecs::MAX_BATCH;

use crate::attention::{AttnDeviceState, AttnGpu};
use crate::device::{Device, Enc, RopeGpu, Scratch};
use crate::forward::{ForwardError, Model};
use crate::hc::{self, HcDims, HcGpu};
use crate::moe::{MoeGpu, Router};
use crate::ops::Rope;

static NEXT_UID: AtomicU64 = AtomicU64::new(2 << 40);

struct LayerGpu {
    attn_hc: HcGpu,
    attn: AttnGpu,
    ffn_hc: HcGpu,
    moe: MoeGpu,
}

/// What a frame computes after the layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Head {
    /// Nothing (a prefill frame before the last).
    None,
    /// The logits of every row.
    All,
    /// The logits of the last row.
    Last,
}

/// A model whose weights live on the device, with the CPU model it was uploaded from (the
/// embedding rows are gathered from that one's mapped file).
pub struct GpuModel<'a> {
    /// The CPU model.
    pub model: Model<'a>,
    res: Resident,
    traced: AtomicBool,
}

struct Resident {
    dev: Device,
    layers: Vec<LayerGpu>,
    head: HcGpu,
    lm_head: Arc<GpuMatrix>,
    ropes: RopeGpu,
    scratch: Scratch,
    ctx_len: usize,
    uid: u64,
}

/// A model that could not go to the device, handed back with the reason.
pub struct Unplaced<'a> {
    /// The CPU model.
    pub model: Model<'a>,
    /// Why.
    pub error: GpuError,
}

impl std::fmt::Debug for Unplaced<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Unplaced({})", self.error)
    }
}

fn unsupported(reason: String) -> GpuError {
    GpuError::UnsupportedFusion {
        epilogue: "deepseek_v4 device forward",
        reason,
    }
}

impl<'a> GpuModel<'a> {
    /// Uploads `model` to `ctx` for sequences of up to `ctx_len` tokens; on any failure (a
    /// geometry the kernels do not take, the VRAM budget, a pipeline the driver rejects) the
    /// CPU model comes back with the error.
    pub fn new(
        model: Model<'a>,
        ctx: Arc<GpuContext>,
        ctx_len: usize,
    ) -> Result<GpuModel<'a>, Box<Unplaced<'a>>> {
        match Self::upload(&model, ctx, ctx_len) {
            Ok(res) => Ok(GpuModel {
                model,
                res,
                traced: AtomicBool::new(false),
            }),
            Err(error) => Err(Box::new(Unplaced { model, error })),
        }
    }

    fn upload(
        model: &Model<'_>,
        ctx: Arc<GpuContext>,
        ctx_len: usize,
    ) -> Result<Resident, GpuError> {
        let c = &model.config;
        let w = &model.weights;
        let (nh, dh, di) = (c.num_attention_heads, c.head_dim, c.index_head_dim);
        // The attention's scratch reuse: `o` holds `q_a`'s and `q_b`'s raw outputs, `ckv`
        // the latent's.
        if c.q_lora_rank > nh * dh || c.hc_mult > 8 || ctx_len == 0 {
            return Err(unsupported(format!(
                "q_lora_rank {} > heads x head_dim {}, hc_mult {} > 8, or ctx {ctx_len}",
                c.q_lora_rank,
                nh * dh,
                c.hc_mult
            )));
        }
        if (nh * dh) % c.o_groups != 0 || di > 2 * dh.max(di) {
            return Err(unsupported(format!(
                "{nh} heads of {dh} in {} groups",
                c.o_groups
            )));
        }
        let uid = NEXT_UID.fetch_add(1, Ordering::Relaxed);
        let dev = Device::new(ctx.clone(), uid);
        let dims = HcDims {
            n: c.hc_mult,
            d: c.hidden_size,
            norm_eps: c.rms_norm_eps as f32,
            hc_eps: c.hc_eps as f32,
            iters: c.hc_sinkhorn_iters,
        };
        let rt = Router::of(c);
        let layers = w
            .layers
            .iter()
            .enumerate()
            .map(|(il, lw)| {
                Ok(LayerGpu {
                    attn_hc: HcGpu::site(&dev, &lw.attn_hc, &lw.input_layernorm, &dims)?,
                    attn: AttnGpu::new(&dev, &lw.attn, c, c.attn_kind(il))?,
                    ffn_hc: HcGpu::site(&dev, &lw.ffn_hc, &lw.post_attention_layernorm, &dims)?,
                    moe: MoeGpu::new(&dev, &lw.moe, &rt, c.hidden_size, c.moe_intermediate_size)?,
                })
            })
            .collect::<Result<Vec<_>, GpuError>>()?;
        let main = Rope::new(c.rope_main(), dh);
        let compress = Rope::new(c.rope_compress(), dh);
        Ok(Resident {
            head: HcGpu::head(&dev, &w.hc_head, &w.norm, &dims)?,
            lm_head: dev.mat(&w.lm_head)?,
            ropes: RopeGpu::new(&ctx, &main, &compress, ctx_len),
            scratch: Scratch::new(&ctx, c, ctx_len),
            layers,
            dev,
            ctx_len,
            uid,
        })
    }

    /// The device context.
    pub fn ctx(&self) -> &Arc<GpuContext> {
        &self.res.dev.ctx
    }

    /// The context the states are sized for.
    pub fn ctx_len(&self) -> usize {
        self.res.ctx_len
    }

    /// Device bytes the weights hold.
    pub fn resident_bytes(&self) -> u64 {
        self.res.dev.resident_bytes()
    }

    /// Makes [`CausalLm::run`] tap every named intermediate for its trace (frames recorded
    /// with taps are slower: each tap ends a compute pass).
    pub fn set_tracing(&self, on: bool) {
        self.traced.store(on, Ordering::Relaxed);
    }

    /// Records a frame of `nt` rows of `st`.
    fn build(&self, st: &GpuState, nt: usize, head: Head, traced: bool) -> Result<Graph, GpuError> {
        let c = &self.model.config;
        let (n, d) = (c.hc_mult, c.hidden_size);
        let mut g = Graph::new();
        let s = &self.res.scratch;
        let mut e = Enc {
            g: &mut g,
            dev: &self.res.dev,
            s,
            frame: &st.frame,
            nt,
            traced,
        };
        for (il, lw) in self.res.layers.iter().enumerate() {
            lw.attn_hc.encode_pre(&mut e, &s.x, nt)?;
            e.tap(ATTN_INPUT, il, &s.u, nt * d);
            e.g.mark("mhc");
            let ropes = &self.res.ropes;
            lw.attn
                .encode(&mut e, c, ropes, &st.layers[il], nt, self.res.ctx_len)?;
            e.tap(ATTN_OUT, il, &s.y, nt * d);
            e.g.mark("attn");
            lw.attn_hc.encode_post(&mut e, &s.x, nt)?;
            e.tap(ATTN_STREAMS, il, &s.x, nt * n * d);
            lw.ffn_hc.encode_pre(&mut e, &s.x, nt)?;
            e.tap(MLP_INPUT, il, &s.u, nt * d);
            e.g.mark("mhc");
            lw.moe.encode(&mut e, nt)?;
            e.tap(MOE_OUT, il, &s.y, nt * d);
            e.g.mark("moe");
            lw.ffn_hc.encode_post(&mut e, &s.x, nt)?;
            e.tap(LAYER_OUT, il, &s.x, nt * n * d);
            e.g.mark("mhc");
        }
        let nl = c.num_hidden_layers;
        let rows = match head {
            Head::None => return Ok(g),
            Head::All => {
                self.res.head.encode_pre(&mut e, &s.x, nt)?;
                nt
            }
            Head::Last => {
                let off = ((nt - 1) * n * d) as u32;
                e.map(3, off, &s.x, &s.u, &s.x_last, n * d)?;
                self.res.head.encode_pre(&mut e, &s.x_last, 1)?;
                1
            }
        };
        e.tap(HEAD_OUT, nl, &s.u, rows * d);
        e.matvec(&self.res.lm_head, &s.u, &s.logits, rows, Epilogue::None)?;
        e.tap(LOGITS, nl, &s.logits, rows * c.vocab_size);
        e.g.mark("head");
        Ok(g)
    }

    /// Feeds `tokens` (one frame, at most 8) and returns the logits `head` asks for, with the
    /// taps of a traced frame.
    fn frame(
        &self,
        tokens: &[u32],
        st: &mut GpuState,
        head: Head,
        taps: Option<&mut Vec<(Tap, wgpu::Buffer)>>,
    ) -> Result<Vec<f32>, ForwardError> {
        let c = &self.model.config;
        let ctx = &self.res.dev.ctx;
        let s = &self.res.scratch;
        let nt = tokens.len();
        let xs = hc::embed_streams(
            &self.model.weights.embed_tokens,
            tokens,
            c.hc_mult,
            c.hidden_size,
        );
        ctx.queue.write_buffer(&s.x, 0, bytemuck::cast_slice(&xs));
        ctx.queue
            .write_buffer(&s.tokens, 0, bytemuck::cast_slice(tokens));
        graph::write_frame(ctx, &st.frame, st.pos as u32, (0, 0), 0);
        let traced = taps.is_some();
        let key = (nt, head, traced);
        if !st.graphs.contains_key(&key) {
            let g = self.build(st, nt, head, traced)?;
            st.graphs.insert(key, g);
            st.recorded += 1;
        }
        let read = match head {
            Head::None => 0,
            Head::All => nt * c.vocab_size,
            Head::Last => c.vocab_size,
        };
        let mut enc = ctx
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("deepseek frame"),
            });
        st.graphs[&key].record(ctx, &mut enc, taps);
        if read > 0 {
            enc.copy_buffer_to_buffer(&s.logits, 0, &st.stage, 0, (read * 4) as u64);
        }
        ctx.checked("a deepseek_v4 frame", || ctx.queue.submit([enc.finish()]))?;
        st.pos += nt;
        if read == 0 {
            ctx.wait();
            return Ok(Vec::new());
        }
        Ok(readback::read_mapped(ctx, &st.stage, read)?)
    }

    fn check(&self, tokens: &[u32], st: &GpuState) -> Result<(), ForwardError> {
        check_tokens(tokens, self.model.config.vocab_size)?;
        if st.model != self.res.uid {
            return Err(ForwardError::StateMismatch(
                "a device state of another model".into(),
            ));
        }
        if st.pos + tokens.len() > self.res.ctx_len {
            return Err(ForwardError::Context {
                needed: st.pos + tokens.len(),
                ctx: self.res.ctx_len,
            });
        }
        Ok(())
    }
}

/// A recorded frame: its rows, what it computes after the layers, whether it is traced.
type FrameKey = (usize, Head, bool);

/// A sequence on the device: every layer's caches preallocated for the model's context, the
/// position, the frame uniform and readback buffer, and the frames recorded against these
/// buffers. `Clone` copies the device buffers (a snapshot); [`GpuState::restore`] copies a
/// snapshot back into this state's own buffers, so its recorded frames stay valid.
pub struct GpuState {
    ctx: Arc<GpuContext>,
    model: u64,
    /// Tokens seen so far.
    pub pos: usize,
    layers: Vec<AttnDeviceState>,
    frame: wgpu::Buffer,
    stage: wgpu::Buffer,
    graphs: HashMap<FrameKey, Graph>,
    recorded: usize,
}

impl std::fmt::Debug for GpuState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuState").field("pos", &self.pos).finish()
    }
}

impl GpuState {
    fn new(m: &GpuModel<'_>) -> GpuState {
        let c = &m.model.config;
        let ctx = &m.res.dev.ctx;
        let layers = m
            .res
            .layers
            .iter()
            .map(|l| l.attn.state(ctx, c, m.res.ctx_len))
            .collect();
        GpuState {
            ctx: ctx.clone(),
            model: m.res.uid,
            pos: 0,
            layers,
            frame: graph::frame_buffer(ctx),
            stage: readback_buffer(ctx, MAX_BATCH * c.vocab_size),
            graphs: HashMap::new(),
            recorded: 0,
        }
    }

    /// Frames recorded so far: a steady decode loop leaves this unchanged.
    pub fn recorded_frames(&self) -> usize {
        self.recorded
    }

    /// Device memory the sequence's caches take (what a snapshot allocates).
    pub fn bytes(&self) -> u64 {
        self.buffers().iter().map(|b| b.size()).sum::<u64>() + self.stage.size()
    }

    /// A snapshot ([`Clone`]), or the device's refusal (out of device memory) as an error.
    pub fn try_clone(&self) -> Result<GpuState, ForwardError> {
        Ok(self.ctx.checked("a sequence snapshot", || self.clone())?)
    }

    fn buffers(&self) -> Vec<&wgpu::Buffer> {
        self.layers.iter().flat_map(|l| l.buffers()).collect()
    }

    /// Copies `snap` (a snapshot of a sequence of the same model) into this state's buffers.
    pub fn restore(&mut self, snap: &GpuState) -> Result<(), ForwardError> {
        if snap.model != self.model {
            return Err(ForwardError::StateMismatch(
                "a snapshot of another model".into(),
            ));
        }
        let mut enc = self
            .ctx
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("restore"),
            });
        for (dst, src) in self.buffers().into_iter().zip(snap.buffers()) {
            enc.copy_buffer_to_buffer(src, 0, dst, 0, src.size());
        }
        self.ctx.checked("a state restore", || {
            self.ctx.queue.submit([enc.finish()]);
        })?;
        self.pos = snap.pos;
        Ok(())
    }
}

impl Clone for GpuState {
    fn clone(&self) -> GpuState {
        let ctx = &self.ctx;
        let dup = |b: &wgpu::Buffer| {
            ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("state snapshot"),
                size: b.size(),
                usage: b.usage(),
                mapped_at_creation: false,
            })
        };
        let layers = self
            .layers
            .iter()
            .map(|l| AttnDeviceState {
                window: dup(&l.window),
                comp: l.comp.as_ref().map(|c| crate::compressor::CompDeviceState {
                    kv: dup(&c.kv),
                    gate: dup(&c.gate),
                    entries: dup(&c.entries),
                }),
                index: l
                    .index
                    .as_ref()
                    .map(|c| crate::compressor::CompDeviceState {
                        kv: dup(&c.kv),
                        gate: dup(&c.gate),
                        entries: dup(&c.entries),
                    }),
            })
            .collect();
        let mut out = GpuState {
            ctx: ctx.clone(),
            model: self.model,
            pos: 0,
            layers,
            frame: graph::frame_buffer(ctx),
            stage: dup(&self.stage),
            graphs: HashMap::new(),
            recorded: 0,
        };
        out.restore(self).expect("same model");
        out
    }
}

impl CausalLm for GpuModel<'_> {
    type State = GpuState;
    type Error = ForwardError;

    fn vocab_size(&self) -> usize {
        self.model.config.vocab_size
    }

    fn new_state(&self) -> GpuState {
        GpuState::new(self)
    }

    fn run(
        &self,
        tokens: &[u32],
        st: &mut GpuState,
        trace: &mut Trace<'_>,
        last_only: bool,
    ) -> Result<Vec<f32>, ForwardError> {
        self.check(tokens, st)?;
        let traced = self.traced.load(Ordering::Relaxed);
        let frames: Vec<&[u32]> = tokens.chunks(MAX_BATCH).collect();
        let mut logits = Vec::new();
        let mut traces = model_core::device::Traces::default();
        for (i, f) in frames.iter().enumerate() {
            let head = match (last_only, i + 1 == frames.len()) {
                (false, _) => Head::All,
                (true, true) => Head::Last,
                (true, false) => Head::None,
            };
            let mut taps = Vec::new();
            logits.extend(self.frame(f, st, head, traced.then_some(&mut taps))?);
            traces.add(&self.res.dev.ctx, taps)?;
        }
        traces.emit(trace);
        Ok(logits)
    }
}
