//! [`CausalLm`]: what every architecture's forward offers, so the engine, the test harnesses
//! and (later) a GPU forward talk to one interface. A model implements [`CausalLm::run`]; the
//! entry points everyone calls are provided on top of it, once.

use crate::input::InputError;
use crate::trace::Trace;

/// A causal language model over a per-sequence state.
pub trait CausalLm {
    /// The per-sequence state (KV caches, recurrent state, ...); `Clone` is its snapshot.
    type State: Clone;
    /// Why a forward refused its input.
    type Error: From<InputError> + std::error::Error;

    /// Width of a logits row.
    fn vocab_size(&self) -> usize;

    /// An empty sequence.
    fn new_state(&self) -> Self::State;

    /// Feeds `tokens` after whatever `st` holds, reporting every named intermediate to `trace`;
    /// returns the logits of every position `[T, vocab]`, or of the last only `[vocab]` when
    /// `last_only` (the lm_head rows nobody reads are skipped).
    fn run(
        &self,
        tokens: &[u32],
        st: &mut Self::State,
        trace: &mut Trace<'_>,
        last_only: bool,
    ) -> Result<Vec<f32>, Self::Error>;

    /// Feeds `tokens` after whatever `st` holds; returns their logits `[T, vocab]`.
    fn forward(&self, tokens: &[u32], st: &mut Self::State) -> Result<Vec<f32>, Self::Error> {
        self.run(tokens, st, &mut |_, _, _| {}, false)
    }

    /// Feeds `tokens` after whatever `st` holds; returns the logits `[vocab]` of the last one
    /// only. What generation needs: the lm_head (vocab x hidden, the largest matrix) then runs
    /// once per call instead of once per prompt token.
    fn forward_last(&self, tokens: &[u32], st: &mut Self::State) -> Result<Vec<f32>, Self::Error> {
        self.run(tokens, st, &mut |_, _, _| {}, true)
    }

    /// [`Self::forward`], reporting every named intermediate to `trace`.
    fn forward_traced(
        &self,
        tokens: &[u32],
        st: &mut Self::State,
        trace: &mut Trace<'_>,
    ) -> Result<Vec<f32>, Self::Error> {
        self.run(tokens, st, trace, false)
    }

    /// Logits `[T, vocab]` of every position of `tokens`, from an empty sequence.
    fn forward_prefill(&self, tokens: &[u32]) -> Result<Vec<f32>, Self::Error> {
        self.forward(tokens, &mut self.new_state())
    }
}
