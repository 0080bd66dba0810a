//! Attention of every layer kind (`DeepseekV4Attention` + the CSA/HCA compressors' masks) and
//! its per-sequence cache; CSA layers attend the entries [`crate::indexer`] selects.
//!
//! `q_res = q_a_norm(q_a_proj h)`; `q = UnweightedRMSNorm(q_b_proj q_res)` per head; one K = V
//! latent `kv = kv_norm(kv_proj h)` shared by all heads; RoPE on the trailing channels of q and
//! kv ("main" set on sliding layers, "compress" on CSA/HCA). Keys: the sliding window (the last
//! `sliding_window` positions, self included) plus the compressed entries the query may see (all
//! of them for HCA; for CSA the indexer's top `index_topk`). Scale `head_dim^-0.5`; a per-head
//! sink logit joins the softmax denominator only. The output's trailing channels are rotated
//! back by the query position (V carried RoPE), then the grouped low-rank projection: group `g`
//! of the heads through `o_a` block `g`, concatenated, through `o_b`.

use rayon::prelude::*;

use crate::compressor::{self, CompDims, CompState};
use crate::config::{AttnKind, DeepseekV4Config};
use crate::indexer;
use crate::ops::{Rope, rms_norm, rms_norm_unweighted, rope_tail};
use crate::weights::AttnWeights;
use quant_codecs::ops::linear;

/// The cache of one attention layer for one sequence.
#[derive(Debug, Clone, Default)]
pub struct AttnState {
    /// Rotated K = V latents of the last `min(pos, sliding_window - 1)` positions `[n, Dh]`.
    pub window: Vec<f32>,
    /// CSA/HCA compressor (buffer, overlap, entries).
    pub comp: CompState,
    /// CSA indexer compressor (its entries are the indexer keys).
    pub index: CompState,
}

/// The two RoPE sets.
pub struct Ropes {
    /// `main` (sliding layers).
    pub main: Rope,
    /// `compress` (CSA/HCA attention, compressors, indexer).
    pub compress: Rope,
}

/// Runs the layer's attention on its inputs `h` `[t, D]` (after `input_layernorm`) at positions
/// `past..past+t`; returns `[t, D]`.
#[allow(clippy::too_many_arguments)]
pub fn forward_cpu(
    w: &AttnWeights<'_>,
    c: &DeepseekV4Config,
    kind: AttnKind,
    ropes: &Ropes,
    h: &[f32],
    t: usize,
    past: usize,
    st: &mut AttnState,
) -> Vec<f32> {
    let (nh, dh) = (c.num_attention_heads, c.head_dim);
    let eps = c.rms_norm_eps as f32;
    let rope = if kind == AttnKind::Sliding {
        &ropes.main
    } else {
        &ropes.compress
    };
    let mut q_res = linear(&w.q_a, h, t);
    rms_norm(&mut q_res, &w.q_a_norm, eps);
    let mut q = linear(&w.q_b, &q_res, t);
    rms_norm_unweighted(&mut q, dh, eps);
    let mut kv = linear(&w.kv, h, t);
    rms_norm(&mut kv, &w.kv_norm, eps);
    let cs: Vec<(Vec<f32>, Vec<f32>)> = (0..t).map(|r| rope.at(past + r)).collect();
    for r in 0..t {
        let (cos, sin) = &cs[r];
        for hh in 0..nh {
            rope_tail(
                &mut q[(r * nh + hh) * dh..(r * nh + hh + 1) * dh],
                cos,
                sin,
                false,
            );
        }
        rope_tail(&mut kv[r * dh..(r + 1) * dh], cos, sin, false);
    }

    // Sliding keys: the cached window, then this call's latents.
    let old = st.window.len() / dh;
    let first = past - old;
    let mut keys = std::mem::take(&mut st.window);
    keys.extend_from_slice(&kv);

    // Compressed entries and, for CSA, the indexer's selection per query.
    let rate = c.rate(kind).unwrap_or(1);
    let mut selected: Vec<Vec<usize>> = Vec::new();
    if let Some(cw) = &w.compressor {
        let dims = CompDims {
            rate,
            head: dh,
            overlap: kind == AttnKind::Csa,
            eps,
        };
        compressor::update(cw, &dims, &ropes.compress, h, t, &mut st.comp);
    }
    if let Some(iw) = &w.indexer {
        selected = indexer::select(
            iw,
            c,
            &ropes.compress,
            rate,
            &q_res,
            h,
            t,
            past,
            &mut st.index,
        );
    }
    let entries = &st.comp.compressed_kv;
    let n_entries = entries.len() / dh;

    let scale = (dh as f32).powf(-0.5);
    let window = c.sliding_window;
    let mut o = vec![0f32; t * nh * dh];
    o.par_chunks_mut(nh * dh)
        .enumerate()
        .for_each(|(r, o_row)| {
            let p = past + r;
            let mut rows = window_rows(&keys, first, p, window, dh);
            match kind {
                AttnKind::Sliding => {}
                AttnKind::Hca => {
                    let vis = compressor::visible(p, rate).min(n_entries);
                    rows.extend((0..vis).map(|s| &entries[s * dh..(s + 1) * dh]));
                }
                AttnKind::Csa => {
                    rows.extend(selected[r].iter().map(|&s| &entries[s * dh..(s + 1) * dh]));
                }
            }
            let (cos, sin) = &cs[r];
            attend(
                &q[r * nh * dh..(r + 1) * nh * dh],
                &rows,
                &w.sinks,
                scale,
                cos,
                sin,
                o_row,
            );
        });

    st.window = keep_window(keys, window, dh);

    grouped_out(w, c.o_lora_rank, &o, t)
}

