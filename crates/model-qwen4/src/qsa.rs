//! Full attention with the QSA indexer (`Qwen4ExpTextAttention` + `Qwen4ExpTextQSAIndexer`).
//!
//! Attention: `[q | gate]` per head from `q_proj`; `q = q_norm(q)`, `k = k_norm(k_proj u)`
//! ((1+w) RMSNorm per head); rotate-half RoPE on the first `rotary_dim` dims; GQA; scale
//! `head_dim^-0.5`; softmax over the SELECTED visible tokens; `o *= sigmoid(gate)`; `o_proj`.
//!
//! Indexer: `[q_I (n_I heads) | k_raw] = index_qk_proj u`; `q_I = RoPE(q_layernorm(q_I))` at the
//! query position; raw keys are kept un-normalised and un-rotated. For a query that sees tokens
//! `0..=p`, the complete blocks of `ratio` tokens get `K_b = RoPE(k_layernorm(mean(k_raw)))` at
//! the block's first position and `score_b = sum_h relu(q_I[h] . K_b) / sqrt(d_I)`; the top
//! `budget / ratio` blocks (ties: lower block first) plus the incomplete tail are attended.
//! Below the budget every token is selected, i.e. dense attention.

use crate::config::Qwen4ExpTextConfig;
use crate::ops::{Rope, rms_norm_1p, rope};
use crate::weights::AttnWeights;
use quant_codecs::ops::{linear, sigmoid, top_k};
use rayon::prelude::*;

/// KV cache of one attention layer for one sequence.
#[derive(Debug, Clone, Default)]
pub struct AttnState {
    /// Normalised, rotated keys `[n, Hkv*hd]`.
    pub k: Vec<f32>,
    /// Values `[n, Hkv*hd]`.
    pub v: Vec<f32>,
    /// Raw indexer keys `[n, d_I]`.
    pub raw: Vec<f32>,
    /// Block keys `RoPE(k_layernorm(mean(k_raw)))` of the complete blocks so far `[n/ratio, d_I]`
    /// (a pure function of `raw`, kept so decode does not recompute them).
    pub block_keys: Vec<f32>,
}

