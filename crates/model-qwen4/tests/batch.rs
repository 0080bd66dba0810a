//! Several sequences fed together (`Model::forward_batch`, what a server's concurrent requests
//! decode through) give each one the logits it gets alone, and leave each state where a
//! forward of its own tokens would: the witnesses are the transformers fixtures (each prompt's
//! last prefill row) and the single-sequence forward.

mod common;

use cmf_format::Cmf;
use common::{CASES, TOL, convert_fixture, fixture, ids, max_abs, max_abs_diff, read_npy};
use model_qwen4::{CausalLm, Model, Weights};
use test_support::Profile;

#[test]
fn batched_sequences_match_separate_forwards() {
    let dir = tempfile::tempdir().unwrap();
    for case in CASES {
        let path = convert_fixture(case, dir.path(), Profile::F32);
        let cmf = Cmf::open(&path).unwrap();
        let (config, weights) = Weights::bind(&cmf).unwrap();
        let model = Model::new(config, weights);
        let vocab = model.config.vocab_size;
        let prompts: Vec<Vec<u32>> = (0..3).map(|p| ids(case, p)).collect();

        // Prefill all three prompts in one batch (different lengths); each last row must be
        // transformers' last prefill row for that prompt.
        let mut states: Vec<_> = (0..3).map(|_| model.new_state()).collect();
        let got = {
            let mut seqs: Vec<(&[u32], _)> = prompts
                .iter()
                .map(Vec::as_slice)
                .zip(states.iter_mut())
                .collect();
            model.forward_batch(&mut seqs).unwrap()
        };
        for (p, logits) in got.iter().enumerate() {
            let want =
                read_npy(&fixture(case).join(format!("expected/p{p}_prefill_logits.npy"))).f32;
            let want = &want[want.len() - vocab..];
            let err = max_abs_diff(logits, want);
            assert!(
                err <= TOL * max_abs(want),
                "{case} p{p}: batched prefill {err:.3e} from transformers"
            );
        }

        // Then steps of mixed widths (one decoding, one taking three tokens, one skipping a
        // step) against each sequence run alone from the same start.
        let mut alone: Vec<_> = states.clone();
        let steps: [[&[u32]; 3]; 3] = [
            [&[5], &[7, 8, 9], &[11]],
            [&[6], &[10], &[]],
            [&[1], &[2], &[3, 4]],
        ];
        for (s, step) in steps.iter().enumerate() {
            let mut seqs: Vec<(&[u32], _)> = step
                .iter()
                .copied()
                .zip(states.iter_mut())
                .filter(|(t, _)| !t.is_empty())
                .collect();
            let got = model.forward_batch(&mut seqs).unwrap();
            let mut k = 0;
            for (i, tokens) in step.iter().enumerate() {
                if tokens.is_empty() {
                    continue;
                }
                let want = model.forward_last(tokens, &mut alone[i]).unwrap();
                let err = max_abs_diff(&got[k], &want);
                assert!(
                    err <= TOL * max_abs(&want),
                    "{case} step {s} sequence {i}: {err:.3e} from its own forward"
                );
                assert_eq!(states[i].pos, alone[i].pos, "{case}: positions");
                k += 1;
            }
        }
    }
}

#[test]
fn a_batch_checks_every_sequence() {
    let dir = tempfile::tempdir().unwrap();
    let path = convert_fixture(CASES[0], dir.path(), Profile::F32);
    let cmf = Cmf::open(&path).unwrap();
    let (config, weights) = Weights::bind(&cmf).unwrap();
    let model = Model::new(config, weights);
    let (mut a, mut b) = (model.new_state(), model.new_state());
    let bad = [model.config.vocab_size as u32];
    let mut seqs: Vec<(&[u32], _)> = vec![(&[1, 2], &mut a), (&bad, &mut b)];
    let err = model.forward_batch(&mut seqs).unwrap_err();
    assert!(err.to_string().contains("vocab"), "{err}");
    // Nothing was fed: the good sequence is untouched.
    assert_eq!(a.pos, 0);
    assert!(model.forward_batch(&mut []).unwrap().is_empty());
}
