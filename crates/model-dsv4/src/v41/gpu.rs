//! DeepSeek-V4.1-Flash on the device: [`crate::gpu::GpuModel`] over a [`super::Model`]. The
//! frames, the global expert bank and the cold path are deepseek_v4's; what this module adds is
//! V4.1's blocks, each beside its CPU version ([`super::attention`], [`super::compressor`],
//! [`super::indexer`], [`crate::engram::block`]):
//!
//! - the Engram module: the n-gram hashes and the table rows are computed and gathered on the
//!   host from the memory-mapped tables (the release's are billions of rows), only the gathered
//!   rows go up (`n_cols * engram_head_dim` floats a token and Engram layer); `wkv` and the
//!   gated stream update (`engram_gate`) run on the device;
//! - single-pass mHC: each site's collapse reads the previous site's `pre` (`mhc_pre`'s `prev`;
//!   a one-hot row before the first layer; the head has no maps of its own);
//! - attention without the per-head query norm, the window latents FP8 fake-quantised before
//!   they are cached (`ds_qat`);
//! - KV sources compress (`ds_compress`'s raw latents, published with RoPE and FP4 by
//!   `ds_qat`, indexer keys through `k_proj`/`k_norm`), and the layers after one attend its
//!   entries (their state binds the source's buffers);
//! - index sources score (`ds_index`, FP4 queries), the candidate source marks its top blocks
//!   (`ds_blocks`), the later index sources of its group score only inside them, and a reusing
//!   layer attends the top-k of the index source before it (the selection stays in the frame's
//!   scratch until the next index source writes it).

use std::sync::Arc;

use gpu_runtime::{Epilogue, GpuContext, GpuError, GpuMatrix};
use kernels_wgsl::Op;
use model_core::trace::{ATTN_INPUT, ATTN_OUT, ATTN_STREAMS, LAYER_OUT, MLP_INPUT, MOE_OUT};
use quant_codecs::MAX_BATCH;

use crate::attention::AttnProj;
use crate::config_v41::{CandidateRole, IndexRole, KvRole, LayerRole, RopeSet};
use crate::device::{self, Device, Enc, RopeGpu, Scratch, ScratchDims};
use crate::engram::NgramContext;
use crate::gpu::{Caches, Head, Shape, Variant, encode_head};
use crate::hc::{HcDims, HcGpu, Prev};
use crate::moe::{GlobalBank, MoeGpu, Router};
use crate::ops::Rope;
use crate::weights::MoeWeights;

use super::{ForwardError, Model};

/// The FP8 window latents' scale floor and inverse maximum (`qat::fp8_ue8m0`).
const FP8_FLOOR: f32 = 1e-4;
/// The FP4 power-of-two scales' floor (`qat::fp4`, `Ue8m0`).
fn fp4_floor() -> f32 {
    6.0 * 2f32.powi(-126)
}

/// V4.1's blocks on the device.
pub struct V41Blocks {
    layers: Vec<LayerGpu>,
    head: HcGpu,
    lm_head: Arc<GpuMatrix>,
    ropes: RopeGpu,
    /// Zeros for `ds_compress`'s position bias (V4.1 pools without one) `[max rate, Dh]`.
    zero_bias: wgpu::Buffer,
}

struct EngramGpu {
    wkv: Arc<GpuMatrix>,
    qk: wgpu::Buffer,
    /// The frame's gathered table rows `[8, n_cols * hd]` (written by the host per frame).
    rows: wgpu::Buffer,
    width: usize,
}

struct CompGpu {
    kv: Arc<GpuMatrix>,
    gate: Option<Arc<GpuMatrix>>,
    norm: wgpu::Buffer,
}

struct KeysGpu {
    k_proj: Arc<GpuMatrix>,
    k_norm: (wgpu::Buffer, usize),
}

struct IndexGpu {
    q_b: Arc<GpuMatrix>,
    weights_proj: Arc<GpuMatrix>,
}

