//! The qwen4_exp frame's scratch buffers ([`Scratch`], sized for 8 token rows), and the device
//! and frame encoder every block shares (model-core's, over this scratch).

use gpu_runtime::GpuContext;
use gpu_runtime::ops::graph;
use quant_codecs::MAX_BATCH;

use crate::config::{LayerType, Qwen4ExpTextConfig};

pub use model_core::device::{Device, Part, TwoMats};

/// A qwen4_exp frame being recorded.
pub type Enc<'a> = model_core::device::Enc<'a, Scratch>;

/// Most token rows of a prompt's frame by default (every routed expert resident: frames with
/// cold experts keep 8 rows). A frame's chain of ~1,200 dependent dispatches costs about what
/// a decoded token does whatever its rows, and a long frame reads each weight once for more
/// rows: the tiled matmat reads a weight once per 64 rows and the expert-major kernels an
/// expert once per 8 of its slots, which at 64 rows (1.25 slots an expert) they seldom have
/// and at 512 rows (10 slots an expert at the release geometry) they mostly have. On an H100,
/// pp512 1,217 tok/s in frames of 64, 1,991 in frames of 256 and 2,376 in frames of 512
/// (2026-12-07, docs/perf.md). The cost: each recorded frame shape keeps its own scratch and
/// int8 activation buffers, about 2.2 MB a row at the release geometry (~1.1 GB at 512 rows
/// against ~190 MB at 64), so the frames are no longer than the budget's room after the
/// weights holds ([`frame_rows`]); a long `--ctx` shortens them too (the attention logits'
/// cap), and `CORTIQ_PROMPT_ROWS` sets fewer (8 gives the frames of earlier builds).
/// Frames of 32 rows and more run the tiled kernels, whose sums differ from a frame of 8's in
/// the last bits (`CORTIQ_MATMAT=plain` keeps them equal).
pub const PROMPT_ROWS: usize = 512;

/// The longest prompt frame `CORTIQ_PROMPT_ROWS` may ask for (what the matvecs take).
pub const MAX_PROMPT_ROWS: usize = gpu_runtime::ops::matvec::MAX_FRAME_ROWS;

/// Most rows of a frame whose every row's logits are read back (`forward`, perplexity): the
/// logits buffers hold this many rows of the vocabulary (64 MB at the release's).
pub const ALL_LOGITS_ROWS: usize = 64;

/// Most bytes of a frame's attention logits (`[rows, heads, ctx]` f32): a long context gets
/// shorter prompt frames rather than a scratch buffer of gigabytes.
const ATTN_LOGITS_CAP: u64 = 256 << 20;

