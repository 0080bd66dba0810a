//! `cortiq run`: tokenise a prompt with the model's embedded tokenizer, prefill it, then
//! sample and feed one token at a time until EOS or the token limit, handing each token to the
//! caller (who streams its text).

use std::time::Instant;

use cmf_format::{Cmf, CmfError};

use crate::model::{AnyModel, BindError, ForwardError};
use crate::sampling::{Sampler, Sampling};

/// Why generation could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The file does not open.
    #[error(transparent)]
    Open(#[from] CmfError),
    /// Not a model this engine runs.
    #[error(transparent)]
    Weights(#[from] BindError),
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
}

/// A loaded model with its tokenizer.
pub struct Runner<'a> {
    /// The forward pass.
    pub model: AnyModel<'a>,
    /// The embedded tokenizer.
    pub tokenizer: tokenizers::Tokenizer,
    /// Token ids that end generation.
    pub eos: Vec<u32>,
}

/// What one generation did.
#[derive(Debug, Clone)]
pub struct Generation {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// The generated ids (the EOS that stopped it included).
    pub tokens: Vec<u32>,
    /// Seconds spent on the prompt (prefill and the first sample).
    pub prompt_seconds: f64,
    /// Seconds spent generating after the prompt.
    pub gen_seconds: f64,
    /// Whether an EOS token ended it.
    pub stopped_at_eos: bool,
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    match v {
        serde_json::Value::Number(n) => n.as_u64().map(|i| vec![i as u32]).unwrap_or_default(),
        serde_json::Value::Array(a) => a.iter().flat_map(ids).collect(),
        _ => Vec::new(),
    }
}

impl<'a> Runner<'a> {
    /// Binds the model in `cmf` and its embedded tokenizer; EOS ids come from the generation
    /// defaults, else the config.
    pub fn new(cmf: &'a Cmf) -> Result<Runner<'a>, RunError> {
        let file = cmf.display_path().display().to_string();
        let h = cmf.header();
        let tok_json = h.tokenizer.as_ref().ok_or_else(|| RunError::Tokenizer {
            file: file.clone(),
            message: "none embedded (convert from a checkpoint with tokenizer.json)".into(),
        })?;
        let tokenizer = tok_json
            .to_string()
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| RunError::Tokenizer {
                file: file.clone(),
                message: e.to_string(),
            })?;
        let model = AnyModel::bind(cmf)?;
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
        Ok(Runner {
            model,
            tokenizer,
            eos,
        })
    }

    /// The prompt's ids (special tokens as the tokenizer's post-processor adds them).
    pub fn encode(&self, prompt: &str) -> Result<Vec<u32>, RunError> {
        let enc = self
            .tokenizer
            .encode(prompt, true)
            .map_err(|e| RunError::Tokenizer {
                file: String::new(),
                message: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Generates up to `max_new` tokens after `prompt`, calling `on_token` with each.
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new: usize,
        sampling: Sampling,
        on_token: &mut dyn FnMut(u32),
    ) -> Result<Generation, RunError> {
        if prompt.is_empty() {
            return Err(RunError::EmptyPrompt);
        }
        let mut sampler = Sampler::new(sampling);
        let mut st = self.model.new_state();
        let t0 = Instant::now();
        let logits = self.model.forward_last(prompt, &mut st)?;
        let mut next = sampler.sample(&logits);
        let prompt_seconds = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut tokens = Vec::new();
        let mut stopped_at_eos = false;
        while tokens.len() < max_new {
            tokens.push(next);
            on_token(next);
            if self.eos.contains(&next) {
                stopped_at_eos = true;
                break;
            }
            if tokens.len() == max_new {
                break;
            }
            let logits = self.model.forward(&[next], &mut st)?;
            next = sampler.sample(&logits);
        }
        Ok(Generation {
            prompt: prompt.to_vec(),
            tokens,
            prompt_seconds,
            gen_seconds: t1.elapsed().as_secs_f64(),
            stopped_at_eos,
        })
    }
}

/// Turns a growing list of token ids into text pieces to print: a piece is released only when
/// the decoded text does not end inside a UTF-8 sequence (byte-level tokens can split one).
pub struct TextStream<'t> {
    tokenizer: &'t tokenizers::Tokenizer,
    ids: Vec<u32>,
    printed: usize,
}

impl<'t> TextStream<'t> {
    /// An empty stream.
    pub fn new(tokenizer: &'t tokenizers::Tokenizer) -> Self {
        TextStream {
            tokenizer,
            ids: Vec::new(),
            printed: 0,
        }
    }

    /// Adds a token; returns the new text that is complete, if any.
    pub fn push(&mut self, id: u32) -> Option<String> {
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids, true).ok()?;
        if text.ends_with('\u{FFFD}')
            || text.len() <= self.printed
            || !text.is_char_boundary(self.printed)
        {
            return None;
        }
        let piece = text[self.printed..].to_string();
        self.printed = text.len();
        Some(piece)
    }
}
