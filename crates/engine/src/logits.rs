//! `cortiq logits`: float32 logits `[T, vocab]` of every prompt position, written as numpy
//! `.npy`. The ids are used exactly as given (no BOS). With `decode_from = K` the first K tokens
//! are prefilled and the rest fed one at a time through the cache; the array has the same shape.
//!
//! Any architecture [`AnyModel`] binds (qwen4_exp, deepseek_v4) runs, through its CPU reference
//! forward or, placed on the GPU (`--backend wgpu`), the device forward, with a device state of
//! exactly the prompt's length.

use std::path::Path;

use crate::model::{AnyModel, ForwardError, LoadError, Placement};
use cmf_format::{Cmf, CmfError};

pub use cmf_format::npy::{Npy, read_npy, write_npy};

/// What to compute.
#[derive(Debug, Clone, Default)]
pub struct LogitsOptions {
    /// Token ids, as given.
    pub tokens: Vec<u32>,
    /// Prefill this many tokens, then decode the rest one at a time.
    pub decode_from: Option<usize>,
    /// Where the model runs (its context is set to the prompt's length).
    pub placement: Placement,
}

/// Logits of every position.
#[derive(Debug, Clone)]
pub struct Logits {
    /// Positions (`T`).
    pub rows: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Row-major `[rows, vocab]`.
    pub data: Vec<f32>,
    /// Where the forward ran: `gpu` or `cpu` (a device that refused the model leaves it on
    /// the CPU with a warning).
    pub backend: &'static str,
}

/// Why no logits came out.
#[derive(Debug, thiserror::Error)]
pub enum LogitsError {
    /// The file does not open.
    #[error(transparent)]
    Open(#[from] CmfError),
    /// Not a usable model (names the file).
    #[error(transparent)]
    Load(#[from] LoadError),
    /// Bad tokens.
    #[error(transparent)]
    Forward(#[from] ForwardError),
    /// `--decode-from` past the prompt.
    #[error("--decode-from {k} is beyond the {t} prompt tokens")]
    DecodeFrom {
        /// Requested K.
        k: usize,
        /// Prompt length.
        t: usize,
    },
}

/// Runs the model at `path` on `opts.tokens`.
pub fn logits(path: &Path, opts: &LogitsOptions) -> Result<Logits, LogitsError> {
    logits_cmf(&Cmf::open(path)?, opts)
}

/// Runs the model in `cmf` on `opts.tokens`.
pub fn logits_cmf(cmf: &Cmf, opts: &LogitsOptions) -> Result<Logits, LogitsError> {
    let place = Placement {
        ctx: Some(opts.tokens.len().max(1)),
        ..opts.placement.clone()
    };
    let model = AnyModel::bind_on(cmf, &place).map_err(|e| LoadError::bind(cmf, e))?;
    // Logits are reference data: every tensor's checksum is checked first.
    cmf.verify()?;
    let t = opts.tokens.len();
    let data = match opts.decode_from {
        None => model.forward_prefill(&opts.tokens)?,
        Some(k) => {
            if k > t {
                return Err(LogitsError::DecodeFrom { k, t });
            }
            if t == 0 {
                // The model's own error for an empty prompt.
                return Err(model
                    .forward_prefill(&[])
                    .err()
                    .map_or(LogitsError::DecodeFrom { k, t }, LogitsError::Forward));
            }
            let mut st = model.new_state();
            let mut data = if k > 0 {
                model.forward(&opts.tokens[..k], &mut st)?
            } else {
                Vec::new()
            };
            for &id in &opts.tokens[k..] {
                data.extend(model.forward(&[id], &mut st)?);
            }
            data
        }
    };
    Ok(Logits {
        rows: t,
        vocab: model.vocab_size(),
        data,
        backend: model.backend_name(),
    })
}
