//! Per-sequence state: the KV + raw indexer keys of attention layers, the GDN conv ring and
//! recurrent state, the PLE conv history and n-gram context. `Clone` is the snapshot.

use crate::config::{LayerType, Qwen4ExpTextConfig};
use crate::gdn::GdnState;
use crate::qsa::AttnState;

/// The cache of one layer.
#[derive(Debug, Clone)]
pub enum LayerState {
    /// GDN conv ring + recurrent state.
    Gdn(GdnState),
    /// KV + raw indexer keys.
    Attn(AttnState),
}

/// Everything one sequence carries between forwards.
#[derive(Debug, Clone)]
pub struct SeqState {
    /// Tokens seen so far (the next position).
    pub pos: usize,
    /// Per layer.
    pub layers: Vec<LayerState>,
    /// Per layer: the PLE dilated-conv history (empty when the layer has no PLE or at start).
    pub ple_conv: Vec<Vec<f32>>,
    /// The last `ngram_size - 1` token ids (EOS-padded at the start).
    pub ngram_ctx: Vec<i64>,
}

impl SeqState {
    /// An empty sequence.
    pub fn new(c: &Qwen4ExpTextConfig) -> SeqState {
        let layers = (0..c.num_hidden_layers)
            .map(|il| match c.layer_type(il) {
                LayerType::LinearAttention => LayerState::Gdn(GdnState::default()),
                LayerType::IndexedAttention => LayerState::Attn(AttnState::default()),
            })
            .collect();
        let eos = c.eos_id().unwrap_or(0);
        SeqState {
            pos: 0,
            layers,
            ple_conv: vec![Vec::new(); c.num_hidden_layers],
            ngram_ctx: vec![eos; c.ngram_size.saturating_sub(1)],
        }
    }

    /// Host memory the caches take (what a prompt cache entry of this state costs).
    pub fn bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Gdn(g) => g.conv.len() + g.s.len(),
                LayerState::Attn(a) => a.k.len() + a.v.len() + a.raw.len() + a.block_keys.len(),
            })
            .sum();
        let ple: usize = self.ple_conv.iter().map(Vec::len).sum();
        4 * (layers + ple) + 8 * self.ngram_ctx.len()
    }

    /// What a rollback to the current position needs: the recurrent parts (GDN, PLE conv,
    /// n-gram context) and the position; the attention caches are cut back instead.
    pub fn recurrent(&self) -> Recurrent {
        Recurrent {
            pos: self.pos,
            gdn: self
                .layers
                .iter()
                .map(|l| match l {
                    LayerState::Gdn(g) => Some(g.clone()),
                    LayerState::Attn(_) => None,
                })
                .collect(),
            ple_conv: self.ple_conv.clone(),
            ngram_ctx: self.ngram_ctx.clone(),
        }
    }

    /// Returns to the position `snap` was taken at (from this state or an ancestor at that
    /// position): its recurrent parts back, every attention cache cut to its position.
    pub fn rollback(&mut self, c: &Qwen4ExpTextConfig, snap: &Recurrent) {
        for (l, g) in self.layers.iter_mut().zip(&snap.gdn) {
            match (l, g) {
                (LayerState::Gdn(s), Some(g)) => s.clone_from(g),
                (LayerState::Attn(a), None) => crate::qsa::truncate(c, a, snap.pos),
                _ => unreachable!("a snapshot of this sequence"),
            }
        }
        self.ple_conv.clone_from(&snap.ple_conv);
        self.ngram_ctx.clone_from(&snap.ngram_ctx);
        self.pos = snap.pos;
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

/// The recurrent part of a [`SeqState`] at one position ([`SeqState::recurrent`]): what a
/// rollback restores (attention caches are cut back to its position instead of copied).
#[derive(Debug, Clone)]
pub struct Recurrent {
    /// The position.
    pub pos: usize,
    /// Per layer: the GDN state (`None` for attention layers).
    pub gdn: Vec<Option<GdnState>>,
    ple_conv: Vec<Vec<f32>>,
    ngram_ctx: Vec<i64>,
}
