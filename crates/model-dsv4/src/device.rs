//! What the deepseek_v4 device forward shares across its blocks: the activation scratch of a
//! frame (every buffer sized once for 8 token rows and the model's context), the RoPE tables,
//! and the frame encoder over them ([`Enc`], model-core's, with this model's scratch).

use gpu_runtime::GpuContext;
use gpu_runtime::ops::graph;
use quant_codecs::MAX_BATCH;

use crate::config::{AttnKind, DeepseekV4Config};
use crate::ops::Rope;

pub use model_core::device::{Device, Part};

/// A frame encoder over deepseek_v4's scratch.
pub type Enc<'a> = model_core::device::Enc<'a, Scratch>;

/// The frame's activations, shared by every layer (one frame runs at a time per model).
pub struct Scratch {
    /// The streams `[8, N*D]`.
    pub x: wgpu::Buffer,
    /// The last row's streams (a head over the last row only) `[N*D]`.
    pub x_last: wgpu::Buffer,
    /// The unweighted norm of the streams `[8, N*D]`.
    pub xn: wgpu::Buffer,
    /// An mHC site's raw mix `[8, (2+N)*N]`.
    pub mix: wgpu::Buffer,
    /// Its maps (pre, post, comb) `[8, (2+N)*N]`.
    pub maps: wgpu::Buffer,
    /// A block's input `[8, D]`.
    pub u: wgpu::Buffer,
    /// A block's output `[8, D]`.
    pub y: wgpu::Buffer,
    /// The frame's token ids (hash routing) `[8]`.
    pub tokens: wgpu::Buffer,
    /// `q_res` `[8, q_lora_rank]`.
    pub q_res: wgpu::Buffer,
    /// The queries `[8, H*Dh]`.
    pub q: wgpu::Buffer,
    /// The K = V latents `[8, Dh]`.
    pub kv: wgpu::Buffer,
    /// A compressor's kv and gate projections `[8, 2*max(Dh, Di)]`.
    pub ckv: wgpu::Buffer,
    /// (see `ckv`)
    pub cgate: wgpu::Buffer,
    /// The indexer's queries `[8, nI*Di]`.
    pub qi: wgpu::Buffer,
    /// The indexer's head weights `[8, nI]`.
    pub iw: wgpu::Buffer,
    /// The indexer's scores `[8, max entries]`.
    pub scores: wgpu::Buffer,
    /// The indexer's selection mask `[8, max entries]`.
    pub sel: wgpu::Buffer,
    /// Attention weights `[8, H, window + max entries]`.
    pub lg: wgpu::Buffer,
    /// The attention output `[8, H*Dh]`.
    pub o: wgpu::Buffer,
    /// The grouped projection's middle `[8, groups*o_lora_rank]`.
    pub o_mid: wgpu::Buffer,
    /// `o_a`'s group of each `[row, group]` slot: `slot % groups`.
    pub o_ids: wgpu::Buffer,
    /// Router logits `[8, E]`.
    pub logits_e: wgpu::Buffer,
    /// Routed experts `[8, k]` and their weights.
    pub ids: wgpu::Buffer,
    /// (see `ids`)
    pub wts: wgpu::Buffer,
    /// The routed slots' global bank slots `[8k]` (0 for a cold one).
    pub bank_ids: wgpu::Buffer,
    /// The routed slots' cold experts `[8k]` (`NONE_SLOT` for a resident one).
    pub cold: wgpu::Buffer,
    /// Routed gate/up `[8k, 2I]`.
    pub mid2: wgpu::Buffer,
    /// Routed SwiGLU `[8k, I]`.
    pub mid: wgpu::Buffer,
    /// Routed expert outputs `[8k, D]`.
    pub eo: wgpu::Buffer,
    /// Shared expert gate, up, SwiGLU `[8, I]` and output `[8, D]`.
    pub sg: wgpu::Buffer,
    /// (see `sg`)
    pub su: wgpu::Buffer,
    /// (see `sg`)
    pub sm: wgpu::Buffer,
    /// (see `sg`)
    pub so: wgpu::Buffer,
    /// The logits `[8, vocab]`.
    pub logits: wgpu::Buffer,
    /// V4.1: the attention site's maps `[8, (2+N)*N]` (`maps` holds the MoE site's: each
    /// site's collapse reads the other's `pre`).
    pub maps2: wgpu::Buffer,
    /// V4.1: the one-hot `pre` before the first layer (stream 0), in the maps' layout.
    pub onehot: wgpu::Buffer,
    /// V4.1: a KV source's pre-RoPE latents of the frame's candidate groups `[8, max(Dh, Di)]`.
    pub lat: wgpu::Buffer,
    /// V4.1: their indexer keys before publishing `[8, Di]`.
    pub klat: wgpu::Buffer,
    /// V4.1: the candidate source's entry mask `[8, max entries]`.
    pub cand: wgpu::Buffer,
    /// V4.1: the candidate source's block scores `[8, max entries]`.
    pub bsc: wgpu::Buffer,
    /// V4.1: an Engram layer's keys and value `[8, (N+1)*D]`.
    pub ekv: wgpu::Buffer,
    /// Entries the finest compressor holds at most (the row stride of `lg`).
    pub maxe: usize,
}

