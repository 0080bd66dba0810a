//! The device-resident forward ([`GpuModel`]): every weight but the embedding and n-gram
//! tables uploaded once, the sequence state ([`GpuState`]) preallocated on the device for the
//! context, and each frame of up to 8 token rows recorded once per (rows, head) into a
//! [`Graph`] that is replayed for every later frame of that shape in one submission: no buffer
//! or bind group is created in the steady-state decode loop, the per-position values go up in
//! one 16-byte uniform, the host writes only the frame's embedding rows and gathered n-gram
//! rows, and reads back only the logits row(s) or the greedy token.
//!
//! The embedding rows are gathered on the host from the memory-mapped file, as the PLE rows
//! are (the host needs every token for the n-gram hashes anyway): the table then costs no VRAM.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use gpu_runtime::ops::graph::{self, Granularity, Graph, Tap};
use gpu_runtime::{Epilogue, GpuContext, GpuError, readback};
pub(crate) use model_core::device::readback_buffer;
use model_core::trace::{
    ATTN_INPUT, ATTN_OUT, ATTN_STREAMS, HEAD_OUT, LAYER_OUT, LOGITS, MLP_INPUT, MOE_OUT,
    PLE_STREAMS,
};
use model_core::{CausalLm, Trace, check_tokens};
use quant_codecs::MAX_BATCH;

use crate::config::LayerType;
use crate::device::{ARGMAX_CHUNK, Device, Enc, Part, Scratch};
use crate::expert_cache::LayerCache;
use crate::forward::{ForwardError, Model};
use crate::gdn::{GdnDeviceState, GdnGpu};
use crate::hc::HcGpu;
use crate::host_clock::{HostClock, HostStats, Phase};
use crate::moe::{MoeGpu, Routed};
use crate::mtp::MtpGpu;
use crate::offload::{ColdPath, Offload, Residency};
use crate::ple::PleGpu;
use crate::qsa::{AttnDeviceState, AttnGpu, RopeGpu};
use crate::weights::MixerWeights;
use crate::{gdn, hc, moe, ple, qsa};

mod state;
pub use state::{GpuRecurrent, GpuState, LayerDeviceState};

static NEXT_UID: AtomicU64 = AtomicU64::new(1 << 40);

enum MixerGpu {
    Gdn(GdnGpu),
    Attn(AttnGpu),
}

pub(crate) struct LayerGpu {
    ple: Option<PleGpu>,
    attn_hc: HcGpu,
    mixer: MixerGpu,
    mlp_hc: HcGpu,
    pub(crate) moe: MoeGpu,
}

/// What a frame computes after the layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Head {
    /// Nothing (a prefill frame before the last).
    None,
    /// The logits of every row.
    All,
    /// The logits of the last row.
    Last,
    /// The greedy token of the last row (its logits stay on the device).
    Argmax,
}

/// A model whose weights live on the device, with the CPU model it was uploaded from (the
/// embedding and n-gram tables are read from that one's mapped file).
pub struct GpuModel<'a> {
    /// The CPU model.
    pub model: Model<'a>,
    pub(crate) res: Resident,
    traced: AtomicBool,
    host: HostClock,
}

/// What lives on the device for a model, and the context its states are sized for.
pub(crate) struct Resident {
    pub(crate) dev: Device,
    pub(crate) layers: Vec<LayerGpu>,
    final_mixer: HcGpu,
    pub(crate) lm_head: Arc<gpu_runtime::GpuMatrix>,
    pub(crate) rope: Option<RopeGpu>,
    pub(crate) scratch: Scratch,
    /// The longest frame (a prompt's): [`crate::device::frame_rows`] where every expert is
    /// resident, else 8.
    pub(crate) frame_rows: usize,
    pub(crate) ctx_len: usize,
    pub(crate) uid: u64,
    /// The MTP head, when the file has one.
    pub(crate) mtp: Option<MtpGpu>,
    /// A batched decode step's gathered n-gram rows, per PLE layer (`[8, ple_embed_dim]`:
    /// one row per sequence; a lone sequence's frames use its state's own).
    batch_rows: Vec<Option<wgpu::Buffer>>,
    /// What a batched decode step's logits are read back through (`[8, vocab]`).
    batch_stage: wgpu::Buffer,
    /// The batched decode steps recorded so far.
    batches: BatchGraphs,
    /// The cold path (routed experts on the CPU): its buffers and counters.
    pub(crate) cold: ColdPath,
}

/// The batched decode steps recorded so far, least recently used first. A graph binds its
/// sequences' buffers, so a state's drop removes the steps that name it.
type BatchGraphs = Arc<Mutex<Vec<BatchStep>>>;

/// A batched decode step of one combination of sequences.
struct BatchStep {
    /// The sequences' uids, in row order.
    uids: Vec<u64>,
    graph: Graph,
    /// The next step's command buffer, encoded while the last one ran (as a lone
    /// sequence's decode does: the graph does not depend on the tokens).
    next: Option<wgpu::CommandBuffer>,
}

/// Batched-step graphs kept: each combination of sequences is one; a server's slots change
/// their combination only when a request starts or ends.
const BATCH_GRAPHS: usize = 16;

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

