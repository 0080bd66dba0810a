//! `cortiq run`: a loaded model with its embedded tokenizer ([`Runner`]), the prompt
//! tokenised and handed to the one generation loop ([`crate::generate`]).

use std::path::Path;
use std::sync::Arc;

use cmf_format::{Cmf, CmfError};

use crate::generate::{Event, GenerateOptions, Generation};
use crate::model::{ForwardError, LoadError, LoadedModel};
use crate::sampling::{Sampler, Sampling};

/// Why generation could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The file does not open.
    #[error(transparent)]
    Open(#[from] CmfError),
    /// Not a model this engine runs, or its config or tensors are unusable (names the file).
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The forward pass refused its input.
    #[error(transparent)]
    Forward(#[from] ForwardError),
    /// The file embeds no tokenizer, or a broken one.
    #[error("{file}: tokenizer: {message}")]
    Tokenizer {
        /// The model file.
        file: String,
        /// What is wrong.
        message: String,
    },
    /// The prompt tokenised to nothing.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A tensor failed its checksum.
    #[error(transparent)]
    Corrupt(#[from] crate::integrity::IntegrityError),
    /// `--mtp` asked for drafting the model or backend cannot do.
    #[error("--mtp: {0}")]
    Mtp(String),
}

impl From<model_qwen4::ForwardError> for RunError {
    fn from(e: model_qwen4::ForwardError) -> RunError {
        RunError::Forward(e.into())
    }
}

/// A loaded model with its tokenizer and EOS ids: owns (an `Arc` of) the model, so it is
/// `Send + Sync` and can be shared by threads that each drive their own sequence.
#[derive(Debug, Clone)]
pub struct Runner {
    /// The model and its file.
    pub model: Arc<LoadedModel>,
    /// The embedded tokenizer.
    pub tokenizer: tokenizers::Tokenizer,
    /// Token ids that end generation.
    pub eos: Vec<u32>,
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    match v {
        serde_json::Value::Number(n) => n.as_u64().map(|i| vec![i as u32]).unwrap_or_default(),
        serde_json::Value::Array(a) => a.iter().flat_map(ids).collect(),
        _ => Vec::new(),
    }
}

impl Runner {
    /// Opens and binds the CMF at `path` with its embedded tokenizer.
    pub fn open(path: &Path) -> Result<Runner, RunError> {
        Self::from_cmf(Cmf::open(path)?)
    }

    /// Binds the model in `cmf` (taking the file) with its embedded tokenizer, on the CPU.
    pub fn from_cmf(cmf: Cmf) -> Result<Runner, RunError> {
        Self::from_cmf_on(cmf, &crate::model::Placement::cpu())
    }

    /// [`Runner::open`] with the model placed as `place` asks.
    pub fn open_on(path: &Path, place: &crate::model::Placement) -> Result<Runner, RunError> {
        Self::from_cmf_on(Cmf::open(path)?, place)
    }

    /// [`Runner::from_cmf`] with the model placed as `place` asks.
    pub fn from_cmf_on(cmf: Cmf, place: &crate::model::Placement) -> Result<Runner, RunError> {
        // The tokenizer is checked first: a file without one is refused before binding.
        let tokenizer = tokenizer_of(&cmf)?;
        Ok(Self::with_tokenizer(
            Arc::new(LoadedModel::new_on(cmf, place)?),
            tokenizer,
        ))
    }

    /// The runner of a loaded model; EOS ids come from the generation defaults, else the
    /// config.
    pub fn new(model: Arc<LoadedModel>) -> Result<Runner, RunError> {
        let tokenizer = tokenizer_of(model.cmf())?;
        Ok(Self::with_tokenizer(model, tokenizer))
    }

    fn with_tokenizer(model: Arc<LoadedModel>, tokenizer: tokenizers::Tokenizer) -> Runner {
        crate::integrity::Integrity::start(&model);
        let h = model.cmf().header();
        let mut eos = h
            .generation
            .as_ref()
            .and_then(|g| g.get("eos_token_id"))
            .map(ids)
            .unwrap_or_default();
        if eos.is_empty() {
            // The config's `eos_token_id` (one id or a list; qwen4_exp and deepseek_v4 alike).
            eos = h.config.get("eos_token_id").map(ids).unwrap_or_default();
        }
        Runner {
            model,
            tokenizer,
            eos,
        }
    }

    /// The model's context length (`max_position_embeddings` of its config), if it states one.
    pub fn context_length(&self) -> Option<usize> {
        context_length_of(self.model.cmf())
    }

    /// The model's own sampling settings (its generation defaults).
    pub fn generation_defaults(&self) -> crate::sampling::GenerationDefaults {
        crate::sampling::GenerationDefaults::from_json(
            self.model.cmf().header().generation.as_ref(),
        )
    }

    /// The prompt's ids (special tokens as the tokenizer's post-processor adds them).
    pub fn encode(&self, prompt: &str) -> Result<Vec<u32>, RunError> {
        let enc = self
            .tokenizer
            .encode(prompt, true)
            .map_err(|e| RunError::Tokenizer {
                file: self.model.cmf().display_path().display().to_string(),
                message: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Generates up to `max_new` tokens after `prompt` from an empty sequence, calling
    /// `on_token` with each (the generation loop with no stop strings).
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new: usize,
        sampling: Sampling,
        on_token: &mut dyn FnMut(u32),
    ) -> Result<Generation, RunError> {
        let mut state = self.model.model().new_state();
        self.complete(
            &mut state,
            prompt,
            &mut Sampler::new(sampling),
            &GenerateOptions::new(max_new),
            &mut |e| {
                if let Event::Token(id) = e {
                    on_token(id);
                }
            },
        )
    }
}

/// The tokenizer embedded in `cmf`.
fn tokenizer_of(cmf: &Cmf) -> Result<tokenizers::Tokenizer, RunError> {
    let file = cmf.display_path().display().to_string();
    let tok_json = cmf
        .header()
        .tokenizer
        .as_ref()
        .ok_or_else(|| RunError::Tokenizer {
            file: file.clone(),
            message: "none embedded (convert from a checkpoint with tokenizer.json)".into(),
        })?;
    tok_json
        .to_string()
        .parse::<tokenizers::Tokenizer>()
        .map_err(|e| RunError::Tokenizer {
            file,
            message: e.to_string(),
        })
}

/// The context length a model file's config declares (`max_position_embeddings`).
pub fn context_length_of(cmf: &Cmf) -> Option<usize> {
    cmf.header()
        .config
        .get("max_position_embeddings")
        .and_then(serde_json::Value::as_u64)
        .map(|n| n as usize)
}

#[cfg(test)]
mod tests {
    /// A server hands one runner to many threads.
    #[test]
    fn runner_is_shareable_across_threads() {
        fn shareable<T: Send + Sync + 'static>() {}
        shareable::<super::Runner>();
        shareable::<crate::model::LoadedModel>();
    }
}
