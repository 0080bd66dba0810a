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

/// The device's mark of an expert without a bank slot (and of a resident slot in a frame's
/// cold list).
pub const NONE_SLOT: u32 = u32::MAX;

/// Every layer's resident routed experts in one global bank of slots (seed-spec.md §5.4):
/// the gate/up and down matrices in two segmented banks that share slot numbers. A layer's
/// expert -> slot map ([`MoeGpu`]) names each of its experts' slot, or [`NONE_SLOT`].
pub struct GlobalBank {
    /// Gate/up `[2I, D]` per slot.
    pub gate_up: gpu_runtime::ops::experts::ExpertBank,
    /// Down `[D, I]` per slot.
    pub down: gpu_runtime::ops::experts::ExpertBank,
}

/// A MoE block on the device: the router matvec, `ds_route` (scores, hash or biased top-k,
/// renormalised weights), `cold_split` (each routed slot to its expert's slot in the global
/// bank, or to the cold list), the resident experts through the grouped kernels with the
/// clamped SwiGLU between them, the shared expert, and `moe_sum`. With cold experts the frame
/// breaks after the split (the host reads the cold list and the block's input back and
/// computes them on the CPU while the GPU runs the resident and shared experts) and before the
/// sum (the host's outputs go up into the cold slots' rows): the sum is the same, in the same
/// order, as with every expert resident.
pub struct MoeGpu {
    router: std::sync::Arc<gpu_runtime::GpuMatrix>,
    bias: wgpu::Buffer,
    table: wgpu::Buffer,
    /// `[E]`: each expert's global bank slot, or [`NONE_SLOT`].
    slot_of: wgpu::Buffer,
    /// Experts of this layer in the bank.
    pub resident: usize,
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
    /// Uploads the block `w` of a model routed by `rt`, its experts' slots `slots` (`[E]`,
    /// [`NONE_SLOT`] for a cold one) in the global bank.
    pub fn new(
        dev: &crate::device::Device,
        w: &MoeWeights<'_>,
        rt: &Router,
        slots: &[u32],
        (hidden, inter): (usize, usize),
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
        Ok(MoeGpu {
            router: dev.mat(&w.gate)?,
            bias,
            table,
            slot_of: dev.words("expert slots", slots),
            resident: slots.iter().filter(|&&s| s != NONE_SLOT).count(),
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

    /// Points expert `x`'s entry of the expert -> slot map at `slot` (or [`NONE_SLOT`]); the
    /// frames queued before it read the old map.
    pub fn set_slot(&self, q: &wgpu::Queue, x: u32, slot: u32) {
        q.write_buffer(&self.slot_of, u64::from(x) * 4, bytemuck::bytes_of(&slot));
    }

    /// Whether some of the layer's experts run on the CPU.
    pub fn has_cold(&self) -> bool {
        self.resident < self.route[0] as usize
    }

    /// Layer `il`'s block on `e.s.u` (the frame's token ids in `e.s.tokens`) into `e.s.y`,
    /// the resident experts read from `bank`.
    pub fn encode(
        &self,
        e: &mut crate::device::Enc<'_>,
        bank: Option<&GlobalBank>,
        nt: usize,
        il: usize,
    ) -> Result<(), gpu_runtime::GpuError> {
        use gpu_runtime::Epilogue;
        use gpu_runtime::ops::graph::Break;
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
        let bufs = [&s.ids, &self.slot_of, &s.bank_ids, &s.cold];
        e.op_lanes(Op::ColdSplit, &[slots as u32], &bufs, slots)?;
        if self.has_cold() {
            e.g.brk(Break::Read(il));
        }
        let lim = self.limit.to_bits();
        let (i2, iu) = ((2 * i) as u32, i as u32);
        if let Some(bank) = bank.filter(|_| self.resident > 0) {
            let ids = &s.bank_ids;
            let none = Epilogue::None;
            e.grouped(&bank.gate_up, &s.u, nt, ids, &s.mid2, slots, k, none)?;
            let p = [(slots * i) as u32, iu, i2, i2, iu, lim, 1];
            e.op_lanes(Op::SwigluClamp, &p, &[&s.mid2, &s.sg, &s.mid], slots * i)?;
            e.grouped(&bank.down, &s.mid, slots, ids, &s.eo, slots, 1, none)?;
        }
        e.matvec(&self.sh_gate, &s.u, &s.sg, nt, Epilogue::None)?;
        e.matvec(&self.sh_up, &s.u, &s.su, nt, Epilogue::None)?;
        let p = [(nt * i) as u32, iu, iu, iu, 0, lim, 0];
        e.op_lanes(Op::SwigluClamp, &p, &[&s.sg, &s.su, &s.sm], nt * i)?;
        e.matvec(&self.sh_down, &s.sm, &s.so, nt, Epilogue::None)?;
        if self.has_cold() {
            e.g.brk(Break::Write(il));
        }
        let p = [(nt * d) as u32, k as u32, d as u32];
        e.op_lanes(Op::MoeSum, &p, &[&s.eo, &s.wts, &s.so, &s.y], nt * d)
    }
}
