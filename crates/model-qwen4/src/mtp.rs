//! The multi-token-prediction head (`mtp.*`, [`MtpWeights`]) on the CPU, and the trunk's final
//! streams it reads.
//!
//! At trunk position `p` the head takes the trunk's final streams `Hs_p` `[H, D]` (the last
//! layer's output, before the head mixer) and the token after `p`, `t_{p+1}`:
//! `e' = fc_embedding(norm_D(embed(t_{p+1})))`, `h_k = fc_hidden(norm_{H*D}(Hs_p)_k)` per stream,
//! `X_k = h_k + e'`; one decoder layer (indexed attention over the head's own cache of positions
//! `0..=p`, MoE, two hyper-connection sites, no PLE) gives `X'`, and
//! `lm_head(mixer(X'))` predicts `t_{p+2}`. A chained draft feeds `X'` and the drafted token
//! back at position `p + 1`. The hidden norm is over all `H*D` values as one vector (vLLM's
//! reading of the released head and the original engine's; llama.cpp normalises per stream).
//! Both norms are zero-centred (`1 + w`), as every norm of the model.

use std::collections::HashMap;
use std::sync::Arc;

use gpu_runtime::ops::graph::{self, Graph, storage};
use gpu_runtime::{Epilogue, GpuError, GpuMatrix, readback};
use kernels_wgsl::Op;
use model_core::check_tokens;
use model_core::trace::LAYER_OUT;
use quant_codecs::MAX_BATCH;
use quant_codecs::ops::linear;

use crate::config::Qwen4ExpTextConfig;
use crate::device::{Device, Enc, Part};
use crate::forward::{ForwardError, Model};
use crate::gpu::{GpuModel, encode_argmax, readback_buffer};
use crate::hc::HcGpu;
use crate::moe::{MoeGpu, Routed};
use crate::ops::rms_norm_1p;
use crate::qsa::{self, AttnDeviceState, AttnGpu, AttnState};
use crate::state::SeqState;
use crate::weights::{MixerWeights, MtpWeights};
use crate::{CausalLm, hc, moe};

/// The head's cache: its attention layer's keys, values and indexer keys, one entry per trunk
/// position it has run at.
#[derive(Debug, Clone, Default)]
pub struct MtpState {
    /// The layer's caches.
    pub attn: AttnState,
}

impl MtpState {
    /// Entries held (the next position the head runs at).
    pub fn len(&self, m: &Model<'_>) -> usize {
        let c = &m.config;
        self.attn.k.len() / (c.num_key_value_heads * c.head_dim)
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.attn.k.is_empty()
    }

    /// Drops the entries from position `n` on (a rejected draft's).
    pub fn truncate(&mut self, m: &Model<'_>, n: usize) {
        qsa::truncate(&m.config, &mut self.attn, n);
    }
}

/// What the head computed for its rows.
pub struct MtpOut {
    /// Its output streams `[t, H*D]` (what a chained draft takes as `Hs`).
    pub streams: Vec<f32>,
    /// The last row's logits `[vocab]` (empty when not asked for).
    pub logits: Vec<f32>,
}

