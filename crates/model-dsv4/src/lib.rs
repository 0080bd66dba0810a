//! DeepSeek-V4-Flash (`deepseek_v4`): the config read from a CMF header, the weights bound by
//! canonical name, and the exact CPU reference forward (transformers' `DeepseekV4ForCausalLM`).
//!
//! Start with [`Weights::bind`] (config + weights from a [`cmf_format::Cmf`]), wrap them in a
//! [`Model`], and feed tokens with [`Model::forward`] and a [`SeqState`].
//!
//! Reference: `transformers/models/deepseek_v4/modeling_deepseek_v4.py` (5.24) and
//! `shared/notes/reference-arch.md` §1.

pub mod attention;
pub mod compressor;
pub mod config;
pub mod forward;
pub mod hc;
pub mod indexer;
pub mod moe;
pub mod ops;
pub mod state;
pub mod weights;

pub use config::{
    AttnKind, ConfigError, DeepseekV4Config, HiddenAct, MlpKind, RopeKind, ScoringFunc,
};
pub use forward::{ForwardError, Model, Trace};
pub use state::SeqState;
pub use weights::{WeightError, Weights};
