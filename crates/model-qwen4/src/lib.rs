//! Qwen3.8-Flash-Next (`qwen4_exp`): the config read from a CMF header, the weights bound by
//! canonical name, and the exact CPU reference forward (transformers' `Qwen4ExpForCausalLM`).
//!
//! Reference: `transformers/models/qwen4_exp/modeling_qwen4_exp.py` (5.24) and
//! `shared/notes/reference-arch.md` §3.

pub mod config;

pub use config::{ConfigError, GateAct, HiddenAct, LayerType, Qwen4ExpTextConfig, RopeType};
pub mod forward;
pub mod gdn;
pub mod hc;
pub mod moe;
pub mod ops;
pub mod ple;
pub mod qsa;
pub mod state;
pub mod weights;

pub use forward::{ForwardError, Model, Trace};
pub use state::SeqState;
pub use weights::{WeightError, Weights};
