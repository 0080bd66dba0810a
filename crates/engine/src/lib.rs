//! cortiq's engine: the facade over the lower crates and the logic behind each `cortiq`
//! subcommand.
//!
//! The crates below are re-exported whole: [`cmf_format`] (the model container, principal type
//! [`cmf_format::Cmf`]) and [`quant_codecs`] (the number formats, principal type
//! [`quant_codecs::DType`]). Each subcommand's logic lives in its own module and returns data
//! that the binary prints; [`inspect`] is the first.
//!
//! ```no_run
//! let report = engine::inspect::inspect("model.cmf".as_ref(), &Default::default())?;
//! report.write_text(&mut std::io::stdout().lock())?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]

pub use cmf_convert as convert;
pub use cmf_format;
pub use gpu_runtime;
pub use kernels_wgsl;
pub use quant_codecs;

pub mod bench;
pub mod bench_model;
pub mod chat;
pub mod doctor;
pub mod files;
pub mod generate;
pub mod inspect;
pub mod integrity;
pub mod logits;
pub mod model;
pub mod perplexity;
pub mod run;
pub mod sampling;
pub mod serve;
pub mod speculative;

/// The default model shipped in the binary: the Shakespeare demo, a 12.6 M-parameter qwen4_exp
/// trained by `tools/demo-model` (`assets/shakespeare.cmf`, the q8 conversion of
/// `fixtures/shakespeare/hf`). `cortiq run`, `chat` and `inspect` use it when no model is given.
pub const EMBEDDED_MODEL: &[u8] = include_bytes!("../../../assets/shakespeare.cmf");

/// The profile the embedded model was converted with.
pub const EMBEDDED_PROFILE: &str = "q8";

/// Opens the embedded default model.
pub fn embedded_model() -> Result<cmf_format::Cmf, cmf_format::CmfError> {
    cmf_format::Cmf::from_bytes(EMBEDDED_MODEL)
}