/// The widths the scratch is sized for (either architecture's config).
#[derive(Debug, Clone)]
pub struct ScratchDims {
    /// `hc_mult`.
    pub n: usize,
    /// `hidden_size`.
    pub d: usize,
    /// `num_attention_heads`.
    pub nh: usize,
    /// `head_dim`.
    pub dh: usize,
    /// `index_n_heads`.
    pub ni: usize,
    /// `index_head_dim`.
    pub di: usize,
    /// `q_lora_rank`.
    pub q_lora: usize,
    /// `o_groups`.
    pub groups: usize,
    /// `o_lora_rank`.
    pub o_lora: usize,
    /// `sliding_window`.
    pub window: usize,
    /// The smallest compression rate of any layer (`None`: no compressed layer).
    pub min_rate: Option<usize>,
    /// `n_routed_experts`.
    pub experts: usize,
    /// `num_experts_per_tok`.
    pub top_k: usize,
    /// `moe_intermediate_size`.
    pub inter: usize,
    /// `vocab_size`.
    pub vocab: usize,
}

impl ScratchDims {
    /// A deepseek_v4 config's.
    pub fn v4(c: &DeepseekV4Config) -> ScratchDims {
        ScratchDims {
            n: c.hc_mult,
            d: c.hidden_size,
            nh: c.num_attention_heads,
            dh: c.head_dim,
            ni: c.index_n_heads,
            di: c.index_head_dim,
            q_lora: c.q_lora_rank,
            groups: c.o_groups,
            o_lora: c.o_lora_rank,
            window: c.sliding_window,
            min_rate: (0..c.num_hidden_layers)
                .filter_map(|il| c.rate(c.attn_kind(il)))
                .min(),
            experts: c.n_routed_experts,
            top_k: c.num_experts_per_tok,
            inter: c.moe_intermediate_size,
            vocab: c.vocab_size,
        }
    }
}

/// Entries a compressor of `rate` can hold in a context of `ctx_len` positions.
pub fn max_entries(ctx_len: usize, rate: usize) -> usize {
    ctx_len / rate
}

/// Rows of a sliding window's ring: the window, plus a frame's rows written before its first
/// query reads (a query at `p` reads `p + 1 - window ..= p`; the frame writes up to `p + 7`).
pub fn window_ring(c: &DeepseekV4Config) -> usize {
    ring_of(c.sliding_window)
}

/// [`window_ring`] of a window of `window` positions.
pub fn ring_of(window: usize) -> usize {
    window + MAX_BATCH
}

/// Rows of a compressor's projection ring: the window the next entry overlaps, its own, and a
/// frame's rows.
pub fn comp_ring(rate: usize) -> usize {
    2 * rate + MAX_BATCH
}

impl Scratch {
    /// Sized for `c` and contexts of `ctx_len`.
    pub fn new(ctx: &GpuContext, c: &DeepseekV4Config, ctx_len: usize) -> Scratch {
        Scratch::with(ctx, &ScratchDims::v4(c), ctx_len)
    }

