//! Sparse MoE (`Qwen4ExpTextSparseMoeBlock`): softmax over ALL experts, top-k, renormalised
//! when `norm_topk_prob`; SwiGLU experts (`gate_up` rows: gate then up) run by model-core's
//! routed-expert executor; plus the shared SwiGLU expert scaled by
//! `sigmoid(shared_expert_gate . u)`. This module owns only the routing.

use crate::config::Qwen4ExpTextConfig;
use crate::weights::MoeWeights;
use model_core::experts::{Activation, Routes, dense_swiglu};
use quant_codecs::ops::{linear, sigmoid, top_k};

/// The routing of `t` rows of `u` `[t, D]`: per expert, the (row, weight) pairs in row order.
pub fn route(w: &MoeWeights<'_>, c: &Qwen4ExpTextConfig, u: &[f32], t: usize) -> Routes {
    let e = c.num_experts;
    let logits = linear(&w.router, u, t);
    let mut routes = Routes::new(e);
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
            routes.push(x, r, wgt);
        }
    }
    routes
}

/// Runs the block on `u` `[t, D]`; returns `[t, D]`.
pub fn forward_cpu(w: &MoeWeights<'_>, c: &Qwen4ExpTextConfig, u: &[f32], t: usize) -> Vec<f32> {
    let d = c.hidden_size;
    let routes = route(w, c, u, t);
    let mut y = w.routed.forward_cpu(&routes, u, t);
    let sh = dense_swiglu(
        &w.sh_gate,
        &w.sh_up,
        &w.sh_down,
        Activation::SwiGlu { limit: None },
        u,
        t,
    );
    for r in 0..t {
        let ur = &u[r * d..(r + 1) * d];
        let s = sigmoid(ur.iter().zip(w.sh_scale.iter()).map(|(a, b)| a * b).sum());
        for k in 0..d {
            y[r * d + k] += s * sh[r * d + k];
        }
    }
    y
}