struct LayerGpu {
    engram: Option<EngramGpu>,
    attn_hc: HcGpu,
    proj: AttnProj,
    comp: Option<CompGpu>,
    keys: Option<KeysGpu>,
    index: Option<IndexGpu>,
    ffn_hc: HcGpu,
    role: LayerRole,
}

/// A KV source's caches: its compressor's projection rings, its entries and (an index source)
/// its indexer keys.
pub struct SourceCaches {
    kv: wgpu::Buffer,
    gate: wgpu::Buffer,
    entries: wgpu::Buffer,
    keys: Option<wgpu::Buffer>,
}

/// One sequence's caches: each layer's window ring, and each KV source's.
pub struct V41Caches {
    windows: Vec<wgpu::Buffer>,
    sources: Vec<Option<SourceCaches>>,
}

impl Caches for V41Caches {
    fn buffers(&self) -> Vec<&wgpu::Buffer> {
        let mut out: Vec<&wgpu::Buffer> = self.windows.iter().collect();
        for s in self.sources.iter().flatten() {
            out.extend([&s.kv, &s.gate, &s.entries]);
            out.extend(&s.keys);
        }
        out
    }

    fn dup(&self, dup: &dyn Fn(&wgpu::Buffer) -> wgpu::Buffer) -> Self {
        V41Caches {
            windows: self.windows.iter().map(dup).collect(),
            sources: self
                .sources
                .iter()
                .map(|s| {
                    s.as_ref().map(|s| SourceCaches {
                        kv: dup(&s.kv),
                        gate: dup(&s.gate),
                        entries: dup(&s.entries),
                        keys: s.keys.as_ref().map(dup),
                    })
                })
                .collect(),
        }
    }
}

fn unsupported(reason: String) -> GpuError {
    GpuError::UnsupportedFusion {
        epilogue: "deepseek_v41 device forward",
        reason,
    }
}

