//! The deepseek_v4 device forward ([`GpuModel`]): every weight but the embedding uploaded
//! once (the routed experts as one bank per layer and matrix), the sequence's caches
//! ([`GpuState`]: window rings, compressor rings and entries, indexer keys) preallocated on
//! the device for the context, and each frame of up to 8 token rows recorded once per
//! (rows, head) into a [`Graph`] replayed for every later frame of that shape: the position
//! goes up in the frame uniform, the host writes the embedding rows and token ids and reads
//! back the logits. Block by block it is the CPU forward ([`crate::forward`]): the same trace
//! names, compared in the tests.
//!
//! What differs between deepseek_v4 and deepseek_v41 on the device is a [`Variant`]: the
//! non-expert blocks it uploads, the caches a sequence holds, the host inputs of a frame (V4.1's
//! Engram rows) and how a frame is encoded. The rest (the global expert bank, the cold path,
//! the learned cache, frames, snapshots) is this module's, shared.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use gpu_runtime::ops::graph::{self, Break, Granularity, Graph, Tap};
use gpu_runtime::{Epilogue, GpuContext, GpuError, GpuMatrix, readback};
use model_core::device::readback_buffer;
use model_core::expert_cache::{Admission, CachePolicy, LayerCache};
use model_core::trace::{
    ATTN_INPUT, ATTN_OUT, ATTN_STREAMS, HEAD_OUT, LAYER_OUT, LOGITS, MLP_INPUT, MOE_OUT,
};
use model_core::{CausalLm, Trace, check_tokens};
use quant_codecs::MAX_BATCH;

use crate::attention::{AttnDeviceState, AttnGpu};
use crate::device::{Device, Enc, RopeGpu, Scratch};
use crate::forward::{ForwardError, Model};
use crate::hc::{self, HcDims, HcGpu};
use crate::moe::{GlobalBank, MoeGpu, NONE_SLOT, Router};
use crate::ops::Rope;
use crate::weights::MoeWeights;

static NEXT_UID: AtomicU64 = AtomicU64::new(2 << 40);

/// Upload bytes a frame's admissions may take (`CORTIQ_ADMIT_MIB` overrides): the host copies
/// each admitted expert into the queue's staging before the next frame, on the token's path,
/// and a release FP4 expert is 13 MiB, so at most two or three layers (in turn) admit per frame;
/// small experts let every layer admit one.
pub const ADMIT_BYTES: u64 = 32 << 20;

/// What a frame computes after the layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Head {
    /// Nothing (a prefill frame before the last).
    None,
    /// The logits of every row.
    All,
    /// The logits of the last row.
    Last,
}

/// The widths the shared machinery needs.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Decoder layers.
    pub layers: usize,
    /// `n_routed_experts`.
    pub experts: usize,
    /// `num_experts_per_tok`.
    pub top_k: usize,
    /// `hidden_size`.
    pub hidden: usize,
    /// `hc_mult`.
    pub hc_mult: usize,
    /// `moe_intermediate_size`.
    pub inter: usize,
    /// `vocab_size`.
    pub vocab: usize,
}

/// The [`Shape`] of a config (V4's and V4.1's name the fields alike).
macro_rules! shape_of {
    ($c:expr) => {
        $crate::gpu::Shape {
            layers: $c.num_hidden_layers,
            experts: $c.n_routed_experts,
            top_k: $c.num_experts_per_tok,
            hidden: $c.hidden_size,
            hc_mult: $c.hc_mult,
            inter: $c.moe_intermediate_size,
            vocab: $c.vocab_size,
        }
    };
}
pub(crate) use shape_of;

/// One sequence's device caches of a [`Variant`].
pub trait Caches: Sized + Send {
    /// Every buffer in a fixed order (what a snapshot copies).
    fn buffers(&self) -> Vec<&wgpu::Buffer>;
    /// The same caches in new buffers made by `dup` (contents copied afterwards).
    fn dup(&self, dup: &dyn Fn(&wgpu::Buffer) -> wgpu::Buffer) -> Self;
}

/// What deepseek_v4 and deepseek_v41 do differently on the device.
pub trait Variant<'a>: Sized {
    /// The CPU forward's error (a device failure converts into it).
    type Error: From<ForwardError>
        + From<model_core::InputError>
        + std::error::Error
        + Send
        + Sync
        + 'static;
    /// The device weights of everything but the routed experts (and the MoE blocks).
    type Blocks: Send + Sync;
    /// One sequence's device caches.
    type Caches: Caches;
    /// One sequence's host state between frames.
    type Host: Clone + Send;

    /// The widths.
    fn shape(&self) -> Shape;
    /// Layer `il`'s MoE weights (the routed experts the CPU runs when cold).
    fn moe(&self, il: usize) -> &MoeWeights<'a>;
    /// The embedding.
    fn embed(&self) -> &model_core::Mat<'a>;
    /// The router's constants.
    fn router(&self) -> Router;
    /// Uploads the blocks for contexts of `ctx_len` (refusing a geometry the kernels do not
    /// take), and sizes the frame scratch.
    fn upload_blocks(
        &self,
        dev: &Device,
        ctx_len: usize,
    ) -> Result<(Self::Blocks, Scratch), GpuError>;
    /// An empty sequence's caches.
    fn caches(&self, b: &Self::Blocks, ctx: &GpuContext, ctx_len: usize) -> Self::Caches;
    /// An empty sequence's host state.
    fn host(&self) -> Self::Host;
    /// Checks a frame's `tokens` and writes its host-side inputs (beyond the embedding rows
    /// and token ids), advancing `host`.
    fn inputs(
        &self,
        b: &Self::Blocks,
        ctx: &GpuContext,
        tokens: &[u32],
        host: &mut Self::Host,
    ) -> Result<(), Self::Error>;
    /// Records a frame of `nt` rows on the caches `st` (the streams in `e.s.x`), its MoE
    /// blocks `moe`, then what `head` asks for into `e.s.logits`.
    #[allow(clippy::too_many_arguments)]
    fn encode(
        &self,
        b: &Self::Blocks,
        moe: &[MoeGpu],
        bank: Option<&GlobalBank>,
        e: &mut Enc<'_>,
        st: &Self::Caches,
        head: Head,
        ctx_len: usize,
    ) -> Result<(), GpuError>;
}