/// Why a geometry is refused by the device kernels, or anything else at upload.
pub(crate) fn unsupported(what: String) -> GpuError {
    GpuError::UnsupportedFusion {
        epilogue: "qwen4_exp device forward",
        reason: what,
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
        Self::with_banks(model, ctx, ctx_len, true)
    }

    /// [`GpuModel::new`], with the routed experts as banks for the grouped kernels (`banks`)
    /// or one matrix each (what a layer whose bank passes a binding falls back to).
    pub fn with_banks(
        model: Model<'a>,
        ctx: Arc<GpuContext>,
        ctx_len: usize,
        banks: bool,
    ) -> Result<GpuModel<'a>, Box<Unplaced<'a>>> {
        Self::with_residency(model, ctx, ctx_len, banks, Residency::Budget)
    }

    /// [`GpuModel::with_offload`] with the default policy.
    pub fn with_residency(
        model: Model<'a>,
        ctx: Arc<GpuContext>,
        ctx_len: usize,
        banks: bool,
        residency: Residency,
    ) -> Result<GpuModel<'a>, Box<Unplaced<'a>>> {
        Self::with_offload(model, ctx, ctx_len, banks, Offload::with(residency))
    }

    /// [`GpuModel::with_banks`] with `offload` choosing how many of each layer's routed
    /// experts live in VRAM, which, and how that changes; the others are computed on the CPU,
    /// from the mapped file.
    pub fn with_offload(
        model: Model<'a>,
        ctx: Arc<GpuContext>,
        ctx_len: usize,
        banks: bool,
        offload: Offload,
    ) -> Result<GpuModel<'a>, Box<Unplaced<'a>>> {
        match Self::upload(&model, ctx, ctx_len, banks, &offload) {
            Ok(res) => Ok(GpuModel {
                model,
                res,
                traced: AtomicBool::new(false),
                host: HostClock::default(),
            }),
            Err(error) => Err(Box::new(Unplaced { model, error })),
        }
    }

    fn upload(
        model: &Model<'_>,
        ctx: Arc<GpuContext>,
        ctx_len: usize,
        banks: bool,
        offload: &Offload,
    ) -> Result<Resident, GpuError> {
        let residency = &offload.residency;
        let c = &model.config;
        let w = &model.weights;
        if ctx_len == 0 {
            return Err(unsupported("a context of 0 tokens".into()));
        }
        let has_attn =
            (0..c.num_hidden_layers).any(|il| c.layer_type(il) == LayerType::IndexedAttention);
        gdn::device_limits(c).map_err(unsupported)?;
        if has_attn {
            qsa::device_limits(c).map_err(unsupported)?;
        }
        if c.num_experts_per_tok > 64 {
            return Err(unsupported("more than 64 experts per token".into()));
        }
        let uid = NEXT_UID.fetch_add(1, Ordering::Relaxed);
        let dev = Device::new(ctx, uid);
        let (nl, ne) = (w.layers.len(), c.num_experts);
        if let Residency::PerLayer(v) = residency
            && v.len() != nl
        {
            return Err(unsupported(format!(
                "resident experts given for {} layers, the model has {nl}",
                v.len()
            )));
        }
        // Everything but the routed experts goes up first (what must be resident whatever
        // the experts do); the budget left is the experts'.
        let needed = w.bytes_per_token(0);
        let over = |e: GpuError| match e {
            GpuError::OverBudget { budget, .. } => GpuError::BudgetTooSmall {
                budget_mib: budget >> 20,
                needed_mib: needed.div_ceil(1 << 20),
            },
            e => e,
        };
        let mut fronts = Vec::with_capacity(nl);
        for lw in &w.layers {
            let front = (|| {
                let ple = lw
                    .ple
                    .as_ref()
                    .map(|p| PleGpu::upload(&dev, p))
                    .transpose()?;
                let attn_hc = HcGpu::upload(&dev, &lw.attn_hc, c.hc_count)?;
                let mixer = match &lw.mixer {
                    MixerWeights::Gdn(g) => MixerGpu::Gdn(GdnGpu::upload(&dev, g)?),
                    MixerWeights::Attn(a) => MixerGpu::Attn(AttnGpu::upload(&dev, a)?),
                };
                let mlp_hc = HcGpu::upload(&dev, &lw.mlp_hc, c.hc_count)?;
                for m in [&lw.moe.router, &lw.moe.sh_down] {
                    dev.mat(m)?;
                }
                // The shared expert's gate and up as `MoeGpu::upload` will bind them.
                dev.two(&lw.moe.sh_gate, &lw.moe.sh_up)?;
                Ok((ple, attn_hc, mixer, mlp_hc))
            })()
            .map_err(over)?;
            fronts.push(front);
        }
        let final_mixer = HcGpu::upload(&dev, &w.final_mixer, c.hc_count).map_err(over)?;
        let lm_head = dev.mat(&w.lm_head).map_err(over)?;
        let resident: Vec<usize> = match residency {
            Residency::PerLayer(v) => v.iter().map(|&x| x.min(ne)).collect(),
            Residency::Budget => {
                let left = dev.budget().saturating_sub(dev.resident_bytes());
                let slot = w.layers.first().map_or(0, |l| Routed::slot_bytes(&l.moe));
                let all = slot * (ne * nl) as u64;
                let per = if left >= all || slot == 0 {
                    ne
                } else {
                    ((left / (slot * nl as u64)) as usize).min(ne)
                };
                vec![per; nl]
            }
        };
        // A partial bank is one binding per projection: at most what one binding holds (the
        // rest of the budget stays unused rather than the model leaving the device).
        let cap = w
            .layers
            .first()
            .map_or(ne, |l| Routed::bank_cap(&dev, &l.moe));
        let resident: Vec<usize> = resident
            .into_iter()
            .map(|r| if r < ne { r.min(cap) } else { r })
            .collect();
        let partial = resident.iter().any(|&r| r < ne);
        if partial {
            let (hot, all) = (resident.iter().sum::<usize>(), ne * nl);
            tracing::info!(
                "{hot} of {all} routed experts in VRAM ({:.1}%), the rest on the CPU",
                100.0 * hot as f64 / all.max(1) as f64
            );
        }
        let mut layers = Vec::with_capacity(nl);
        for (il, ((lw, (ple, attn_hc, mixer, mlp_hc)), &r)) in
            w.layers.iter().zip(fronts).zip(&resident).enumerate()
        {
            let scores = offload
                .warm
                .as_ref()
                .and_then(|s| s.get(il))
                .map(Vec::as_slice);
            let hot = LayerCache::initial(ne, r, scores);
            let routed = if r < ne {
                Routed::upload(&dev, &lw.moe, banks, Some((&hot, scores)))?
            } else {
                Routed::upload(&dev, &lw.moe, banks, None)?
            };
            layers.push(LayerGpu {
                ple,
                attn_hc,
                mixer,
                mlp_hc,
                moe: MoeGpu::upload(&dev, &lw.moe, routed)?,
            });
        }
        // The head goes up last and is optional: a model whose trunk fits runs on the device
        // without drafting when the head does not fit or its attention geometry is refused.
        let mtp = match w.mtp.as_deref() {
            Some(_) if partial => {
                tracing::warn!(
                    "the MTP head stays off the device (no drafting there): the trunk's experts do not all fit"
                );
                None
            }
            Some(m) => match qsa::device_limits(c)
                .map_err(unsupported)
                .and_then(|()| MtpGpu::upload(&dev, m, c, banks))
            {
                Ok(head) => Some(head),
                Err(e) => {
                    tracing::warn!("the MTP head stays off the device (no drafting there): {e}");
                    None
                }
            },
            None => None,
        };
        // The head is an indexed-attention layer whatever the trunk's layers are.
        let has_attn = has_attn || mtp.is_some();
        let rope = has_attn.then(|| RopeGpu::new(&dev, model.rope(), c.rotary_dim(), ctx_len));
        // A frame with cold experts reads back its slots and MoE input in buffers of 8 rows.
        let frame_rows = if partial {
            MAX_BATCH
        } else {
            let room = dev.budget().saturating_sub(dev.resident_bytes());
            crate::device::frame_rows(c, ctx_len, has_attn, dev.ctx.max_binding(), room)
        };
        let own_outs = dev.ctx.concurrent && !partial;
        let scratch = Scratch::new(&dev.ctx, c, frame_rows, ctx_len, has_attn, own_outs);
        let batch_rows = w
            .layers
            .iter()
            .map(|lw| {
                lw.ple.as_ref().map(|_| {
                    graph::storage(&dev.ctx, "batched ple rows", MAX_BATCH * c.ple_embed_dim())
                })
            })
            .collect();
        let batch_stage = readback_buffer(&dev.ctx, MAX_BATCH * c.vocab_size);
        let slot = w.layers.first().map_or(0, |l| Routed::slot_bytes(&l.moe));
        let cold = ColdPath::new(&dev, c, offload, slot, partial);
        Ok(Resident {
            dev,
            layers,
            final_mixer,
            lm_head,
            rope,
            scratch,
            frame_rows,
            ctx_len,
            uid,
            batch_rows,
            batch_stage,
            batches: Arc::default(),
            mtp,
            cold,
        })
    }

    /// Batched decode steps recorded and kept (each binds the sequences it was recorded for).
    pub fn batched_graphs(&self) -> usize {
        self.res.batches.lock().map_or(0, |b| b.len())
    }

    /// The context.
    pub fn ctx(&self) -> &Arc<GpuContext> {
        &self.res.dev.ctx
    }

    /// The longest sequence a state holds.
    pub fn ctx_len(&self) -> usize {
        self.res.ctx_len
    }

    /// Layers whose routed experts run through the grouped kernels.
    pub fn grouped_layers(&self) -> usize {
        self.res.layers.iter().filter(|l| l.moe.grouped()).count()
    }

    /// Device bytes of the weights.
    pub fn resident_bytes(&self) -> u64 {
        self.res.dev.resident_bytes()
    }

    /// Whether later forwards report their intermediates to the trace (each tap ends the
    /// compute pass and copies out: for the block-by-block comparison, not for speed).
    pub fn set_tracing(&self, on: bool) {
        self.traced.store(on, Ordering::Relaxed);
    }

    /// Records a frame of `seqs` (each sequence with its rows, in row order: one sequence's
    /// frame, or a batched decode step's row per sequence).
    fn build(
        &self,
        seqs: &[(&GpuState, usize)],
        head: Head,
        traced: bool,
    ) -> Result<Graph, GpuError> {
        let c = &self.model.config;
        let (h, d) = (c.hc_count, c.hidden_size);
        let eps = c.rms_norm_eps as f32;
        let nt: usize = seqs.iter().map(|(_, n)| n).sum();
        let mut g = Graph::new();
        let s = &self.res.scratch;
        let mut e = Enc {
            g: &mut g,
            dev: &self.res.dev,
            s,
            frame: &seqs[0].0.frame,
            nt,
            traced,
        };

        // A block's output waits to be injected into the streams by the next HC site's norm
        // (one dispatch fewer per block); it is injected on its own where the streams are
        // needed whole first: PLE, the end of a frame without a head, a traced run's taps.
        let mut pending: Option<&wgpu::Buffer> = None;
        // Which slot of `s.inj` holds the last site's injection weights (`hc::encode`).
        let mut slot = 0;
        let prefetch = self.res.dev.ctx.prefetch_hc;
        for (il, lw) in self.res.layers.iter().enumerate() {
            if let Some(pw) = &lw.ple {
                if let Some(y) = pending.take() {
                    hc::encode_inject(&mut e, &s.x, y, nt, h, d, slot)?;
                }
                let parts: Vec<Part<'_, wgpu::Buffer>> = seqs
                    .iter()
                    .map(|(st, rows)| Part {
                        frame: &st.frame,
                        state: &st.ple[il].as_ref().expect("state made for this model").1,
                        rows: *rows,
                    })
                    .collect();
                let e_in = match seqs {
                    [(st, _)] => &st.ple[il].as_ref().expect("state made for this model").0,
                    _ => self.res.batch_rows[il]
                        .as_ref()
                        .expect("made for this model"),
                };
                ple::encode(&mut e, pw, c, &s.x, e_in, &parts, nt)?;
                e.tap(PLE_STREAMS, il, &s.x, nt * h * d);
                e.g.mark("ple");
            }
            hc::encode(
                &mut e,
                &lw.attn_hc,
                &s.x,
                nt,
                h,
                d,
                eps,
                pending.take(),
                &mut slot,
            )?;
            e.tap(ATTN_INPUT, il, &s.u, nt * d);
            e.g.mark("hc");
            match &lw.mixer {
                MixerGpu::Gdn(gw) => {
                    let parts: Vec<_> = seqs
                        .iter()
                        .map(|(st, rows)| match &st.layers[il] {
                            LayerDeviceState::Gdn(gs) => Part {
                                frame: &st.frame,
                                state: gs,
                                rows: *rows,
                            },
                            _ => unreachable!("state checked against the model"),
                        })
                        .collect();
                    gdn::encode(&mut e, gw, c, &parts, nt, il)?
                }
                MixerGpu::Attn(aw) => {
                    let parts: Vec<_> = seqs
                        .iter()
                        .map(|(st, rows)| match &st.layers[il] {
                            LayerDeviceState::Attn(as_) => Part {
                                frame: &st.frame,
                                state: as_,
                                rows: *rows,
                            },
                            _ => unreachable!("state checked against the model"),
                        })
                        .collect();
                    let rope = self.res.rope.as_ref();
                    let rope = rope.expect("attention layers have RoPE tables");
                    qsa::encode(&mut e, aw, c, rope, &parts, nt, self.res.ctx_len, il)?
                }
            }
            if let Some(o) = s.outs(il, nt).filter(|_| prefetch) {
                hc::encode_prefetch(&mut e, &lw.mlp_hc, &o.prefetch[2..])?;
            }
            e.tap(ATTN_OUT, il, &s.y, nt * d);
            e.g.mark(match lw.mixer {
                MixerGpu::Gdn(_) => "gdn",
                MixerGpu::Attn(_) => "qsa",
            });
            if traced {
                hc::encode_inject(&mut e, &s.x, &s.y, nt, h, d, slot)?;
                e.tap(ATTN_STREAMS, il, &s.x, nt * h * d);
            } else {
                pending = Some(&s.y);
            }
            hc::encode(
                &mut e,
                &lw.mlp_hc,
                &s.x,
                nt,
                h,
                d,
                eps,
                pending.take(),
                &mut slot,
            )?;
            e.tap(MLP_INPUT, il, &s.u, nt * d);
            e.g.mark("hc");
            moe::encode(&mut e, &lw.moe, c, &s.y, nt, il)?;
            let next = self.res.layers.get(il + 1);
            if let (Some(o), Some(nw)) = (s.outs(il + 1, nt).filter(|_| prefetch), next) {
                hc::encode_prefetch(&mut e, &nw.attn_hc, &o.prefetch[..2])?;
            }
            e.tap(MOE_OUT, il, &s.y, nt * d);
            e.g.mark("moe");
            if traced {
                hc::encode_inject(&mut e, &s.x, &s.y, nt, h, d, slot)?;
                e.tap(LAYER_OUT, il, &s.x, nt * h * d);
                e.g.mark("hc");
            } else {
                pending = Some(&s.y);
            }
        }
        let nl = c.num_hidden_layers;
        let v = c.vocab_size;
        let rows = match head {
            Head::None => {
                if let Some(y) = pending.take() {
                    hc::encode_inject(&mut e, &s.x, y, nt, h, d, slot)?;
                    e.g.mark("hc");
                }
                return Ok(g);
            }
            Head::All => {
                hc::encode(
                    &mut e,
                    &self.res.final_mixer,
                    &s.x,
                    nt,
                    h,
                    d,
                    eps,
                    pending,
                    &mut slot,
                )?;
                nt
            }
            Head::Last | Head::Argmax if nt == 1 => {
                hc::encode(
                    &mut e,
                    &self.res.final_mixer,
                    &s.x,
                    1,
                    h,
                    d,
                    eps,
                    pending,
                    &mut slot,
                )?;
                1
            }
            Head::Last | Head::Argmax => {
                if let Some(y) = pending.take() {
                    hc::encode_inject(&mut e, &s.x, y, nt, h, d, slot)?;
                }
                let off = ((nt - 1) * h * d) as u32;
                e.map(3, off, &s.x, &s.g, &s.x_last, h * d)?;
                hc::encode(
                    &mut e,
                    &self.res.final_mixer,
                    &s.x_last,
                    1,
                    h,
                    d,
                    eps,
                    None,
                    &mut slot,
                )?;
                1
            }
        };
        e.tap(HEAD_OUT, nl, &s.u, rows * d);
        e.matvec(&self.res.lm_head, &s.u, &s.logits, rows, Epilogue::None)?;
        e.tap(LOGITS, nl, &s.logits, rows * v);
        if head == Head::Argmax {
            encode_argmax(&mut e, v)?;
        }
        e.g.mark("head");
        Ok(g)
    }

    /// A new empty sequence state on the device.
    pub fn new_device_state(&self) -> GpuState {
        GpuState::new(self)
    }

    /// The longest frame a prompt is fed in: up to 512 rows by default (fewer with
    /// `CORTIQ_PROMPT_ROWS`) where every routed expert is
    /// resident (fewer at a long context or where the budget leaves little room:
    /// [`crate::device::frame_rows`]), else 8.
    pub fn frame_rows(&self) -> usize {
        self.res.frame_rows
    }

    /// A prompt's frames ([`crate::device::frame_lengths`]): the longest of
    /// [`Resident::frame_rows`] rows and its halves (at most
    /// [`crate::device::ALL_LOGITS_ROWS`] when every row's logits are read: `all`) that the
    /// tokens left fill, then frames of 8 (so a state records a few long shapes, not one per
    /// prompt length: each keeps its own activation buffers).
    fn frames<'t>(&self, tokens: &'t [u32], all: bool) -> Vec<&'t [u32]> {
        let long = if all {
            self.res.frame_rows.min(crate::device::ALL_LOGITS_ROWS)
        } else {
            self.res.frame_rows
        };
        let mut out = Vec::new();
        let mut rest = tokens;
        for n in crate::device::frame_lengths(tokens.len(), long) {
            let (f, r) = rest.split_at(n);
            out.push(f);
            rest = r;
        }
        out
    }

    /// Feeds `tokens` (one frame, at most [`Resident::frame_rows`]) and returns what `head` asks for: logits rows, or
    /// the greedy token as the single value of the vector (bit-cast in `token`).
    fn frame(
        &self,
        tokens: &[u32],
        st: &mut GpuState,
        head: Head,
        taps: Option<&mut Vec<(Tap, wgpu::Buffer)>>,
        stages: Option<(Granularity, &mut Vec<(String, f64)>)>,
        streams: Option<&mut Vec<f32>>,
    ) -> Result<FrameOut, ForwardError> {
        let c = &self.model.config;
        let ctx = &self.res.dev.ctx;
        let nt = tokens.len();
        if nt > self.res.frame_rows
            || (head == Head::All && nt > crate::device::ALL_LOGITS_ROWS)
            || (nt > MAX_BATCH && !nt.is_multiple_of(MAX_BATCH))
        {
            return Err(unsupported(format!("a frame of {nt} rows with head {head:?}")).into());
        }
        let t_inputs = Instant::now();
        let xs = self.embed_rows(tokens);
        ctx.queue
            .write_buffer(&self.res.scratch.x, 0, bytemuck::cast_slice(&xs));
        let (history, gathered) = self.ngram_inputs(st, tokens);
        for (il, e) in gathered {
            let (e_in, _) = st.ple[il].as_ref().expect("state made for this model");
            ctx.queue.write_buffer(e_in, 0, bytemuck::cast_slice(&e));
        }
        self.write_frame(st, nt, 0);
        // Counted with the frame, where it runs without breaks (the cold path times its own).
        let inputs = t_inputs.elapsed();
        let traced = taps.is_some();
        let key = (nt, head, traced);
        if !st.graphs.contains_key(&key) {
            let g = self.build(&[(&*st, nt)], head, traced)?;
            st.graphs.insert(key, g);
            st.recorded += 1;
        }
        let v = c.vocab_size;
        let read = match head {
            Head::None => 0,
            Head::All => nt * v,
            Head::Last => v,
            Head::Argmax => 1,
        };
        let plain = taps.is_none() && stages.is_none();
        let hs = streams.is_some().then_some(nt * c.hc_count * c.hidden_size);
        st.fit_stages(read, hs.unwrap_or(0));
        if st.graphs[&key].has_breaks() {
            if stages.is_some() {
                return Err(unsupported(
                    "a profile of a model with experts on the CPU (profile it all-resident)".into(),
                )
                .into());
            }
            st.next = None;
            let g = &st.graphs[&key];
            self.run_breaks(g, nt, taps, &|enc| self.copy_out(enc, st, head, read, hs))?;
            return self.frame_out(st, &history, nt, head, read, hs, streams);
        }
        // A decode step encoded while the previous one ran (the graph does not depend on the
        // token: its inputs go up by `write_buffer`, queued before this submission).
        let stashed = match st.next.take() {
            Some((k, cb)) if plain && k == (key, hs.is_some()) => Some(cb),
            _ => None,
        };
        let mut profile = None;
        let cb = match stashed {
            Some(cb) => cb,
            None => {
                let g = &st.graphs[&key];
                let mut enc = ctx
                    .device
                    .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                        label: Some("frame"),
                    });
                match &stages {
                    Some((gran, _)) => profile = g.record_profiled(ctx, &mut enc, *gran),
                    None => g.record(ctx, &mut enc, taps),
                }
                self.copy_out(&mut enc, st, head, read, hs);
                enc.finish()
            }
        };
        self.host.add_time(Phase::Inputs, inputs);
        let t_submit = Instant::now();
        ctx.queue.submit([cb]);
        self.host.add(Phase::Submit, t_submit);
        let t_ahead = Instant::now();
        // The next frame of the same shape is encoded while this one runs (a decode step's
        // next, a prefill's next frame); a frame of another shape (a drafting loop
        // alternates checks and re-fed rows) encodes its own and this one is dropped.
        if plain {
            let g = &st.graphs[&key];
            let mut enc = ctx
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("frame (next)"),
                });
            g.record(ctx, &mut enc, None);
            self.copy_out(&mut enc, st, head, read, hs);
            st.next = Some(((key, hs.is_some()), enc.finish()));
        }
        self.host.add(Phase::Ahead, t_ahead);
        if let (Some(p), Some((_, out))) = (profile, stages) {
            out.extend(p.read(ctx)?);
        }
        let t_read = Instant::now();
        let out = self.frame_out(st, &history, nt, head, read, hs, streams);
        self.host.add(Phase::Read, t_read);
        self.host.frame();
        out
    }

    /// The host's time in the frames that ran without breaks so far ([`HostClock`]).
    pub fn host_stats(&self) -> HostStats {
        self.host.stats()
    }

    /// After a frame's submission: the state moves on, and what the frame copied out is read.
    #[allow(clippy::too_many_arguments)]
    fn frame_out(
        &self,
        st: &mut GpuState,
        history: &[i64],
        nt: usize,
        head: Head,
        read: usize,
        hs: Option<usize>,
        streams: Option<&mut Vec<f32>>,
    ) -> Result<FrameOut, ForwardError> {
        let ctx = &self.res.dev.ctx;
        self.count_routed(nt);
        st.advance(history, nt);
        if let (Some(n), Some(out)) = (hs, streams) {
            out.extend(readback::read_mapped(ctx, &st.hs_stage, n)?);
        }
        if read == 0 {
            ctx.wait();
            return Ok(FrameOut::Nothing);
        }
        let out = readback::read_mapped(ctx, &st.stage, read)?;
        Ok(if head == Head::Argmax {
            FrameOut::Token(out[0].to_bits())
        } else {
            FrameOut::Logits(out)
        })
    }

    /// The frame's input: each token's embedding row (gathered on the host from the mapped
    /// table), repeated into the H streams: `[nt, H*D]`.
    fn embed_rows(&self, tokens: &[u32]) -> Vec<f32> {
        let c = &self.model.config;
        let (h, d) = (c.hc_count, c.hidden_size);
        let mut xs = vec![0f32; tokens.len() * h * d];
        for (r, e) in self.embeddings(tokens).chunks(d).enumerate() {
            for k in 0..h {
                xs[r * h * d + k * d..r * h * d + (k + 1) * d].copy_from_slice(e);
            }
        }
        xs
    }

    /// Each token's embedding row `[nt, D]`, gathered on the host from the mapped table.
    pub(crate) fn embeddings(&self, tokens: &[u32]) -> Vec<f32> {
        let d = self.model.config.hidden_size;
        let mut e = vec![0f32; tokens.len() * d];
        for (row, &id) in e.chunks_mut(d).zip(tokens) {
            let embed = &self.model.weights.embed;
            embed.dequantize_row(id as usize, row).expect("id checked");
        }
        e
    }

    /// `st`'s n-gram history after `tokens`, and per PLE layer the gathered n-gram rows of
    /// `tokens` (`[nt, ple_embed_dim]`).
    fn ngram_inputs(&self, st: &GpuState, tokens: &[u32]) -> (Vec<i64>, Vec<(usize, Vec<f32>)>) {
        let c = &self.model.config;
        let mut history = st.ngram_ctx.clone();
        history.extend(tokens.iter().map(|&id| id as i64));
        let mut gathered = Vec::new();
        for (il, lw) in self.model.weights.layers.iter().enumerate() {
            if let Some(pw) = &lw.ple {
                let rows = ple::ngram_rows(
                    &pw.hash,
                    &history,
                    tokens.len(),
                    c.ngram_size,
                    c.heads_per_ngram,
                    c.eos_id().expect("validated"),
                );
                gathered.push((il, ple::gather(pw, c, &rows, tokens.len())));
            }
        }
        (history, gathered)
    }

    /// Writes `st`'s frame uniform for its next `nt` tokens, its rows starting at `row0`.
    fn write_frame(&self, st: &GpuState, nt: usize, row0: usize) {
        let past = st.pos;
        let ratio = self.model.config.qsa().map_or(1, |q| q.ratio);
        let blocks = ((past / ratio) as u32, ((past + nt) / ratio) as u32);
        graph::write_frame(
            &self.res.dev.ctx,
            &st.frame,
            past as u32,
            blocks,
            row0 as u32,
        );
    }

    /// Feeds one token to each sequence, 8 sequences to a frame (a batched decode step):
    /// every weight is read once for all the frame's rows, while each sequence's caches,
    /// recurrent state and position advance as if it had been fed alone. Returns each one's
    /// logits. Nothing is fed when a token or a state is refused.
    pub fn forward_rows(
        &self,
        seqs: &mut [(u32, &mut GpuState)],
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        for (tok, st) in seqs.iter() {
            self.check(&[*tok], st)?;
        }
        let mut out = Vec::with_capacity(seqs.len());
        for frame in seqs.chunks_mut(MAX_BATCH) {
            out.extend(self.batched_frame(frame)?);
        }
        Ok(out)
    }

    /// One frame of [`GpuModel::forward_rows`] (at most 8 sequences, checked).
    fn batched_frame(
        &self,
        seqs: &mut [(u32, &mut GpuState)],
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        if let [(tok, st)] = seqs {
            return Ok(vec![self.forward_last(&[*tok], st)?]);
        }
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let c = &self.model.config;
        let ctx = &self.res.dev.ctx;
        let (k, v) = (seqs.len(), c.vocab_size);
        let tokens: Vec<u32> = seqs.iter().map(|(t, _)| *t).collect();
        let xs = self.embed_rows(&tokens);
        ctx.queue
            .write_buffer(&self.res.scratch.x, 0, bytemuck::cast_slice(&xs));
        let mut histories = Vec::with_capacity(k);
        for (row, (tok, st)) in seqs.iter().enumerate() {
            let (history, gathered) = self.ngram_inputs(st, &[*tok]);
            for (il, e) in gathered {
                let buf = self.res.batch_rows[il]
                    .as_ref()
                    .expect("made for this model");
                let at = (row * e.len() * 4) as u64;
                ctx.queue.write_buffer(buf, at, bytemuck::cast_slice(&e));
            }
            self.write_frame(st, 1, row);
            histories.push(history);
        }
        let uids: Vec<u64> = seqs.iter().map(|(_, st)| st.uid).collect();
        let stage = &self.res.batch_stage;
        let encode = |g: &Graph| {
            let mut enc = ctx
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("batched frame"),
                });
            g.record(ctx, &mut enc, None);
            enc.copy_buffer_to_buffer(&self.res.scratch.logits, 0, stage, 0, (k * v * 4) as u64);
            enc.finish()
        };
        {
            let mut batches = self.res.batches.lock().unwrap_or_else(|p| p.into_inner());
            let mut step = match batches.iter().position(|b| b.uids == uids) {
                Some(at) => batches.remove(at),
                None => {
                    let members: Vec<(&GpuState, usize)> =
                        seqs.iter().map(|(_, st)| (&**st, 1)).collect();
                    let graph = self.build(&members, Head::All, false)?;
                    if batches.len() == BATCH_GRAPHS {
                        batches.remove(0);
                    }
                    for (_, st) in seqs.iter_mut() {
                        st.recorded += 1;
                    }
                    BatchStep {
                        uids,
                        graph,
                        next: None,
                    }
                }
            };
            if step.graph.has_breaks() {
                let tail = |enc: &mut wgpu::CommandEncoder| {
                    let bytes = (k * v * 4) as u64;
                    enc.copy_buffer_to_buffer(&self.res.scratch.logits, 0, stage, 0, bytes);
                };
                let run = self.run_breaks(&step.graph, k, None, &tail);
                batches.push(step);
                run?;
            } else {
                let cb = step.next.take().unwrap_or_else(|| encode(&step.graph));
                ctx.queue.submit([cb]);
                step.next = Some(encode(&step.graph));
                batches.push(step);
            }
        }
        for ((_, st), history) in seqs.iter_mut().zip(&histories) {
            st.advance(history, 1);
        }
        self.count_routed(k);
        let out = readback::read_mapped(ctx, stage, k * v)?;
        Ok(out.chunks(v).map(<[f32]>::to_vec).collect())
    }

    /// Copies what the host reads (`read` floats of the logits, or the token) into the
    /// state's readback buffer, and the frame's final streams (`hs` floats) when asked.
    fn copy_out(
        &self,
        enc: &mut wgpu::CommandEncoder,
        st: &GpuState,
        head: Head,
        read: usize,
        hs: Option<usize>,
    ) {
        if let Some(n) = hs {
            let x = &self.res.scratch.x;
            enc.copy_buffer_to_buffer(x, 0, &st.hs_stage, 0, (n * 4) as u64);
        }
        if read > 0 {
            let src = if head == Head::Argmax {
                &self.res.scratch.token
            } else {
                &self.res.scratch.logits
            };
            enc.copy_buffer_to_buffer(src, 0, &st.stage, 0, (read * 4) as u64);
        }
    }

    fn check(&self, tokens: &[u32], st: &GpuState) -> Result<(), ForwardError> {
        check_tokens(tokens, self.model.config.vocab_size)?;
        if st.model != self.res.uid {
            return Err(ForwardError::StateMismatch(0));
        }
        if st.pos + tokens.len() > self.res.ctx_len {
            return Err(ForwardError::Context {
                needed: st.pos + tokens.len(),
                ctx: self.res.ctx_len,
            });
        }
        Ok(())
    }

    /// Runs `n` frames of `first.len()` rows (one row: greedy decode steps; more: a prefill's
    /// frames, every row's token fed, no head but the last row's argmax), the first of `first`,
    /// each later one of the previous frame's greedy token repeated, with every stage (or every
    /// dispatch, `granularity`) timed by GPU timestamps (a pass per timed part: slower than the
    /// plain replay, for where the time goes, not how much there is); returns, per name in
    /// first-seen order, the timed passes per frame and their seconds per frame (summed over
    /// layers). Empty without timestamp queries.
    pub fn profile_frames(
        &self,
        first: &[u32],
        n: usize,
        st: &mut GpuState,
        granularity: Granularity,
    ) -> Result<Vec<(String, usize, f64)>, ForwardError> {
        let rows = first.len();
        if rows == 0
            || rows > self.res.frame_rows
            || (rows > MAX_BATCH && !rows.is_multiple_of(MAX_BATCH))
        {
            return Err(unsupported(format!(
                "a profiled frame of {rows} rows (1..=8, or a multiple of 8 up to {})",
                self.res.frame_rows
            ))
            .into());
        }
        let mut toks = first.to_vec();
        let mut total: Vec<(String, usize, f64)> = Vec::new();
        for _ in 0..n {
            self.check(&toks, st)?;
            let mut stages = Vec::new();
            if let FrameOut::Token(t) = self.frame(
                &toks,
                st,
                Head::Argmax,
                None,
                Some((granularity, &mut stages)),
                None,
            )? {
                toks.fill(t);
            }
            for (name, sec) in stages {
                match total.iter_mut().find(|(n, _, _)| *n == name) {
                    Some(e) => {
                        e.1 += 1;
                        e.2 += sec;
                    }
                    None => total.push((name, 1, sec)),
                }
            }
        }
        for e in &mut total {
            e.1 /= n.max(1);
            e.2 /= n.max(1) as f64;
        }
        Ok(total)
    }

    /// Empties `st` in place (zeroed caches, position 0): its recorded frames stay valid, so a
    /// benchmark's repetitions do not record them again.
    pub fn reset(&self, st: &mut GpuState) {
        let mut enc =
            self.res
                .dev
                .ctx
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("reset"),
                });
        for b in st.buffers() {
            enc.clear_buffer(b, 0, None);
        }
        self.res.dev.ctx.queue.submit([enc.finish()]);
        let c = &self.model.config;
        st.pos = 0;
        st.ngram_ctx = vec![c.eos_id().unwrap_or(0); c.ngram_size.saturating_sub(1)];
    }

    /// [`Model::forward_streams`] on the device: feeds `tokens` and returns the logits of
    /// every row (of the last when `last_only`) with every row's final streams `[t, H*D]`
    /// (read back with the logits: what the MTP head takes).
    pub fn forward_streams(
        &self,
        tokens: &[u32],
        st: &mut GpuState,
        last_only: bool,
    ) -> Result<(Vec<f32>, Vec<f32>), ForwardError> {
        self.check(tokens, st)?;
        let frames: Vec<&[u32]> = self.frames(tokens, !last_only);
        let (mut logits, mut streams) = (Vec::new(), Vec::new());
        for (i, f) in frames.iter().enumerate() {
            let head = match (last_only, i + 1 == frames.len()) {
                (false, _) => Head::All,
                (true, true) => Head::Last,
                (true, false) => Head::None,
            };
            if let FrameOut::Logits(l) = self.frame(f, st, head, None, None, Some(&mut streams))? {
                logits.extend(l);
            }
        }
        Ok((logits, streams))
    }

    /// Feeds `tokens` and returns the greedy next token, chosen on the device (only its id
    /// is read back).
    pub fn forward_greedy(&self, tokens: &[u32], st: &mut GpuState) -> Result<u32, ForwardError> {
        self.check(tokens, st)?;
        let frames: Vec<&[u32]> = self.frames(tokens, false);
        let mut token = 0;
        for (i, f) in frames.iter().enumerate() {
            let head = if i + 1 == frames.len() {
                Head::Argmax
            } else {
                Head::None
            };
            if let FrameOut::Token(t) = self.frame(f, st, head, None, None, None)? {
                token = t;
            }
        }
        Ok(token)
    }
}

