//! One engine code path over every architecture: [`AnyModel`] binds the model a CMF header names
//! (`qwen4_exp` -> model-qwen4, `deepseek_v4` -> model-dsv4) and [`AnyState`] is its sequence
//! state; `cortiq logits` and `cortiq run` only talk to these.

use cmf_format::Cmf;

/// Why a CMF could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// No model crate for this architecture.
    #[error("unsupported architecture `{0}` (this engine runs qwen4_exp and deepseek_v4)")]
    Architecture(String),
    /// A qwen4_exp model whose config or tensors are unusable.
    #[error(transparent)]
    Qwen4(#[from] model_qwen4::WeightError),
    /// A deepseek_v4 model whose config or tensors are unusable.
    #[error(transparent)]
    Dsv4(#[from] model_dsv4::WeightError),
}

/// Why a forward refused its input.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// From model-qwen4.
    #[error(transparent)]
    Qwen4(#[from] model_qwen4::ForwardError),
    /// From model-dsv4.
    #[error(transparent)]
    Dsv4(#[from] model_dsv4::ForwardError),
    /// A state made by one architecture handed to another.
    #[error("the sequence state belongs to a different architecture")]
    StateMismatch,
}

/// A bound model of any supported architecture.
pub enum AnyModel<'a> {
    /// Qwen3.8-Flash-Next.
    Qwen4(model_qwen4::Model<'a>),
    /// DeepSeek-V4-Flash.
    Dsv4(model_dsv4::Model<'a>),
}

/// The sequence state of an [`AnyModel`]; `Clone` is the snapshot.
#[derive(Debug, Clone)]
pub enum AnyState {
    /// For [`AnyModel::Qwen4`].
    Qwen4(model_qwen4::SeqState),
    /// For [`AnyModel::Dsv4`].
    Dsv4(model_dsv4::SeqState),
}

impl<'a> AnyModel<'a> {
    /// Binds the model the header's `architecture` names.
    pub fn bind(cmf: &'a Cmf) -> Result<AnyModel<'a>, BindError> {
        match cmf.header().architecture.as_str() {
            "qwen4_exp" => {
                let (c, w) = model_qwen4::Weights::bind(cmf)?;
                Ok(AnyModel::Qwen4(model_qwen4::Model::new(c, w)))
            }
            "deepseek_v4" => {
                let (c, w) = model_dsv4::Weights::bind(cmf)?;
                Ok(AnyModel::Dsv4(model_dsv4::Model::new(c, w)))
            }
            other => Err(BindError::Architecture(other.to_string())),
        }
    }

    /// Vocabulary size (width of a logits row).
    pub fn vocab_size(&self) -> usize {
        match self {
            AnyModel::Qwen4(m) => m.config.vocab_size,
            AnyModel::Dsv4(m) => m.config.vocab_size,
        }
    }

    /// An empty sequence for this model.
    pub fn new_state(&self) -> AnyState {
        match self {
            AnyModel::Qwen4(m) => AnyState::Qwen4(model_qwen4::SeqState::new(&m.config)),
            AnyModel::Dsv4(m) => AnyState::Dsv4(model_dsv4::SeqState::new(&m.config)),
        }
    }

    /// Feeds `tokens` after whatever `st` holds; returns their logits `[T, vocab]`.
    pub fn forward(&self, tokens: &[u32], st: &mut AnyState) -> Result<Vec<f32>, ForwardError> {
        match (self, st) {
            (AnyModel::Qwen4(m), AnyState::Qwen4(s)) => Ok(m.forward(tokens, s)?),
            (AnyModel::Dsv4(m), AnyState::Dsv4(s)) => Ok(m.forward(tokens, s)?),
            _ => Err(ForwardError::StateMismatch),
        }
    }

    /// Feeds `tokens` after whatever `st` holds; returns the logits `[vocab]` of the last one
    /// (what sampling needs: the lm_head rows nobody reads are skipped).
    pub fn forward_last(
        &self,
        tokens: &[u32],
        st: &mut AnyState,
    ) -> Result<Vec<f32>, ForwardError> {
        match (self, st) {
            (AnyModel::Qwen4(m), AnyState::Qwen4(s)) => Ok(m.forward_last(tokens, s)?),
            (AnyModel::Dsv4(m), AnyState::Dsv4(s)) => Ok(m.forward_last(tokens, s)?),
            _ => Err(ForwardError::StateMismatch),
        }
    }

    /// Logits `[T, vocab]` of every position of `tokens`, from an empty sequence.
    pub fn forward_prefill(&self, tokens: &[u32]) -> Result<Vec<f32>, ForwardError> {
        self.forward(tokens, &mut self.new_state())
    }
}
