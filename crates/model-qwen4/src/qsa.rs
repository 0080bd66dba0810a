//! Full attention with the QSA indexer (`Qwen4ExpTextAttention` + `Qwen4ExpTextQSAIndexer`).
//!
//! Attention: `[q | gate]` per head from `q_proj`; `q = q_norm(q)`, `k = k_norm(k_proj u)`
//! ((1+w) RMSNorm per head); rotate-half RoPE on the first `rotary_dim` dims; GQA; scale
//! `head_dim^-0.5`; softmax over the SELECTED visible tokens; `o *= sigmoid(gate)`; `o_proj`.
//!
//! Indexer: `[q_I (n_I heads) | k_raw] = index_qk_proj u`; `q_I = RoPE(q_layernorm(q_I))` at the
//! query position; raw keys are kept un-normalised and un-rotated. For a query that sees tokens
//! `0..=p`, the complete blocks of `ratio` tokens get `K_b = RoPE(k_layernorm(mean(k_raw)))` at
//! the block's first position and `score_b = sum_h relu(q_I[h] . K_b) / sqrt(d_I)`; the top
//! `budget / ratio` blocks (ties: lower block first) plus the incomplete tail are attended.
//! Below the budget every token is selected, i.e. dense attention.

use std::sync::Arc;

use crate::config::Qwen4ExpTextConfig;
use crate::device::{Device, Enc, Part};
use crate::ops::{Rope, rms_norm_1p, rope};
use crate::weights::AttnWeights;
use gpu_runtime::ops::graph::storage;
use gpu_runtime::{Epilogue, GpuContext, GpuError, GpuMatrix};
use kernels_wgsl::Op;
use quant_codecs::ops::{linear, sigmoid, top_k};
use rayon::prelude::*;

/// KV cache of one attention layer for one sequence.
#[derive(Debug, Clone, Default)]
pub struct AttnState {
    /// Normalised, rotated keys `[n, Hkv*hd]`.
    pub k: Vec<f32>,
    /// Values `[n, Hkv*hd]`.
    pub v: Vec<f32>,
    /// Raw indexer keys `[n, d_I]`.
    pub raw: Vec<f32>,
    /// Block keys `RoPE(k_layernorm(mean(k_raw)))` of the complete blocks so far `[n/ratio, d_I]`
    /// (a pure function of `raw`, kept so decode does not recompute them).
    pub block_keys: Vec<f32>,
}

/// Drops the entries of `st` from position `n` on (a rolled-back draft's): the caches are
/// per position, and the block keys are those of the blocks still complete.
pub fn truncate(c: &Qwen4ExpTextConfig, st: &mut AttnState, n: usize) {
    let kvd = c.num_key_value_heads * c.head_dim;
    st.k.truncate(n * kvd);
    st.v.truncate(n * kvd);
    if let Some(q) = c.qsa() {
        st.raw.truncate(n * q.head_dim);
        st.block_keys.truncate(n / q.ratio * q.head_dim);
    }
}

/// Runs the block on block inputs `u` `[t, D]` at positions `past..past+t`; returns `[t, D]`.
pub fn forward_cpu(
    w: &AttnWeights<'_>,
    c: &Qwen4ExpTextConfig,
    rp: &Rope,
    u: &[f32],
    t: usize,
    st: &mut AttnState,
) -> Vec<f32> {
    let p = project(w, u, t);
    let o = attend(w, c, rp, &p, 0, t, st);
    linear(&w.o, &o, t)
}

/// The projections of `t` rows (row-wise: rows of several sequences project together).
pub struct AttnProj {
    /// `[t, Hq * 2hd]`: per head `q | gate`.
    pub qg: Vec<f32>,
    /// `[t, Hkv*hd]`, before `k_norm` and RoPE.
    pub k: Vec<f32>,
    /// `[t, Hkv*hd]`.
    pub v: Vec<f32>,
    /// `[t, (n_I + 1) d_I]`: indexer queries, then the raw key.
    pub qk_i: Vec<f32>,
}

/// Projects block inputs `u` `[t, D]`.
pub fn project(w: &AttnWeights<'_>, u: &[f32], t: usize) -> AttnProj {
    AttnProj {
        qg: linear(&w.q, u, t),
        k: linear(&w.k, u, t),
        v: linear(&w.v, u, t),
        qk_i: linear(&w.idx_qk, u, t),
    }
}

