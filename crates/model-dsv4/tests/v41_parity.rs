//! deepseek_v41 f32 logits against transformers' own (cached) forward on fixtures/deepseek_v41_*
//! (tools/reference/make_dsv41_fixtures.py): prefill, cached decode and the 16-token greedy
//! continuation; then, against the one-shot reference, every prefill/decode split, chunked
//! prefill, snapshot/restore and `forward_last`; bad tokens are errors. The checks are the shared
//! harness's (test_support::harness), the same for every architecture.
//!
//! The Engram token map is derived from the tokenizer embedded in the converted CMF, as the
//! engine derives it (tests/v41_engram.rs shows it equals the reference's map).

mod common;

use cmf_format::Cmf;
use common::token_map;
use model_dsv4::v41::{Model, Weights};

const CASES: [&str; 2] = ["deepseek_v41_a", "deepseek_v41_b"];

/// Tolerance relative to `max|logit|`: ten times tighter than the 1e-4, and about 18x
/// the largest error measured on both fixtures (1.07e-6 on logits of max 1.99, f32
/// summation-order noise). Each V4.1 feature moves these logits far more: switching off the
/// Engram, the indexer top-k or the candidate mask moves them by 1.17 / 1.51 / 0.60
/// (`feature_probes` in the fixtures' cases.json).
const TOL: f32 = 1e-5;

fn bind(cmf: &Cmf) -> Model<'_> {
    let (config, weights) = Weights::bind(cmf, Some(token_map(cmf))).unwrap();
    Model::new(config, weights)
}

// Snapshot/restore on prompt 1 of deepseek_v41_a at K=21: mid-window and mid-group.
test_support::causal_lm_parity_tests!(CASES, TOL, bind, ("deepseek_v41_a", 1, 21));