/// Runs the block on block inputs `u` `[t, D]` at positions `past..past+t`; returns `[t, D]`.
pub fn forward_cpu(
    w: &AttnWeights<'_>,
    c: &Qwen4ExpTextConfig,
    rp: &Rope,
    u: &[f32],
    t: usize,
    st: &mut AttnState,
) -> Vec<f32> {
    let (hq, hkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let qsa = c.qsa().expect("validated");
    let (ni, di) = (qsa.n_heads, qsa.head_dim);
    let eps = c.rms_norm_eps as f32;
    let kvd = hkv * hd;
    let past = st.k.len() / kvd;
    let qg = linear(&w.q, u, t);
    let mut k = linear(&w.k, u, t);
    let v = linear(&w.v, u, t);
    let qk_i = linear(&w.idx_qk, u, t);
    rms_norm_1p(&mut k, &w.k_norm, hd, eps);
    let mut q = vec![0f32; t * hq * hd];
    let mut gate = vec![0f32; t * hq * hd];
    for r in 0..t {
        for h in 0..hq {
            let src = &qg[r * hq * 2 * hd + h * 2 * hd..r * hq * 2 * hd + (h + 1) * 2 * hd];
            q[(r * hq + h) * hd..(r * hq + h + 1) * hd].copy_from_slice(&src[..hd]);
            gate[(r * hq + h) * hd..(r * hq + h + 1) * hd].copy_from_slice(&src[hd..]);
        }
    }
    rms_norm_1p(&mut q, &w.q_norm, hd, eps);
    // Indexer queries and raw keys.
    let mut qi = vec![0f32; t * ni * di];
    for r in 0..t {
        qi[r * ni * di..(r + 1) * ni * di]
            .copy_from_slice(&qk_i[r * (ni + 1) * di..r * (ni + 1) * di + ni * di]);
        st.raw
            .extend_from_slice(&qk_i[r * (ni + 1) * di + ni * di..(r + 1) * (ni + 1) * di]);
    }
    rms_norm_1p(&mut qi, &w.idx_q_norm, di, eps);
    for r in 0..t {
        let (cos, sin) = rp.at(past + r);
        for h in 0..hq {
            rope(&mut q[(r * hq + h) * hd..(r * hq + h + 1) * hd], &cos, &sin);
        }
        for h in 0..hkv {
            rope(
                &mut k[(r * hkv + h) * hd..(r * hkv + h + 1) * hd],
                &cos,
                &sin,
            );
        }
        for h in 0..ni {
            rope(
                &mut qi[(r * ni + h) * di..(r * ni + h + 1) * di],
                &cos,
                &sin,
            );
        }
    }
    st.k.extend_from_slice(&k);
    st.v.extend_from_slice(&v);
    let n = past + t;
    // Block keys of the complete blocks not yet pooled (independent of the query).
    let nblocks = n / qsa.ratio;
    for b in st.block_keys.len() / di..nblocks {
        let mut out = vec![0f32; di];
        for j in 0..qsa.ratio {
            let tok = b * qsa.ratio + j;
            for (o, x) in out.iter_mut().zip(&st.raw[tok * di..(tok + 1) * di]) {
                *o += x;
            }
        }
        for o in out.iter_mut() {
            *o /= qsa.ratio as f32;
        }
        rms_norm_1p(&mut out, &w.idx_k_norm, di, eps);
        let (cos, sin) = rp.at(b * qsa.ratio);
        rope(&mut out, &cos, &sin);
        st.block_keys.extend_from_slice(&out);
    }
    let bk = &st.block_keys;
    let (ks, vs) = (&st.k, &st.v);
    let scale = 1.0 / (hd as f32).sqrt();
    let rep = hq / hkv;
    let mut o = vec![0f32; t * hq * hd];
    o.par_chunks_mut(hq * hd)
        .enumerate()
        .for_each(|(r, o_row)| {
            let p = past + r;
            let visible = p + 1;
            let nb = visible / qsa.ratio;
            let mut selected: Vec<usize> = Vec::with_capacity(visible);
            if nb > 0 {
                let scores: Vec<f32> = (0..nb)
                    .map(|b| {
                        let kb = &bk[b * di..(b + 1) * di];
                        let mut s = 0f32;
                        for h in 0..ni {
                            let qh = &qi[(r * ni + h) * di..(r * ni + h + 1) * di];
                            let dot: f32 = qh.iter().zip(kb).map(|(a, b)| a * b).sum();
                            s += dot.max(0.0);
                        }
                        s / (di as f32).sqrt()
                    })
                    .collect();
                for b in top_k(&scores, qsa.block_topk().min(nb)) {
                    selected.extend(b * qsa.ratio..(b + 1) * qsa.ratio);
                }
            }
            selected.extend(nb * qsa.ratio..visible);
            selected.sort_unstable();
            for h in 0..hq {
                let kh = h / rep;
                let qh = &q[(r * hq + h) * hd..(r * hq + h + 1) * hd];
                let logits: Vec<f32> = selected
                    .iter()
                    .map(|&s| {
                        let ks = &ks[s * kvd + kh * hd..s * kvd + (kh + 1) * hd];
                        qh.iter().zip(ks).map(|(a, b)| a * b).sum::<f32>() * scale
                    })
                    .collect();
                let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = logits.iter().map(|l| (l - m).exp()).collect();
                let z: f32 = e.iter().sum();
                let out = &mut o_row[h * hd..(h + 1) * hd];
                for (&s, &p) in selected.iter().zip(&e) {
                    let vrow = &vs[s * kvd + kh * hd..s * kvd + (kh + 1) * hd];
                    for (a, b) in out.iter_mut().zip(vrow) {
                        *a += p / z * b;
                    }
                }
            }
        });
    for (a, g) in o.iter_mut().zip(&gate) {
        *a *= sigmoid(*g);
    }
    linear(&w.o, &o, t)
}
