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

use quant_codecs::ops::{act_path, linear, silu};
use quant_codecs::team::{Parallel, Rayon};
use quant_codecs::{ActPath, Link, MAX_BATCH, MatRef};

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

/// One expert MLP on the `n` rows of `xs` `[n, D]`: `down(act(gate_up xs))`, `[n, D]`, its
/// projections split over the threads by the CPU kernels.
pub fn expert_mlp(
    act: Activation,
    gate_up: &MatRef<'_>,
    down: &MatRef<'_>,
    xs: &[f32],
    n: usize,
) -> Vec<f32> {
    let i = down.cols();
    let gu = linear(gate_up, xs, n);
    let mut hmid = Vec::with_capacity(n * i);
    for row in gu.chunks(2 * i) {
        hmid.extend(act.apply(&row[..i], &row[i..]));
    }
    linear(down, &hmid, n)
}

/// Several expert MLPs (`(gate_up, down, xs)`, each on its own rows `[n, D]`), each output
/// equal to [`expert_mlp`]'s bit for bit, but scheduled together: every expert's gate/up and
/// down rows in one parallel region ([`MatRef::matmat_chain_on`]), an expert's down starting
/// as soon as its own gate/up is done. A layer's few cold experts are small matrices (a few MB
/// each), so one fork/join for all of them instead of one per expert and projection is what
/// keeps the cores reading.
pub fn experts_mlp(act: Activation, jobs: &[(&MatRef<'_>, &MatRef<'_>, &[f32])]) -> Vec<Vec<f32>> {
    experts_mlp_on(&Rayon, act, jobs)
}

/// [`experts_mlp`] with its parallel region run by `exec` (the offload's cold path runs it on
/// a [`quant_codecs::team::Team`] kept awake between layers); the same bits.
pub fn experts_mlp_on(
    exec: &dyn Parallel,
    act: Activation,
    jobs: &[(&MatRef<'_>, &MatRef<'_>, &[f32])],
) -> Vec<Vec<f32>> {
    // One region when every matrix takes the int8 path. Otherwise (float experts, q8_2f on
    // `--act auto`'s f32 path, or a gate/up and down of different codecs) each expert runs
    // alone, each matrix on its own path as in `expert_mlp`, the experts side by side.
    let int8 = |m: &MatRef<'_>| act_path(m.dtype()) == ActPath::Int8;
    if !jobs.iter().all(|(gu, down, _)| int8(gu) && int8(down)) {
        let outs: Vec<std::sync::Mutex<Vec<f32>>> =
            jobs.iter().map(|_| Default::default()).collect();
        exec.for_each_index(jobs.len(), &|j| {
            let (gu, down, xs) = jobs[j];
            let y = expert_mlp(act, gu, down, xs, xs.len() / gu.cols());
            *outs[j].lock().unwrap_or_else(|p| p.into_inner()) = y;
        });
        return outs
            .into_iter()
            .map(|y| y.into_inner().unwrap_or_else(|p| p.into_inner()))
            .collect();
    }
    let mut out: Vec<Vec<f32>> = jobs
        .iter()
        .map(|&(gu, down, xs)| vec![0.0; xs.len() / gu.cols() * down.rows()])
        .collect();
    // Links of at most MAX_BATCH rows each.
    let mut links: Vec<Link<'_, '_>> = Vec::new();
    for (&(gu, down, xs), ys) in jobs.iter().zip(out.iter_mut()) {
        let rows = xs.chunks(MAX_BATCH * gu.cols());
        for (xs, ys) in rows.zip(ys.chunks_mut(MAX_BATCH * down.rows())) {
            links.push(Link {
                first: *gu,
                xs,
                second: *down,
                ys,
            });
        }
    }
    let widths: Vec<usize> = links.iter().map(|l| l.second.cols()).collect();
    let between = |j: usize, g: &[f32], h: &mut [f32]| {
        let i = widths[j];
        for (row, h) in g.chunks(2 * i).zip(h.chunks_mut(i)) {
            h.copy_from_slice(&act.apply(&row[..i], &row[i..]));
        }
    };
    MatRef::matmat_chain_on(exec, ActPath::Int8, &mut links, &between)
        .expect("shapes checked at bind time");
    drop(links);
    out
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
        let e = &self.experts[x];
        expert_mlp(self.activation, e.gate_up.mat(), e.down.mat(), xs, n)
    }

    /// Several experts at once, each on its own rows (`jobs`: expert id and its rows
    /// `[n, D]`), unweighted, as one parallel region per projection ([`experts_mlp`]); each
    /// output equals [`RoutedExperts::expert_rows`] bit for bit.
    ///
    /// # Panics
    /// If an id is not an expert of the layer.
    pub fn experts_rows(&self, jobs: &[(usize, &[f32])]) -> Vec<Vec<f32>> {
        self.experts_rows_on(&Rayon, jobs)
    }

    /// [`RoutedExperts::experts_rows`] with the parallel regions run by `exec`.
    ///
    /// # Panics
    /// If an id is not an expert of the layer.
    pub fn experts_rows_on(&self, exec: &dyn Parallel, jobs: &[(usize, &[f32])]) -> Vec<Vec<f32>> {
        let mats: Vec<(&MatRef<'_>, &MatRef<'_>, &[f32])> = jobs
            .iter()
            .map(|&(x, xs)| {
                let e = &self.experts[x];
                (e.gate_up.mat(), e.down.mat(), xs)
            })
            .collect();
        experts_mlp_on(exec, self.activation, &mats)
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
        // Every chosen expert's rows gathered, then all of them in one parallel region (each
        // output the same bits as the expert alone, [`RoutedExperts::experts_rows`]).
        let chosen: Vec<(usize, Vec<f32>)> = routes
            .per_expert
            .iter()
            .enumerate()
            .filter(|(_, rows)| !rows.is_empty())
            .map(|(x, rows)| {
                let mut xs = Vec::with_capacity(rows.len() * d);
                for &(r, _) in rows {
                    xs.extend_from_slice(&u[r * d..(r + 1) * d]);
                }
                (x, xs)
            })
            .collect();
        let jobs: Vec<(usize, &[f32])> = chosen.iter().map(|(x, xs)| (*x, xs.as_slice())).collect();
        let mut outs: Vec<Vec<f32>> = vec![Vec::new(); routes.per_expert.len()];
        for ((x, _), mut y) in chosen.iter().zip(self.experts_rows(&jobs)) {
            for (row, &(_, wgt)) in y.chunks_mut(d).zip(&routes.per_expert[*x]) {
                row.iter_mut().for_each(|v| *v *= wgt);
            }
            outs[*x] = y;
        }
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