/// The sliding keys of the query at position `p`: positions `max(p + 1 - window, first)..=p`
/// of `keys` `[n, dh]`, whose first row is position `first`.
pub(crate) fn window_rows(
    keys: &[f32],
    first: usize,
    p: usize,
    window: usize,
    dh: usize,
) -> Vec<&[f32]> {
    let lo = (p + 1).saturating_sub(window).max(first);
    (lo..=p)
        .map(|pos| &keys[(pos - first) * dh..(pos - first + 1) * dh])
        .collect()
}

/// The last `window - 1` rows of `keys` `[n, dh]`: what the next call's queries can still see.
pub(crate) fn keep_window(mut keys: Vec<f32>, window: usize, dh: usize) -> Vec<f32> {
    let total = keys.len() / dh;
    let keep = total.min(window - 1);
    keys.drain(..(total - keep) * dh);
    keys
}

/// One query row `q_row` `[H, Dh]` over the K = V `rows`: per head, `softmax(q . k * scale)` with
/// the head's sink logit in the denominator only, the weighted sum of the rows, and V's RoPE
/// (`cos`, `sin` of the query position) rotated back; written to `o_row` `[H, Dh]`.
pub(crate) fn attend(
    q_row: &[f32],
    rows: &[&[f32]],
    sinks: &[f32],
    scale: f32,
    cos: &[f32],
    sin: &[f32],
    o_row: &mut [f32],
) {
    let nh = sinks.len();
    let dh = q_row.len() / nh;
    let mut logits = vec![0f32; rows.len()];
    for hh in 0..nh {
        let qh = &q_row[hh * dh..(hh + 1) * dh];
        for (l, k) in logits.iter_mut().zip(rows) {
            *l = qh.iter().zip(*k).map(|(a, b)| a * b).sum::<f32>() * scale;
        }
        let sink = sinks[hh];
        let m = logits.iter().copied().fold(sink, f32::max);
        let mut z = (sink - m).exp();
        for l in logits.iter_mut() {
            *l = (*l - m).exp();
            z += *l;
        }
        let out = &mut o_row[hh * dh..(hh + 1) * dh];
        for (pr, v) in logits.iter().zip(rows) {
            let pw = pr / z;
            for (a, b) in out.iter_mut().zip(*v) {
                *a += pw * b;
            }
        }
        rope_tail(out, cos, sin, true);
    }
}