impl Model<'_> {
    /// The MTP head, when the file has one.
    pub fn mtp(&self) -> Option<&MtpWeights<'_>> {
        self.weights.mtp.as_deref()
    }

    /// Feeds `tokens` like [`CausalLm::forward`] and returns the logits of every row
    /// `[t, vocab]` (of the last row when `last_only`) with every row's final streams
    /// `[t, H*D]` (what the MTP head reads).
    pub fn forward_streams(
        &self,
        tokens: &[u32],
        st: &mut SeqState,
        last_only: bool,
    ) -> Result<(Vec<f32>, Vec<f32>), ForwardError> {
        let last = self.config.num_hidden_layers - 1;
        let mut streams = Vec::new();
        let logits = self.run(
            tokens,
            st,
            &mut |name, layer, data| {
                if name == LAYER_OUT && layer == last {
                    streams = data.to_vec();
                }
            },
            last_only,
        )?;
        Ok((logits, streams))
    }

    /// Runs the MTP head over `t` rows at positions `st.len()..`: row `r` takes the streams
    /// `hs[r]` (`[t, H*D]`: the trunk's final streams at that position, or the head's own
    /// output for a chained draft) and `tokens[r]`, the token after that position; the
    /// logits of the last row when `logits` (else none: entries made for later steps).
    /// Errors when the file has no head or a token is outside the vocabulary.
    pub fn mtp_forward(
        &self,
        hs: &[f32],
        tokens: &[u32],
        st: &mut MtpState,
        logits: bool,
    ) -> Result<MtpOut, ForwardError> {
        let c = &self.config;
        let w = self.mtp().ok_or(ForwardError::NoMtp)?;
        model_core::check_tokens(tokens, c.vocab_size)?;
        let t = tokens.len();
        let (h, d) = (c.hc_count, c.hidden_size);
        let hd = h * d;
        assert_eq!(hs.len(), t * hd, "streams of every row");
        let eps = c.rms_norm_eps as f32;

        let mut e = vec![0f32; t * d];
        for (r, &id) in tokens.iter().enumerate() {
            let row = &mut e[r * d..(r + 1) * d];
            let embed = &self.weights.embed;
            embed.dequantize_row(id as usize, row).expect("id checked");
        }
        rms_norm_1p(&mut e, &w.pre_fc_norm_embedding, d, eps);
        let e = linear(&w.fc_embedding, &e, t);
        let mut hn = hs.to_vec();
        rms_norm_1p(&mut hn, &w.pre_fc_norm_hidden, hd, eps);
        // Every stream of every row through the one projection: `t * H` rows of D.
        let mut x = linear(&w.fc_hidden, &hn, t * h);
        for r in 0..t {
            for k in 0..h {
                let xs = &mut x[r * hd + k * d..r * hd + (k + 1) * d];
                for (a, b) in xs.iter_mut().zip(&e[r * d..(r + 1) * d]) {
                    *a += b;
                }
            }
        }

        let lw = &w.layer;
        let MixerWeights::Attn(aw) = &lw.mixer else {
            unreachable!("bound as indexed attention")
        };
        let mix = hc::forward_cpu(&lw.attn_hc, &x, t, h, d, eps);
        let p = qsa::project(aw, &mix.input, t);
        let o = qsa::attend(aw, c, self.rope(), &p, 0, t, &mut st.attn);
        let y = linear(&aw.o, &o, t);
        hc::inject(&mut x, &y, &mix.inject, t, h, d);
        let mix = hc::forward_cpu(&lw.mlp_hc, &x, t, h, d, eps);
        let y = moe::forward_cpu(&lw.moe, c, &mix.input, t);
        hc::inject(&mut x, &y, &mix.inject, t, h, d);

        let logits = if logits {
            let last = &x[(t - 1) * hd..];
            let mixed = hc::forward_cpu(&w.final_mixer, last, 1, h, d, eps);
            linear(&self.weights.lm_head, &mixed.input, 1)
        } else {
            Vec::new()
        };
        Ok(MtpOut { streams: x, logits })
    }
}

/// The head's weights on the device, with its input buffers (the frame's embedding rows and
/// streams, written by the host).
pub(crate) struct MtpGpu {
    fc_embedding: Arc<GpuMatrix>,
    fc_hidden: Arc<GpuMatrix>,
    norm_embedding: (wgpu::Buffer, usize),
    norm_hidden: (wgpu::Buffer, usize),
    attn_hc: HcGpu,
    attn: AttnGpu,
    mlp_hc: HcGpu,
    moe: MoeGpu,
    final_mixer: HcGpu,
    /// Injection weights of 1 (`[8, H]`): adds the embedding row to every stream.
    ones: wgpu::Buffer,
    /// The rows' token embeddings `[8, D]`.
    emb_in: wgpu::Buffer,
    /// The rows' input streams `[8, H*D]`.
    hs_in: wgpu::Buffer,
    /// The projected embeddings `[8, D]`.
    e: wgpu::Buffer,
}

