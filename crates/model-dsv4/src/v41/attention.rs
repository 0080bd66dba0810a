//! V4.1 attention (`DeepseekV41Attention`): latent shared-KV attention over the layer's sliding
//! window plus, on a compressed layer, the entries of its group's compressed KV that the
//! group's indexer picked.
//!
//! As V4 (the shared pieces are [`crate::attention`]'s): `q_res = q_a_norm(q_a_proj h)`,
//! `q = q_b_proj q_res` (no per-head query norm in V4.1), one K = V latent
//! `kv = kv_norm(kv_proj h)`, RoPE on the trailing channels ("main" set on sliding-only layers,
//! "compress" on compressed ones), sinks, V's RoPE undone, the grouped output projection. New:
//! the window latents are FP8 fake-quantised before they are cached or attended
//! ([`super::qat`]); only KV sources compress ([`super::compressor`]), and the layers after one
//! read its entries; only index sources score ([`super::indexer`]), and the layers after one
//! reuse its top-k. What a source publishes within one forward travels in [`Published`].

use rayon::prelude::*;

use crate::attention::{Ropes, attend, grouped_out, keep_window, window_rows};
use crate::config_v41::{CandidateRole, DeepseekV41Config, IndexRole, KvRole, LayerRole, RopeSet};
use crate::ops::{rms_norm, rope_tail};
use quant_codecs::ops::linear;

use super::compressor;
use super::indexer::{self, Blocks};
use super::qat;
use super::state::LayerState;
use super::weights::LayerWeights;

/// What index sources published so far in the current forward (the reference's per-forward
/// `shared` dict): per layer, its top-k; the candidate source's block mask.
#[derive(Default)]
pub struct Published {
    topk: Vec<Option<Vec<Vec<usize>>>>,
    candidates: Option<Vec<Vec<bool>>>,
}

impl Published {
    /// Nothing published yet, for a model of `layers` layers.
    pub fn new(layers: usize) -> Published {
        Published {
            topk: vec![None; layers],
            candidates: None,
        }
    }
}

/// Runs layer `il`'s attention on its inputs `h` `[t, D]` (after `input_layernorm`) at
/// positions `past..past+t`, updating `layers[il]` (and reading its KV source's state);
/// returns `[t, D]`.
#[allow(clippy::too_many_arguments)]
pub fn forward_cpu(
    lw: &LayerWeights<'_>,
    c: &DeepseekV41Config,
    il: usize,
    ropes: &Ropes,
    h: &[f32],
    t: usize,
    past: usize,
    layers: &mut [LayerState],
    published: &mut Published,
) -> Vec<f32> {
    let w = &lw.attn;
    let roles = c.roles();
    let role: &LayerRole = &roles[il];
    let (nh, dh) = (c.num_attention_heads, c.head_dim);
    let eps = c.rms_norm_eps as f32;
    let rope = match role.rope {
        RopeSet::Main => &ropes.main,
        RopeSet::Compress => &ropes.compress,
    };
    let mut q_res = linear(&w.q_a, h, t);
    rms_norm(&mut q_res, &w.q_a_norm, eps);
    let mut q = linear(&w.q_b, &q_res, t);
    let mut kv = linear(&w.kv, h, t);
    rms_norm(&mut kv, &w.kv_norm, eps);
    let cs: Vec<(Vec<f32>, Vec<f32>)> = (0..t).map(|r| rope.at(past + r)).collect();
    for (r, (cos, sin)) in cs.iter().enumerate() {
        for head in q[r * nh * dh..(r + 1) * nh * dh].chunks_exact_mut(dh) {
            rope_tail(head, cos, sin, false);
        }
        let row = &mut kv[r * dh..(r + 1) * dh];
        rope_tail(row, cos, sin, false);
        qat::fp8_ue8m0(row, 32);
    }

    // Sliding keys: the cached window, then this call's latents.
    let old = layers[il].window.len() / dh;
    let first = past - old;
    let mut keys = std::mem::take(&mut layers[il].window);
    keys.extend_from_slice(&kv);

    // A KV source compresses the groups this call completes (entries, and indexer keys).
    if let (KvRole::Source, Some(cw)) = (role.kv, &lw.compressor) {
        let ratio = role.compress_ratio;
        let st = &mut layers[il].kv;
        let first_group = st.entries.len() / dh;
        let latents = compressor::update(cw, ratio, eps, h, t, st);
        let key_w = lw.indexer.as_ref().and_then(|x| x.keys.as_ref());
        compressor::publish(
            &latents,
            dh,
            first_group,
            ratio,
            key_w,
            &ropes.compress,
            eps,
            st,
        );
    }

    // An index source scores its group's keys.
    if let Some(iw) = &lw.indexer {
        let keys_from = match role.index {
            IndexRole::Reindex { keys_from } => keys_from,
            _ => il,
        };
        let src = &layers[keys_from].kv.index_keys;
        let selection = if src.is_empty() {
            if role.candidate == CandidateRole::Source {
                published.candidates = None;
            }
            None
        } else {
            let blocks = (role.candidate == CandidateRole::Source).then_some(Blocks {
                size: c.candidate_block_size,
                top: c.candidate_topk_blocks,
            });
            let restrict = match role.candidate {
                CandidateRole::Restricted { .. } => published.candidates.as_deref(),
                _ => None,
            };
            let s = indexer::select(
                iw,
                (c.index_n_heads, c.index_head_dim, c.index_topk),
                &ropes.compress,
                roles[keys_from].compress_ratio,
                &q_res,
                h,
                t,
                past,
                src,
                blocks,
                restrict,
            );
            if blocks.is_some() {
                published.candidates = s.candidates;
            }
            Some(s.topk)
        };
        published.topk[il] = selection;
    }

    // The compressed entries this layer attends: its group's, at the top-k of its group.
    let source = match role.kv {
        KvRole::Source => Some(il),
        KvRole::Reuse { source } => Some(source),
        KvRole::SlidingOnly => None,
    };
    let topk = match role.index {
        IndexRole::Source | IndexRole::Reindex { .. } => published.topk[il].as_ref(),
        IndexRole::Reuse { from } => published.topk[from].as_ref(),
        IndexRole::None => None,
    };
    let empty = Vec::new();
    let (entries, selected) = match (source, topk) {
        (Some(s), Some(sel)) => (&layers[s].kv.entries, Some(sel)),
        _ => (&empty, None),
    };

    let scale = (dh as f32).powf(-0.5);
    let window = c.sliding_window;
    let mut o = vec![0f32; t * nh * dh];
    o.par_chunks_mut(nh * dh)
        .enumerate()
        .for_each(|(r, o_row)| {
            let p = past + r;
            let mut rows = window_rows(&keys, first, p, window, dh);
            if let Some(sel) = selected {
                rows.extend(sel[r].iter().map(|&s| &entries[s * dh..(s + 1) * dh]));
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

    layers[il].window = keep_window(keys, window, dh);

    grouped_out(w, c.o_lora_rank, &o, t)
}