/// The grouped low-rank output projection of the attention output `o` `[t, H*Dh]`: group `g` of
/// the heads through `o_a` block `g` (to `o_lora_rank`), concatenated, through `o_b`.
pub(crate) fn grouped_out(
    w: &AttnWeights<'_>,
    o_lora_rank: usize,
    o: &[f32],
    t: usize,
) -> Vec<f32> {
    let width = o.len() / t.max(1);
    let groups = w.o_a.groups();
    let gin = width / groups;
    let r_rank = o_lora_rank;
    let mut mid = vec![0f32; t * groups * r_rank];
    for g in 0..groups {
        let mut xs = Vec::with_capacity(t * gin);
        for r in 0..t {
            xs.extend_from_slice(&o[r * width + g * gin..r * width + (g + 1) * gin]);
        }
        let y = linear(&w.o_a.group(g), &xs, t);
        for r in 0..t {
            mid[r * groups * r_rank + g * r_rank..r * groups * r_rank + (g + 1) * r_rank]
                .copy_from_slice(&y[r * r_rank..(r + 1) * r_rank]);
        }
    }
    linear(&w.o_b, &mid, t)
}

/// The projections of a layer's attention on the device (V4's and V4.1's): the query path
/// (`q_a`, its norm, `q_b`), the K = V latent (`kv`, its norm), the sinks, and the output
/// (`o_a`'s groups as a bank of the grouped kernel: slot `(row, g)` reads the row's group `g`
/// of heads, then `o_b`).
pub struct AttnProj {
    q_a: std::sync::Arc<gpu_runtime::GpuMatrix>,
    q_a_norm: (wgpu::Buffer, usize),
    q_b: std::sync::Arc<gpu_runtime::GpuMatrix>,
    kv: std::sync::Arc<gpu_runtime::GpuMatrix>,
    kv_norm: (wgpu::Buffer, usize),
    o_a: gpu_runtime::ops::experts::ExpertBank,
    o_b: std::sync::Arc<gpu_runtime::GpuMatrix>,
    /// The heads' sink logits.
    pub sinks: wgpu::Buffer,
}

impl AttnProj {
    /// Uploads `w`'s projections.
    pub fn new(
        dev: &crate::device::Device,
        w: &AttnWeights<'_>,
    ) -> Result<AttnProj, gpu_runtime::GpuError> {
        let groups: Vec<model_core::Mat<'_>> = (0..w.o_a.groups())
            .map(|g| {
                model_core::Mat::new(format!("{}#{g}", w.o_a.name()), usize::MAX, w.o_a.group(g))
            })
            .collect();
        let refs: Vec<&model_core::Mat<'_>> = groups.iter().collect();
        Ok(AttnProj {
            q_a: dev.mat(&w.q_a)?,
            q_a_norm: (dev.vec("q_a_norm", &w.q_a_norm), w.q_a_norm.len()),
            q_b: dev.mat(&w.q_b)?,
            kv: dev.mat(&w.kv)?,
            kv_norm: (dev.vec("kv_norm", &w.kv_norm), w.kv_norm.len()),
            o_a: dev.bank(&refs)?,
            o_b: dev.mat(&w.o_b)?,
            sinks: dev.vec("sinks", &w.sinks),
        })
    }

