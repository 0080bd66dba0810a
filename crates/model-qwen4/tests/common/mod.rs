//! Test helpers: the shared ones from `test-support`, and this crate's fixture list.
#![allow(dead_code, unused_imports)]

pub use test_support::*;

/// The qwen4_exp fixture cases.
pub const CASES: [&str; 3] = ["qwen4_exp_a", "qwen4_exp_b", "qwen4_exp_c"];
