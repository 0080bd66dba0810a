//! What every cortiq model crate shares, below the architectures:
//!
//! - [`bind`]: tensors of a CMF bound by canonical name with the shape the config implies; every
//!   bound matrix ([`Mat`]) and vector ([`Vector`]) keeps its name and CMF tensor id, so a device
//!   upload, a trace and an error message can all say which tensor.
//! - [`experts`]: the one routed-expert executor. A model routes (which experts, which weights,
//!   per token row); [`RoutedExperts`] batches the token rows of each expert, runs
//!   gate/up -> SwiGLU (optionally clamped) -> down, and adds the weighted results in expert
//!   order. It is the seam where the expert offload decides "in VRAM" or "on the CPU".
//! - [`expert_cache`]: which routed experts a bank of VRAM slots keeps, learned from the
//!   routing each frame reads back (the policy both architectures' offload runs).
//! - [`device`]: the device a model's GPU forward lives on (its weight arena, the activation
//!   path per dtype) and the frame encoder its blocks record into.
//! - [`config`]: config values that select math are enums ([`config_enum!`]); an unknown value
//!   is an error naming the field and the accepted values.
//! - [`lm`]: [`CausalLm`], the interface every architecture's forward offers (`run` per model;
//!   `forward`, `forward_last`, `forward_traced`, `forward_prefill` once, on top of it).
//! - [`input`]: the checks every forward makes on its tokens.
//! - [`synthetic`]: random payloads for benchmarks at a released geometry.
//! - [`trace`]: the callback that sees every named intermediate, and the names both
//!   architectures use for the same step.
//!
//! ```
//! use model_core::experts::{Activation, Routes};
//! // Token row 0 goes to experts 2 and 0, row 1 to expert 2.
//! let mut routes = Routes::new(3);
//! routes.push(2, 0, 0.75);
//! routes.push(0, 0, 0.25);
//! routes.push(2, 1, 1.0);
//! assert_eq!(routes.rows(2), &[(0, 0.75), (1, 1.0)]);
//! assert_eq!(Activation::SwiGlu { limit: None }.apply(&[0.0], &[3.0]), vec![0.0]);
//! ```
#![deny(missing_docs)]

pub mod bind;
pub mod config;
pub mod device;
pub mod expert_cache;
pub mod experts;
pub mod input;
pub mod lm;
pub mod synthetic;
pub mod trace;

pub use bind::{BindError, Binder, Mat, Vector};
pub use config::ConfigEnum;
pub use experts::{Activation, Expert, RoutedExperts, Routes};
pub use input::{InputError, check_tokens};
pub use lm::CausalLm;
pub use trace::Trace;

#[doc(hidden)]
pub use serde as __serde;
