//! Per-sequence state of a V4.1 model: every layer's sliding window of K = V latents (FP8
//! fake-quantised, as the reference caches them); on a KV source the compressor's incomplete
//! group, its compressed entries and (on an index source) the indexer keys, which the layers of
//! its group read; the Engram n-gram look-back. `Clone` is the snapshot.
//!
//! A state records the geometry it was made for; every forward checks it and the cache sizes
//! against the model, so a state from another model is a
//! [`crate::v41::ForwardError::StateMismatch`] instead of an out-of-bounds panic.

use crate::config_v41::{DeepseekV41Config, IndexRole, KvRole, LayerRole};
use crate::engram::{EngramHasher, NgramContext};

/// The compressed branch a KV source owns (`DeepseekV41CSACache`'s group state).
#[derive(Debug, Clone, Default)]
pub struct SharedKv {
    /// `kv_proj` rows of the incomplete group `[n < ratio, Dh]`.
    pub buffer_kv: Vec<f32>,
    /// `gate_proj` rows of the incomplete group `[n, Dh]` (ratio > 1).
    pub buffer_gate: Vec<f32>,
    /// Compressed entries, rotated and FP4 fake-quantised `[groups, Dh]`.
    pub entries: Vec<f32>,
    /// Indexer keys, rotated and FP4 fake-quantised `[groups, dI]` (index sources).
    pub index_keys: Vec<f32>,
}

/// One layer's cache.
#[derive(Debug, Clone, Default)]
pub struct LayerState {
    /// K = V latents of the last `min(pos, sliding_window - 1)` positions `[n, Dh]`.
    pub window: Vec<f32>,
    /// The compressed branch (empty unless the layer is a KV source).
    pub kv: SharedKv,
}

/// The geometry that sizes a state's caches.
#[derive(Debug, Clone, PartialEq)]
pub struct StateShape {
    /// `head_dim`.
    pub head_dim: usize,
    /// `index_head_dim`.
    pub index_head_dim: usize,
    /// `sliding_window`.
    pub sliding_window: usize,
    /// Every layer's role.
    pub roles: Vec<LayerRole>,
}

impl StateShape {
    /// The geometry of `c`.
    pub fn of(c: &DeepseekV41Config) -> StateShape {
        StateShape {
            head_dim: c.head_dim,
            index_head_dim: c.index_head_dim,
            sliding_window: c.sliding_window,
            roles: c.roles().to_vec(),
        }
    }
}

/// Everything one sequence carries between forwards.
#[derive(Debug, Clone)]
pub struct SeqState {
    /// Tokens seen so far (the next position).
    pub pos: usize,
    /// Per layer.
    pub layers: Vec<LayerState>,
    /// The Engram look-back (models with Engram layers).
    pub ngram: Option<NgramContext>,
    shape: StateShape,
}

impl SeqState {
    /// An empty sequence.
    pub fn new(c: &DeepseekV41Config, hasher: Option<&EngramHasher>) -> SeqState {
        SeqState {
            pos: 0,
            layers: vec![LayerState::default(); c.num_hidden_layers],
            ngram: hasher.map(EngramHasher::new_context),
            shape: StateShape::of(c),
        }
    }

    /// Host memory the caches take.
    pub fn bytes(&self) -> usize {
        4 * self
            .layers
            .iter()
            .map(|l| {
                l.window.len()
                    + l.kv.buffer_kv.len()
                    + l.kv.buffer_gate.len()
                    + l.kv.entries.len()
                    + l.kv.index_keys.len()
            })
            .sum::<usize>()
    }

    /// The geometry this state was made for.
    pub fn shape(&self) -> &StateShape {
        &self.shape
    }

    /// Why this state cannot continue under `c`, if it cannot: another geometry, or caches
    /// whose sizes do not follow from `pos`.
    pub fn mismatch(&self, c: &DeepseekV41Config, has_hasher: bool) -> Option<String> {
        let want = StateShape::of(c);
        if self.shape != want {
            return Some(format!("made for {:?}, the model is {want:?}", self.shape));
        }
        if self.layers.len() != want.roles.len() {
            return Some(format!(
                "{} layers, the model has {}",
                self.layers.len(),
                want.roles.len()
            ));
        }
        if self.ngram.is_some() != has_hasher {
            return Some("the Engram look-back does not match the model's Engram layers".into());
        }
        let (p, dh, di) = (self.pos, want.head_dim, want.index_head_dim);
        let window = p.min(want.sliding_window - 1) * dh;
        for (il, (st, role)) in self.layers.iter().zip(&want.roles).enumerate() {
            let kv = &st.kv;
            let ok = st.window.len() == window
                && match role.kv {
                    KvRole::Source => {
                        let ratio = role.compress_ratio;
                        let (done, tail) = (p / ratio, p % ratio);
                        let keys = if role.index == IndexRole::Source {
                            done * di
                        } else {
                            0
                        };
                        let gate = if ratio > 1 { tail * dh } else { 0 };
                        kv.entries.len() == done * dh
                            && kv.buffer_kv.len() == tail * dh
                            && kv.buffer_gate.len() == gate
                            && kv.index_keys.len() == keys
                    }
                    _ => {
                        kv.entries.is_empty()
                            && kv.buffer_kv.is_empty()
                            && kv.buffer_gate.is_empty()
                            && kv.index_keys.is_empty()
                    }
                };
            if !ok {
                return Some(format!(
                    "layer {il}'s caches do not match {p} tokens of a {} layer",
                    role.layer_type()
                ));
            }
        }
        None
    }
}