/// deepseek_v4's blocks on the device.
pub struct V4Blocks {
    layers: Vec<(HcGpu, AttnGpu, HcGpu)>,
    head: HcGpu,
    lm_head: Arc<GpuMatrix>,
    ropes: RopeGpu,
}

/// deepseek_v4's caches: each layer's.
pub struct V4Caches(Vec<AttnDeviceState>);

impl Caches for V4Caches {
    fn buffers(&self) -> Vec<&wgpu::Buffer> {
        self.0.iter().flat_map(|l| l.buffers()).collect()
    }

    fn dup(&self, dup: &dyn Fn(&wgpu::Buffer) -> wgpu::Buffer) -> Self {
        let comp = |c: &crate::compressor::CompDeviceState| crate::compressor::CompDeviceState {
            kv: dup(&c.kv),
            gate: dup(&c.gate),
            entries: dup(&c.entries),
        };
        V4Caches(
            self.0
                .iter()
                .map(|l| AttnDeviceState {
                    window: dup(&l.window),
                    comp: l.comp.as_ref().map(comp),
                    index: l.index.as_ref().map(comp),
                })
                .collect(),
        )
    }
}

impl<'a> Variant<'a> for Model<'a> {
    type Error = ForwardError;
    type Blocks = V4Blocks;
    type Caches = V4Caches;
    type Host = ();

    fn shape(&self) -> Shape {
        shape_of!(self.config)
    }

    fn moe(&self, il: usize) -> &MoeWeights<'a> {
        &self.weights.layers[il].moe
    }

    fn embed(&self) -> &model_core::Mat<'a> {
        &self.weights.embed_tokens
    }

    fn router(&self) -> Router {
        Router::of(&self.config)
    }

    fn upload_blocks(&self, dev: &Device, ctx_len: usize) -> Result<(V4Blocks, Scratch), GpuError> {
        let c = &self.config;
        let w = &self.weights;
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
        if (nh * dh) % c.o_groups != 0 || di > 2 * dh.max(di) || c.index_n_heads > 512 {
            return Err(unsupported(format!(
                "{nh} heads of {dh} in {} groups, or {} indexer heads (ds_index takes 512)",
                c.o_groups, c.index_n_heads
            )));
        }
        let dims = HcDims {
            n: c.hc_mult,
            d: c.hidden_size,
            norm_eps: c.rms_norm_eps as f32,
            hc_eps: c.hc_eps as f32,
            iters: c.hc_sinkhorn_iters,
        };
        let head = HcGpu::head(dev, &w.hc_head, &w.norm, &dims)?;
        let lm_head = dev.mat(&w.lm_head)?;
        let layers = w
            .layers
            .iter()
            .enumerate()
            .map(|(il, lw)| {
                Ok((
                    HcGpu::site(dev, &lw.attn_hc, &lw.input_layernorm, &dims)?,
                    AttnGpu::new(dev, &lw.attn, c, c.attn_kind(il))?,
                    HcGpu::site(dev, &lw.ffn_hc, &lw.post_attention_layernorm, &dims)?,
                ))
            })
            .collect::<Result<Vec<_>, GpuError>>()?;
        let main = Rope::new(c.rope_main(), dh);
        let compress = Rope::new(c.rope_compress(), dh);
        let blocks = V4Blocks {
            layers,
            head,
            lm_head,
            ropes: RopeGpu::new(&dev.ctx, &main, &compress, ctx_len),
        };
        Ok((blocks, Scratch::new(&dev.ctx, c, ctx_len)))
    }

    fn caches(&self, b: &V4Blocks, ctx: &GpuContext, ctx_len: usize) -> V4Caches {
        let c = &self.config;
        V4Caches(
            b.layers
                .iter()
                .map(|(_, attn, _)| attn.state(ctx, c, ctx_len))
                .collect(),
        )
    }

    fn host(&self) {}

    fn inputs(
        &self,
        _: &V4Blocks,
        _: &GpuContext,
        _: &[u32],
        _: &mut (),
    ) -> Result<(), ForwardError> {
        Ok(())
    }

    fn encode(
        &self,
        b: &V4Blocks,
        moe: &[MoeGpu],
        bank: Option<&GlobalBank>,
        e: &mut Enc<'_>,
        st: &V4Caches,
        head: Head,
        ctx_len: usize,
    ) -> Result<(), GpuError> {
        let c = &self.config;
        let (n, d) = (c.hc_mult, c.hidden_size);
        let s = e.s;
        let nt = e.nt;
        for (il, ((attn_hc, attn, ffn_hc), moe)) in b.layers.iter().zip(moe).enumerate() {
            attn_hc.encode_pre(e, &s.x, nt)?;
            e.tap(ATTN_INPUT, il, &s.u, nt * d);
            e.g.mark("mhc");
            attn.encode(e, c, &b.ropes, &st.0[il], nt, ctx_len)?;
            e.tap(ATTN_OUT, il, &s.y, nt * d);
            e.g.mark("attn");
            attn_hc.encode_post(e, &s.x, nt)?;
            e.tap(ATTN_STREAMS, il, &s.x, nt * n * d);
            ffn_hc.encode_pre(e, &s.x, nt)?;
            e.tap(MLP_INPUT, il, &s.u, nt * d);
            e.g.mark("mhc");
            moe.encode(e, bank, nt, il)?;
            e.tap(MOE_OUT, il, &s.y, nt * d);
            e.g.mark("moe");
            ffn_hc.encode_post(e, &s.x, nt)?;
            e.tap(LAYER_OUT, il, &s.x, nt * n * d);
            e.g.mark("mhc");
        }
        encode_head(
            e,
            c.num_hidden_layers,
            (n, d, c.vocab_size),
            head,
            &b.lm_head,
            |e, x, rows| b.head.encode_pre(e, x, rows),
        )
    }
}

