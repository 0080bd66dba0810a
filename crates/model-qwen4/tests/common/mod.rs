//! Test helpers: the shared ones from `test-support`, and this crate's fixture list.
#![allow(dead_code, unused_imports)]

pub use test_support::*;

/// The qwen4_exp fixture cases.
pub const CASES: [&str; 3] = ["qwen4_exp_a", "qwen4_exp_b", "qwen4_exp_c"];

/// Tolerance relative to `max|logit|` for the f32 profile (the issue asked for 1e-4; measured
/// errors are about 2e-6 relative: f32 summation-order noise through GDN, QSA, PLE and MoE).
pub const TOL: f32 = 1e-5;
