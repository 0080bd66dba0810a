//! DeepSeek-V4-Flash (`deepseek_v4`): the config read from a CMF header, the weights bound by
//! canonical name, and the exact CPU reference forward (transformers' `DeepseekV4ForCausalLM`).
//!
//! Start with [`Weights::bind`] (config + weights from a [`cmf_format::Cmf`]), wrap them in a
//! [`Model`], and feed tokens through the [`CausalLm`] interface ([`CausalLm::forward`] with a
//! [`SeqState`], [`CausalLm::forward_prefill`] from an empty one). Weights are bound through
//! model-core (every tensor keeps its name and id); the routed experts run on model-core's
//! executor, this crate owns the routing.
//!
//! ```
//! use model_dsv4::{CausalLm, Model, Weights};
//! # let dir = tempfile::tempdir()?;
//! # let path = test_support::convert_fixture("deepseek_v4_a", dir.path(), test_support::Profile::F32);
//! // `path`: a deepseek_v4 CMF, here the converted fixtures/deepseek_v4_a.
//! let cmf = cmf_format::Cmf::open(&path)?;
//! let (config, weights) = Weights::bind(&cmf)?;
//! let model = Model::new(config, weights);
//! let mut state = model.new_state();
//! let logits = model.forward(&[1, 17, 42], &mut state)?; // [3, vocab]
//! let next = model.forward(&[7], &mut state)?; // cached: [1, vocab]
//! assert_eq!(logits.len(), 3 * model.vocab_size());
//! assert_eq!(next.len(), model.vocab_size());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Reference: `transformers/models/deepseek_v4/modeling_deepseek_v4.py` (5.24) and
//! `shared/notes/reference-arch.md` §1.
//!
//! DeepSeek-V4.1-Flash (`deepseek_v41`) lives beside it: its config and layer roles
//! ([`config_v41`]), its Engram n-gram hashing, tables and gating block ([`engram`]), and its
//! exact CPU forward ([`v41`]), which reuses V4's blocks where the math is shared.
#![deny(missing_docs)]

pub mod attention;
pub mod compressor;
pub mod config;
pub mod config_v41;
pub mod device;
pub mod engram;
pub mod forward;
pub mod gpu;
pub mod hc;
pub mod indexer;
pub mod moe;
pub mod ops;
pub mod state;
pub mod synthetic;
pub mod v41;
pub mod weights;

pub use config::{
    AttnKind, ConfigError, DeepseekV4Config, HiddenAct, MlpKind, RopeKind, ScoringFunc,
};
pub use config_v41::{DeepseekV41Config, V41ConfigError};
pub use forward::{ForwardError, Model, Trace};
pub use gpu::{ColdStats, ExpertPlacement, GpuModel, GpuState, Residency, Unplaced};
pub use model_core::{BindError, CausalLm, InputError};
pub use state::SeqState;
pub use weights::{Source, WeightError, Weights};
