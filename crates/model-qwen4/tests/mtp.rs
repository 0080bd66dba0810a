//! The MTP head's binding and the rollback a rejected draft needs: a fixture with a head added
//! (test-support's `with_mtp_head`) binds it and keeps the trunk unchanged; rolling a sequence
//! back to a snapshot (recurrent state restored, attention caches cut) and feeding on gives
//! transformers' logits, as if the rolled-back tokens had never run; the head run over rows
//! in one call equals the head run one row at a time.

mod common;

use common::{CASES, TOL};
use model_qwen4::{CausalLm, Model, MtpState, Weights};
use test_support::Profile;
use test_support::harness as h;
use test_support::mtp::with_mtp_head;

fn bind(cmf: &cmf_format::Cmf) -> Model<'_> {
    let (config, weights) = Weights::bind(cmf).unwrap();
    Model::new(config, weights)
}

#[test]
fn the_head_is_converted_and_bound_and_the_trunk_is_unchanged() {
    for case in CASES {
        h::with_converted(case, Profile::F32, |cmf| assert!(bind(cmf).mtp().is_none()));
        let failures = with_mtp_head(case, Profile::F32, 1, |cmf| {
            assert!(
                cmf.tensor("mtp.layers.0.mlp.experts.0.gate_up_proj.weight")
                    .is_some()
            );
            let m = bind(cmf);
            assert!(m.mtp().is_some(), "{case}: no head bound");
            h::prefill_parity(case, &m, TOL)
        });
        h::assert_none(&failures);
    }
}

/// Rolled back from a snapshot (after 1..=8 extra tokens), the sequence continues with
/// transformers' logits of the un-detoured prompt.
#[test]
fn rollback_forgets_the_rolled_back_tokens() {
    let mut failures = Vec::new();
    for case in CASES {
        h::with_converted(case, Profile::F32, |cmf| {
            let m = bind(cmf);
            let ids = test_support::ids(case, 0);
            let want = m.forward_prefill(&ids).unwrap();
            let v = m.vocab_size();
            for (k, extra) in [(3usize, 1usize), (5, 8), (9, 3)] {
                let k = k.min(ids.len() - 1);
                let mut st = m.new_state();
                m.forward(&ids[..k], &mut st).unwrap();
                let snap = st.recurrent();
                let junk: Vec<u32> = (0..extra as u32).map(|i| (i * 37 + 5) % v as u32).collect();
                m.forward(&junk, &mut st).unwrap();
                st.rollback(&m.config, &snap);
                assert_eq!(st.pos, k);
                let got = m.forward(&ids[k..], &mut st).unwrap();
                let err = test_support::max_abs_diff(&got, &want[k * v..]);
                let scale = test_support::max_abs(&want);
                if err > TOL * scale {
                    failures.push(format!(
                        "{case}: k {k}, {extra} rolled back: max|diff| {err:.3e}"
                    ));
                }
            }
        });
    }
    h::assert_none(&failures);
}

/// The head over several rows in one call (its cache filled as it goes) gives the rows one call
/// per row gives; truncating its cache and running again repeats the result.
#[test]
fn the_head_over_rows_equals_the_head_row_by_row() {
    with_mtp_head("qwen4_exp_c", Profile::F32, 7, |cmf| {
        let m = bind(cmf);
        let ids = test_support::ids("qwen4_exp_c", 0);
        let n = ids.len().min(12);
        let mut st = m.new_state();
        let (_, streams) = m.forward_streams(&ids[..n], &mut st, true).unwrap();
        let hd = m.config.hc_count * m.config.hidden_size;
        let mut all = MtpState::default();
        let whole = m
            .mtp_forward(&streams[..(n - 1) * hd], &ids[1..n], &mut all, true)
            .unwrap();
        let mut one = MtpState::default();
        let mut last = None;
        for r in 0..n - 1 {
            let out = m
                .mtp_forward(
                    &streams[r * hd..(r + 1) * hd],
                    &[ids[r + 1]],
                    &mut one,
                    true,
                )
                .unwrap();
            let want = &whole.streams[r * hd..(r + 1) * hd];
            let err = test_support::max_abs_diff(&out.streams, want);
            assert!(
                err <= 1e-5 * test_support::max_abs(want),
                "row {r}: {err:.3e}"
            );
            last = Some(out.logits);
        }
        let last = last.unwrap();
        let err = test_support::max_abs_diff(&last, &whole.logits);
        assert!(
            err <= TOL * test_support::max_abs(&whole.logits),
            "logits: {err:.3e}"
        );
        assert_eq!(one.len(&m), n - 1);
        one.truncate(&m, n - 2);
        let again = m
            .mtp_forward(
                &streams[(n - 2) * hd..(n - 1) * hd],
                &[ids[n - 1]],
                &mut one,
                true,
            )
            .unwrap();
        assert_eq!(again.logits, last, "the cut cache repeats its last row");
    });
}
