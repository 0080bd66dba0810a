//! One engine code path over every architecture: [`AnyModel`] binds the model a CMF header names
//! (`qwen4_exp` -> model-qwen4, `deepseek_v4` -> model-dsv4) and [`AnyState`] is its sequence
//! state; every command only talks to these. [`LoadedModel`] owns the file and the model bound
//! to it, so one loaded model can be shared across threads (`Arc<LoadedModel>`) by the
//! generation loop, a server's requests and a speculative drafter alike.

use std::path::Path;

use cmf_format::{Cmf, CmfError};
use model_core::CausalLm;

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

self_cell::self_cell!(
    /// The file and the model borrowing its mapped bytes, kept together.
    struct Bound {
        owner: Cmf,
        #[covariant]
        dependent: AnyModel,
    }
);

/// Why a model file could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file does not open or validate.
    #[error(transparent)]
    Open(#[from] CmfError),
    /// Not a model this engine runs, or its config or tensors are unusable.
    #[error("{file}: {source}")]
    Bind {
        /// The model file.
        file: String,
        /// What is wrong.
        source: BindError,
    },
}

impl LoadError {
    /// `source` from binding the model in `cmf`.
    pub fn bind(cmf: &Cmf, source: BindError) -> LoadError {
        LoadError::Bind {
            file: cmf.display_path().display().to_string(),
            source,
        }
    }
}

/// A CMF file and its bound model, owned together: `Send + Sync`, so an `Arc<LoadedModel>` is
/// shared across threads (the mapped weights are read-only; each sequence has its own
/// [`AnyState`]).
pub struct LoadedModel {
    bound: Bound,
    integrity: crate::integrity::Integrity,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("cmf", self.cmf())
            .finish()
    }
}

impl LoadedModel {
    /// Binds the model in `cmf`, taking ownership of the file.
    pub fn new(cmf: Cmf) -> Result<LoadedModel, LoadError> {
        Ok(LoadedModel {
            bound: Bound::try_new(cmf, |c| {
                AnyModel::bind(c).map_err(|e| LoadError::bind(c, e))
            })?,
            integrity: Default::default(),
        })
    }

    /// Opens (memory-maps) and binds the CMF at `path`.
    pub fn open(path: &Path) -> Result<LoadedModel, LoadError> {
        Self::new(Cmf::open(path)?)
    }

    /// The file.
    pub fn cmf(&self) -> &Cmf {
        self.bound.borrow_owner()
    }

    /// The bound model.
    pub fn model(&self) -> &AnyModel<'_> {
        self.bound.borrow_dependent()
    }

    /// The tensor checksum check of this model ([`crate::integrity`]).
    pub fn integrity(&self) -> &crate::integrity::Integrity {
        &self.integrity
    }
}
