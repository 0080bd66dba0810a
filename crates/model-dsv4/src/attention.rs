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
