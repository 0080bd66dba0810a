//! The lightning indexer of CSA layers (`DeepseekV4Indexer`): which compressed entries each
//! query attends.
//!
//! Keys come from the indexer's own overlapping compressor at `index_head_dim` (the compressor
//! half lives in [`crate::compressor`]; its entries are the indexer keys `K_I`). Queries
//! `q_I = RoPE(q_b_proj q_res)` per indexer head ("compress" set) at the query position, from
//! the attention's `q_res`. Score of entry `s` for one query:
//! `sum_h (weights_proj(h)_h / sqrt(nI)) relu(q_I[h] . K_I[s]) / sqrt(dI)` over the entries
//! visible at the query's position; the top `min(index_topk, visible)` are kept (ties: the
//! lower entry first; `-0.0` and `+0.0` tie).

use rayon::prelude::*;

use crate::compressor::{self, CompDims, CompState};
use crate::config::DeepseekV4Config;
use crate::ops::{Rope, rope_tail};
use crate::weights::IndexerWeights;
use quant_codecs::ops::{linear, top_k};

/// Feeds the `t` attention inputs `h` `[t, D]` (positions `past..past+t`) to the indexer's
/// compressor, then scores the visible entries for every query (`q_res` `[t, q_lora_rank]`).
/// Returns, per query, the selected entry indices in ascending order.
#[allow(clippy::too_many_arguments)]
pub fn select(
    w: &IndexerWeights<'_>,
    c: &DeepseekV4Config,
    rope: &Rope,
    rate: usize,
    q_res: &[f32],
    h: &[f32],
    t: usize,
    past: usize,
    st: &mut CompState,
) -> Vec<Vec<usize>> {
    let (ni, di) = (c.index_n_heads, c.index_head_dim);
    let dims = CompDims {
        rate,
        head: di,
        overlap: true,
        eps: c.rms_norm_eps as f32,
    };
    compressor::update(&w.comp, &dims, rope, h, t, st);
    let mut qi = linear(&w.q_b, q_res, t);
    for r in 0..t {
        let (cos, sin) = rope.at(past + r);
        for hh in 0..ni {
            rope_tail(
                &mut qi[(r * ni + hh) * di..(r * ni + hh + 1) * di],
                &cos,
                &sin,
                false,
            );
        }
    }
    let wts = linear(&w.weights_proj, h, t);
    let (wscale, sscale) = ((ni as f32).powf(-0.5), (di as f32).powf(-0.5));
    let keys = &st.compressed_kv;
    (0..t)
        .into_par_iter()
        .map(|r| {
            let vis = compressor::visible(past + r, rate).min(keys.len() / di);
            let scores: Vec<f32> = (0..vis)
                .map(|s| {
                    let k = &keys[s * di..(s + 1) * di];
                    let mut acc = 0f32;
                    for hh in 0..ni {
                        let qh = &qi[(r * ni + hh) * di..(r * ni + hh + 1) * di];
                        let dot: f32 = qh.iter().zip(k).map(|(a, b)| a * b).sum();
                        acc += dot.max(0.0) * sscale * (wts[r * ni + hh] * wscale);
                    }
                    acc
                })
                .collect();
            top_entries(&scores, c.index_topk.min(vis))
        })
        .collect()
}

/// The `k` highest-scoring entries, returned in ascending entry order. Equal scores keep the
/// lower entry, and zeros of either sign are equal (see [`quant_codecs::ops::top_k`]).
pub fn top_entries(scores: &[f32], k: usize) -> Vec<usize> {
    let mut idx = top_k(scores, k);
    idx.sort_unstable();
    idx
}

/// The indexer on the device: its compressor (the keys), its queries from `q_res`, its head
/// weights, and `ds_index` (scores and the top-k mask into `e.s.sel`).
pub struct IndexGpu {
    /// The compressor whose entries are the keys.
    pub comp: compressor::CompGpu,
    q_b: std::sync::Arc<gpu_runtime::GpuMatrix>,
    weights_proj: std::sync::Arc<gpu_runtime::GpuMatrix>,
    ni: usize,
    di: usize,
    topk: usize,
}

impl IndexGpu {
    /// Uploads `w` for a CSA layer of `rate`.
    pub fn new(
        dev: &crate::device::Device,
        w: &IndexerWeights<'_>,
        c: &DeepseekV4Config,
        rate: usize,
    ) -> Result<IndexGpu, gpu_runtime::GpuError> {
        let dims = CompDims {
            rate,
            head: c.index_head_dim,
            overlap: true,
            eps: c.rms_norm_eps as f32,
        };
        Ok(IndexGpu {
            comp: compressor::CompGpu::new(dev, &w.comp, dims)?,
            q_b: dev.mat(&w.q_b)?,
            weights_proj: dev.mat(&w.weights_proj)?,
            ni: c.index_n_heads,
            di: c.index_head_dim,
            topk: c.index_topk,
        })
    }

    /// Feeds the frame (attention inputs `e.s.u`, `q_res` in `e.s.q_res`) and selects, per
    /// row, the entries its query attends (`e.s.sel`).
    pub fn encode(
        &self,
        e: &mut crate::device::Enc<'_>,
        st: &compressor::CompDeviceState,
        rope: (&wgpu::Buffer, usize),
        nt: usize,
        ctx_len: usize,
    ) -> Result<(), gpu_runtime::GpuError> {
        use gpu_runtime::Epilogue;
        use kernels_wgsl::Op;
        let s = e.s;
        let (ni, di) = (self.ni, self.di);
        self.comp.encode(e, st, rope, nt, ctx_len)?;
        e.matvec(&self.q_b, &s.q_res, &s.qi, nt, Epilogue::None)?;
        let (cs, pairs) = rope;
        let p = [
            (nt * ni * pairs) as u32,
            ni as u32,
            di as u32,
            pairs as u32,
            0,
        ];
        e.op_lanes(Op::DsRope, &p, &[&s.qi, cs], nt * ni * pairs)?;
        e.matvec(&self.weights_proj, &s.u, &s.iw, nt, Epilogue::None)?;
        let rate = self.comp.rate();
        let maxe = crate::device::max_entries(ctx_len, rate).max(1);
        let p = [
            nt as u32,
            ni as u32,
            di as u32,
            rate as u32,
            self.topk as u32,
            maxe as u32,
            (ni as f32).powf(-0.5).to_bits(),
            (di as f32).powf(-0.5).to_bits(),
        ];
        let bufs = [&s.qi, &s.iw, &st.entries, &s.scores, &s.sel];
        e.op(Op::DsIndex, &p, &bufs, (nt as u32, 1))
    }
}

#[cfg(test)]
mod tests {
    use super::top_entries;

    #[test]
    fn entries_come_in_ascending_order_with_zero_ties_to_the_lower_index() {
        // All-zero scores (every relu clipped): the first k entries.
        assert_eq!(top_entries(&[0.0; 6], 3), vec![0, 1, 2]);
        // -0.0 ties with +0.0: index 0 wins over index 1 although its sign bit is set.
        assert_eq!(top_entries(&[-0.0, 0.0, 0.0, 1.0], 2), vec![0, 3]);
        // A tie at the cut between 2 and 4 keeps 2; the result is in entry order.
        assert_eq!(
            top_entries(&[0.1, 0.5, 0.3, -1.0, 0.3, 0.9], 3),
            vec![1, 2, 5]
        );
        // Fewer entries than k: all of them.
        assert_eq!(top_entries(&[0.2, 0.1], 3), vec![0, 1]);
    }
}
