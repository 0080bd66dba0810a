//! The routed-expert executor both architectures call.
//!
//! A model decides the routing (softmax/top-k, sqrt-softplus with a bias, a hash table: that
//! stays in its own `moe` module) and records it as [`Routes`]: for each expert, the token rows
//! it serves with their weights, in row order. [`RoutedExperts::forward_cpu`] then runs each
//! expert once over all of its rows (one batched matmat, so each weight group is decoded once
//! per batch rather than once per row), applies the activation, scales by the routing weight,
//! and adds the results in expert order. That order is fixed (it is the reference's
//! `index_add_` loop order), so the sum does not depend on how the experts were scheduled: the
//! experts run in parallel, the adds do not.
//!
//! This is where the expert offload (models larger than VRAM) will decide, per expert, whether
//! it runs from the VRAM bank or on the CPU.

use quant_codecs::ops::{linear, silu};
use rayon::prelude::*;

use crate::bind::Mat;

/// One routed expert.
#[derive(Debug, Clone)]
pub struct Expert<'a> {
    /// `gate_up_proj` `[2I, D]`: the gate rows, then the up rows.
    pub gate_up: Mat<'a>,
    /// `down_proj` `[D, I]`.
    pub down: Mat<'a>,
}

/// The expert MLP's activation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    /// `silu(gate) * up`; with `limit`, DeepSeek's clamp first: `gate <= limit`,
    /// `up` in `[-limit, limit]`.
    SwiGlu {
        /// The clamp, if any.
        limit: Option<f32>,
    },
}

impl Activation {
    /// The activation of one row (or many): `gate` and `up` of equal length.
    pub fn apply(self, gate: &[f32], up: &[f32]) -> Vec<f32> {
        match self {
            Activation::SwiGlu { limit: None } => {
                gate.iter().zip(up).map(|(&g, &u)| silu(g) * u).collect()
            }
            // torch's `clamp(min, max)` is `min(max(x, min), max)`; spelled out because
            // `f32::clamp` panics on an inverted interval (configs validate `limit >= 0`, but
            // one edited after validation must not crash the forward).
            Activation::SwiGlu { limit: Some(l) } => gate
                .iter()
                .zip(up)
                .map(|(&g, &u)| silu(g.min(l)) * u.max(-l).min(l))
                .collect(),
        }
    }
}

/// The routing of one batch of token rows: per expert, `(row, weight)` pairs in the order they
/// were pushed (row order, when a model routes row by row).
#[derive(Debug, Clone, PartialEq)]
pub struct Routes {
    per_expert: Vec<Vec<(usize, f32)>>,
}

impl Routes {
    /// No routes yet, over `n_experts` experts.
    pub fn new(n_experts: usize) -> Routes {
        Routes {
            per_expert: vec![Vec::new(); n_experts],
        }
    }

    /// Sends token row `row` to `expert` with weight `weight`.
    ///
    /// # Panics
    /// If `expert` is not below the expert count (the models bound-check their routing tables).
    pub fn push(&mut self, expert: usize, row: usize, weight: f32) {
        self.per_expert[expert].push((row, weight));
    }

    /// The `(row, weight)` pairs of `expert`.
    pub fn rows(&self, expert: usize) -> &[(usize, f32)] {
        &self.per_expert[expert]
    }

    /// Number of experts.
    pub fn n_experts(&self) -> usize {
        self.per_expert.len()
    }

    /// The experts that serve at least one row, in expert order.
    pub fn active(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.per_expert.len()).filter(|&x| !self.per_expert[x].is_empty())
    }
}

/// The routed experts of one MoE layer.
#[derive(Debug, Clone)]
pub struct RoutedExperts<'a> {
    /// The experts, by id.
    pub experts: Vec<Expert<'a>>,
    /// Model width `D`.
    pub hidden: usize,
    /// Expert width `I`.
    pub intermediate: usize,
    /// The expert MLP's activation.
    pub activation: Activation,
}

impl RoutedExperts<'_> {
    /// Expert `x` on the `n` rows of `xs` `[n, D]`, unweighted: `[n, D]` (what a device
    /// without the expert in VRAM has the CPU compute for it).
    ///
    /// # Panics
    /// If `x` is not an expert of the layer.
    pub fn expert_rows(&self, x: usize, xs: &[f32], n: usize) -> Vec<f32> {
        let i = self.intermediate;
        let e = &self.experts[x];
        let gu = linear(&e.gate_up, xs, n);
        let mut hmid = Vec::with_capacity(n * i);
        for row in gu.chunks(2 * i) {
            hmid.extend(self.activation.apply(&row[..i], &row[i..]));
        }
        linear(&e.down, &hmid, n)
    }

    /// `sum over routes of weight * expert(u[row])` for the `t` rows of `u` `[t, D]`; returns
    /// `[t, D]`.
    ///
    /// # Panics
    /// If `routes` covers another expert count or names a row `>= t`.
    pub fn forward_cpu(&self, routes: &Routes, u: &[f32], t: usize) -> Vec<f32> {
        let d = self.hidden;
        assert_eq!(
            routes.n_experts(),
            self.experts.len(),
            "routes over another expert count"
        );
        let outs: Vec<Vec<f32>> = routes
            .per_expert
            .par_iter()
            .enumerate()
            .map(|(x, rows)| {
                if rows.is_empty() {
                    return Vec::new();
                }
                let n = rows.len();
                let mut xs = Vec::with_capacity(n * d);
                for &(r, _) in rows {
                    xs.extend_from_slice(&u[r * d..(r + 1) * d]);
                }
                let mut y = self.expert_rows(x, &xs, n);
                for (row, &(_, wgt)) in y.chunks_mut(d).zip(rows) {
                    row.iter_mut().for_each(|v| *v *= wgt);
                }
                y
            })
            .collect();
        let mut y = vec![0f32; t * d];
        for (rows, out) in routes.per_expert.iter().zip(&outs) {
            for (j, &(r, _)) in rows.iter().enumerate() {
                for (a, b) in y[r * d..(r + 1) * d]
                    .iter_mut()
                    .zip(&out[j * d..(j + 1) * d])
                {
                    *a += b;
                }
            }
        }
        y
    }
}

/// A dense SwiGLU MLP (the shared expert): `down(act(gate . u, up . u))` for `t` rows.
pub fn dense_swiglu(
    gate: &Mat<'_>,
    up: &Mat<'_>,
    down: &Mat<'_>,
    activation: Activation,
    u: &[f32],
    t: usize,
) -> Vec<f32> {
    let g = linear(gate, u, t);
    let p = linear(up, u, t);
    linear(down, &activation.apply(&g, &p), t)
}