impl MtpGpu {
    /// Uploads `w`.
    pub(crate) fn upload(
        dev: &Device,
        w: &MtpWeights<'_>,
        c: &Qwen4ExpTextConfig,
        banks: bool,
    ) -> Result<MtpGpu, GpuError> {
        let lw = &w.layer;
        let MixerWeights::Attn(aw) = &lw.mixer else {
            unreachable!("bound as indexed attention")
        };
        let (h, d) = (c.hc_count, c.hidden_size);
        let n = |v: &model_core::bind::Vector| (dev.vec(v.name(), v), v.len());
        Ok(MtpGpu {
            fc_embedding: dev.mat(&w.fc_embedding)?,
            fc_hidden: dev.mat(&w.fc_hidden)?,
            norm_embedding: n(&w.pre_fc_norm_embedding),
            norm_hidden: n(&w.pre_fc_norm_hidden),
            attn_hc: HcGpu::upload(dev, &lw.attn_hc, h)?,
            attn: AttnGpu::upload(dev, aw)?,
            mlp_hc: HcGpu::upload(dev, &lw.mlp_hc, h)?,
            moe: MoeGpu::upload(dev, &lw.moe, Routed::upload(dev, &lw.moe, banks, None)?)?,
            final_mixer: HcGpu::upload(dev, &w.final_mixer, h)?,
            ones: dev.vec("mtp ones", &vec![1.0; MAX_BATCH * h]),
            emb_in: storage(&dev.ctx, "mtp embedding rows", MAX_BATCH * d),
            hs_in: storage(&dev.ctx, "mtp streams in", MAX_BATCH * h * d),
            e: storage(&dev.ctx, "mtp projected embeddings", MAX_BATCH * d),
        })
    }
}

/// What a head frame on the device computes after its layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MtpHead {
    /// Nothing (entries made for later drafts).
    None,
    /// The last row's logits.
    Logits,
    /// The last row's greedy token (its logits stay on the device).
    Argmax,
}

/// What the head computed on the device for its rows.
pub struct MtpGpuOut {
    /// Its output streams `[t, H*D]`.
    pub streams: Vec<f32>,
    /// The last row's logits, when asked for.
    pub logits: Vec<f32>,
    /// The last row's greedy token, when asked for.
    pub token: Option<u32>,
}

/// The head's cache on the device (its attention layer's, preallocated for the model's
/// context), its position and frame uniform, and the frames recorded against them.
pub struct MtpDeviceState {
    model: u64,
    attn: AttnDeviceState,
    pos: usize,
    frame: wgpu::Buffer,
    /// The streams `[8, H*D]` the host reads back.
    stage: wgpu::Buffer,
    /// The logits row, or the token, the host reads back (only what was asked for is read).
    stage_head: wgpu::Buffer,
    graphs: HashMap<(usize, MtpHead), Graph>,
    /// The next head frame of the last one's shape, encoded while that one ran.
    next: Option<((usize, MtpHead), wgpu::CommandBuffer)>,
}

impl std::fmt::Debug for MtpDeviceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MtpDeviceState")
            .field("pos", &self.pos)
            .finish()
    }
}

impl MtpDeviceState {
    /// Entries held (the next position the head runs at).
    pub fn len(&self) -> usize {
        self.pos
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.pos == 0
    }

    /// Drops the entries from position `n` on (a rejected draft's): later frames overwrite
    /// them, and a compressed block is only read once the frame that completes it has run.
    pub fn truncate(&mut self, n: usize) {
        self.pos = self.pos.min(n);
    }
}