    /// From `e.s.u` (`nt` rows): `q_res` into `e.s.q_res`, the queries into `e.s.q` (with
    /// V4's per-head unweighted norm when `head_norm`; `nh` heads of `dh`), the normed
    /// latents into `e.s.kv`; all before RoPE.
    pub fn encode_in(
        &self,
        e: &mut crate::device::Enc<'_>,
        (nh, dh): (usize, usize),
        eps: f32,
        head_norm: bool,
    ) -> Result<(), gpu_runtime::GpuError> {
        use gpu_runtime::Epilogue;
        let s = e.s;
        let nt = e.nt;
        let plain = model_core::device::NormWeight::Plain;
        // `o` holds the raw projections until attention writes it.
        e.matvec(&self.q_a, &s.u, &s.o, nt, Epilogue::None)?;
        let (qn, ql) = (&self.q_a_norm.0, self.q_a_norm.1);
        e.rms_norm_kind(&s.o, (qn, ql), &s.q_res, nt, ql, eps, plain)?;
        if head_norm {
            e.matvec(&self.q_b, &s.q_res, &s.o, nt, Epilogue::None)?;
            e.rms_norm_unweighted(&s.o, &s.q, nt * nh, dh, eps)?;
        } else {
            e.matvec(&self.q_b, &s.q_res, &s.q, nt, Epilogue::None)?;
        }
        e.matvec(&self.kv, &s.u, &s.ckv, nt, Epilogue::None)?;
        let (kn, kl) = (&self.kv_norm.0, self.kv_norm.1);
        e.rms_norm_kind(&s.ckv, (kn, kl), &s.kv, nt, kl, eps, plain)
    }

    /// From the attention output `e.s.o` (`nh` heads of `dh`, V still rotated by the table
    /// `cs` of `pairs` pairs): V's RoPE undone, the grouped output projection into `e.s.y`.
    pub fn encode_out(
        &self,
        e: &mut crate::device::Enc<'_>,
        (nh, dh): (usize, usize),
        (cs, pairs): (&wgpu::Buffer, usize),
    ) -> Result<(), gpu_runtime::GpuError> {
        use gpu_runtime::Epilogue;
        let s = e.s;
        let nt = e.nt;
        let p = [
            (nt * nh * pairs) as u32,
            nh as u32,
            dh as u32,
            pairs as u32,
            1,
        ];
        e.op_lanes(kernels_wgsl::Op::DsRope, &p, &[&s.o, cs], nt * nh * pairs)?;
        let groups = self.o_a.count;
        let slots = nt * groups;
        e.grouped(
            &self.o_a,
            &s.o,
            slots,
            &s.o_ids,
            &s.o_mid,
            slots,
            1,
            Epilogue::None,
        )?;
        e.matvec(&self.o_b, &s.o_mid, &s.y, nt, Epilogue::None)
    }
}

/// A layer's attention on the device: the projections ([`AttnProj`], V4's per-head query
/// norm), RoPE, the K = V latent into the window ring, the compressor and indexer,
/// `ds_attend`, and the output.
pub struct AttnGpu {
    proj: AttnProj,
    comp: Option<crate::compressor::CompGpu>,
    index: Option<crate::indexer::IndexGpu>,
    kind: AttnKind,
    rate: usize,
}

/// A layer's caches for one sequence on the device.
pub struct AttnDeviceState {
    /// The K = V latents of the last positions `[window ring, Dh]` (by position).
    pub window: wgpu::Buffer,
    /// The CSA/HCA compressor's.
    pub comp: Option<crate::compressor::CompDeviceState>,
    /// The CSA indexer's.
    pub index: Option<crate::compressor::CompDeviceState>,
}

impl AttnDeviceState {
    /// Its buffers in a fixed order (what a snapshot copies).
    pub fn buffers(&self) -> Vec<&wgpu::Buffer> {
        let mut out = vec![&self.window];
        for c in self.comp.iter().chain(&self.index) {
            out.extend([&c.kv, &c.gate, &c.entries]);
        }
        out
    }
}