/// The greedy token of the first logits row (`v` wide) into `e.s.token`, in two passes (one
/// workgroup over a release vocabulary is slow).
pub(crate) fn encode_argmax(e: &mut Enc<'_>, v: usize) -> Result<(), GpuError> {
    let s = e.s;
    let parts = v.div_ceil(ARGMAX_CHUNK);
    let bufs = [&s.logits, &s.token, &s.argmax_part];
    let p = [v as u32, 0, 0, ARGMAX_CHUNK as u32];
    e.op(kernels_wgsl::Op::Argmax, &p, &bufs, (parts as u32, 1))?;
    let p = [parts as u32, 0, 1, 0];
    e.op(kernels_wgsl::Op::Argmax, &p, &bufs, (1, 1))
}

enum FrameOut {
    Nothing,
    Logits(Vec<f32>),
    Token(u32),
}

/// A recorded frame: its rows, what it computes after the layers, whether it is traced.
type FrameKey = (usize, Head, bool);

/// An encoded-ahead command buffer's frame, and whether it copies the streams out.
type NextKey = (FrameKey, bool);

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
        let frames: Vec<&[u32]> = self.frames(tokens, !last_only);
        let mut logits = Vec::new();
        let mut traces = model_core::device::Traces::default();
        for (i, f) in frames.iter().enumerate() {
            let last = i + 1 == frames.len();
            let head = match (last_only, last) {
                (false, _) => Head::All,
                (true, true) => Head::Last,
                (true, false) => Head::None,
            };
            let mut taps = Vec::new();
            let out = self.frame(f, st, head, traced.then_some(&mut taps), None, None)?;
            if let FrameOut::Logits(l) = out {
                logits.extend(l);
            }
            traces.add(&self.res.dev.ctx, taps)?;
        }
        traces.emit(trace);
        Ok(logits)
    }
}