impl GpuModel<'_> {
    /// A new empty head cache on the device; an error when the file has no head.
    pub fn new_mtp_state(&self) -> Result<MtpDeviceState, ForwardError> {
        let c = &self.model.config;
        if self.res.mtp.is_none() {
            return Err(ForwardError::NoMtp);
        }
        let ctx = &self.res.dev.ctx;
        let (h, d) = (c.hc_count, c.hidden_size);
        let st = ctx.checked("the MTP head's cache", || MtpDeviceState {
            model: self.res.uid,
            attn: AttnDeviceState::new(ctx, c, self.res.ctx_len),
            pos: 0,
            frame: graph::frame_buffer(ctx),
            stage: readback_buffer(ctx, MAX_BATCH * h * d),
            stage_head: readback_buffer(ctx, c.vocab_size),
            graphs: HashMap::new(),
            next: None,
        })?;
        Ok(st)
    }

    /// [`Model::mtp_forward`] on the device: the head over `t` rows at positions `st.len()..`
    /// (frames of up to 8), each row's streams `hs[r]` with `tokens[r]`; after the last
    /// frame, what `head` asks for of the last row.
    pub fn mtp_forward(
        &self,
        hs: &[f32],
        tokens: &[u32],
        st: &mut MtpDeviceState,
        head: MtpHead,
    ) -> Result<MtpGpuOut, ForwardError> {
        let c = &self.model.config;
        let m = self.res.mtp.as_ref().ok_or(ForwardError::NoMtp)?;
        check_tokens(tokens, c.vocab_size)?;
        if st.model != self.res.uid {
            return Err(ForwardError::StateMismatch(0));
        }
        if st.pos + tokens.len() > self.res.ctx_len {
            return Err(ForwardError::Context {
                needed: st.pos + tokens.len(),
                ctx: self.res.ctx_len,
            });
        }
        let (h, d, v) = (c.hc_count, c.hidden_size, c.vocab_size);
        let hd = h * d;
        assert_eq!(hs.len(), tokens.len() * hd, "streams of every row");
        let ctx = &self.res.dev.ctx;
        let ratio = c.qsa().map_or(1, |q| q.ratio);
        let mut out = MtpGpuOut {
            streams: Vec::with_capacity(hs.len()),
            logits: Vec::new(),
            token: None,
        };
        let frames = tokens.len().div_ceil(MAX_BATCH);
        for (i, (toks, rows)) in tokens
            .chunks(MAX_BATCH)
            .zip(hs.chunks(MAX_BATCH * hd))
            .enumerate()
        {
            let nt = toks.len();
            let fh = if i + 1 == frames { head } else { MtpHead::None };
            let emb = self.embeddings(toks);
            ctx.queue
                .write_buffer(&m.emb_in, 0, bytemuck::cast_slice(&emb));
            ctx.queue
                .write_buffer(&m.hs_in, 0, bytemuck::cast_slice(rows));
            let past = st.pos;
            let blocks = ((past / ratio) as u32, ((past + nt) / ratio) as u32);
            graph::write_frame(ctx, &st.frame, past as u32, blocks, 0);
            if !st.graphs.contains_key(&(nt, fh)) {
                let g = self.build_mtp(m, st, nt, fh)?;
                st.graphs.insert((nt, fh), g);
            }
            let key = (nt, fh);
            let encode = |st: &MtpDeviceState| {
                let mut enc = ctx
                    .device
                    .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                        label: Some("mtp frame"),
                    });
                st.graphs[&key].record(ctx, &mut enc, None);
                let s = &self.res.scratch;
                enc.copy_buffer_to_buffer(&s.x, 0, &st.stage, 0, (nt * hd * 4) as u64);
                let read = match fh {
                    MtpHead::None => 0,
                    MtpHead::Logits => v,
                    MtpHead::Argmax => 1,
                };
                let src = if fh == MtpHead::Argmax {
                    &s.token
                } else {
                    &s.logits
                };
                if read > 0 {
                    enc.copy_buffer_to_buffer(src, 0, &st.stage_head, 0, (read * 4) as u64);
                }
                enc.finish()
            };
            // Encoded while the last head frame ran, when it had this shape (the graph does
            // not depend on the rows: their inputs go up by `write_buffer`).
            let cb = match st.next.take() {
                Some((k, cb)) if k == key => cb,
                _ => encode(st),
            };
            ctx.queue.submit([cb]);
            st.next = Some((key, encode(st)));
            st.pos += nt;
            out.streams
                .extend(readback::read_mapped(ctx, &st.stage, nt * hd)?);
            match fh {
                MtpHead::None => {}
                MtpHead::Logits => out.logits = readback::read_mapped(ctx, &st.stage_head, v)?,
                MtpHead::Argmax => {
                    let t = readback::read_mapped(ctx, &st.stage_head, 1)?;
                    out.token = Some(t[0].to_bits());
                }
            }
        }
        Ok(out)
    }

    /// Records a head frame of `nt` rows for `st`: the two input projections, the layer, and
    /// what `head` asks for.
    fn build_mtp(
        &self,
        m: &MtpGpu,
        st: &MtpDeviceState,
        nt: usize,
        head: MtpHead,
    ) -> Result<Graph, GpuError> {
        let c = &self.model.config;
        let (h, d, v) = (c.hc_count, c.hidden_size, c.vocab_size);
        let eps = c.rms_norm_eps as f32;
        let mut g = Graph::new();
        let s = &self.res.scratch;
        let mut e = Enc {
            g: &mut g,
            dev: &self.res.dev,
            s,
            frame: &st.frame,
            nt,
            traced: false,
        };
        // e' = fc_embedding(norm(embed)) into `m.e`.
        e.rms_norm(&m.emb_in, &m.norm_embedding, &s.u, nt, d, eps)?;
        e.matvec(&m.fc_embedding, &s.u, &m.e, nt, Epilogue::None)?;
        // Each stream through fc_hidden: `nt * H` rows of D, in runs of at most 8 rows (the
        // matvec's tile) staged through `u` and `y` when they do not fit one.
        e.rms_norm(&m.hs_in, &m.norm_hidden, &s.xn, nt, h * d, eps)?;
        if nt * h <= MAX_BATCH {
            e.matvec(&m.fc_hidden, &s.xn, &s.x, nt * h, Epilogue::None)?;
        } else {
            for r0 in (0..nt * h).step_by(MAX_BATCH) {
                let rows = MAX_BATCH.min(nt * h - r0);
                let off = (r0 * d) as u32;
                e.map(3, off, &s.xn, &s.g, &s.u, rows * d)?;
                e.matvec(&m.fc_hidden, &s.u, &s.y, rows, Epilogue::None)?;
                e.map(4, off, &s.y, &s.g, &s.x, rows * d)?;
            }
        }
        let p = [(nt * h * d) as u32, h as u32, d as u32];
        e.op_lanes(Op::HcInject, &p, &[&s.x, &m.ones, &m.e], nt * h * d)?;

        // Which slot of `s.inj` holds the last site's injection weights (`hc::encode`).
        let mut slot = 0;
        hc::encode(&mut e, &m.attn_hc, &s.x, nt, h, d, eps, None, &mut slot)?;
        let rope = self
            .res
            .rope
            .as_ref()
            .expect("made for a model with a head");
        let parts = [Part {
            frame: &st.frame,
            state: &st.attn,
            rows: nt,
        }];
        qsa::encode(
            &mut e,
            &m.attn,
            c,
            rope,
            &parts,
            nt,
            self.res.ctx_len,
            c.num_hidden_layers,
        )?;
        let y = Some(&s.y);
        hc::encode(&mut e, &m.mlp_hc, &s.x, nt, h, d, eps, y, &mut slot)?;
        moe::encode(&mut e, &m.moe, c, &s.y, nt, c.num_hidden_layers)?;
        hc::encode_inject(&mut e, &s.x, &s.y, nt, h, d, slot)?;
        if head == MtpHead::None {
            return Ok(g);
        }
        let last = if nt == 1 {
            &s.x
        } else {
            let off = ((nt - 1) * h * d) as u32;
            e.map(3, off, &s.x, &s.g, &s.x_last, h * d)?;
            &s.x_last
        };
        hc::encode(&mut e, &m.final_mixer, last, 1, h, d, eps, None, &mut slot)?;
        e.matvec(&self.res.lm_head, &s.u, &s.logits, 1, Epilogue::None)?;
        if head == MtpHead::Argmax {
            encode_argmax(&mut e, v)?;
        }
        Ok(g)
    }
}
