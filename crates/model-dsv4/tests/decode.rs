//! Cached decode against transformers' cached decode, and the 16-token greedy continuation.

mod common;

use cmf_format::Cmf;
use common::{
    CASES, TOL, argmax, convert_fixture, fixture, k_prefill, max_abs, max_abs_diff, read_npy,
};
use model_dsv4::{Model, SeqState, Weights};
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
            let (err, tol) = (max_abs_diff(&got, &want.f32), TOL * max_abs(&want.f32));
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
                TOL * max_abs(&greedy_logits.f32),
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
    let path = convert_fixture("deepseek_v4_a", dir.path(), Profile::F32);
    let cmf = Cmf::open(&path).unwrap();
    let (config, weights) = Weights::bind(&cmf).unwrap();
    let model = Model::new(config, weights);
    let ids: Vec<u32> = read_npy(&fixture("deepseek_v4_a").join("expected/p1_ids.npy"))
        .i64
        .iter()
        .map(|&i| i as u32)
        .collect();
    let want = read_npy(&fixture("deepseek_v4_a").join("expected/p1_prefill_logits.npy"));
    let vocab = model.config.vocab_size;
    // Mid-window for both compressors (CSA rate 4, HCA rate 8), so buffers and overlap matter.
    let k = 21;
    let mut st = SeqState::new(&model.config);
    model.forward(&ids[..k], &mut st).unwrap();
    let snap = st.snapshot();
    // Run junk tokens, then roll back and continue with the real ones.
    model.forward(&[1, 2, 3, 503, 7], &mut st).unwrap();
    st.restore(&snap);
    let got = model.forward(&ids[k..], &mut st).unwrap();
    let want_tail = &want.f32[k * vocab..];
    let (err, tol) = (max_abs_diff(&got, want_tail), TOL * max_abs(want_tail));
    assert!(err <= tol, "after restore: {err:.3e} > {tol:.3e}");
}

/// Prefill in chunks of 7 (every chunk starts mid-window and mid-sliding-window) equals the
/// reference's one-shot prefill.
#[test]
fn chunked_prefill_matches_one_shot() {
    let dir = tempfile::tempdir().unwrap();
    for case in CASES {
        let path = convert_fixture(case, dir.path(), Profile::F32);
        let cmf = Cmf::open(&path).unwrap();
        let (config, weights) = Weights::bind(&cmf).unwrap();
        let model = Model::new(config, weights);
        let ids = common::ids(case, 0);
        let want = read_npy(&fixture(case).join("expected/p0_prefill_logits.npy")).f32;
        let mut st = SeqState::new(&model.config);
        let mut got = Vec::new();
        for chunk in ids.chunks(7) {
            got.extend(model.forward(chunk, &mut st).unwrap());
        }
        let (err, tol) = (max_abs_diff(&got, &want), TOL * max_abs(&want));
        eprintln!("{case}: chunked prefill max|diff| {err:.3e} (tol {tol:.3e})");
        assert!(err <= tol, "{case}: chunked prefill {err:.3e} > {tol:.3e}");
    }
}

/// Every prefill/decode hand-over point: for each prompt of each fixture and every `K` in
/// `1..T`, prefill `ids[..K]`, then feed `ids[K..]` one token at a time, and separately as one
/// chunk; every row must match transformers' one-shot prefill logits. The fixtures' own `K`
/// are all odd; this covers the splits on CSA/HCA window and sliding-window boundaries too.
#[test]
fn every_prefill_split_matches_one_shot() {
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    let mut splits = 0usize;
    for case in CASES {
        let path = convert_fixture(case, dir.path(), Profile::F32);
        let cmf = Cmf::open(&path).unwrap();
        let (config, weights) = Weights::bind(&cmf).unwrap();
        let model = Model::new(config, weights);
        let vocab = model.config.vocab_size;
        for p in 0..3 {
            let ids = common::ids(case, p);
            let want = read_npy(&fixture(case).join(format!("expected/p{p}_prefill_logits.npy")));
            let tol = TOL * max_abs(&want.f32);
            let mut worst = 0f32;
            for k in 1..ids.len() {
                let mut st = SeqState::new(&model.config);
                let mut got = model.forward(&ids[..k], &mut st).unwrap();
                let snap = st.snapshot();
                for &id in &ids[k..] {
                    got.extend(model.forward(&[id], &mut st).unwrap());
                }
                let err = max_abs_diff(&got, &want.f32);
                if err > tol {
                    failures.push(format!(
                        "{case} p{p} K={k} one at a time: {err:.3e} > {tol:.3e}"
                    ));
                }
                worst = worst.max(err);
                st.restore(&snap);
                got.truncate(k * vocab);
                got.extend(model.forward(&ids[k..], &mut st).unwrap());
                let err = max_abs_diff(&got, &want.f32);
                if err > tol {
                    failures.push(format!(
                        "{case} p{p} K={k} as a chunk: {err:.3e} > {tol:.3e}"
                    ));
                }
                worst = worst.max(err);
                splits += 1;
            }
            eprintln!(
                "{case} p{p}: T={} every K in 1..T: max|diff| {worst:.3e} (tol {tol:.3e})",
                ids.len()
            );
        }
    }
    eprintln!("{splits} splits, each fed one at a time and as a chunk");
    assert!(failures.is_empty(), "failures: {failures:#?}");
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
        let ids = common::ids(case, 0);
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
