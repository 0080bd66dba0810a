//! Per-sequence state: for every layer the sliding-window K = V latents, the compressor's
//! buffer / overlap / compressed entries and the indexer's (whose entries are the indexer keys).
//! `Clone` is the snapshot: a restored state is exactly the state before the extra tokens.
//!
//! A state records the geometry it was made for ([`StateShape`]); every forward checks it and
//! the cache sizes against the model, so a state from another model (or one edited by hand) is
//! a [`crate::ForwardError::StateMismatch`] instead of an out-of-bounds panic in attention.

use crate::attention::AttnState;
use crate::config::{AttnKind, DeepseekV4Config};

/// The geometry that sizes a state's caches.
#[derive(Debug, Clone, PartialEq)]
pub struct StateShape {
    /// `head_dim` (window latents and compressed entries).
    pub head_dim: usize,
    /// `index_head_dim` (indexer keys).
    pub index_head_dim: usize,
    /// `sliding_window`.
    pub sliding_window: usize,
    /// Per layer: its attention kind and compression rate (0 for sliding layers).
    pub layers: Vec<(AttnKind, usize)>,
}

impl StateShape {
    /// The geometry of `c`.
    pub fn of(c: &DeepseekV4Config) -> StateShape {
        StateShape {
            head_dim: c.head_dim,
            index_head_dim: c.index_head_dim,
            sliding_window: c.sliding_window,
            layers: (0..c.num_hidden_layers)
                .map(|il| {
                    let kind = c.attn_kind(il);
                    (kind, c.rate(kind).unwrap_or(0))
                })
                .collect(),
        }
    }
}

/// Everything one sequence carries between forwards.
#[derive(Debug, Clone)]
pub struct SeqState {
    /// Tokens seen so far (the next position).
    pub pos: usize,
    /// Per layer.
    pub layers: Vec<AttnState>,
    shape: StateShape,
}

impl SeqState {
    /// An empty sequence.
    pub fn new(c: &DeepseekV4Config) -> SeqState {
        SeqState {
            pos: 0,
            layers: vec![AttnState::default(); c.num_hidden_layers],
            shape: StateShape::of(c),
        }
    }

    /// Host memory the caches take (what a prompt cache entry of this state costs).
    pub fn bytes(&self) -> usize {
        let comp = |c: &crate::compressor::CompState| {
            c.buffer_kv.len()
                + c.buffer_gate.len()
                + c.overlap_kv.len()
                + c.overlap_gate.len()
                + c.compressed_kv.len()
        };
        4 * self
            .layers
            .iter()
            .map(|l| l.window.len() + comp(&l.comp) + comp(&l.index))
            .sum::<usize>()
    }

    /// The geometry this state was made for.
    pub fn shape(&self) -> &StateShape {
        &self.shape
    }

    /// A copy to roll back to.
    pub fn snapshot(&self) -> SeqState {
        self.clone()
    }

    /// Rolls back to `snap`.
    pub fn restore(&mut self, snap: &SeqState) {
        *self = snap.clone();
    }

    /// Why this state cannot continue under `c`, if it cannot: another geometry, or caches
    /// whose sizes do not follow from `pos` (what the forward's slicing relies on).
    pub fn mismatch(&self, c: &DeepseekV4Config) -> Option<String> {
        let want = StateShape::of(c);
        if self.shape != want {
            return Some(format!("made for {:?}, the model is {want:?}", self.shape));
        }
        if self.layers.len() != want.layers.len() {
            return Some(format!(
                "{} layers, the model has {}",
                self.layers.len(),
                want.layers.len()
            ));
        }
        let (p, dh, di) = (self.pos, want.head_dim, want.index_head_dim);
        let window = p.min(want.sliding_window - 1) * dh;
        for (il, (st, &(kind, rate))) in self.layers.iter().zip(&want.layers).enumerate() {
            let empty = |s: &crate::compressor::CompState| {
                s.buffer_kv.is_empty()
                    && s.buffer_gate.is_empty()
                    && s.overlap_kv.is_empty()
                    && s.overlap_gate.is_empty()
                    && s.compressed_kv.is_empty()
            };
            let comp = |s: &crate::compressor::CompState, width: usize, head: usize, overlap| {
                let (done, tail) = (p / rate, p % rate);
                let ov = if overlap && done > 0 { rate * head } else { 0 };
                s.compressed_kv.len() == done * head
                    && s.buffer_kv.len() == tail * width
                    && s.buffer_gate.len() == tail * width
                    && s.overlap_kv.len() == ov
                    && s.overlap_gate.len() == ov
            };
            let ok = st.window.len() == window
                && match kind {
                    AttnKind::Sliding => empty(&st.comp) && empty(&st.index),
                    AttnKind::Hca => comp(&st.comp, dh, dh, false) && empty(&st.index),
                    AttnKind::Csa => {
                        comp(&st.comp, 2 * dh, dh, true) && comp(&st.index, 2 * di, di, true)
                    }
                };
            if !ok {
                return Some(format!(
                    "layer {il}'s caches do not match {p} tokens of a {kind:?} layer"
                ));
            }
        }
        None
    }
}
