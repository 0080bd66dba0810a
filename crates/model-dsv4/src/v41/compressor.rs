//! The shared compressor of a V4.1 KV source (`DeepseekV41Compressor`) and what becomes of its
//! latents: the compressed entries its group attends and the indexer keys its group scores.
//!
//! Every token contributes `kv = kv_proj h` (and at ratio > 1 `gate = gate_proj h`), `h` the
//! attention input after `input_layernorm`. Groups are `ratio` consecutive tokens from the
//! sequence start; only complete groups emit, the tail waits in the state. A group's latent is
//! `kv_norm(sum_slots softmax_slots(gate) * kv)` per channel at ratio > 1 (V4's pooling without
//! the overlap and the position bias), `kv_norm(kv)` of its one token at ratio 1. Unlike V4 the
//! latent leaves the compressor before RoPE: the indexer keys are
//! `fp4_32(RoPE(k_norm(k_proj latent)))`, the entries `fp4_16(RoPE(latent))`, both at the
//! group's first position with the `compress` set ([`super::qat`]).

use crate::compressor::pool;
use crate::ops::{Rope, rms_norm, rope_tail};
use quant_codecs::ops::linear;

use super::qat::{self, Fp4Scale};
use super::state::SharedKv;
use super::weights::{CompressorWeights, IndexKeyWeights};

/// Feeds `t` attention inputs `h` `[t, D]` to the compressor; returns the pre-RoPE latents of
/// the groups they complete `[g, Dh]`, in group order after those already in `st.entries`.
pub fn update(
    w: &CompressorWeights<'_>,
    ratio: usize,
    eps: f32,
    h: &[f32],
    t: usize,
    st: &mut SharedKv,
) -> Vec<f32> {
    let dh = w.norm.len();
    let mut latents = linear(&w.kv, h, t);
    if let Some(gate) = &w.gate {
        let g = linear(gate, h, t);
        st.buffer_kv.extend_from_slice(&latents);
        st.buffer_gate.extend_from_slice(&g);
        let groups = st.buffer_kv.len() / (ratio * dh);
        let kv: Vec<f32> = st.buffer_kv.drain(..groups * ratio * dh).collect();
        let gate: Vec<f32> = st.buffer_gate.drain(..groups * ratio * dh).collect();
        latents = Vec::with_capacity(groups * dh);
        for gi in 0..groups {
            let slots: Vec<(&[f32], &[f32])> = (0..ratio)
                .map(|j| {
                    let at = (gi * ratio + j) * dh;
                    (&kv[at..at + dh], &gate[at..at + dh])
                })
                .collect();
            latents.extend(pool(&slots, dh));
        }
    }
    rms_norm(&mut latents, &w.norm, eps);
    latents
}

/// Appends the entries (and, with `keys`, the indexer keys) of `latents` `[g, dh]`, groups
/// `first..first + g` of a source of ratio `ratio`.
#[allow(clippy::too_many_arguments)]
pub fn publish(
    latents: &[f32],
    dh: usize,
    first: usize,
    ratio: usize,
    keys: Option<&IndexKeyWeights<'_>>,
    rope: &Rope,
    eps: f32,
    st: &mut SharedKv,
) {
    let g = latents.len() / dh;
    if g == 0 {
        return;
    }
    if let Some(kw) = keys {
        let mut k = linear(&kw.k_proj, latents, g);
        rms_norm(&mut k, &kw.k_norm, eps);
        let di = kw.k_norm.len();
        for (j, row) in k.chunks_exact_mut(di).enumerate() {
            let (cos, sin) = rope.at((first + j) * ratio);
            rope_tail(row, &cos, &sin, false);
            qat::fp4(row, 32, Fp4Scale::Ue8m0);
        }
        st.index_keys.extend_from_slice(&k);
    }
    for (j, lat) in latents.chunks_exact(dh).enumerate() {
        let mut e = lat.to_vec();
        let (cos, sin) = rope.at((first + j) * ratio);
        rope_tail(&mut e, &cos, &sin, false);
        qat::fp4(&mut e, 16, Fp4Scale::E4m3);
        st.entries.extend_from_slice(&e);
    }
}