/// The head of a frame after the layers (none, every row, or the last row's streams copied
/// out first): `collapse` writes the normed rows into `e.s.u`, `lm_head` the logits.
pub(crate) fn encode_head(
    e: &mut Enc<'_>,
    nl: usize,
    (n, d, vocab): (usize, usize, usize),
    head: Head,
    lm_head: &GpuMatrix,
    collapse: impl FnOnce(&mut Enc<'_>, &wgpu::Buffer, usize) -> Result<(), GpuError>,
) -> Result<(), GpuError> {
    let s = e.s;
    let nt = e.nt;
    let rows = match head {
        Head::None => return Ok(()),
        Head::All => {
            collapse(e, &s.x, nt)?;
            nt
        }
        Head::Last => {
            let off = ((nt - 1) * n * d) as u32;
            e.map(3, off, &s.x, &s.u, &s.x_last, n * d)?;
            collapse(e, &s.x_last, 1)?;
            1
        }
    };
    e.tap(HEAD_OUT, nl, &s.u, rows * d);
    e.matvec(lm_head, &s.u, &s.logits, rows, Epilogue::None)?;
    e.tap(LOGITS, nl, &s.logits, rows * vocab);
    e.g.mark("head");
    Ok(())
}

/// A model whose weights live on the device, with the CPU model it was uploaded from (the
/// embedding rows are gathered from that one's mapped file, the cold experts computed from
/// it): deepseek_v4 ([`Model`], the default) or deepseek_v41 ([`crate::v41::Model`]).
///
/// `B` is `M`'s [`Variant::Blocks`], spelled out so that the model stays covariant in `'a`
/// (an associated type would pin it).
pub struct GpuModel<'a, M = Model<'a>, B = V4Blocks> {
    /// The CPU model.
    pub model: M,
    res: Resident<B>,
    traced: AtomicBool,
    _a: std::marker::PhantomData<&'a ()>,
}

struct Resident<B> {
    dev: Device,
    blocks: B,
    moe: Vec<MoeGpu>,
    /// Every layer's resident routed experts (`None` when none is).
    bank: Option<GlobalBank>,
    /// The cold path's readback: a layer's cold list `[8k]`, its routed experts `[8k]`, then
    /// its MoE input `[8, D]`.
    cold_stage: wgpu::Buffer,
    /// Each layer's first slot in the global bank (its slots follow).
    bank_base: Vec<usize>,
    /// What each layer's bank slots hold and what the policy knows (`None` for a layer with
    /// all or none of its experts resident, or under [`CachePolicy::Static`]).
    caches: Mutex<Vec<Option<LayerCache>>>,
    policy: CachePolicy,
    /// Layers that may admit in a frame: those with `(layer + frame) % admit_stride == 0`
    /// (every layer when the experts are small; see [`ADMIT_BYTES`]).
    admit_stride: usize,
    /// Frames run (which layers admit next).
    frames: AtomicU64,
    /// The threads the cold experts run on (spinning between layers, as qwen4_exp's cold path
    /// does; `None`: rayon's pool, where the CPU has no integer kernels or nothing is cold).
    team: Option<quant_codecs::team::Team>,
    /// Counters of the cold path.
    stats: ColdCounters,
    scratch: Scratch,
    ctx_len: usize,
    uid: u64,
}

/// A model that could not go to the device, handed back with the reason.
pub struct Unplaced<M> {
    /// The CPU model.
    pub model: M,
    /// Why.
    pub error: GpuError,
}

impl<M> std::fmt::Debug for Unplaced<M> {
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

/// Which routed experts live in the global bank; the rest are computed on the CPU.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Residency {
    /// All of them when the VRAM budget holds them after every other weight; else as many per
    /// layer as what is left holds, the same number in every layer.
    #[default]
    Budget,
    /// Per layer, how many (experts `0..n` of layer `l`: `--n-cpu-moe`'s static split is
    /// 0 for its first layers and all for the rest).
    PerLayer(Vec<usize>),
}

/// How the routed experts are placed ([`GpuModel::with_experts`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ExpertPlacement {
    /// Which are resident.
    pub residency: Residency,
    /// Slots per bank segment (`None`: as many as one storage binding holds; tests force
    /// small segments to run several on a small model).
    pub segment_slots: Option<usize>,
    /// How a layer's resident experts change while running (model-core's expert cache: the
    /// learned policy by default; static keeps the first ones placed).
    pub policy: CachePolicy,
    /// Per layer, each expert's score from an earlier run ([`GpuModel::expert_scores`]): the
    /// learned policy starts with the best-scored experts resident and their scores. Static
    /// placement ignores it (the first experts by id, as `--n-cpu-moe` places them).
    pub warm: Option<Vec<Vec<f32>>>,
}

