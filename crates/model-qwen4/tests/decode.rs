//! Cached decode against transformers' cached decode, and the 16-token greedy continuation.

mod common;

use cmf_format::Cmf;
use common::{CASES, argmax, convert_fixture, fixture, k_prefill, max_abs, max_abs_diff, read_npy};
use model_qwen4::{Model, SeqState, Weights};
use test_support::Profile;

#[test]
fn f32_cached_decode_and_greedy_match_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for case in CASES {
        let path = convert_fixture(case, dir.path(), Profile::F32);
        let cmf = Cmf::open(&path).unwrap();
        let (config, weights) = Weights::bind(&cmf).unwrap();
        let model = Model::new(config, weights);
        let vocab = model.config.vocab_size;
        let exp = fixture(case).join("expected");
        for p in 0..3 {
            let ids: Vec<u32> = read_npy(&exp.join(format!("p{p}_ids.npy")))
                .i64
                .iter()
                .map(|&i| i as u32)
                .collect();
            let k = k_prefill(case, p);
            // Prefill K, then one token at a time.
            let mut st = SeqState::new(&model.config);
            model.forward(&ids[..k], &mut st).unwrap();
            let mut got = Vec::new();
            for &id in &ids[k..] {
                got.extend(model.forward(&[id], &mut st).unwrap());
            }
            let want = read_npy(&exp.join(format!("p{p}_decode_logits.npy")));
            assert_eq!(want.shape, vec![ids.len() - k, vocab]);
            let (err, tol) = (max_abs_diff(&got, &want.f32), 1e-4 * max_abs(&want.f32));
            eprintln!("{case} p{p}: decode from K={k}: max|diff| {err:.3e} (tol {tol:.3e})");
            if err > tol {
                failures.push(format!("{case} p{p} decode: {err:.3e} > {tol:.3e}"));
            }

            // Greedy continuation after the whole prompt (cached).
            let greedy_ids = read_npy(&exp.join(format!("p{p}_greedy_ids.npy"))).i64;
            let greedy_logits = read_npy(&exp.join(format!("p{p}_greedy_logits.npy")));
            let mut st = SeqState::new(&model.config);
            let prompt_logits = model.forward(&ids, &mut st).unwrap();
            let mut row = prompt_logits[(ids.len() - 1) * vocab..].to_vec();
            let mut ours = Vec::new();
            let mut rows = Vec::new();
            for _ in 0..greedy_ids.len() {
                let next = argmax(&row) as u32;
                ours.push(next as i64);
                rows.extend_from_slice(&row);
                row = model.forward(&[next], &mut st).unwrap();
            }
            if ours != greedy_ids {
                failures.push(format!(
                    "{case} p{p} greedy: ours {ours:?} vs {greedy_ids:?}"
                ));
            }
            let (err, tol) = (
                max_abs_diff(&rows, &greedy_logits.f32),
                1e-4 * max_abs(&greedy_logits.f32),
            );
            if err > tol {
                failures.push(format!("{case} p{p} greedy logits: {err:.3e} > {tol:.3e}"));
            }
        }
    }
    assert!(failures.is_empty(), "failures: {failures:#?}");
}

#[test]
fn snapshot_restore_forgets_the_extra_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let path = convert_fixture("qwen4_exp_a", dir.path(), Profile::F32);
    let cmf = Cmf::open(&path).unwrap();
    let (config, weights) = Weights::bind(&cmf).unwrap();
    let model = Model::new(config, weights);
    let ids: Vec<u32> = read_npy(&fixture("qwen4_exp_a").join("expected/p1_ids.npy"))
        .i64
        .iter()
        .map(|&i| i as u32)
        .collect();
    let want = read_npy(&fixture("qwen4_exp_a").join("expected/p1_prefill_logits.npy"));
    let vocab = model.config.vocab_size;
    let k = 20;
    let mut st = SeqState::new(&model.config);
    model.forward(&ids[..k], &mut st).unwrap();
    let snap = st.snapshot();
    // Run junk tokens, then roll back and continue with the real ones.
    model.forward(&[1, 2, 3, 503, 7], &mut st).unwrap();
    st.restore(&snap);
    let got = model.forward(&ids[k..], &mut st).unwrap();
    let want_tail = &want.f32[k * vocab..];
    let (err, tol) = (max_abs_diff(&got, want_tail), 1e-4 * max_abs(want_tail));
    assert!(err <= tol, "after restore: {err:.3e} > {tol:.3e}");
}

/// `forward_last` is the last row of `forward`, bit for bit, and leaves the same state behind
/// (the next token's logits agree too).
#[test]
fn forward_last_is_the_last_row_of_forward() {
    let dir = tempfile::tempdir().unwrap();
    for case in CASES {
        let path = convert_fixture(case, dir.path(), Profile::F32);
        let cmf = Cmf::open(&path).unwrap();
        let (config, weights) = Weights::bind(&cmf).unwrap();
        let model = Model::new(config, weights);
        let vocab = model.config.vocab_size;
        let ids: Vec<u32> = read_npy(&fixture(case).join("expected/p0_ids.npy"))
            .i64
            .iter()
            .map(|&i| i as u32)
            .collect();
        let (mut a, mut b) = (SeqState::new(&model.config), SeqState::new(&model.config));
        let all = model.forward(&ids, &mut a).unwrap();
        let last = model.forward_last(&ids, &mut b).unwrap();
        assert_eq!(last.len(), vocab);
        assert!(last == all[all.len() - vocab..], "{case}: last row differs");
        let next_a = model.forward(&ids[..1], &mut a).unwrap();
        let next_b = model.forward(&ids[..1], &mut b).unwrap();
        assert!(next_a == next_b, "{case}: state differs after forward_last");
    }
}
