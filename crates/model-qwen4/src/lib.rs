//! Qwen3.8-Flash-Next (`qwen4_exp`): the config read from a CMF header, the weights bound by
//! canonical name, and the exact CPU reference forward (transformers' `Qwen4ExpForCausalLM`).
//!
//! Start with [`Weights::bind`] (config + weights from a [`cmf_format::Cmf`]), wrap them in a
//! [`Model`], and feed tokens through the [`CausalLm`] interface ([`CausalLm::forward`] with a
//! [`SeqState`], [`CausalLm::forward_prefill`] from an empty one). Weights are bound through
//! model-core (every tensor keeps its name and id); the routed experts run on model-core's
//! executor, this crate owns the routing.
//!
//! ```
//! use model_qwen4::{CausalLm, Model, Weights};
//! # let dir = tempfile::tempdir()?;
//! # let path = test_support::convert_fixture("qwen4_exp_a", dir.path(), test_support::Profile::F32);
//! // `path`: a qwen4_exp CMF, here the converted fixtures/qwen4_exp_a.
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
//! Reference: `transformers/models/qwen4_exp/modeling_qwen4_exp.py` (5.24) and
//! `shared/notes/reference-arch.md` §3.
#![deny(missing_docs)]

pub mod cache_replay;
pub mod config;
pub mod device;
/// The expert cache's policy (model-core's, shared with deepseek_v4's global bank).
pub use model_core::expert_cache;
pub mod gpu;

pub use config::{ConfigError, GateAct, HiddenAct, LayerType, Qwen4ExpTextConfig, RopeType};
pub mod forward;
pub mod gdn;
pub mod hc;
pub mod host_clock;
pub mod moe;
pub mod mtp;
pub mod offload;
pub mod ops;
pub mod ple;
pub mod prefetch;
pub mod qsa;
pub mod state;
pub mod synthetic;
pub mod weights;

pub use expert_cache::CachePolicy;
pub use forward::{ForwardError, Model, Trace};
pub use gpu::{GpuModel, GpuRecurrent, GpuState, Head, Unplaced};
pub use model_core::{BindError, CausalLm, InputError};
pub use mtp::{MtpDeviceState, MtpGpuOut, MtpHead, MtpOut, MtpState};
pub use offload::{DEFAULT_ADMISSIONS, Offload, OffloadStats, Residency};
pub use state::{Recurrent, SeqState};
pub use weights::{WeightError, Weights};
