//! f32 logits against transformers' own forward (fixtures/*/expected): prefill, cached decode
//! and the 16-token greedy continuation; then, against the one-shot reference, every
//! prefill/decode split, chunked prefill, snapshot/restore and `forward_last`; bad tokens are
//! errors. The checks are the shared harness's (test_support::harness), the same for every
//! architecture.

mod common;

use cmf_format::Cmf;
use common::{CASES, TOL};
use model_qwen4::{Model, Weights};

fn bind(cmf: &Cmf) -> Model<'_> {
    let (config, weights) = Weights::bind(cmf).unwrap();
    Model::new(config, weights)
}

// Snapshot/restore on prompt 1 of qwen4_exp_a at K=20: mid-window for every cache.
test_support::causal_lm_parity_tests!(CASES, TOL, bind, ("qwen4_exp_a", 1, 20));