/// Attention of one sequence's rows `r0..r0+t` of `p` (its next tokens, in order) over its
/// cache, which they join; returns the gated heads `[t, Hq*hd]` (`o_proj`'s input).
pub fn attend(
    w: &AttnWeights<'_>,
    c: &Qwen4ExpTextConfig,
    rp: &Rope,
    p: &AttnProj,
    r0: usize,
    t: usize,
    st: &mut AttnState,
) -> Vec<f32> {
    let (hq, hkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let qsa = c.qsa().expect("validated");
    let (ni, di) = (qsa.n_heads, qsa.head_dim);
    let eps = c.rms_norm_eps as f32;
    let kvd = hkv * hd;
    let past = st.k.len() / kvd;
    let qkvd = hq * 2 * hd;
    let qid = (ni + 1) * di;
    let qg = &p.qg[r0 * qkvd..(r0 + t) * qkvd];
    let mut k = p.k[r0 * kvd..(r0 + t) * kvd].to_vec();
    let v = &p.v[r0 * kvd..(r0 + t) * kvd];
    let qk_i = &p.qk_i[r0 * qid..(r0 + t) * qid];
    rms_norm_1p(&mut k, &w.k_norm, hd, eps);
    let mut q = vec![0f32; t * hq * hd];
    let mut gate = vec![0f32; t * hq * hd];
    for r in 0..t {
        for h in 0..hq {
            let src = &qg[r * hq * 2 * hd + h * 2 * hd..r * hq * 2 * hd + (h + 1) * 2 * hd];
            q[(r * hq + h) * hd..(r * hq + h + 1) * hd].copy_from_slice(&src[..hd]);
            gate[(r * hq + h) * hd..(r * hq + h + 1) * hd].copy_from_slice(&src[hd..]);
        }
    }
    rms_norm_1p(&mut q, &w.q_norm, hd, eps);
    // Indexer queries and raw keys.
    let mut qi = vec![0f32; t * ni * di];
    for r in 0..t {
        qi[r * ni * di..(r + 1) * ni * di]
            .copy_from_slice(&qk_i[r * (ni + 1) * di..r * (ni + 1) * di + ni * di]);
        st.raw
            .extend_from_slice(&qk_i[r * (ni + 1) * di + ni * di..(r + 1) * (ni + 1) * di]);
    }
    rms_norm_1p(&mut qi, &w.idx_q_norm, di, eps);
    for r in 0..t {
        let (cos, sin) = rp.at(past + r);
        for h in 0..hq {
            rope(&mut q[(r * hq + h) * hd..(r * hq + h + 1) * hd], &cos, &sin);
        }
        for h in 0..hkv {
            rope(
                &mut k[(r * hkv + h) * hd..(r * hkv + h + 1) * hd],
                &cos,
                &sin,
            );
        }
        for h in 0..ni {
            rope(
                &mut qi[(r * ni + h) * di..(r * ni + h + 1) * di],
                &cos,
                &sin,
            );
        }
    }
    st.k.extend_from_slice(&k);
    st.v.extend_from_slice(v);
    let n = past + t;
    // Block keys of the complete blocks not yet pooled (independent of the query).
    let nblocks = n / qsa.ratio;
    for b in st.block_keys.len() / di..nblocks {
        let mut out = vec![0f32; di];
        for j in 0..qsa.ratio {
            let tok = b * qsa.ratio + j;
            for (o, x) in out.iter_mut().zip(&st.raw[tok * di..(tok + 1) * di]) {
                *o += x;
            }
        }
        for o in out.iter_mut() {
            *o /= qsa.ratio as f32;
        }
        rms_norm_1p(&mut out, &w.idx_k_norm, di, eps);
        let (cos, sin) = rp.at(b * qsa.ratio);
        rope(&mut out, &cos, &sin);
        st.block_keys.extend_from_slice(&out);
    }
    let bk = &st.block_keys;
    let (ks, vs) = (&st.k, &st.v);
    let scale = 1.0 / (hd as f32).sqrt();
    let rep = hq / hkv;
    let mut o = vec![0f32; t * hq * hd];
    o.par_chunks_mut(hq * hd)
        .enumerate()
        .for_each(|(r, o_row)| {
            let p = past + r;
            let visible = p + 1;
            let nb = visible / qsa.ratio;
            let mut selected: Vec<usize> = Vec::with_capacity(visible);
            if nb > 0 {
                let scores: Vec<f32> = (0..nb)
                    .map(|b| {
                        let kb = &bk[b * di..(b + 1) * di];
                        let mut s = 0f32;
                        for h in 0..ni {
                            let qh = &qi[(r * ni + h) * di..(r * ni + h + 1) * di];
                            let dot: f32 = qh.iter().zip(kb).map(|(a, b)| a * b).sum();
                            s += dot.max(0.0);
                        }
                        s / (di as f32).sqrt()
                    })
                    .collect();
                for b in top_k(&scores, qsa.block_topk().min(nb)) {
                    selected.extend(b * qsa.ratio..(b + 1) * qsa.ratio);
                }
            }
            selected.extend(nb * qsa.ratio..visible);
            selected.sort_unstable();
            for h in 0..hq {
                let kh = h / rep;
                let qh = &q[(r * hq + h) * hd..(r * hq + h + 1) * hd];
                let logits: Vec<f32> = selected
                    .iter()
                    .map(|&s| {
                        let ks = &ks[s * kvd + kh * hd..s * kvd + (kh + 1) * hd];
                        qh.iter().zip(ks).map(|(a, b)| a * b).sum::<f32>() * scale
                    })
                    .collect();
                let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = logits.iter().map(|l| (l - m).exp()).collect();
                let z: f32 = e.iter().sum();
                let out = &mut o_row[h * hd..(h + 1) * hd];
                for (&s, &p) in selected.iter().zip(&e) {
                    let vrow = &vs[s * kvd + kh * hd..s * kvd + (kh + 1) * hd];
                    for (a, b) in out.iter_mut().zip(vrow) {
                        *a += p / z * b;
                    }
                }
            }
        });
    for (a, g) in o.iter_mut().zip(&gate) {
        *a *= sigmoid(*g);
    }
    o
}

/// One attention layer's weights on the device.
pub struct AttnGpu {
    q: Arc<GpuMatrix>,
    k: Arc<GpuMatrix>,
    v: Arc<GpuMatrix>,
    o: Arc<GpuMatrix>,
    idx_qk: Arc<GpuMatrix>,
    q_norm: wgpu::Buffer,
    k_norm: wgpu::Buffer,
    idx_q_norm: wgpu::Buffer,
    idx_k_norm: wgpu::Buffer,
}

impl AttnGpu {
    /// Uploads the layer's weights.
    pub fn upload(dev: &Device, w: &AttnWeights<'_>) -> Result<AttnGpu, GpuError> {
        Ok(AttnGpu {
            q: dev.mat(&w.q)?,
            k: dev.mat(&w.k)?,
            v: dev.mat(&w.v)?,
            o: dev.mat(&w.o)?,
            idx_qk: dev.mat(&w.idx_qk)?,
            q_norm: dev.vec(w.q_norm.name(), &w.q_norm),
            k_norm: dev.vec(w.k_norm.name(), &w.k_norm),
            idx_q_norm: dev.vec(w.idx_q_norm.name(), &w.idx_q_norm),
            idx_k_norm: dev.vec(w.idx_k_norm.name(), &w.idx_k_norm),
        })
    }
}

/// The RoPE tables on the device: `cos`, `sin` `[ctx, rotary_dim / 2]`, computed on the host
/// by [`Rope::at`] (the CPU forward's values: a GPU `cos` of a large angle is not accurate).
pub struct RopeGpu {
    /// Cosines.
    pub cos: wgpu::Buffer,
    /// Sines.
    pub sin: wgpu::Buffer,
    /// `rotary_dim / 2`.
    pub half: usize,
}

impl RopeGpu {
    /// Tables for positions `0..ctx_len`.
    pub fn new(dev: &Device, rp: &Rope, rot: usize, ctx_len: usize) -> RopeGpu {
        let half = rot / 2;
        let (mut cos, mut sin) = (Vec::with_capacity(ctx_len * half), Vec::new());
        for p in 0..ctx_len {
            let (c, s) = rp.at(p);
            cos.extend_from_slice(&c);
            sin.extend_from_slice(&s);
        }
        RopeGpu {
            cos: dev.vec("rope cos", &cos),
            sin: dev.vec("rope sin", &sin),
            half,
        }
    }
}

/// An attention layer's cache on the device, preallocated for the context: rotated keys and
/// values `[ctx, Hkv*hd]`, raw indexer keys `[ctx, d_I]`, block keys `[ctx/ratio + 1, d_I]`.
pub struct AttnDeviceState {
    /// Keys.
    pub k: wgpu::Buffer,
    /// Values.
    pub v: wgpu::Buffer,
    /// Raw indexer keys.
    pub raw: wgpu::Buffer,
    /// Block keys.
    pub block_keys: wgpu::Buffer,
}

impl AttnDeviceState {
    /// Empty caches for `c` and `ctx_len` tokens.
    pub fn new(ctx: &GpuContext, c: &Qwen4ExpTextConfig, ctx_len: usize) -> AttnDeviceState {
        let kvd = c.num_key_value_heads * c.head_dim;
        let q = c.qsa().expect("validated");
        AttnDeviceState {
            k: storage(ctx, "k cache", ctx_len * kvd),
            v: storage(ctx, "v cache", ctx_len * kvd),
            raw: storage(ctx, "indexer keys", ctx_len * q.head_dim),
            block_keys: storage(ctx, "block keys", (ctx_len / q.ratio + 1) * q.head_dim),
        }
    }
}

/// Whether the device kernels take this geometry.
pub fn device_limits(c: &Qwen4ExpTextConfig) -> Result<(), String> {
    let q = c.qsa().ok_or("no QSA indexer config")?;
    if c.head_dim > 512 || q.head_dim > 512 {
        return Err(format!(
            "head_dim {} / indexer_head_dim {} > 512 (a head is staged in workgroup memory)",
            c.head_dim, q.head_dim
        ));
    }
    if !c.head_dim.is_multiple_of(4) {
        return Err(format!(
            "head_dim {} is not a multiple of 4 (attention reads heads as vec4s)",
            c.head_dim
        ));
    }
    if c.rotary_dim() > q.head_dim.min(c.head_dim) {
        return Err("rotary_dim wider than a head".into());
    }
    Ok(())
}

/// Encodes the layer on block inputs `e.s.u` `[nt, D]` into `e.s.y`: the projections over
/// every row; per sequence (`parts`, their rows in order, each at positions `past..` of its
/// frame uniform) the heads' norms and RoPE, the appends to its caches, the indexer's block
/// choice and the attention.
#[allow(clippy::too_many_arguments)]
pub fn encode<'a>(
    e: &mut Enc<'a>,
    w: &AttnGpu,
    c: &Qwen4ExpTextConfig,
    rope_t: &RopeGpu,
    parts: &[Part<'a, AttnDeviceState>],
    nt: usize,
    ctx_len: usize,
    il: usize,
) -> Result<(), GpuError> {
    let s = e.s;
    let [qg, k, v, qki, ..] = &s.w;
    // A short frame's projections write the layer's own buffers, so they run side by side
    // (`crate::device::LayerOuts`).
    let proj = match s.outs(il, nt).and_then(|o| o.qsa.as_ref()) {
        Some([a, b, cc, dd]) => [a, b, cc, dd],
        None => [qg, k, v, qki],
    };
    let [qg, k, v, qki] = proj;
    let projections = [(&*w.q, qg), (&*w.k, k), (&*w.v, v), (&*w.idx_qk, qki)];
    e.matvecs(&projections, &s.u, nt)?;
    for part in parts {
        e.with_frame(part.frame, |e| {
            attend_part(e, w, c, rope_t, part.state, part.rows, ctx_len, proj)
        })?;
    }
    let ao = &s.w[7];
    e.matvec(&w.o, ao, &s.y, nt, Epilogue::None)
}

/// One sequence's attention over its caches (the frame uniform is its own): from the
/// projections of its rows in `proj` (q and gate, k, v, the indexer's q and k) to its rows
/// of the gated attention output.
#[allow(clippy::too_many_arguments)]
fn attend_part(
    e: &mut Enc<'_>,
    w: &AttnGpu,
    c: &Qwen4ExpTextConfig,
    rope_t: &RopeGpu,
    st: &AttnDeviceState,
    nt: usize,
    ctx_len: usize,
    [qg, k, v, qki]: [&wgpu::Buffer; 4],
) -> Result<(), GpuError> {
    let (hq, hkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let qsa = c.qsa().expect("validated");
    let (ni, di) = (qsa.n_heads, qsa.head_dim);
    let eps = (c.rms_norm_eps as f32).to_bits();
    let kvd = hkv * hd;
    let half = rope_t.half as u32;
    let s = e.s;
    let [_, _, _, _, q, gate, qi, ao] = &s.w;
    let (cs, sn) = (&rope_t.cos, &rope_t.sin);
    // One head of one row per workgroup: where it is read, where it goes, what is applied.
    struct Prep<'b> {
        src: &'b wgpu::Buffer,
        src_stride: usize,
        src_off: usize,
        head_stride: usize,
        dim: usize,
        dst: &'b wgpu::Buffer,
        dst_stride: usize,
        at_past: u32,
        norm: Option<&'b wgpu::Buffer>,
        rope: bool,
        heads: usize,
    }
    let qk_row = (ni + 1) * di;
    // Three dispatches, each a normed (and rotated) member and a copied one of the same width:
    // q and the attention gate, k and v into the cache rows past..past+nt, the indexer queries
    // and the raw indexer keys into their cache.
    let pairs = [
        (
            Prep {
                src: qg,
                src_stride: 2 * hq * hd,
                src_off: 0,
                head_stride: 2 * hd,
                dim: hd,
                dst: q,
                dst_stride: hq * hd,
                at_past: 0,
                norm: Some(&w.q_norm),
                rope: true,
                heads: hq,
            },
            Prep {
                src: qg,
                src_stride: 2 * hq * hd,
                src_off: hd,
                head_stride: 2 * hd,
                dim: hd,
                dst: gate,
                dst_stride: hq * hd,
                at_past: 0,
                norm: None,
                rope: false,
                heads: hq,
            },
        ),
        (
            Prep {
                src: k,
                src_stride: kvd,
                src_off: 0,
                head_stride: hd,
                dim: hd,
                dst: &st.k,
                dst_stride: kvd,
                at_past: 1,
                norm: Some(&w.k_norm),
                rope: true,
                heads: hkv,
            },
            Prep {
                src: v,
                src_stride: kvd,
                src_off: 0,
                head_stride: hd,
                dim: hd,
                dst: &st.v,
                dst_stride: kvd,
                at_past: 1,
                norm: None,
                rope: false,
                heads: hkv,
            },
        ),
        (
            Prep {
                src: qki,
                src_stride: qk_row,
                src_off: 0,
                head_stride: di,
                dim: di,
                dst: qi,
                dst_stride: ni * di,
                at_past: 0,
                norm: Some(&w.idx_q_norm),
                rope: true,
                heads: ni,
            },
            Prep {
                src: qki,
                src_stride: qk_row,
                src_off: ni * di,
                head_stride: 0,
                dim: di,
                dst: &st.raw,
                dst_stride: di,
                at_past: 1,
                norm: None,
                rope: false,
                heads: 1,
            },
        ),
    ];
    for (a, b) in pairs {
        // The second member is a plain copy of the same width (the kernel's `src_b`, `dst_b`).
        debug_assert!(b.norm.is_none() && !b.rope && b.dim == a.dim);
        let own = !std::ptr::eq(a.src, b.src);
        let p = [
            a.src_stride as u32,
            a.src_off as u32,
            a.head_stride as u32,
            a.dim as u32,
            a.dst_stride as u32,
            a.heads as u32,
            a.at_past,
            u32::from(a.norm.is_some()),
            if a.rope { half } else { 0 },
            eps,
            b.src_stride as u32,
            b.src_off as u32,
            b.head_stride as u32,
            b.dst_stride as u32,
            b.at_past,
            u32::from(own),
        ];
        let wbuf = a.norm.unwrap_or(&s.g);
        let bufs = [a.src, wbuf, a.dst, cs, sn, b.dst, b.src];
        // A source both members read is bound once (binding 2).
        let bufs = if own { &bufs[..] } else { &bufs[..6] };
        let grid = ((a.heads + b.heads) as u32, nt as u32);
        e.op(Op::HeadPrep, &p, bufs, grid)?;
    }
    let p = [qsa.ratio as u32, di as u32, half, eps];
    let new_blocks = (nt / qsa.ratio + 1) as u32;
    e.op(
        Op::BlockKeys,
        &p,
        &[&st.raw, &w.idx_k_norm, &st.block_keys, cs, sn],
        (new_blocks, 1),
    )?;
    let max_blocks = ctx_len / qsa.ratio + 1;
    let topk = qsa.block_topk() as u32;
    let p = [
        qsa.ratio as u32,
        ni as u32,
        di as u32,
        topk,
        max_blocks as u32,
    ];
    e.op(
        Op::QsaSelect,
        &p,
        &[qi, &st.block_keys, &s.scores, &s.sel],
        (nt as u32, 1),
    )?;
    let scale = 1.0 / (hd as f32).sqrt();
    let p = [
        hq as u32,
        hkv as u32,
        hd as u32,
        qsa.ratio as u32,
        topk,
        max_blocks as u32,
        ctx_len as u32,
        scale.to_bits(),
    ];
    e.op(
        Op::Attend,
        &p,
        &[q, &st.k, &st.v, &s.sel, &s.attn_logits, gate, ao],
        (hq as u32, nt as u32),
    )
}
