//! Per-sequence state: for every layer the sliding-window K = V latents, the compressor's
//! buffer / overlap / compressed entries and the indexer's (whose entries are the indexer keys).
//! `Clone` is the snapshot: a restored state is exactly the state before the extra tokens.

use crate::attention::AttnState;
use crate::config::DeepseekV4Config;

/// Everything one sequence carries between forwards.
#[derive(Debug, Clone)]
pub struct SeqState {
    /// Tokens seen so far (the next position).
    pub pos: usize,
    /// Per layer.
    pub layers: Vec<AttnState>,
}

impl SeqState {
    /// An empty sequence.
    pub fn new(c: &DeepseekV4Config) -> SeqState {
        SeqState {
            pos: 0,
            layers: vec![AttnState::default(); c.num_hidden_layers],
        }
    }

    /// A copy to roll back to.
    pub fn snapshot(&self) -> SeqState {
        self.clone()
    }

    /// Rolls back to `snap`.
    pub fn restore(&mut self, snap: &SeqState) {
        *self = snap.clone();
    }
}