impl<'a> Variant<'a> for Model<'a> {
    type Error = ForwardError;
    type Blocks = V41Blocks;
    type Caches = V41Caches;
    type Host = Option<NgramContext>;

    fn shape(&self) -> Shape {
        crate::gpu::shape_of!(self.config)
    }

    fn moe(&self, il: usize) -> &MoeWeights<'a> {
        &self.weights.layers[il].moe
    }

    fn embed(&self) -> &model_core::Mat<'a> {
        &self.weights.embed_tokens
    }

    fn router(&self) -> Router {
        self.router
    }

    fn upload_blocks(
        &self,
        dev: &Device,
        ctx_len: usize,
    ) -> Result<(V41Blocks, Scratch), GpuError> {
        let c = &self.config;
        let w = &self.weights;
        let roles = c.roles();
        let (nh, dh, di) = (c.num_attention_heads, c.head_dim, c.index_head_dim);
        // `o` holds `q_a`'s raw output; the compressor's rings and `lat` hold Dh or Di wide rows.
        if c.q_lora_rank > nh * dh || (nh * dh) % c.o_groups != 0 || c.index_n_heads > 512 {
            return Err(unsupported(format!(
                "q_lora_rank {} > heads x head_dim {}, {nh} heads of {dh} in {} groups, or {} \
                 indexer heads (ds_index takes 512)",
                c.q_lora_rank,
                nh * dh,
                c.o_groups,
                c.index_n_heads
            )));
        }
        // The selection and candidate masks cross layers with one row stride: a reusing
        // layer's (or a restricted index source's) source must compress at its rate.
        for (il, r) in roles.iter().enumerate() {
            let src = match r.kv {
                KvRole::Reuse { source } => Some(source),
                _ => None,
            };
            let idx = match (r.index, r.candidate) {
                (IndexRole::Reuse { from }, _) => Some(from),
                (_, CandidateRole::Restricted { by }) => Some(by),
                (IndexRole::Reindex { keys_from }, _) => Some(keys_from),
                _ => None,
            };
            for other in [src, idx].into_iter().flatten() {
                if source_ratio(roles, other) != source_ratio(roles, il) {
                    return Err(unsupported(format!(
                        "layer {il} shares compressed entries with layer {other} of another ratio"
                    )));
                }
            }
        }
        let eps = c.rms_norm_eps as f32;
        let dims = HcDims {
            n: c.hc_mult,
            d: c.hidden_size,
            norm_eps: eps,
            hc_eps: c.hc_eps as f32,
            iters: c.hc_sinkhorn_iters,
        };
        let mut layers = Vec::with_capacity(w.layers.len());
        for (lw, role) in w.layers.iter().zip(roles) {
            let engram = match &lw.engram {
                Some(ew) => Some(EngramGpu {
                    wkv: dev.mat(&ew.wkv)?,
                    qk: dev.vec("engram qk", &ew.qk),
                    rows: gpu_runtime::ops::graph::storage(
                        &dev.ctx,
                        "engram rows",
                        MAX_BATCH * ew.wkv.cols(),
                    ),
                    width: ew.wkv.cols(),
                }),
                None => None,
            };
            let comp = match &lw.compressor {
                Some(cw) => Some(CompGpu {
                    kv: dev.mat(&cw.kv)?,
                    gate: cw.gate.as_ref().map(|g| dev.mat(g)).transpose()?,
                    norm: dev.vec("compressor norm", &cw.norm),
                }),
                None => None,
            };
            let iw = lw.indexer.as_ref();
            let keys = match iw.and_then(|x| x.keys.as_ref()) {
                Some(kw) => Some(KeysGpu {
                    k_proj: dev.mat(&kw.k_proj)?,
                    k_norm: (dev.vec("indexer k_norm", &kw.k_norm), kw.k_norm.len()),
                }),
                None => None,
            };
            let index = match iw {
                Some(iw) => Some(IndexGpu {
                    q_b: dev.mat(&iw.q_b)?,
                    weights_proj: dev.mat(&iw.weights_proj)?,
                }),
                None => None,
            };
            layers.push(LayerGpu {
                engram,
                attn_hc: HcGpu::site(dev, &lw.attn_hc, &lw.input_layernorm, &dims)?,
                proj: AttnProj::new(dev, &lw.attn)?,
                comp,
                keys,
                index,
                ffn_hc: HcGpu::site(dev, &lw.ffn_hc, &lw.post_attention_layernorm, &dims)?,
                role: *role,
            });
        }
        let max_rate = roles
            .iter()
            .map(|r| r.compress_ratio)
            .max()
            .unwrap_or(1)
            .max(1);
        let main = Rope::new(
            c.rope_main()
                .expect("resolved by from_json, checked by validate"),
            dh,
        );
        let compress = Rope::new(
            c.rope_compress()
                .expect("resolved by from_json, checked by validate"),
            dh,
        );
        let blocks = V41Blocks {
            layers,
            head: HcGpu::collapse_head(dev, &w.norm, &dims),
            lm_head: dev.mat(&w.lm_head)?,
            ropes: RopeGpu::new(&dev.ctx, &main, &compress, ctx_len),
            zero_bias: dev.vec("no position bias", &vec![0.0; max_rate * dh.max(di)]),
        };
        let sd = ScratchDims {
            n: c.hc_mult,
            d: c.hidden_size,
            nh,
            dh,
            ni: c.index_n_heads,
            di,
            q_lora: c.q_lora_rank,
            groups: c.o_groups,
            o_lora: c.o_lora_rank,
            window: c.sliding_window,
            min_rate: roles
                .iter()
                .filter(|r| r.kv == KvRole::Source)
                .map(|r| r.compress_ratio.max(1))
                .min(),
            experts: c.n_routed_experts,
            top_k: c.num_experts_per_tok,
            inter: c.moe_intermediate_size,
            vocab: c.vocab_size,
        };
        Ok((blocks, Scratch::with(&dev.ctx, &sd, ctx_len)))
    }

    fn caches(&self, b: &V41Blocks, ctx: &GpuContext, ctx_len: usize) -> V41Caches {
        let c = &self.config;
        let (dh, di) = (c.head_dim, c.index_head_dim);
        let s = |l: &str, n: usize| gpu_runtime::ops::graph::storage(ctx, l, n);
        let ring = device::ring_of(c.sliding_window);
        V41Caches {
            windows: b
                .layers
                .iter()
                .map(|_| s("window ring", ring * dh))
                .collect(),
            sources: b
                .layers
                .iter()
                .map(|l| {
                    l.comp.as_ref().map(|_| {
                        let rate = l.role.compress_ratio.max(1);
                        let cr = device::comp_ring(rate);
                        let maxe = device::max_entries(ctx_len, rate).max(1);
                        SourceCaches {
                            kv: s("compressor kv ring", cr * dh),
                            gate: s("compressor gate ring", cr * dh),
                            entries: s("compressed entries", maxe * dh),
                            keys: l.keys.as_ref().map(|_| s("indexer keys", maxe * di)),
                        }
                    })
                })
                .collect(),
        }
    }

    fn host(&self) -> Option<NgramContext> {
        self.weights
            .hasher
            .as_ref()
            .map(crate::engram::EngramHasher::new_context)
    }

    fn inputs(
        &self,
        b: &V41Blocks,
        ctx: &GpuContext,
        tokens: &[u32],
        host: &mut Option<NgramContext>,
    ) -> Result<(), ForwardError> {
        let rows = self.engram_rows(tokens, host)?;
        for (l, rows) in b.layers.iter().zip(rows) {
            if let (Some(eg), Some(rows)) = (&l.engram, rows) {
                debug_assert_eq!(rows.len(), tokens.len() * eg.width);
                ctx.queue
                    .write_buffer(&eg.rows, 0, bytemuck::cast_slice(&rows));
            }
        }
        Ok(())
    }

    fn encode(
        &self,
        b: &V41Blocks,
        moe: &[MoeGpu],
        bank: Option<&GlobalBank>,
        e: &mut Enc<'_>,
        st: &V41Caches,
        head: Head,
        ctx_len: usize,
    ) -> Result<(), GpuError> {
        let c = &self.config;
        let (n, d) = (c.hc_mult, c.hidden_size);
        let m = (2 + n) * n;
        let s = e.s;
        let nt = e.nt;
        for (il, (l, moe)) in b.layers.iter().zip(moe).enumerate() {
            if let Some(eg) = &l.engram {
                e.matvec(&eg.wkv, &eg.rows, &s.ekv, nt, Epilogue::None)?;
                let p = [n as u32, d as u32, (c.rms_norm_eps as f32).to_bits()];
                e.op(
                    Op::EngramGate,
                    &p,
                    &[&s.ekv, &eg.qk, &s.x],
                    (n as u32, nt as u32),
                )?;
                e.g.mark("engram");
            }
            // The attention site's maps go to `maps2`; its collapse reads the MoE site's
            // `pre` of the layer before (`maps`), or stream 0 alone.
            let prev = if il == 0 { &s.onehot } else { &s.maps };
            let prev = Prev {
                maps: prev,
                stride: m,
            };
            l.attn_hc
                .encode_pre_from(e, &s.x, nt, &s.maps2, Some(prev))?;
            e.tap(ATTN_INPUT, il, &s.u, nt * d);
            e.g.mark("mhc");
            self.encode_attention(b, l, il, e, st, ctx_len)?;
            e.tap(ATTN_OUT, il, &s.y, nt * d);
            e.g.mark("attn");
            l.attn_hc.encode_post_from(e, &s.x, nt, &s.maps2)?;
            e.tap(ATTN_STREAMS, il, &s.x, nt * n * d);
            let prev = Prev {
                maps: &s.maps2,
                stride: m,
            };
            l.ffn_hc.encode_pre_from(e, &s.x, nt, &s.maps, Some(prev))?;
            e.tap(MLP_INPUT, il, &s.u, nt * d);
            e.g.mark("mhc");
            moe.encode(e, bank, nt, il)?;
            e.tap(MOE_OUT, il, &s.y, nt * d);
            e.g.mark("moe");
            l.ffn_hc.encode_post_from(e, &s.x, nt, &s.maps)?;
            e.tap(LAYER_OUT, il, &s.x, nt * n * d);
            e.g.mark("mhc");
        }
        // The head collapses with the last site's `pre`: the last row's, for the last row.
        let prev = match head {
            Head::Last => {
                e.map(3, ((nt - 1) * m) as u32, &s.maps, &s.u, &s.maps2, m)?;
                &s.maps2
            }
            _ => &s.maps,
        };
        let prev = Prev {
            maps: prev,
            stride: m,
        };
        let nl = c.num_hidden_layers;
        encode_head(
            e,
            nl,
            (n, d, c.vocab_size),
            head,
            &b.lm_head,
            |e, x, rows| b.head.encode_pre_from(e, x, rows, &s.xn, Some(prev)),
        )
    }
}