    /// Sized for `dims` and contexts of `ctx_len`.
    pub fn with(ctx: &GpuContext, c: &ScratchDims, ctx_len: usize) -> Scratch {
        let b = MAX_BATCH;
        let (n, d) = (c.n, c.d);
        let (nh, dh, di) = (c.nh, c.dh, c.di);
        let m = (2 + n) * n;
        let maxe = max_entries(ctx_len, c.min_rate.unwrap_or(ctx_len.max(1))).max(1);
        let (k, i) = (c.top_k, c.inter);
        let groups = c.groups;
        let s = |l: &str, len: usize| graph::storage(ctx, l, len);
        let o_ids: Vec<u32> = (0..b * groups).map(|x| (x % groups) as u32).collect();
        let onehot: Vec<f32> = (0..b * m).map(|x| f32::from(x % m == 0)).collect();
        Scratch {
            x: s("x", b * n * d),
            x_last: s("x last", n * d),
            xn: s("xn", b * n * d),
            mix: s("mix", b * m),
            maps: s("maps", b * m),
            u: s("u", b * d),
            y: s("y", b * d),
            tokens: s("tokens", b),
            q_res: s("q_res", b * c.q_lora),
            q: s("q", b * nh * dh),
            kv: s("kv", b * dh),
            ckv: s("ckv", b * 2 * dh.max(di)),
            cgate: s("cgate", b * 2 * dh.max(di)),
            qi: s("qi", b * c.ni * di),
            iw: s("iw", b * c.ni),
            scores: s("scores", b * maxe),
            sel: s("sel", b * maxe),
            lg: s("lg", b * nh * (c.window + maxe)),
            o: s("o", b * nh * dh),
            o_mid: s("o mid", b * groups * c.o_lora),
            o_ids: graph::upload_words(ctx, "o groups", &o_ids),
            logits_e: s("router logits", b * c.experts),
            ids: s("ids", b * k),
            wts: s("wts", b * k),
            bank_ids: s("bank ids", b * k),
            cold: s("cold", b * k),
            mid2: s("mid2", b * k * 2 * i),
            mid: s("mid", b * k * i),
            eo: s("eo", b * k * d),
            sg: s("sg", b * i),
            su: s("su", b * i),
            sm: s("sm", b * i),
            so: s("so", b * d),
            logits: s("logits", b * c.vocab),
            maps2: s("maps2", b * m),
            onehot: graph::upload_f32(ctx, "one-hot pre", &onehot),
            lat: s("latents", b * dh.max(di)),
            klat: s("key latents", b * di),
            cand: s("candidates", b * maxe),
            bsc: s("block scores", b * maxe),
            ekv: s("engram kv", b * (n + 1) * d),
            maxe,
        }
    }
}

/// The two RoPE sets as device tables `[ctx_len, 2*pairs]` (cos then sin per position, the
/// CPU's own f32 values).
pub struct RopeGpu {
    /// `main` (sliding layers) and its rotated pairs per head.
    pub main: (wgpu::Buffer, usize),
    /// `compress` (CSA/HCA attention, compressors, indexer) and its pairs.
    pub compress: (wgpu::Buffer, usize),
}

impl RopeGpu {
    /// Tables of `main` and `compress` for positions `0..ctx_len`.
    pub fn new(ctx: &GpuContext, main: &Rope, compress: &Rope, ctx_len: usize) -> RopeGpu {
        let table = |r: &Rope| {
            let mut t = Vec::with_capacity(ctx_len * 2 * r.inv_freq().len());
            for p in 0..ctx_len {
                let (cos, sin) = r.at(p);
                t.extend(cos);
                t.extend(sin);
            }
            (graph::upload_f32(ctx, "rope table", &t), r.inv_freq().len())
        };
        RopeGpu {
            main: table(main),
            compress: table(compress),
        }
    }

    /// The table of a layer kind and its pairs.
    pub fn of(&self, kind: AttnKind) -> (&wgpu::Buffer, usize) {
        let (t, n) = if kind == AttnKind::Sliding {
            &self.main
        } else {
            &self.compress
        };
        (t, *n)
    }
}
