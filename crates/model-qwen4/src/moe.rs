//! Sparse MoE (`Qwen4ExpTextSparseMoeBlock`): softmax over ALL experts, top-k, renormalised
//! when `norm_topk_prob`; SwiGLU experts (`gate_up` rows: gate then up); plus the shared
//! SwiGLU expert scaled by `sigmoid(shared_expert_gate . u)`.

use crate::config::Qwen4ExpTextConfig;
use crate::weights::MoeWeights;
use quant_codecs::ops::{linear, sigmoid, silu, top_k};
use rayon::prelude::*;

/// Runs the block on `u` `[t, D]`; returns `[t, D]`.
pub fn forward_cpu(w: &MoeWeights<'_>, c: &Qwen4ExpTextConfig, u: &[f32], t: usize) -> Vec<f32> {
    let d = c.hidden_size;
    let (e, i) = (c.num_experts, c.moe_intermediate_size);
    let logits = linear(&w.router, u, t);
    // Routing: per expert, the (token, weight) pairs, in token order.
    let mut routes: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
    for r in 0..t {
        let l = &logits[r * e..(r + 1) * e];
        let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let ex: Vec<f32> = l.iter().map(|x| (x - m).exp()).collect();
        let z: f32 = ex.iter().sum();
        let p: Vec<f32> = ex.iter().map(|x| x / z).collect();
        let top = top_k(&p, c.num_experts_per_tok);
        let sum: f32 = top.iter().map(|&x| p[x]).sum();
        for &x in &top {
            let wgt = if c.norm_topk_prob { p[x] / sum } else { p[x] };
            routes[x].push((r, wgt));
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
            let mut hmid = vec![0f32; n * i];
            for j in 0..n {
                for k in 0..i {
                    hmid[j * i + k] = silu(gu[j * 2 * i + k]) * gu[j * 2 * i + i + k];
                }
            }
            linear(&w.experts[x].1, &hmid, n)
        })
        .collect();
    let mut y = vec![0f32; t * d];
    for (toks, out) in routes.iter().zip(&outs) {
        for (j, &(r, wgt)) in toks.iter().enumerate() {
            for k in 0..d {
                y[r * d + k] += out[j * d + k] * wgt;
            }
        }
    }
    let is = c.shared_expert_intermediate_size;
    let g = linear(&w.sh_gate, u, t);
    let up = linear(&w.sh_up, u, t);
    let hmid: Vec<f32> = (0..t * is).map(|k| silu(g[k]) * up[k]).collect();
    let sh = linear(&w.sh_down, &hmid, t);
    for r in 0..t {
        let ur = &u[r * d..(r + 1) * d];
        let s = sigmoid(ur.iter().zip(&w.sh_scale).map(|(a, b)| a * b).sum());
        for k in 0..d {
            y[r * d + k] += s * sh[r * d + k];
        }
    }
    y
}