/// Counters of the cold path ([`GpuModel::cold_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ColdStats {
    /// Routed (token row, expert) slots run.
    pub routed: u64,
    /// Those computed on the CPU.
    pub cold: u64,
    /// Bytes of the experts the CPU computed (each once per frame and layer).
    pub cold_bytes: u64,
    /// The CPU's seconds on them.
    pub cold_seconds: f64,
    /// Experts uploaded into the bank while running (each over a resident the policy valued
    /// less).
    pub admitted: u64,
}

#[derive(Default)]
struct ColdCounters {
    routed: AtomicU64,
    cold: AtomicU64,
    cold_bytes: AtomicU64,
    cold_ns: AtomicU64,
    admitted: AtomicU64,
}

impl<'a, B, M: Variant<'a, Blocks = B>> GpuModel<'a, M, B> {
    /// Uploads `model` to `ctx` for sequences of up to `ctx_len` tokens, as many routed
    /// experts resident as the budget holds; on any failure (a geometry the kernels do not
    /// take, the VRAM budget, a pipeline the driver rejects) the CPU model comes back with the
    /// error.
    pub fn new(
        model: M,
        ctx: Arc<GpuContext>,
        ctx_len: usize,
    ) -> Result<GpuModel<'a, M, B>, Box<Unplaced<M>>> {
        Self::with_experts(model, ctx, ctx_len, &ExpertPlacement::default())
    }

    /// [`GpuModel::new`] with the routed experts placed as `place` says.
    pub fn with_experts(
        model: M,
        ctx: Arc<GpuContext>,
        ctx_len: usize,
        place: &ExpertPlacement,
    ) -> Result<GpuModel<'a, M, B>, Box<Unplaced<M>>> {
        match Self::upload(&model, ctx, ctx_len, place) {
            Ok(res) => Ok(GpuModel {
                model,
                res,
                traced: AtomicBool::new(false),
                _a: std::marker::PhantomData,
            }),
            Err(error) => Err(Box::new(Unplaced { model, error })),
        }
    }

    fn upload(
        model: &M,
        ctx: Arc<GpuContext>,
        ctx_len: usize,
        place: &ExpertPlacement,
    ) -> Result<Resident<B>, GpuError> {
        let sh = model.shape();
        if ctx_len == 0 || sh.hc_mult > 8 {
            return Err(unsupported(format!(
                "hc_mult {} > 8, or ctx {ctx_len}",
                sh.hc_mult
            )));
        }
        let uid = NEXT_UID.fetch_add(1, Ordering::Relaxed);
        let dev = Device::new(ctx.clone(), uid);
        let rt = model.router();
        // Everything but the routed experts first; what the budget has left is the bank.
        let (blocks, scratch) = model.upload_blocks(&dev, ctx_len)?;
        let resident = Self::residency(model, &dev, place)?;
        let ne = sh.experts;
        // Which experts start resident: the best-scored of an earlier run, or the first ids.
        let warm = |il: usize| {
            let w = place.warm.as_ref()?.get(il)?;
            (place.policy != CachePolicy::Static && w.len() == ne).then_some(&w[..])
        };
        let initial: Vec<Vec<u32>> = resident
            .iter()
            .enumerate()
            .map(|(il, &n)| LayerCache::initial(ne, n, warm(il)))
            .collect();
        let (bank, slots) = Self::fill_bank(model, &dev, &initial, place.segment_slots)?;
        let bank_base = resident
            .iter()
            .scan(0, |at, &n| {
                let base = *at;
                *at += n;
                Some(base)
            })
            .collect();
        // Slot i of a layer holds its expert initial[i] (fill_bank's order).
        let caches = initial
            .iter()
            .enumerate()
            .map(|(il, first)| {
                let n = first.len();
                let learns = n > 0 && n < ne && place.policy != CachePolicy::Static;
                learns.then(|| LayerCache::new(ne, first, warm(il)))
            })
            .collect();
        let moe = slots
            .iter()
            .enumerate()
            .map(|(il, slots)| MoeGpu::new(&dev, model.moe(il), &rt, slots, (sh.hidden, sh.inter)))
            .collect::<Result<Vec<_>, GpuError>>()?;
        let k = sh.top_k;
        Ok(Resident {
            blocks,
            moe,
            scratch,
            bank,
            cold_stage: readback_buffer(&ctx, MAX_BATCH * (2 * k + sh.hidden)),
            bank_base,
            caches: Mutex::new(caches),
            policy: place.policy,
            admit_stride: {
                let budget = std::env::var("CORTIQ_ADMIT_MIB")
                    .ok()
                    .and_then(|v| v.parse::<u64>().ok())
                    .map_or(ADMIT_BYTES, |m| m << 20);
                let per = (sh.layers > 0)
                    .then(|| {
                        model
                            .moe(0)
                            .routed
                            .experts
                            .first()
                            .map(|x| (x.gate_up.bytes().len() + x.down.bytes().len()) as u64)
                    })
                    .flatten()
                    .unwrap_or(1);
                let n = (budget / per.max(1)).max(1) as usize;
                sh.layers.div_ceil(n).max(1)
            },
            frames: AtomicU64::new(0),
            team: (resident.iter().any(|&n| n < ne) && quant_codecs::ops::fast_int8())
                .then(|| quant_codecs::team::Team::from_env(ctx.is_software())),
            stats: ColdCounters::default(),
            dev,
            ctx_len,
            uid,
        })
    }

    /// How many of each layer's routed experts go to the bank.
    fn residency(model: &M, dev: &Device, place: &ExpertPlacement) -> Result<Vec<usize>, GpuError> {
        let sh = model.shape();
        let (nl, ne) = (sh.layers, sh.experts);
        let first = (nl > 0)
            .then(|| model.moe(0).routed.experts.first())
            .flatten();
        match &place.residency {
            Residency::PerLayer(n) if n.len() == nl => Ok(n.iter().map(|&n| n.min(ne)).collect()),
            Residency::PerLayer(n) => Err(unsupported(format!(
                "residency for {} layers, the model has {nl}",
                n.len()
            ))),
            Residency::Budget => {
                let pad =
                    |m: &model_core::bind::Mat<'_>| (m.bytes().len() as u64).next_multiple_of(16);
                let per = first.map_or(0, |x| pad(&x.gate_up) + pad(&x.down));
                // The state and the frames' buffers come out of the same budget: keep a
                // twentieth of it (at least 64 MiB) for them.
                let budget = dev.budget();
                let reserve = (budget / 20).max(64 << 20);
                let left = budget.saturating_sub(dev.resident_bytes() + reserve);
                // ... and no more than the bank's segments bind (on a 2 GiB binding limit,
                // 3,840 of the release's FP4 experts).
                let cap = first.map_or(0, |x| {
                    [&x.gate_up, &x.down]
                        .map(|m| {
                            let m = m.mat();
                            gpu_runtime::ops::experts::ExpertBank::capacity(
                                &dev.ctx,
                                m.dtype(),
                                m.rows(),
                                m.cols(),
                            )
                        })
                        .into_iter()
                        .min()
                        .unwrap_or(0)
                });
                let fit = left
                    .checked_div(per)
                    .map_or(ne, |n| (n as usize).min(cap) / nl.max(1))
                    .min(ne);
                if fit < ne {
                    tracing::info!(
                        "{fit} of {ne} routed experts per layer resident ({} MiB left of a {} MiB budget, a bank of at most {cap} slots); the rest on the CPU",
                        left >> 20,
                        budget >> 20
                    );
                }
                Ok(vec![fit; nl])
            }
        }
    }

    /// The global bank of every layer's experts `resident[l]` (slots in layer order, then in
    /// that order), and each layer's expert -> slot map.
    fn fill_bank(
        model: &M,
        dev: &Device,
        resident: &[Vec<u32>],
        segment_slots: Option<usize>,
    ) -> Result<(Option<GlobalBank>, Vec<Vec<u32>>), GpuError> {
        let sh = model.shape();
        let ne = sh.experts;
        let total: usize = resident.iter().map(Vec::len).sum();
        let mut maps = vec![vec![NONE_SLOT; ne]; resident.len()];
        let first = (sh.layers > 0)
            .then(|| model.moe(0).routed.experts.first())
            .flatten();
        let (Some(first), true) = (first, total > 0) else {
            return Ok((None, maps));
        };
        let shape = |m: &model_core::bind::Mat<'_>| {
            let m = m.mat();
            (m.dtype(), (m.rows(), m.cols()))
        };
        let (gd, gs) = shape(&first.gate_up);
        let (dd, ds) = shape(&first.down);
        let bank = GlobalBank {
            gate_up: dev.empty_bank(gd, gs, total, segment_slots)?,
            down: dev.empty_bank(dd, ds, total, segment_slots)?,
        };
        let ctx = &dev.ctx;
        let mut ring = gpu_runtime::staging::StagingRing::new(ctx);
        let mut slot = 0;
        for (il, (xs, map)) in resident.iter().zip(&mut maps).enumerate() {
            let experts = &model.moe(il).routed.experts;
            for (x, e) in xs.iter().map(|&x| (x as usize, &experts[x as usize])) {
                bank.gate_up.write(ctx, &mut ring, slot, e.gate_up.mat())?;
                bank.down.write(ctx, &mut ring, slot, e.down.mat())?;
                map[x] = slot as u32;
                slot += 1;
            }
        }
        ring.flush(ctx)?;
        Ok((Some(bank), maps))
    }

    /// `n` frames of `first`'s rows (each a decode step when one row) on a fresh state, each
    /// dispatch in a compute pass per stage (mhc, attn, moe, head) or per kernel
    /// (`granularity`) timed by GPU timestamps; per stage or kernel its passes per frame and
    /// seconds per frame. Refused with experts on the CPU (a frame there is many
    /// submissions).
    pub fn profile_frames(
        &self,
        first: &[u32],
        n: usize,
        granularity: Granularity,
    ) -> Result<Vec<(String, usize, f64)>, M::Error> {
        let mut st = self.new_state();
        let mut total: Vec<(String, usize, f64)> = Vec::new();
        for _ in 0..n {
            self.check(first, &st)?;
            let mut stages = Vec::new();
            self.frame(
                first,
                &mut st,
                Head::Last,
                None,
                Some((granularity, &mut stages)),
            )?;
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

    /// Per layer, each routed expert's learned score (empty rows for layers whose experts are
    /// all or none resident, or under the static policy): what [`ExpertPlacement::warm`]
    /// takes in a later run.
    pub fn expert_scores(&self) -> Vec<Vec<f32>> {
        let caches = self.res.caches.lock().unwrap_or_else(|p| p.into_inner());
        caches
            .iter()
            .map(|c| c.as_ref().map_or_else(Vec::new, LayerCache::scores))
            .collect()
    }

    /// Layer `il`'s resident experts now, ascending, where its residents are learned (`None`
    /// for a layer with all or none of its experts resident, or under the static policy).
    pub fn learned_residents(&self, il: usize) -> Option<Vec<u32>> {
        let caches = self.res.caches.lock().unwrap_or_else(|p| p.into_inner());
        let c = caches.get(il)?.as_ref()?;
        Some(
            c.slots()
                .iter()
                .enumerate()
                .filter(|(_, s)| s.is_some())
                .map(|(x, _)| x as u32)
                .collect(),
        )
    }

    /// Routed experts resident, of all (every layer's).
    pub fn resident_experts(&self) -> (usize, usize) {
        let sh = self.model.shape();
        let n = self.res.moe.iter().map(|m| m.resident).sum();
        (n, sh.experts * sh.layers)
    }

    /// How the global bank is bound (segments and binding kind), when there is one.
    pub fn bank_binding(&self) -> Option<(usize, kernels_wgsl::Segments)> {
        let b = self.res.bank.as_ref()?;
        Some((
            b.gate_up.segments.len(),
            b.gate_up.binding(&self.res.dev.ctx),
        ))
    }

    /// The cold path's counters so far.
    pub fn cold_stats(&self) -> ColdStats {
        let s = &self.res.stats;
        ColdStats {
            routed: s.routed.load(Ordering::Relaxed),
            cold: s.cold.load(Ordering::Relaxed),
            cold_bytes: s.cold_bytes.load(Ordering::Relaxed),
            cold_seconds: s.cold_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            admitted: s.admitted.load(Ordering::Relaxed),
        }
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
    fn build(
        &self,
        st: &GpuState<M::Caches, M::Host>,
        nt: usize,
        head: Head,
        traced: bool,
    ) -> Result<Graph, GpuError> {
        let mut g = Graph::new();
        let mut e = Enc {
            g: &mut g,
            dev: &self.res.dev,
            s: &self.res.scratch,
            frame: &st.frame,
            nt,
            traced,
        };
        let r = &self.res;
        self.model.encode(
            &r.blocks,
            &r.moe,
            r.bank.as_ref(),
            &mut e,
            &st.caches,
            head,
            r.ctx_len,
        )?;
        Ok(g)
    }

    /// Feeds `tokens` (one frame, at most 8) and returns the logits `head` asks for, with the
    /// taps of a traced frame.
    fn frame(
        &self,
        tokens: &[u32],
        st: &mut GpuState<M::Caches, M::Host>,
        head: Head,
        taps: Option<&mut Vec<(Tap, wgpu::Buffer)>>,
        stages: Option<(Granularity, &mut Vec<(String, f64)>)>,
    ) -> Result<Vec<f32>, M::Error> {
        let sh = self.model.shape();
        let ctx = &self.res.dev.ctx;
        let s = &self.res.scratch;
        let nt = tokens.len();
        // The host's inputs first: a refused frame leaves the state as it was.
        self.model
            .inputs(&self.res.blocks, ctx, tokens, &mut st.host)?;
        let xs = hc::embed_streams(self.model.embed(), tokens, sh.hc_mult, sh.hidden);
        ctx.queue.write_buffer(&s.x, 0, bytemuck::cast_slice(&xs));
        ctx.queue
            .write_buffer(&s.tokens, 0, bytemuck::cast_slice(tokens));
        graph::write_frame(ctx, &st.frame, st.pos as u32, (0, 0), 0);
        let traced = taps.is_some();
        let key = (nt, head, traced);
        if !st.graphs.contains_key(&key) {
            let g = self
                .build(st, nt, head, traced)
                .map_err(dev_err::<M::Error>)?;
            st.graphs.insert(key, g);
            st.recorded += 1;
        }
        let read = match head {
            Head::None => 0,
            Head::All => nt * sh.vocab,
            Head::Last => sh.vocab,
        };
        let g = &st.graphs[&key];
        let tail = |enc: &mut wgpu::CommandEncoder| {
            if read > 0 {
                enc.copy_buffer_to_buffer(&s.logits, 0, &st.stage, 0, (read * 4) as u64);
            }
        };
        let routed = (nt * sh.top_k * sh.layers) as u64;
        self.res.stats.routed.fetch_add(routed, Ordering::Relaxed);
        let mut profile = None;
        if g.has_breaks() {
            if stages.is_some() {
                return Err(dev_err(unsupported(
                    "a profile of a model with experts on the CPU (profile it all-resident)".into(),
                )));
            }
            self.run_breaks(g, nt, taps, &tail)?;
        } else {
            let mut enc = ctx
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("deepseek frame"),
                });
            match &stages {
                Some((gran, _)) => profile = g.record_profiled(ctx, &mut enc, *gran),
                None => g.record(ctx, &mut enc, taps),
            }
            tail(&mut enc);
            ctx.checked("a deepseek frame", || ctx.queue.submit([enc.finish()]))
                .map_err(dev_err::<M::Error>)?;
        }
        if let (Some(p), Some((_, out))) = (profile, stages) {
            out.extend(p.read(ctx).map_err(dev_err::<M::Error>)?);
        }
        st.pos += nt;
        if read == 0 {
            ctx.wait();
            return Ok(Vec::new());
        }
        readback::read_mapped(ctx, &st.stage, read).map_err(dev_err::<M::Error>)
    }

    /// Runs a frame with cold experts span by span: at a layer's [`Break::Read`] the span so
    /// far goes to the GPU with a copy of the layer's cold list and MoE input, and the next
    /// span (the resident experts and the shared expert) right behind it; while the GPU runs
    /// that, the host reads the copy back and computes the cold experts from the mapped file
    /// (each expert once over all of its rows, all cores), and their outputs go up by queued
    /// writes into the cold slots' rows, which land before the span that sums them.
    fn run_breaks(
        &self,
        g: &Graph,
        nt: usize,
        mut taps: Option<&mut Vec<(Tap, wgpu::Buffer)>>,
        tail: &dyn Fn(&mut wgpu::CommandEncoder),
    ) -> Result<(), ForwardError> {
        let ctx = &self.res.dev.ctx;
        let s = &self.res.scratch;
        let sh = self.model.shape();
        let (k, d) = (sh.top_k, sh.hidden);
        let spans = g.spans();
        let mut index = None;
        let mut pending: Option<usize> = None;
        let mut admissions: Vec<(usize, Admission)> = Vec::new();
        let frame = self.res.frames.fetch_add(1, Ordering::Relaxed) as usize;
        for span in &spans {
            let mut enc = ctx
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("deepseek frame (span)"),
                });
            g.record_span(ctx, &mut enc, span.items.clone(), taps.as_deref_mut());
            match span.end {
                Some(Break::Read(il)) => {
                    let at = (MAX_BATCH * k * 4) as u64;
                    let stage = &self.res.cold_stage;
                    let slots = (nt * k * 4) as u64;
                    enc.copy_buffer_to_buffer(&s.cold, 0, stage, 0, slots);
                    enc.copy_buffer_to_buffer(&s.ids, 0, stage, at, slots);
                    enc.copy_buffer_to_buffer(&s.u, 0, stage, 2 * at, (nt * d * 4) as u64);
                    pending = Some(il);
                }
                Some(Break::Write(_)) => {}
                None => tail(&mut enc),
            }
            let i = ctx.checked("a deepseek frame", || ctx.queue.submit([enc.finish()]))?;
            if matches!(span.end, Some(Break::Read(_))) {
                index = Some(i);
                continue;
            }
            // The resident span is queued: now the host's part of the layer before it.
            if let (Some(il), Some(Break::Write(_))) = (pending.take(), span.end) {
                let words = 2 * MAX_BATCH * k + nt * d;
                let back =
                    readback::read_mapped_after(ctx, &self.res.cold_stage, words, index.take())?;
                let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
                let cold = bits(&back[..nt * k]);
                self.cold_experts(il, &cold, &back[2 * MAX_BATCH * k..])?;
                let routed = bits(&back[MAX_BATCH * k..][..nt * k]);
                let mut caches = self.res.caches.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(cache) = caches[il].as_mut() {
                    // One upload per admitting layer and frame at most, and only over a
                    // resident the policy values less.
                    let admits = (il + frame).is_multiple_of(self.res.admit_stride);
                    let picked = cache.frame(&routed, &cold, self.res.policy, usize::from(admits));
                    admissions.extend(picked.into_iter().map(|a| (il, a)));
                }
            }
        }
        // Every span of the frame is queued: uploads written now land after it (queue order)
        // and before the next frame's split reads the maps.
        for (il, a) in admissions {
            self.admit(il, &a);
        }
        Ok(())
    }

    /// Uploads expert `a.expert` of layer `il` into its bank slot `a.slot` (which held
    /// `a.evicted`) and points the layer's expert -> slot map at it.
    fn admit(&self, il: usize, a: &Admission) {
        let Some(bank) = &self.res.bank else {
            return;
        };
        let q = &self.res.dev.ctx.queue;
        let slot = self.res.bank_base[il] + a.slot as usize;
        let e = &self.model.moe(il).routed.experts[a.expert as usize];
        for (b, m) in [(&bank.gate_up, &e.gate_up), (&bank.down, &e.down)] {
            let (buffer, at) = b.slot_at(slot);
            q.write_buffer(buffer, at, m.bytes());
        }
        let moe = &self.res.moe[il];
        moe.set_slot(q, a.evicted, NONE_SLOT);
        moe.set_slot(q, a.expert, slot as u32);
        self.res.stats.admitted.fetch_add(1, Ordering::Relaxed);
    }

    /// Computes layer `il`'s cold slots (`cold[slot]`: the expert, or [`NONE_SLOT`]) on the
    /// CPU from the MoE input rows `u` (`[nt, D]`, slot `i` reading row `i / k`) and writes
    /// each slot's output row into the expert outputs.
    fn cold_experts(&self, il: usize, cold: &[u32], u: &[f32]) -> Result<(), ForwardError> {
        let sh = self.model.shape();
        let (k, d, ne) = (sh.top_k, sh.hidden, sh.experts);
        let routed = &self.model.moe(il).routed;
        let mut by_expert: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
        for (slot, &x) in cold.iter().enumerate() {
            if x == NONE_SLOT {
                continue;
            }
            if x as usize >= ne {
                return Err(unsupported(format!(
                    "layer {il}: the device routed slot {slot} to expert {x} of {ne}"
                ))
                .into());
            }
            by_expert.entry(x as usize).or_default().push(slot);
        }
        let st = &self.res.stats;
        let n_cold: usize = by_expert.values().map(Vec::len).sum();
        st.cold.fetch_add(n_cold as u64, Ordering::Relaxed);
        let bytes: usize = by_expert
            .keys()
            .map(|&x| {
                let e = &routed.experts[x];
                e.gate_up.bytes().len() + e.down.bytes().len()
            })
            .sum();
        st.cold_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        let t0 = std::time::Instant::now();
        let inputs: Vec<(usize, Vec<usize>, Vec<f32>)> = by_expert
            .into_iter()
            .map(|(x, slots)| {
                let xs = slots
                    .iter()
                    .flat_map(|&s| &u[s / k * d..][..d])
                    .copied()
                    .collect();
                (x, slots, xs)
            })
            .collect();
        let jobs: Vec<(usize, &[f32])> = inputs.iter().map(|(x, _, xs)| (*x, &xs[..])).collect();
        let ys = match &self.res.team {
            Some(team) => routed.experts_rows_on(team, &jobs),
            None => routed.experts_rows(&jobs),
        };
        st.cold_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let ctx = &self.res.dev.ctx;
        for ((_, slots, _), y) in inputs.iter().zip(&ys) {
            for (&slot, row) in slots.iter().zip(y.chunks(d)) {
                ctx.queue.write_buffer(
                    &self.res.scratch.eo,
                    (slot * d * 4) as u64,
                    bytemuck::cast_slice(row),
                );
            }
        }
        Ok(())
    }

    fn check(&self, tokens: &[u32], st: &GpuState<M::Caches, M::Host>) -> Result<(), ForwardError> {
        check_tokens(tokens, self.model.shape().vocab)?;
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

/// A device failure as a forward error of the variant.
fn dev_err<E: From<ForwardError>>(e: GpuError) -> E {
    ForwardError::Gpu(e).into()
}

/// A recorded frame: its rows, what it computes after the layers, whether it is traced.
type FrameKey = (usize, Head, bool);

/// A sequence on the device: every layer's caches preallocated for the model's context, the
/// position, the frame uniform and readback buffer, the host's state between frames (V4.1's
/// n-gram look-back), and the frames recorded against these buffers. `Clone` copies the
/// device buffers (a snapshot); [`GpuState::restore`] copies a snapshot back into this
/// state's own buffers, so its recorded frames stay valid.
pub struct GpuState<C = V4Caches, H = ()> {
    ctx: Arc<GpuContext>,
    model: u64,
    /// Tokens seen so far.
    pub pos: usize,
    caches: C,
    host: H,
    frame: wgpu::Buffer,
    stage: wgpu::Buffer,
    graphs: HashMap<FrameKey, Graph>,
    recorded: usize,
}

impl<C, H> std::fmt::Debug for GpuState<C, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuState").field("pos", &self.pos).finish()
    }
}

