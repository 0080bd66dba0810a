//! The V4.1 indexer (`DeepseekV41Indexer`, `select_candidate_blocks`): which compressed entries
//! each query of a compressed layer attends, scored once per index source and reused by the
//! layers after it in its group.
//!
//! Queries `q_I = fp4_32(RoPE(q_b_proj q_res))` per indexer head ("compress" set, query
//! position), from the attention's `q_res`; keys are the group source's indexer keys
//! ([`super::compressor::publish`]). Score of entry `s`:
//! `sum_h relu(q_I[h] . K[s]) / sqrt(dI) * weights_proj(h)_h / sqrt(nI)` over the entries
//! visible at the query (`(pos + 1) / ratio`), the rest `-inf`. Two-level top-k: the candidate
//! source groups its scores in blocks of `candidate_block_size` entries, scores a block by its
//! best entry, pins the block of the query's newest visible entry and keeps the top
//! `candidate_topk_blocks`; the later index sources of its group score only inside those
//! blocks. The top `index_topk` finite scores are kept (fewer when fewer are finite).

use rayon::prelude::*;

use crate::ops::{Rope, rope_tail};
use quant_codecs::ops::linear;

use super::qat::{self, Fp4Scale};
use super::weights::IndexerWeights;

/// The block shape of the two-level top-k.
#[derive(Debug, Clone, Copy)]
pub struct Blocks {
    /// `candidate_block_size`.
    pub size: usize,
    /// `candidate_topk_blocks`.
    pub top: usize,
}

/// What an index source publishes for the `t` queries of a forward.
pub struct Selection {
    /// Per query, the selected entries in ascending order.
    pub topk: Vec<Vec<usize>>,
    /// On the candidate source: per query, whether each entry lies in a kept block.
    pub candidates: Option<Vec<Vec<bool>>>,
}

/// Scores the `t` queries (positions `past..past + t`, attention inputs `h` `[t, D]`, low-rank
/// residuals `q_res`) against `keys` `[n, dI]` of a source of ratio `ratio`.
#[allow(clippy::too_many_arguments)]
pub fn select(
    w: &IndexerWeights<'_>,
    (ni, di, index_topk): (usize, usize, usize),
    rope: &Rope,
    ratio: usize,
    q_res: &[f32],
    h: &[f32],
    t: usize,
    past: usize,
    keys: &[f32],
    blocks: Option<Blocks>,
    restrict: Option<&[Vec<bool>]>,
) -> Selection {
    let mut qi = linear(&w.q_b, q_res, t);
    for r in 0..t {
        let (cos, sin) = rope.at(past + r);
        for head in qi[r * ni * di..(r + 1) * ni * di].chunks_exact_mut(di) {
            rope_tail(head, &cos, &sin, false);
            qat::fp4(head, 32, Fp4Scale::Ue8m0);
        }
    }
    let wscale = (ni as f32).powf(-0.5);
    let wts: Vec<f32> = linear(&w.weights_proj, h, t)
        .into_iter()
        .map(|v| v * wscale)
        .collect();
    let sscale = (di as f32).powf(-0.5);
    let n = keys.len() / di;
    let per_query: Vec<(Vec<usize>, Option<Vec<bool>>)> = (0..t)
        .into_par_iter()
        .map(|r| {
            let vis = ((past + r + 1) / ratio).min(n);
            let mut scores = vec![f32::NEG_INFINITY; n];
            for (s, sc) in scores.iter_mut().enumerate().take(vis) {
                let k = &keys[s * di..(s + 1) * di];
                let mut acc = 0f32;
                for hh in 0..ni {
                    let qh = &qi[(r * ni + hh) * di..(r * ni + hh + 1) * di];
                    let dot: f32 = qh.iter().zip(k).map(|(a, b)| a * b).sum();
                    acc += dot.max(0.0) * sscale * wts[r * ni + hh];
                }
                *sc = acc;
            }
            let cand = blocks.map(|b| candidate_mask(&scores, (past + r + 1) / ratio, b));
            if let Some(mask) = restrict {
                for (sc, &keep) in scores.iter_mut().zip(&mask[r]) {
                    if !keep {
                        *sc = f32::NEG_INFINITY;
                    }
                }
            }
            (top_finite(&scores, index_topk), cand)
        })
        .collect();
    let mut topk = Vec::with_capacity(t);
    let mut cands = blocks.map(|_| Vec::with_capacity(t));
    for (sel, cand) in per_query {
        topk.push(sel);
        if let (Some(all), Some(c)) = (cands.as_mut(), cand) {
            all.push(c);
        }
    }
    Selection {
        topk,
        candidates: cands,
    }
}

/// The top `k` finite scores' entries in ascending entry order (equal scores: the lower entry).
pub fn top_finite(scores: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len())
        .filter(|&s| scores[s] > f32::NEG_INFINITY)
        .collect();
    // Stable: ties keep entry order. Finite scores always compare.
    idx.sort_by(|&a, &b| scores[b].partial_cmp(&scores[a]).expect("finite"));
    idx.truncate(k);
    idx.sort_unstable();
    idx
}

/// Level one of the two-level top-k for one query whose first `visible` entries are visible:
/// the entries of its top `b.top` blocks (a block scores its best entry; the block holding
/// entry `visible - 1` is always kept; blocks with no visible entry never are).
pub fn candidate_mask(scores: &[f32], visible: usize, b: Blocks) -> Vec<bool> {
    let n = scores.len();
    let nb = n.div_ceil(b.size);
    let mut block: Vec<f32> = (0..nb)
        .map(|i| {
            scores[i * b.size..((i + 1) * b.size).min(n)]
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max)
        })
        .collect();
    if visible > 0 && (visible - 1) / b.size < nb {
        block[(visible - 1) / b.size] = f32::INFINITY;
    }
    let mut order: Vec<usize> = (0..nb).collect();
    order.sort_by(|&x, &y| block[y].total_cmp(&block[x]));
    let mut mask = vec![false; n];
    for &i in order.iter().take(b.top.min(nb)) {
        if block[i] > f32::NEG_INFINITY {
            mask[i * b.size..((i + 1) * b.size).min(n)].fill(true);
        }
    }
    mask
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidate_blocks_pin_the_newest_and_keep_the_best() {
        let ninf = f32::NEG_INFINITY;
        // 7 entries in blocks of 2: [0.1, 0.9 | 0.2, 0.3 | 0.8, ninf | ninf]; 5 visible.
        let s = [0.1, 0.9, 0.2, 0.3, 0.8, ninf, ninf];
        let b = Blocks { size: 2, top: 2 };
        // Block 2 (entry 4, the newest visible) is pinned; then block 0 (0.9).
        assert_eq!(
            candidate_mask(&s, 5, b),
            [true, true, false, false, true, true, false]
        );
        // Nothing visible: no block.
        assert_eq!(candidate_mask(&[ninf; 3], 0, b), [false; 3]);
        // More blocks asked for than reachable: the unreachable ones stay out.
        let wide = Blocks { size: 2, top: 9 };
        assert_eq!(
            candidate_mask(&s, 5, wide),
            [true, true, true, true, true, true, false]
        );
    }

    #[test]
    fn top_finite_drops_minus_infinity_and_sorts_entries() {
        let ninf = f32::NEG_INFINITY;
        assert_eq!(top_finite(&[0.5, ninf, 0.7, 0.1], 2), vec![0, 2]);
        assert_eq!(top_finite(&[ninf, 0.3, ninf], 4), vec![1]);
        assert_eq!(top_finite(&[0.2, 0.2, 0.2], 2), vec![0, 1]);
    }
}
