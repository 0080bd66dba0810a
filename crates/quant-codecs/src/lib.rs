//! cortiq's number formats.
//!
//! The principal type is [`DType`]: every tensor in a CMF file carries one, and
//! [`DType::expected_nbytes`] is the single source of truth for payload sizes.
#![deny(missing_docs)]

mod dtype;
mod error;

pub use dtype::{DType, GROUP, Layout, split_matrix_shape};
pub use error::CodecError;