impl<C: Caches, H: Clone> GpuState<C, H> {
    fn new<'a, B, M: Variant<'a, Blocks = B, Caches = C, Host = H>>(
        m: &GpuModel<'a, M, B>,
    ) -> GpuState<C, H> {
        let ctx = &m.res.dev.ctx;
        GpuState {
            ctx: ctx.clone(),
            model: m.res.uid,
            pos: 0,
            caches: m.model.caches(&m.res.blocks, ctx, m.res.ctx_len),
            host: m.model.host(),
            frame: graph::frame_buffer(ctx),
            stage: readback_buffer(ctx, MAX_BATCH * m.model.shape().vocab),
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
        self.caches.buffers().iter().map(|b| b.size()).sum::<u64>() + self.stage.size()
    }

    /// A snapshot ([`Clone`]), or the device's refusal (out of device memory) as an error.
    pub fn try_clone(&self) -> Result<GpuState<C, H>, ForwardError> {
        Ok(self.ctx.checked("a sequence snapshot", || self.clone())?)
    }

    /// Copies `snap` (a snapshot of a sequence of the same model) into this state's buffers.
    pub fn restore(&mut self, snap: &GpuState<C, H>) -> Result<(), ForwardError> {
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
        for (dst, src) in self.caches.buffers().into_iter().zip(snap.caches.buffers()) {
            enc.copy_buffer_to_buffer(src, 0, dst, 0, src.size());
        }
        self.ctx.checked("a state restore", || {
            self.ctx.queue.submit([enc.finish()]);
        })?;
        self.pos = snap.pos;
        self.host = snap.host.clone();
        Ok(())
    }
}

impl<C: Caches, H: Clone> Clone for GpuState<C, H> {
    fn clone(&self) -> GpuState<C, H> {
        let ctx = &self.ctx;
        let dup = |b: &wgpu::Buffer| {
            ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("state snapshot"),
                size: b.size(),
                usage: b.usage(),
                mapped_at_creation: false,
            })
        };
        let mut out = GpuState {
            ctx: ctx.clone(),
            model: self.model,
            pos: 0,
            caches: self.caches.dup(&dup),
            host: self.host.clone(),
            frame: graph::frame_buffer(ctx),
            stage: dup(&self.stage),
            graphs: HashMap::new(),
            recorded: 0,
        };
        out.restore(self).expect("same model");
        out
    }
}

impl<'a, B, M: Variant<'a, Blocks = B>> CausalLm for GpuModel<'a, M, B> {
    type State = GpuState<M::Caches, M::Host>;
    type Error = M::Error;

    fn vocab_size(&self) -> usize {
        self.model.shape().vocab
    }

    fn new_state(&self) -> Self::State {
        GpuState::new(self)
    }

    fn run(
        &self,
        tokens: &[u32],
        st: &mut Self::State,
        trace: &mut Trace<'_>,
        last_only: bool,
    ) -> Result<Vec<f32>, M::Error> {
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
            logits.extend(self.frame(f, st, head, traced.then_some(&mut taps), None)?);
            traces
                .add(&self.res.dev.ctx, taps)
                .map_err(dev_err::<M::Error>)?;
        }
        traces.emit(trace);
        Ok(logits)
    }
}