/// The longest frame a prompt is fed in for `c` and a context of `ctx_len` tokens on a device
/// binding at most `max_binding` bytes, `room` bytes of the VRAM budget left after the weights:
/// [`PROMPT_ROWS`], or what `CORTIQ_PROMPT_ROWS` asks for (8 gives the frames of the earlier
/// builds, for comparisons), fewer where the attention logits would pass `ATTN_LOGITS_CAP` (256 MiB)
/// or the binding limit, and no more than [`ROOMLESS_ROWS`] beyond what `room` holds at
/// [`row_bytes`] a row (a model that fills its budget keeps the frames it had before long
/// frames were the default); a multiple of 8, at least 8.
pub fn frame_rows(
    c: &Qwen4ExpTextConfig,
    ctx_len: usize,
    has_attn: bool,
    max_binding: u64,
    room: u64,
) -> usize {
    let want = std::env::var("CORTIQ_PROMPT_ROWS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(PROMPT_ROWS)
        .min(MAX_PROMPT_ROWS);
    let logits_row = if has_attn {
        (c.num_attention_heads * ctx_len * 4) as u64
    } else {
        1
    };
    let cap = ATTN_LOGITS_CAP.min(max_binding) / logits_row.max(1);
    let fit = room / row_bytes(c, ctx_len, has_attn).max(1);
    let fit = usize::try_from(fit)
        .unwrap_or(usize::MAX)
        .max(ROOMLESS_ROWS);
    let want = want
        .min(usize::try_from(cap).unwrap_or(usize::MAX))
        .min(fit);
    (want / MAX_BATCH * MAX_BATCH).max(MAX_BATCH)
}

/// The shortest of a prompt's long frames: the tiled matmats run from 32 rows, where a frame
/// reads each weight once against four times in frames of 8.
pub const SHORTEST_LONG_FRAME: usize = 32;

/// The lengths of the frames `n` prompt tokens are fed in when the longest frame is `long`
/// rows: the longest of `long`, `long / 2`, `long / 4`, ... (multiples of 8, down to
/// [`SHORTEST_LONG_FRAME`]) that the tokens left fill, then frames of 8 and a last one of the
/// rest. A prompt shorter than `long` still runs in long frames (a 300-token prompt at 512:
/// 256, 32, 8, 4), while a state records at most one graph per rung, not one per prompt length
/// (each keeps its own int8 activation buffers: [`row_bytes`] counts the rungs below the
/// longest).
pub fn frame_lengths(n: usize, long: usize) -> Vec<usize> {
    let mut rungs = Vec::new();
    let mut r = long / MAX_BATCH * MAX_BATCH;
    while r >= SHORTEST_LONG_FRAME {
        rungs.push(r);
        r = r / 2 / MAX_BATCH * MAX_BATCH;
    }
    let mut out = Vec::new();
    let mut rest = n;
    while rest > 0 {
        let len = rungs
            .iter()
            .copied()
            .find(|&r| r <= rest)
            .unwrap_or(rest.min(MAX_BATCH));
        out.push(len);
        rest -= len;
    }
    out
}

/// The frame rows a prompt keeps whatever room the budget leaves (the default before longer
/// frames).
pub const ROOMLESS_ROWS: usize = 64;

/// Logits per workgroup of greedy argmax's first pass.
pub const ARGMAX_CHUNK: usize = 1024;

/// The intermediates of one frame (up to `rows` token rows), shared by every layer: the blocks run
/// one after another, so one set serves the whole forward.
pub struct Scratch {
    /// The H residual streams `[nt, H*D]` (the frame's input is written here).
    pub x: wgpu::Buffer,
    /// The last row of the streams `[H*D]` (the head's input when only it is needed).
    pub x_last: wgpu::Buffer,
    /// Normalised streams `[nt, H*D]`.
    pub xn: wgpu::Buffer,
    /// HC down projection `[nt, R]`.
    pub low: wgpu::Buffer,
    /// The same after its activation.
    pub low_act: wgpu::Buffer,
    /// HC gates `[nt, H*D]`.
    pub g: wgpu::Buffer,
    /// A block's input `[nt, D]`.
    pub u: wgpu::Buffer,
    /// HC injection projection `[nt, H]`.
    pub inj_raw: wgpu::Buffer,
    /// HC injection weights `[nt, H]`, in two slots: a site whose norm is folded into its
    /// front and read-out writes its weights to one while its read-out reads the previous
    /// site's from the other (`crate::hc::encode`).
    pub inj: [wgpu::Buffer; 2],
    /// Each token row's streams' `1 / rms` `[nt, H]` (a folded norm's front to its read-out).
    pub rstd: wgpu::Buffer,
    /// A block's output `[nt, D]`.
    pub y: wgpu::Buffer,
    /// Per-block work buffers, each big enough for the widest use (named by the block that
    /// owns the layout it holds at a time).
    pub w: [wgpu::Buffer; 8],
    /// QSA block scores `[nt, max_blocks]`.
    pub scores: wgpu::Buffer,
    /// QSA block choices `[nt, max_blocks]`.
    pub sel: wgpu::Buffer,
    /// Attention logits `[nt, Hq, ctx]`.
    pub attn_logits: wgpu::Buffer,
    /// Logits `[min(nt, ALL_LOGITS_ROWS), vocab]`.
    pub logits: wgpu::Buffer,
    /// The greedy token.
    pub token: wgpu::Buffer,
    /// Greedy argmax's per-chunk best (value bits, index) pairs.
    pub argmax_part: wgpu::Buffer,
    /// The MoE slots of a frame (rows x top-k): expert ids `[rows k]`.
    pub slot_ids: wgpu::Buffer,
    /// The slots' expert hidden states `[8k, I]`.
    pub expert_mid: wgpu::Buffer,
    /// The slots' expert outputs `[rows k, D]`, then their routing weights `[rows, k]` and the
    /// rows' shared-expert gates `[rows]` (offsets from `gpu_runtime::ops::matvec::moe_out_offsets` for the
    /// frame's row count).
    pub expert_out: wgpu::Buffer,
    /// The slots' bank slots, where some experts are on the CPU `[rows k]` (u32).
    pub bank_ids: wgpu::Buffer,
    /// The slots' cold experts (`NONE_SLOT` for a resident one) `[rows k]` (u32).
    pub cold: wgpu::Buffer,
    /// Per layer, outputs of its own for the dispatches a frame of at most [`MAX_BATCH`] rows
    /// runs side by side ([`LayerOuts`]); empty where the context orders every dispatch after
    /// the one before (`CORTIQ_CONCURRENT=off`), and for a model with experts on the CPU: its
    /// frames are submitted in ~100 spans a token, and wgpu's submission of a span tracks each
    /// buffer the span uses first, which on an H100's host cost more than the dispatches side
    /// by side saved (docs/perf.md, 2026-12-07: 41.5 against 37.1-39.9 tok/s at 12G).
    pub outs: Vec<LayerOuts>,
}

/// One layer's own outputs for the dispatches of a short frame that do not depend on each
/// other. wgpu orders a dispatch after everything before it (a pipeline barrier) whenever one
/// of its buffers changes use, and a storage buffer written before (the shared work buffers,
/// which every layer writes) always does; a buffer this command buffer has not yet used needs
/// no barrier, so a dispatch that reads what the one before it read and writes such a buffer
/// runs beside it on the device. A decode step's GDN projections (qkv, z and the b/a pair
/// after their shared quantiser), its attention projections (q and gate, k, v, the
/// indexer's), and its MoE router and shared expert (beside the quantiser and the routed
/// experts' gate/up) then take one step of the chain each instead of several. About 20 MB at
/// the release geometry, outside [`row_bytes`]' estimate.
pub struct LayerOuts {
    /// GDN's projections `[8, conv dim]`, `[8, value dim]`, `[8, Hv]` twice (`None` for an
    /// attention layer).
    pub gdn: Option<[wgpu::Buffer; 4]>,
    /// Indexed attention's projections: q and gate, k, v, the indexer's q and k (`None` for
    /// a GDN layer).
    pub qsa: Option<[wgpu::Buffer; 4]>,
    /// The router's logits `[8, experts]`.
    pub router: wgpu::Buffer,
    /// The shared expert's gate/up product `[8, shared intermediate]`.
    pub shared: wgpu::Buffer,
    /// The outputs of the L2 prefetches of the layer's two hyper-connection sites' matrices
    /// (`GpuContext::prefetch_hc`: attention site front and up, MLP site front and up; 16 bytes
    /// each, never written in practice).
    pub prefetch: [wgpu::Buffer; 4],
}

/// The work buffers' row width (the widest any block's layout needs), the QSA blocks of a
/// context of `ctx_len` tokens, and the attention heads (1 without attention).
fn work_widths(c: &Qwen4ExpTextConfig, ctx_len: usize, has_attn: bool) -> (usize, usize, usize) {
    let (h, d) = (c.hc_count, c.hidden_size);
    // The widest per-row width any block's work buffer holds.
    let mut widest = vec![d * h, c.num_experts, c.moe_intermediate_size, d];
    widest.push(c.shared_expert_intermediate_size);
    widest.push(c.ple_embed_dim());
    let has_gdn = (0..c.num_hidden_layers).any(|il| c.layer_type(il) == LayerType::LinearAttention);
    if has_gdn {
        let (hk, hv) = (c.linear_num_key_heads, c.linear_num_value_heads);
        let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
        widest.push(2 * hk * dk + hv * dv);
        // gdn_prep's rows: q, k, beta, decay.
        widest.push(2 * hk * dk + 2 * hv);
    }
    let mut max_blocks = 1;
    let mut hq = 1;
    if has_attn {
        let (hq_, hkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        hq = hq_;
        widest.push(2 * hq * hd);
        widest.push(hkv * hd);
        if let Some(q) = c.qsa() {
            widest.push((q.n_heads + 1) * q.head_dim);
            max_blocks = ctx_len / q.ratio + 1;
        }
    }
    (widest.into_iter().max().unwrap_or(d), max_blocks, hq)
}

/// Device bytes a frame row costs beyond the weights, an estimate: the scratch's per-row
/// buffers ([`Scratch::new`]) five times over, since the int8 activation buffers each frame
/// shape records are about twice the scratch at the release geometry (0.7 and 1.3 MB a row),
/// and the shorter rungs of [`frame_lengths`] record as many rows again as the longest.
pub fn row_bytes(c: &Qwen4ExpTextConfig, ctx_len: usize, has_attn: bool) -> u64 {
    let (h, d, k) = (c.hc_count, c.hidden_size, c.num_experts_per_tok);
    let (wide, max_blocks, hq) = work_widths(c, ctx_len, has_attn);
    let floats = 3 * h * d
        + 2 * c.hc_lowrank
        + 3 * h
        + 2 * d
        + 8 * wide
        + 2 * max_blocks
        + hq * ctx_len
        + 4 * k
        + k * (c.moe_intermediate_size + d);
    5 * 4 * floats as u64
}

impl Scratch {
    /// Buffers for `c`, frames of up to `rows` token rows and a context of `ctx_len` tokens;
    /// `has_attn` when an indexed-attention layer runs (the trunk's, or the MTP head's);
    /// `own_outs` for the layers' own outputs ([`LayerOuts`]).
    pub fn new(
        gpu: &GpuContext,
        c: &Qwen4ExpTextConfig,
        rows: usize,
        ctx_len: usize,
        has_attn: bool,
        own_outs: bool,
    ) -> Scratch {
        let nt = rows.max(MAX_BATCH);
        let (h, d) = (c.hc_count, c.hidden_size);
        let buf = |label: &str, n: usize| graph::storage(gpu, label, n);
        let (wide, max_blocks, hq) = work_widths(c, ctx_len, has_attn);
        let wide = wide * nt;
        Scratch {
            x: buf("x", nt * h * d),
            x_last: buf("x_last", h * d),
            xn: buf("xn", nt * h * d),
            // The fused HC front writes the down and injection rows together.
            low: buf("low", nt * (c.hc_lowrank + h)),
            low_act: buf("low_act", nt * c.hc_lowrank),
            g: buf("hc_g", nt * h * d),
            u: buf("u", nt * d),
            inj_raw: buf("inj_raw", nt * h),
            inj: [buf("inj", nt * h), buf("inj (second slot)", nt * h)],
            rstd: buf("hc 1/rms", nt * h),
            y: buf("y", nt * d),
            w: std::array::from_fn(|i| buf(&format!("work{i}"), wide)),
            scores: buf("scores", nt * max_blocks),
            sel: buf("sel", nt * max_blocks),
            attn_logits: buf("attn_logits", nt * hq * ctx_len),
            logits: buf("logits", nt.min(ALL_LOGITS_ROWS) * c.vocab_size),
            argmax_part: buf("argmax_part", 2 * c.vocab_size.div_ceil(ARGMAX_CHUNK)),
            token: buf("token", 4),
            slot_ids: buf("slot ids", nt * c.num_experts_per_tok),
            expert_mid: buf(
                "expert hidden",
                nt * c.num_experts_per_tok * c.moe_intermediate_size,
            ),
            // The slots' outputs, then their weights and the rows' shared-expert gates
            // (`gpu_runtime::ops::matvec::moe_out_offsets`).
            expert_out: buf("expert out", nt * c.num_experts_per_tok * (d + 1) + nt),
            bank_ids: buf("bank slots", nt * c.num_experts_per_tok),
            cold: buf("cold slots", nt * c.num_experts_per_tok),
            outs: if own_outs {
                (0..c.num_hidden_layers)
                    .map(|il| LayerOuts::new(gpu, c, il))
                    .collect()
            } else {
                Vec::new()
            },
        }
    }

    /// Layer `il`'s own outputs for a frame of `nt` rows, where it has them (see [`LayerOuts`]).
    pub fn outs(&self, il: usize, nt: usize) -> Option<&LayerOuts> {
        (nt <= MAX_BATCH).then(|| self.outs.get(il)).flatten()
    }
}

impl LayerOuts {
    fn new(gpu: &GpuContext, c: &Qwen4ExpTextConfig, il: usize) -> LayerOuts {
        let buf = |label: &str, n: usize| graph::storage(gpu, label, MAX_BATCH * n);
        let gdn = (c.layer_type(il) == LayerType::LinearAttention).then(|| {
            let (hk, hv) = (c.linear_num_key_heads, c.linear_num_value_heads);
            let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
            [
                buf("gdn qkv (layer)", 2 * hk * dk + hv * dv),
                buf("gdn z (layer)", hv * dv),
                buf("gdn b (layer)", hv),
                buf("gdn a (layer)", hv),
            ]
        });
        let qsa = (c.layer_type(il) != LayerType::LinearAttention).then(|| {
            let (hq, hkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
            let idx = c.qsa().map_or(1, |q| (q.n_heads + 1) * q.head_dim);
            [
                buf("qsa q and gate (layer)", 2 * hq * hd),
                buf("qsa k (layer)", hkv * hd),
                buf("qsa v (layer)", hkv * hd),
                buf("qsa indexer q and k (layer)", idx),
            ]
        });
        LayerOuts {
            gdn,
            qsa,
            router: buf("router logits (layer)", c.num_experts),
            shared: buf("shared expert (layer)", c.shared_expert_intermediate_size),
            prefetch: std::array::from_fn(|_| graph::storage(gpu, "prefetch (layer)", 4)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every prompt length's frames add up to it, each a rung of the ladder (the longest frame
    /// halved while a multiple of 8 and at least 32 rows), 8 rows, or the last one's rest;
    /// longer rungs first, and a rung only where no longer one fits what is left.
    #[test]
    fn prompt_frames_take_the_longest_rung_that_fits() {
        for long in [8usize, 24, 64, 96, 256, 512] {
            let mut rungs = vec![];
            let mut r = long;
            while r >= 32 && r % 8 == 0 {
                rungs.push(r);
                r /= 2;
            }
            for n in 0..1200 {
                let f = frame_lengths(n, long);
                assert_eq!(f.iter().sum::<usize>(), n, "{n} at {long}");
                let mut rest = n;
                for (i, &len) in f.iter().enumerate() {
                    let want = rungs.iter().copied().find(|&r| r <= rest);
                    match want {
                        Some(r) => assert_eq!(len, r, "{n} at {long}: frame {i}"),
                        None => {
                            let last = i + 1 == f.len();
                            assert!(
                                len == 8 || (last && len == rest && len < 8),
                                "{n} at {long}: {f:?}"
                            );
                        }
                    }
                    rest -= len;
                }
            }
        }
        assert_eq!(frame_lengths(300, 512), vec![256, 32, 8, 4]);
        assert_eq!(frame_lengths(1000, 512), vec![512, 256, 128, 64, 32, 8]);
    }

    /// At the release geometry a frame row costs about 3.5 MB beyond the weights (the scratch's
    /// 0.7 MB of buffers counted from `Scratch::new`'s sizes by hand, five times over), and the
    /// default frames shrink to what the budget's room holds, never below the old default.
    #[test]
    fn frames_shrink_to_the_room_the_budget_leaves() {
        if std::env::var("CORTIQ_PROMPT_ROWS").is_ok() {
            return;
        }
        let c = Qwen4ExpTextConfig::from_json(&crate::synthetic::release_config(48, 512)).unwrap();
        let ctx = 528;
        let row = row_bytes(&c, ctx, true);
        // x, xn, g: 3 x 4 x 2560; 8 work buffers of 12,288 (QSA's 2 x 24 x 256); the expert
        // rows 10 x (640 + 2560); QSA block scores and choices of 4-token blocks; attention
        // logits 24 x 528.
        let floats = 3 * 4 * 2560
            + 2 * 320
            + 12
            + 2 * 2560
            + 8 * 12288
            + 2 * (ctx / 4 + 1)
            + 24 * ctx
            + 40
            + 10 * (640 + 2560);
        assert_eq!(row, 20 * floats as u64);
        let max = 1u64 << 31;
        assert_eq!(frame_rows(&c, ctx, true, max, u64::MAX), PROMPT_ROWS);
        assert_eq!(frame_rows(&c, ctx, true, max, 0), ROOMLESS_ROWS);
        assert_eq!(frame_rows(&c, ctx, true, max, 100 * row + 5), 96);
    }
}
