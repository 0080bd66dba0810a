//! DeepSeekMoE (`DeepseekV4SparseMoeBlock` with `DeepseekV4TopKRouter` / `DeepseekV4HashRouter`).
//!
//! Router scores `s = score_fn(gate . u)` (`sqrt(softplus)`, sigmoid or softmax). Experts:
//! `hash_moe` layers take `tid2eid[token]`; `moe` layers take the top-k of
//! `s + e_score_correction_bias` (the bias only selects). Weights `s[idx] / (sum + 1e-20)`
//! times `routed_scaling_factor` (the reference always renormalises). Each expert is a SwiGLU
//! with `gate <= limit`, `up` clamped to `[-limit, limit]`; the one shared expert has the same
//! clamp and is added unweighted.

use rayon::prelude::*;

use crate::config::DeepseekV4Config;
use crate::ops::softmax;
use crate::weights::{MoeWeights, Routing};
use quant_codecs::ops::{linear, sigmoid, silu, softplus, top_k};

fn swiglu(gate: &[f32], up: &[f32], limit: f32) -> Vec<f32> {
    gate.iter()
        .zip(up)
        // torch's `clamp(min, max)` is `min(max(x, min), max)`; spelled out because
        // `f32::clamp` panics on an inverted interval (validate() rejects `limit < 0`, but a
        // config edited after validation must not crash the forward).
        .map(|(&g, &u)| silu(g.min(limit)) * u.max(-limit).min(limit))
        .collect()
}

/// Runs the block on `u` `[t, D]` for `tokens` (the input ids, for hash routing); returns
/// `[t, D]`.
pub fn forward_cpu(
    w: &MoeWeights<'_>,
    c: &DeepseekV4Config,
    u: &[f32],
    tokens: &[u32],
    t: usize,
) -> Vec<f32> {
    let d = c.hidden_size;
    let (e, i, k) = (
        c.n_routed_experts,
        c.moe_intermediate_size,
        c.num_experts_per_tok,
    );
    let limit = c.swiglu_limit as f32;
    let mut scores = linear(&w.gate, u, t);
    match c.scoring_func.as_str() {
        "softmax" => scores.chunks_mut(e).for_each(softmax),
        "sigmoid" => scores.iter_mut().for_each(|s| *s = sigmoid(*s)),
        _ => scores.iter_mut().for_each(|s| *s = softplus(*s).sqrt()),
    }
    // Routing: per expert, the (token, weight) pairs, in token order.
    let mut routes: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
    for r in 0..t {
        let s = &scores[r * e..(r + 1) * e];
        let idx: Vec<usize> = match &w.routing {
            Routing::Hash(table) => {
                let at = tokens[r] as usize * k;
                table[at..at + k].iter().map(|&x| x as usize).collect()
            }
            Routing::Scored(bias) => {
                let biased: Vec<f32> = s.iter().zip(bias).map(|(a, b)| a + b).collect();
                top_k(&biased, k)
            }
        };
        let sum: f32 = idx.iter().map(|&x| s[x]).sum();
        let scale = c.routed_scaling_factor as f32;
        for &x in &idx {
            routes[x].push((r, s[x] / (sum + 1e-20) * scale));
        }
    }
    // Experts run in parallel; their outputs are summed in expert order (as the reference's
    // `index_add_` loop does), so the result does not depend on scheduling.
    let outs: Vec<Vec<f32>> = routes
        .par_iter()
        .enumerate()
        .map(|(x, toks)| {
            if toks.is_empty() {
                return Vec::new();
            }
            let n = toks.len();
            let mut xs = Vec::with_capacity(n * d);
            for &(r, _) in toks {
                xs.extend_from_slice(&u[r * d..(r + 1) * d]);
            }
            let gu = linear(&w.experts[x].0, &xs, n);
            let mut hmid = Vec::with_capacity(n * i);
            for row in gu.chunks(2 * i) {
                hmid.extend(swiglu(&row[..i], &row[i..], limit));
            }
            let mut y = linear(&w.experts[x].1, &hmid, n);
            for (row, &(_, wgt)) in y.chunks_mut(d).zip(toks) {
                row.iter_mut().for_each(|v| *v *= wgt);
            }
            y
        })
        .collect();
    let mut y = vec![0f32; t * d];
    for (toks, out) in routes.iter().zip(&outs) {
        for (j, &(r, _)) in toks.iter().enumerate() {
            for (a, b) in y[r * d..(r + 1) * d]
                .iter_mut()
                .zip(&out[j * d..(j + 1) * d])
            {
                *a += b;
            }
        }
    }
    let g = linear(&w.sh_gate, u, t);
    let up = linear(&w.sh_up, u, t);
    let sh = linear(&w.sh_down, &swiglu(&g, &up, limit), t);
    for (a, b) in y.iter_mut().zip(&sh) {
        *a += b;
    }
    y
}
