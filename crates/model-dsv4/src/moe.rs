//! DeepSeekMoE (`DeepseekV4SparseMoeBlock` with `DeepseekV4TopKRouter` / `DeepseekV4HashRouter`).
//!
//! Router scores `s = score_fn(gate . u)` (`sqrt(softplus)`, sigmoid or softmax). Experts:
//! `hash_moe` layers take `tid2eid[token]`; `moe` layers take the top-k of
//! `s + e_score_correction_bias` (the bias only selects). Weights `s[idx] / (sum + 1e-20)`
//! times `routed_scaling_factor` (the reference always renormalises). Each expert is a SwiGLU
//! with `gate <= limit`, `up` clamped to `[-limit, limit]` (run by model-core's routed-expert
//! executor); the one shared expert has the same clamp and is added unweighted. This module
//! owns only the routing.

use model_core::experts::{Activation, Routes, dense_swiglu};
use quant_codecs::ops::{linear, sigmoid, softplus, top_k};

use crate::config::{DeepseekV4Config, ScoringFunc};
use crate::ops::softmax;
use crate::weights::{MoeWeights, Routing};

/// The router's constants (V4's from its config; V4.1 adds a logit temperature).
#[derive(Debug, Clone, Copy)]
pub struct Router {
    /// `n_routed_experts`.
    pub n_experts: usize,
    /// `num_experts_per_tok`.
    pub top_k: usize,
    /// `scoring_func`.
    pub scoring: ScoringFunc,
    /// `routed_scaling_factor`.
    pub scale: f32,
    /// `gate_temp` (V4.1): the logits are divided by it before scoring; 1 for V4.
    pub temp: f32,
    /// `swiglu_limit` of the routed and shared experts.
    pub swiglu_limit: f32,
}

impl Router {
    /// V4's router.
    pub fn of(c: &DeepseekV4Config) -> Router {
        Router {
            n_experts: c.n_routed_experts,
            top_k: c.num_experts_per_tok,
            scoring: c.scoring_func,
            scale: c.routed_scaling_factor as f32,
            temp: 1.0,
            swiglu_limit: c.swiglu_limit as f32,
        }
    }
}

/// The routing of `t` rows of `u` `[t, D]` for `tokens` (the input ids, for hash routing): per
/// expert, the (row, weight) pairs in row order.
pub fn route(w: &MoeWeights<'_>, rt: &Router, u: &[f32], tokens: &[u32], t: usize) -> Routes {
    let (e, k) = (rt.n_experts, rt.top_k);
    let mut scores = linear(&w.gate, u, t);
    if rt.temp != 1.0 {
        scores.iter_mut().for_each(|s| *s /= rt.temp);
    }
    match rt.scoring {
        ScoringFunc::Softmax => scores.chunks_mut(e).for_each(softmax),
        ScoringFunc::Sigmoid => scores.iter_mut().for_each(|s| *s = sigmoid(*s)),
        ScoringFunc::SqrtSoftplus => scores.iter_mut().for_each(|s| *s = softplus(*s).sqrt()),
    }
    let mut routes = Routes::new(e);
    for r in 0..t {
        let s = &scores[r * e..(r + 1) * e];
        let idx: Vec<usize> = match &w.routing {
            Routing::Hash(table) => {
                let at = tokens[r] as usize * k;
                table[at..at + k].iter().map(|&x| x as usize).collect()
            }
            Routing::Scored(bias) => {
                let biased: Vec<f32> = s.iter().zip(bias.iter()).map(|(a, b)| a + b).collect();
                top_k(&biased, k)
            }
        };
        let sum: f32 = idx.iter().map(|&x| s[x]).sum();
        for &x in &idx {
            routes.push(x, r, s[x] / (sum + 1e-20) * rt.scale);
        }
    }
    routes
}

/// Runs the block on `u` `[t, D]` for `tokens` (the input ids, for hash routing); returns
/// `[t, D]`.
pub fn forward_cpu(
    w: &MoeWeights<'_>,
    rt: &Router,
    u: &[f32],
    tokens: &[u32],
    t: usize,
) -> Vec<f32> {
    let routes = route(w, rt, u, tokens, t);
    let mut y = w.routed.forward_cpu(&routes, u, t);
    let act = Activation::SwiGlu {
        limit: Some(rt.swiglu_limit),
    };
    let sh = dense_swiglu(&w.sh_gate, &w.sh_up, &w.sh_down, act, u, t);
    for (a, b) in y.iter_mut().zip(&sh) {
        *a += b;
    }
    y
}