/// The compression ratio of the entries layer `il` attends (its KV source's), or its own.
fn source_ratio(roles: &[LayerRole], il: usize) -> usize {
    match roles[il].kv {
        KvRole::Reuse { source } => roles[source].compress_ratio,
        _ => roles[il].compress_ratio,
    }
}

impl Model<'_> {
    /// Layer `il`'s attention on `e.s.u` into `e.s.y` (see the module doc).
    fn encode_attention(
        &self,
        b: &V41Blocks,
        l: &LayerGpu,
        il: usize,
        e: &mut Enc<'_>,
        st: &V41Caches,
        ctx_len: usize,
    ) -> Result<(), GpuError> {
        let c = &self.config;
        let roles = c.roles();
        let role = &l.role;
        let s = e.s;
        let nt = e.nt;
        let (nh, dh) = (c.num_attention_heads, c.head_dim);
        let (ni, di) = (c.index_n_heads, c.index_head_dim);
        let eps = c.rms_norm_eps as f32;
        let (cs, pairs) = match role.rope {
            RopeSet::Main => (&b.ropes.main.0, b.ropes.main.1),
            RopeSet::Compress => (&b.ropes.compress.0, b.ropes.compress.1),
        };
        let compress = (&b.ropes.compress.0, b.ropes.compress.1);
        l.proj.encode_in(e, (nh, dh), eps, false)?;
        let rope = |e: &mut Enc<'_>,
                    x: &wgpu::Buffer,
                    heads: usize,
                    hd: usize,
                    (cs, pairs): (&wgpu::Buffer, usize)| {
            let p = [
                (nt * heads * pairs) as u32,
                heads as u32,
                hd as u32,
                pairs as u32,
                0,
            ];
            e.op_lanes(Op::DsRope, &p, &[x, cs], nt * heads * pairs)
        };
        rope(e, &s.q, nh, dh, (cs, pairs))?;
        rope(e, &s.kv, 1, dh, (cs, pairs))?;
        let fp8 = qat_params(
            nt,
            dh,
            32,
            0,
            FP8_FLOOR,
            1.0 / quant_codecs::mxfp8::E4M3_MAX,
        );
        e.op(Op::DsQat, &fp8, &[&s.mix, &s.kv], (nt as u32, 1))?;
        let ring = device::ring_of(c.sliding_window);
        let p = [(nt * dh) as u32, dh as u32, ring as u32];
        e.op_lanes(Op::DsStore, &p, &[&s.kv, &st.windows[il]], nt * dh)?;

        if let (Some(cg), Some(src)) = (&l.comp, &st.sources[il]) {
            let rate = role.compress_ratio.max(1);
            self.encode_compress(b, l, cg, src, rate, e, compress, ctx_len)?;
        }

        if let Some(ig) = &l.index {
            let keys_from = match role.index {
                IndexRole::Reindex { keys_from } => keys_from,
                _ => il,
            };
            let keys = st.sources[keys_from]
                .as_ref()
                .and_then(|x| x.keys.as_ref())
                .ok_or_else(|| unsupported(format!("layer {il}: no indexer keys to score")))?;
            let rate = roles[keys_from].compress_ratio.max(1);
            e.matvec(&ig.q_b, &s.q_res, &s.qi, nt, Epilogue::None)?;
            rope(e, &s.qi, ni, di, compress)?;
            let fp4 = qat_params(nt * ni, di, 32, 1, fp4_floor(), 1.0 / 6.0);
            e.op(Op::DsQat, &fp4, &[&s.mix, &s.qi], ((nt * ni) as u32, 1))?;
            e.matvec(&ig.weights_proj, &s.u, &s.iw, nt, Epilogue::None)?;
            let restricted = matches!(role.candidate, CandidateRole::Restricted { .. });
            let p = [
                nt as u32,
                ni as u32,
                di as u32,
                rate as u32,
                c.index_topk as u32,
                s.maxe as u32,
                (ni as f32).powf(-0.5).to_bits(),
                (di as f32).powf(-0.5).to_bits(),
                u32::from(restricted),
            ];
            let bufs = [&s.qi, &s.iw, keys, &s.scores, &s.sel, &s.cand];
            e.op(Op::DsIndex, &p, &bufs, (nt as u32, 1))?;
            if role.candidate == CandidateRole::Source {
                let p = [
                    rate as u32,
                    s.maxe as u32,
                    c.candidate_block_size as u32,
                    c.candidate_topk_blocks as u32,
                ];
                e.op(
                    Op::DsBlocks,
                    &p,
                    &[&s.scores, &s.bsc, &s.cand],
                    (nt as u32, 1),
                )?;
            }
        }

        // The compressed entries: the KV source's, at the top-k in `sel` (this layer's, or
        // the index source's before it, which no layer since has overwritten).
        let source = match role.kv {
            KvRole::Source => Some(il),
            KvRole::Reuse { source } => Some(source),
            KvRole::SlidingOnly => None,
        };
        let entries = match (source, role.index) {
            (
                Some(src),
                IndexRole::Source | IndexRole::Reindex { .. } | IndexRole::Reuse { .. },
            ) => st.sources[src]
                .as_ref()
                .map(|x| (&x.entries, roles[src].compress_ratio)),
            _ => None,
        };
        let (mode, ent, rate) = match entries {
            Some((ent, rate)) => (2u32, ent, rate.max(1)),
            None => (0, &s.scores, 1),
        };
        let p = [
            nh as u32,
            dh as u32,
            c.sliding_window as u32,
            ring as u32,
            mode,
            rate as u32,
            s.maxe as u32,
            (c.sliding_window + s.maxe) as u32,
            (dh as f32).powf(-0.5).to_bits(),
        ];
        let bufs = [
            &s.q,
            &st.windows[il],
            ent,
            &s.sel,
            &l.proj.sinks,
            &s.lg,
            &s.o,
        ];
        e.op(Op::DsAttend, &p, &bufs, (nh as u32, nt as u32))?;
        l.proj.encode_out(e, (nh, dh), (cs, pairs))
    }

    /// A KV source's compressor: the frame's projections into the rings, the latents of the
    /// groups it completes (`ds_compress`, raw), published as entries (RoPE, FP4 per 16 with
    /// E4M3 scales) and, with the indexer's key weights, as keys (`k_proj`, `k_norm`, RoPE,
    /// FP4 per 32).
    #[allow(clippy::too_many_arguments)]
    fn encode_compress(
        &self,
        b: &V41Blocks,
        l: &LayerGpu,
        cg: &CompGpu,
        src: &SourceCaches,
        rate: usize,
        e: &mut Enc<'_>,
        (cs, pairs): (&wgpu::Buffer, usize),
        ctx_len: usize,
    ) -> Result<(), GpuError> {
        let c = &self.config;
        let s = e.s;
        let nt = e.nt;
        let (dh, di) = (c.head_dim, c.index_head_dim);
        let eps = c.rms_norm_eps as f32;
        let cr = device::comp_ring(rate);
        let maxe = device::max_entries(ctx_len, rate).max(1);
        e.matvec(&cg.kv, &s.u, &s.ckv, nt, Epilogue::None)?;
        let p = [(nt * dh) as u32, dh as u32, cr as u32];
        e.op_lanes(Op::DsStore, &p, &[&s.ckv, &src.kv], nt * dh)?;
        // At ratio 1 a group is its one token: the softmax over one slot weighs it by 1.
        let gate = match &cg.gate {
            Some(g) => {
                e.matvec(g, &s.u, &s.cgate, nt, Epilogue::None)?;
                e.op_lanes(Op::DsStore, &p, &[&s.cgate, &src.gate], nt * dh)?;
                &src.gate
            }
            None => &src.kv,
        };
        // The frame's candidate groups: every row at ratio 1, else at most `nt / rate + 1`.
        let groups = if rate == 1 { nt } else { nt / rate + 1 };
        let p = [
            nt as u32,
            rate as u32,
            dh as u32,
            dh as u32,
            0,
            cr as u32,
            eps.to_bits(),
            pairs as u32,
            maxe as u32,
            1,
        ];
        let bufs = [&src.kv, gate, &b.zero_bias, &cg.norm, cs, &s.lat];
        e.op(Op::DsCompress, &p, &bufs, (groups as u32, 1))?;
        let mut p = qat_params(nt, dh, 16, 2, 6.0 * 2f32.powi(-9), 1.0 / 6.0);
        p[4..8].copy_from_slice(&[1, rate as u32, maxe as u32, pairs as u32]);
        e.op(
            Op::DsQat,
            &p,
            &[&s.lat, &src.entries, cs],
            (groups as u32, 1),
        )?;
        if let (Some(kg), Some(keys)) = (&l.keys, &src.keys) {
            e.matvec(&kg.k_proj, &s.lat, &s.klat, groups, Epilogue::None)?;
            let plain = model_core::device::NormWeight::Plain;
            let (kn, kl) = (&kg.k_norm.0, kg.k_norm.1);
            e.rms_norm_kind(&s.klat, (kn, kl), &s.cgate, groups, kl, eps, plain)?;
            let mut p = qat_params(nt, di, 32, 1, fp4_floor(), 1.0 / 6.0);
            p[4..8].copy_from_slice(&[1, rate as u32, maxe as u32, pairs as u32]);
            e.op(Op::DsQat, &p, &[&s.cgate, keys, cs], (groups as u32, 1))?;
        }
        Ok(())
    }
}

/// deepseek_v41 on the device.
pub type GpuModel<'a> = crate::gpu::GpuModel<'a, Model<'a>, V41Blocks>;

/// A deepseek_v41 sequence on the device.
pub type GpuState = crate::gpu::GpuState<V41Caches, Option<NgramContext>>;

/// `ds_qat`'s parameters for `rows` rows of `width` in blocks of `block`, in place (`map` 0).
fn qat_params(
    rows: usize,
    width: usize,
    block: usize,
    mode: u32,
    floor: f32,
    inv: f32,
) -> [u32; 10] {
    [
        rows as u32,
        width as u32,
        block as u32,
        mode,
        0,
        1,
        1,
        0,
        floor.to_bits(),
        inv.to_bits(),
    ]
}
