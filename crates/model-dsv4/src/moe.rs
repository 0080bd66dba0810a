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

/// A MoE block on the device, every routed expert resident: the router matvec, `ds_route`
/// (scores, hash or biased top-k, renormalised weights), the routed experts through the
/// grouped kernels over the layer's banks with the clamped SwiGLU between them, the shared
/// expert, and `moe_sum`.
pub struct MoeGpu {
    router: std::sync::Arc<gpu_runtime::GpuMatrix>,
    bias: wgpu::Buffer,
    table: wgpu::Buffer,
    gate_up: gpu_runtime::ops::experts::ExpertBank,
    down: gpu_runtime::ops::experts::ExpertBank,
    sh_gate: std::sync::Arc<gpu_runtime::GpuMatrix>,
    sh_up: std::sync::Arc<gpu_runtime::GpuMatrix>,
    sh_down: std::sync::Arc<gpu_runtime::GpuMatrix>,
    /// `ds_route`'s parameters.
    route: [u32; 6],
    limit: f32,
    inter: usize,
    hidden: usize,
}

impl MoeGpu {
    /// Uploads the block `w` of a model routed by `rt`.
    pub fn new(
        dev: &crate::device::Device,
        w: &MoeWeights<'_>,
        rt: &Router,
        hidden: usize,
        inter: usize,
    ) -> Result<MoeGpu, gpu_runtime::GpuError> {
        let (hash, table, bias) = match &w.routing {
            Routing::Hash(tab) => (1u32, dev.words("tid2eid", tab), dev.vec("bias", &[0.0])),
            Routing::Scored(b) => (0u32, dev.words("tid2eid", &[0]), dev.vec("bias", b)),
        };
        let scoring = match rt.scoring {
            ScoringFunc::Softmax => 0u32,
            ScoringFunc::Sigmoid => 1,
            ScoringFunc::SqrtSoftplus => 2,
        };
        let gu: Vec<_> = w.routed.experts.iter().map(|x| &x.gate_up).collect();
        let dn: Vec<_> = w.routed.experts.iter().map(|x| &x.down).collect();
        Ok(MoeGpu {
            router: dev.mat(&w.gate)?,
            bias,
            table,
            gate_up: dev.bank(&gu)?,
            down: dev.bank(&dn)?,
            sh_gate: dev.mat(&w.sh_gate)?,
            sh_up: dev.mat(&w.sh_up)?,
            sh_down: dev.mat(&w.sh_down)?,
            route: [
                rt.n_experts as u32,
                rt.top_k as u32,
                scoring,
                hash,
                rt.temp.to_bits(),
                rt.scale.to_bits(),
            ],
            limit: rt.swiglu_limit,
            inter,
            hidden,
        })
    }

    /// The block on `e.s.u` (the frame's token ids in `e.s.tokens`) into `e.s.y`.
    pub fn encode(
        &self,
        e: &mut crate::device::Enc<'_>,
        nt: usize,
    ) -> Result<(), gpu_runtime::GpuError> {
        use gpu_runtime::Epilogue;
        use kernels_wgsl::Op;
        let s = e.s;
        let (k, i, d) = (self.route[1] as usize, self.inter, self.hidden);
        e.matvec(&self.router, &s.u, &s.logits_e, nt, Epilogue::None)?;
        let bufs = [
            &s.logits_e,
            &self.bias,
            &self.table,
            &s.tokens,
            &s.ids,
            &s.wts,
        ];
        e.op(Op::DsRoute, &self.route, &bufs, (nt as u32, 1))?;
        let slots = nt * k;
        let lim = self.limit.to_bits();
        e.grouped(
            &self.gate_up,
            &s.u,
            nt,
            &s.ids,
            &s.mid2,
            slots,
            k,
            Epilogue::None,
        )?;
        let (i2, iu) = ((2 * i) as u32, i as u32);
        let p = [(slots * i) as u32, iu, i2, i2, iu, lim, 1];
        e.op_lanes(Op::SwigluClamp, &p, &[&s.mid2, &s.sg, &s.mid], slots * i)?;
        e.grouped(
            &self.down,
            &s.mid,
            slots,
            &s.ids,
            &s.eo,
            slots,
            1,
            Epilogue::None,
        )?;
        e.matvec(&self.sh_gate, &s.u, &s.sg, nt, Epilogue::None)?;
        e.matvec(&self.sh_up, &s.u, &s.su, nt, Epilogue::None)?;
        let p = [(nt * i) as u32, iu, iu, iu, 0, lim, 0];
        e.op_lanes(Op::SwigluClamp, &p, &[&s.sg, &s.su, &s.sm], nt * i)?;
        e.matvec(&self.sh_down, &s.sm, &s.so, nt, Epilogue::None)?;
        let p = [(nt * d) as u32, k as u32, d as u32];
        e.op_lanes(Op::MoeSum, &p, &[&s.eo, &s.wts, &s.so, &s.y], nt * d)
    }
}
