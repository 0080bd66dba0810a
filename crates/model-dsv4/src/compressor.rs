//! The KV compressors of CSA and HCA layers and of the lightning indexer
//! (`DeepseekV4HCACompressor`, `DeepseekV4CSACompressor`, the compressor half of
//! `DeepseekV4Indexer`), with their incremental state.
//!
//! Every token contributes `kv = kv_proj h` and `gate = gate_proj h` (`h` = the attention input
//! after `input_layernorm`). Windows are aligned to absolute positions that are multiples of the
//! rate; only complete windows emit an entry, the tail waits in a buffer. Entry `w` is
//! `kv_norm(sum_slots softmax_slots(gate + position_bias) * kv)` (softmax per channel),
//! RoPE'd ("compress" set, trailing channels) at position `rate * w`.
//!
//! Non-overlapping (HCA): the slots are the window's `rate` tokens. Overlapping (CSA and the
//! indexer): `kv`/`gate` are twice the head dim, `[Ca | Cb]`; entry `w` pools the Ca halves of
//! window `w-1` and the Cb halves of window `w` (`2 * rate` slots; window 0 has no Ca slots).
//! The previous window's Ca (its gate with `position_bias` added) is carried in the state.

use crate::ops::{Rope, rms_norm, rope_tail};
use crate::weights::CompressorWeights;
use quant_codecs::ops::linear;

/// The incremental state of one compressor for one sequence.
#[derive(Debug, Clone, Default)]
pub struct CompState {
    /// Projected `kv` rows of the incomplete window `[n < rate, W]`.
    pub buffer_kv: Vec<f32>,
    /// Projected `gate` rows (without `position_bias`) of the incomplete window `[n, W]`.
    pub buffer_gate: Vec<f32>,
    /// Overlapping only: the last complete window's Ca `kv` `[rate, head]` (empty before it).
    pub overlap_kv: Vec<f32>,
    /// Overlapping only: the last complete window's Ca `gate + position_bias` `[rate, head]`.
    pub overlap_gate: Vec<f32>,
    /// Emitted entries, normalised and rotated `[count, head]`.
    pub compressed_kv: Vec<f32>,
}

/// What a compressor needs besides its weights.
#[derive(Debug, Clone, Copy)]
pub struct CompDims {
    /// Tokens per entry.
    pub rate: usize,
    /// Entry width (head dim or index head dim).
    pub head: usize,
    /// Two series `[Ca | Cb]` per token (CSA, indexer) or one (HCA).
    pub overlap: bool,
    /// `rms_norm_eps`.
    pub eps: f32,
}

/// Feeds `t` new attention inputs `h` `[t, D]`; emits the entries of the windows they complete.
pub fn update(
    w: &CompressorWeights<'_>,
    dims: &CompDims,
    rope: &Rope,
    h: &[f32],
    t: usize,
    st: &mut CompState,
) {
    let kv = linear(&w.kv, h, t);
    let gate = linear(&w.gate, h, t);
    st.buffer_kv.extend_from_slice(&kv);
    st.buffer_gate.extend_from_slice(&gate);
    let width = w.kv.rows();
    let (rate, hd) = (dims.rate, dims.head);
    while st.buffer_kv.len() >= rate * width {
        let win_kv: Vec<f32> = st.buffer_kv.drain(..rate * width).collect();
        let mut win_gate: Vec<f32> = st.buffer_gate.drain(..rate * width).collect();
        for (g, a) in win_gate.iter_mut().zip(&w.position_bias) {
            *g += a;
        }
        // Slots as (kv row, gate row) slices of width `hd`.
        let mut slots: Vec<(&[f32], &[f32])> = Vec::with_capacity(2 * rate);
        let (prev_kv, prev_gate) = (
            std::mem::take(&mut st.overlap_kv),
            std::mem::take(&mut st.overlap_gate),
        );
        if dims.overlap {
            for j in 0..prev_kv.len() / hd {
                slots.push((
                    &prev_kv[j * hd..(j + 1) * hd],
                    &prev_gate[j * hd..(j + 1) * hd],
                ));
            }
        }
        let off = if dims.overlap { hd } else { 0 };
        for j in 0..rate {
            let at = j * width + off;
            slots.push((&win_kv[at..at + hd], &win_gate[at..at + hd]));
        }
        let mut entry = pool(&slots, hd);
        if dims.overlap {
            let mut ov_kv = Vec::with_capacity(rate * hd);
            let mut ov_gate = Vec::with_capacity(rate * hd);
            for j in 0..rate {
                ov_kv.extend_from_slice(&win_kv[j * width..j * width + hd]);
                ov_gate.extend_from_slice(&win_gate[j * width..j * width + hd]);
            }
            st.overlap_kv = ov_kv;
            st.overlap_gate = ov_gate;
        }
        rms_norm(&mut entry, &w.norm, dims.eps);
        let count = st.compressed_kv.len() / hd;
        let (cos, sin) = rope.at(count * rate);
        rope_tail(&mut entry, &cos, &sin, false);
        st.compressed_kv.extend_from_slice(&entry);
    }
}

/// The gated pooling of one window: per channel, `sum_slots softmax_slots(gate) * kv` over the
/// `(kv, gate)` slot rows (each `hd` wide).
pub fn pool(slots: &[(&[f32], &[f32])], hd: usize) -> Vec<f32> {
    let mut entry = vec![0f32; hd];
    for (ch, e) in entry.iter_mut().enumerate() {
        let m = slots
            .iter()
            .map(|s| s.1[ch])
            .fold(f32::NEG_INFINITY, f32::max);
        let z: f32 = slots.iter().map(|(_, g)| (g[ch] - m).exp()).sum();
        // `kv * softmax(gate)` summed: each weight normalised first, as the reference does.
        *e = slots
            .iter()
            .map(|(k, g)| (g[ch] - m).exp() / z * k[ch])
            .sum();
    }
    entry
}

/// Entries a query at position `p` may see: those of windows complete at `p`.
pub fn visible(p: usize, rate: usize) -> usize {
    (p + 1) / rate
}