impl AttnGpu {
    /// Uploads layer `w` of kind `kind`.
    pub fn new(
        dev: &crate::device::Device,
        w: &AttnWeights<'_>,
        c: &DeepseekV4Config,
        kind: AttnKind,
    ) -> Result<AttnGpu, gpu_runtime::GpuError> {
        let rate = c.rate(kind).unwrap_or(1);
        let eps = c.rms_norm_eps as f32;
        let comp = match &w.compressor {
            Some(cw) => {
                let dims = CompDims {
                    rate,
                    head: c.head_dim,
                    overlap: kind == AttnKind::Csa,
                    eps,
                };
                Some(crate::compressor::CompGpu::new(dev, cw, dims)?)
            }
            None => None,
        };
        let index = match &w.indexer {
            Some(iw) => Some(crate::indexer::IndexGpu::new(dev, iw, c, rate)?),
            None => None,
        };
        Ok(AttnGpu {
            proj: AttnProj::new(dev, w)?,
            comp,
            index,
            kind,
            rate,
        })
    }

    /// An empty cache for contexts of `ctx_len`.
    pub fn state(
        &self,
        ctx: &gpu_runtime::GpuContext,
        c: &DeepseekV4Config,
        ctx_len: usize,
    ) -> AttnDeviceState {
        let ring = crate::device::window_ring(c);
        AttnDeviceState {
            window: gpu_runtime::ops::graph::storage(ctx, "window ring", ring * c.head_dim),
            comp: self.comp.as_ref().map(|x| x.state(ctx, ctx_len)),
            index: self.index.as_ref().map(|x| x.comp.state(ctx, ctx_len)),
        }
    }

    /// The layer on `e.s.u` (`nt` rows at the frame's position) into `e.s.y`.
    pub fn encode(
        &self,
        e: &mut crate::device::Enc<'_>,
        c: &DeepseekV4Config,
        ropes: &crate::device::RopeGpu,
        st: &AttnDeviceState,
        nt: usize,
        ctx_len: usize,
    ) -> Result<(), gpu_runtime::GpuError> {
        use crate::config::AttnKind::*;
        use kernels_wgsl::Op;
        let s = e.s;
        let (nh, dh) = (c.num_attention_heads, c.head_dim);
        let eps = c.rms_norm_eps as f32;
        let (cs, pairs) = ropes.of(self.kind);
        self.proj.encode_in(e, (nh, dh), eps, true)?;
        let p = [
            (nt * nh * pairs) as u32,
            nh as u32,
            dh as u32,
            pairs as u32,
            0,
        ];
        e.op_lanes(Op::DsRope, &p, &[&s.q, cs], nt * nh * pairs)?;
        let p = [(nt * pairs) as u32, 1, dh as u32, pairs as u32, 0];
        e.op_lanes(Op::DsRope, &p, &[&s.kv, cs], nt * pairs)?;
        let ring = crate::device::window_ring(c);
        let p = [(nt * dh) as u32, dh as u32, ring as u32];
        e.op_lanes(Op::DsStore, &p, &[&s.kv, &st.window], nt * dh)?;

        let compress = ropes.of(Csa);
        if let (Some(cg), Some(cst)) = (&self.comp, &st.comp) {
            cg.encode(e, cst, compress, nt, ctx_len)?;
        }
        if let (Some(ig), Some(ist)) = (&self.index, &st.index) {
            ig.encode(e, ist, compress, nt, ctx_len)?;
        }
        let mode = match self.kind {
            Sliding => 0u32,
            Hca => 1,
            Csa => 2,
        };
        let maxe = crate::device::max_entries(ctx_len, self.rate).max(1);
        let p = [
            nh as u32,
            dh as u32,
            c.sliding_window as u32,
            ring as u32,
            mode,
            self.rate as u32,
            maxe as u32,
            (c.sliding_window + s.maxe) as u32,
            (dh as f32).powf(-0.5).to_bits(),
        ];
        let ent = st.comp.as_ref().map_or(&s.scores, |x| &x.entries);
        let bufs = [&s.q, &st.window, ent, &s.sel, &self.proj.sinks, &s.lg, &s.o];
        e.op(Op::DsAttend, &p, &bufs, (nh as u32, nt as u32))?;
        self.proj.encode_out(e, (nh, dh), (cs, pairs))
    }
}
