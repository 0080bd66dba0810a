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

pub use cmf_format;
pub use quant_codecs;

pub mod inspect;
