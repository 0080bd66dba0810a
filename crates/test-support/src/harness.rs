//! Parity harnesses over any [`CausalLm`]: each architecture's tests bind a fixture's model and
//! hand it here, so "prefill matches transformers", "cached decode matches", "every prefill
//! split matches", "snapshot/restore forgets", "forward_last is the last row" are written once
//! and hold for every model (and, later, for a GPU forward behind the same trait).
//!
//! Tolerances are relative to `max |logit|` of the reference rows. Each check prints what it
//! measured and returns its failures (empty when it holds), so one test reports every case.

use cmf_format::Cmf;
use model_core::CausalLm;

use crate::{
    Profile, argmax, convert_fixture, fixture, ids, k_prefill, max_abs, max_abs_diff, read_npy,
};

/// Converts fixture `case` under `profile` into a temporary directory, opens it, and runs `f`
/// on the file (which lives until `f` returns).
pub fn with_converted<R>(case: &str, profile: Profile, f: impl FnOnce(&Cmf) -> R) -> R {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temporary directory: {e}"));
    let path = convert_fixture(case, dir.path(), profile);
    let cmf = Cmf::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    f(&cmf)
}

/// How many prompts `fixtures/<case>/expected` holds (`p0_ids.npy`, `p1_ids.npy`, ...).
pub fn prompt_count(case: &str) -> usize {
    let exp = fixture(case).join("expected");
    (0..)
        .take_while(|p| exp.join(format!("p{p}_ids.npy")).is_file())
        .count()
}

fn expected(case: &str, file: &str) -> crate::Npy {
    read_npy(&fixture(case).join("expected").join(file))
}

fn check(failures: &mut Vec<String>, what: String, got: &[f32], want: &[f32], rel_tol: f32) -> f32 {
    let (err, tol) = (max_abs_diff(got, want), rel_tol * max_abs(want));
    eprintln!("{what}: max|diff| {err:.3e} (tol {tol:.3e})");
    if err > tol {
        failures.push(format!("{what}: {err:.3e} > {tol:.3e}"));
    }
    err
}

/// One uncached forward over each prompt against transformers' `pN_prefill_logits`.
pub fn prefill_parity<M: CausalLm>(case: &str, model: &M, rel_tol: f32) -> Vec<String> {
    let mut failures = Vec::new();
    for p in 0..prompt_count(case) {
        let tokens = ids(case, p);
        let want = expected(case, &format!("p{p}_prefill_logits.npy"));
        assert_eq!(
            want.shape,
            vec![tokens.len(), model.vocab_size()],
            "{case} p{p}"
        );
        let got = model
            .forward_prefill(&tokens)
            .unwrap_or_else(|e| panic!("{case} p{p}: {e}"));
        let what = format!("{case} p{p} prefill T={}", tokens.len());
        check(&mut failures, what, &got, &want.f32, rel_tol);
    }
    failures
}

/// Prefill `k_prefill` tokens then decode one at a time, against `pN_decode_logits`; then the
/// greedy continuation after the whole prompt against `pN_greedy_ids` and the logits each
/// greedy token was the argmax of.
pub fn decode_and_greedy_parity<M: CausalLm>(case: &str, model: &M, rel_tol: f32) -> Vec<String> {
    let mut failures = Vec::new();
    let vocab = model.vocab_size();
    for p in 0..prompt_count(case) {
        let tokens = ids(case, p);
        let k = k_prefill(case, p);
        let mut st = model.new_state();
        model.forward(&tokens[..k], &mut st).unwrap();
        let mut got = Vec::new();
        for &id in &tokens[k..] {
            got.extend(model.forward(&[id], &mut st).unwrap());
        }
        let want = expected(case, &format!("p{p}_decode_logits.npy"));
        assert_eq!(want.shape, vec![tokens.len() - k, vocab], "{case} p{p}");
        let what = format!("{case} p{p} decode from K={k}");
        check(&mut failures, what, &got, &want.f32, rel_tol);

        let greedy_ids = expected(case, &format!("p{p}_greedy_ids.npy")).i64;
        let greedy_logits = expected(case, &format!("p{p}_greedy_logits.npy"));
        let mut st = model.new_state();
        let prompt_logits = model.forward(&tokens, &mut st).unwrap();
        let mut row = prompt_logits[(tokens.len() - 1) * vocab..].to_vec();
        let (mut ours, mut rows) = (Vec::new(), Vec::new());
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
        let what = format!("{case} p{p} greedy logits");
        check(&mut failures, what, &rows, &greedy_logits.f32, rel_tol);
    }
    failures
}

/// Every prefill/decode hand-over point: for each prompt and every `K` in `1..T`, prefill
/// `ids[..K]`, then feed `ids[K..]` one token at a time, and again (from a snapshot) as one
/// chunk; every row must match transformers' one-shot prefill. Returns the failures and the
/// number of splits checked.
pub fn every_split_parity<M: CausalLm>(
    case: &str,
    model: &M,
    rel_tol: f32,
) -> (Vec<String>, usize) {
    let mut failures = Vec::new();
    let mut splits = 0;
    let vocab = model.vocab_size();
    for p in 0..prompt_count(case) {
        let tokens = ids(case, p);
        let want = expected(case, &format!("p{p}_prefill_logits.npy")).f32;
        let tol = rel_tol * max_abs(&want);
        let mut worst = 0f32;
        for k in 1..tokens.len() {
            let mut st = model.new_state();
            let mut got = model.forward(&tokens[..k], &mut st).unwrap();
            let snap = st.clone();
            for &id in &tokens[k..] {
                got.extend(model.forward(&[id], &mut st).unwrap());
            }
            let err = max_abs_diff(&got, &want);
            if err > tol {
                failures.push(format!(
                    "{case} p{p} K={k} one at a time: {err:.3e} > {tol:.3e}"
                ));
            }
            worst = worst.max(err);
            let mut st = snap;
            got.truncate(k * vocab);
            got.extend(model.forward(&tokens[k..], &mut st).unwrap());
            let err = max_abs_diff(&got, &want);
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
            tokens.len()
        );
    }
    (failures, splits)
}

/// Prompt 0 fed in chunks of `chunk` tokens equals the one-shot prefill reference.
pub fn chunked_prefill_parity<M: CausalLm>(
    case: &str,
    model: &M,
    chunk: usize,
    rel_tol: f32,
) -> Vec<String> {
    let tokens = ids(case, 0);
    let want = expected(case, "p0_prefill_logits.npy").f32;
    let mut st = model.new_state();
    let mut got = Vec::new();
    for c in tokens.chunks(chunk) {
        got.extend(model.forward(c, &mut st).unwrap());
    }
    let mut failures = Vec::new();
    let what = format!("{case} p0 in chunks of {chunk}");
    check(&mut failures, what, &got, &want, rel_tol);
    failures
}

/// Prefill `k` tokens of prompt `p`, snapshot, run `junk`, restore, feed the rest: the rows
/// must equal the reference's, as if the junk never ran.
pub fn snapshot_restore_parity<M: CausalLm>(
    case: &str,
    model: &M,
    p: usize,
    k: usize,
    junk: &[u32],
    rel_tol: f32,
) -> Vec<String> {
    let tokens = ids(case, p);
    let want = expected(case, &format!("p{p}_prefill_logits.npy")).f32;
    let mut st = model.new_state();
    model.forward(&tokens[..k], &mut st).unwrap();
    let snap = st.clone();
    model.forward(junk, &mut st).unwrap();
    let mut st = snap;
    let got = model.forward(&tokens[k..], &mut st).unwrap();
    let mut failures = Vec::new();
    let what = format!("{case} p{p} restored at K={k}");
    check(
        &mut failures,
        what,
        &got,
        &want[k * model.vocab_size()..],
        rel_tol,
    );
    failures
}

/// `forward_last` is the last row of `forward`, bit for bit, and leaves the same state (the
/// next token's logits agree too).
pub fn forward_last_is_last_row<M: CausalLm>(case: &str, model: &M) -> Vec<String> {
    let vocab = model.vocab_size();
    let tokens = ids(case, 0);
    let (mut a, mut b) = (model.new_state(), model.new_state());
    let all = model.forward(&tokens, &mut a).unwrap();
    let last = model.forward_last(&tokens, &mut b).unwrap();
    let mut failures = Vec::new();
    if last.len() != vocab || last[..] != all[all.len() - vocab..] {
        failures.push(format!("{case}: forward_last differs from the last row"));
    }
    let next_a = model.forward(&tokens[..1], &mut a).unwrap();
    let next_b = model.forward(&tokens[..1], &mut b).unwrap();
    if next_a != next_b {
        failures.push(format!("{case}: the state differs after forward_last"));
    }
    failures
}

/// Panics listing `failures` when there are any.
pub fn assert_none(failures: &[String]) {
    assert!(failures.is_empty(), "failures: {failures:#?}");
}

/// An empty prompt and a token id equal to the vocabulary size are errors, not panics, and say
/// what is wrong.
pub fn bad_tokens_are_refused<M: CausalLm>(model: &M) -> Vec<String> {
    let vocab = model.vocab_size() as u32;
    let mut failures = Vec::new();
    match model.forward_prefill(&[]) {
        Err(e) if e.to_string().contains("empty prompt") => {}
        other => failures.push(format!("empty prompt: {:?}", other.map(|l| l.len()))),
    }
    match model.forward_prefill(&[1, vocab]) {
        Err(e)
            if e.to_string()
                .contains(&format!("token id {vocab} at position 1")) => {}
        other => failures.push(format!("token {vocab}: {:?}", other.map(|l| l.len()))),
    }
    failures
}

/// A traced forward's intermediates in order: (name, layer, values).
pub type Traced = Vec<(String, usize, Vec<f32>)>;

/// Feeds `step` to a reference model `c` (the CPU forward) and a model under test `g` (a
/// device forward), traced, and compares every intermediate: those off by more than
/// `tol x max|reference value|` (or of another length, or a different list of names) as
/// lines naming `what`; and how many were compared.
pub fn compare_step<A: CausalLm, B: CausalLm>(
    what: &str,
    c: &A,
    sc: &mut A::State,
    g: &B,
    sg: &mut B::State,
    step: &[u32],
    tol: f32,
) -> (usize, Vec<String>)
where
    A::Error: std::fmt::Debug,
    B::Error: std::fmt::Debug,
{
    let mut want: Traced = Vec::new();
    c.forward_traced(step, sc, &mut |n, l, d| {
        want.push((n.to_string(), l, d.to_vec()))
    })
    .unwrap();
    let mut got: Traced = Vec::new();
    g.forward_traced(step, sg, &mut |n, l, d| {
        got.push((n.to_string(), l, d.to_vec()))
    })
    .unwrap();
    let wn: Vec<_> = want.iter().map(|w| (&w.0, w.1)).collect();
    let gn: Vec<_> = got.iter().map(|w| (&w.0, w.1)).collect();
    if wn != gn {
        return (0, vec![format!("{what}: trace names {gn:?} != {wn:?}")]);
    }
    let mut failures = Vec::new();
    for (w, gv) in want.iter().zip(&got) {
        let scale = max_abs(&w.2).max(1e-3);
        let err = max_abs_diff(&w.2, &gv.2);
        if w.2.len() != gv.2.len() || err > tol * scale {
            failures.push(format!(
                "{what} {} layer {}: max|diff| {err:.3e} (scale {scale:.3e}, len {} vs {})",
                w.0,
                w.1,
                gv.2.len(),
                w.2.len()
            ));
        }
    }
    (want.len(), failures)
}

/// The parity tests every architecture runs, as `#[test]` functions: prefill, cached decode and
/// greedy against transformers, snapshot/restore, chunked prefill, every prefill split, and
/// `forward_last`. Invoke in a test file with the crate's fixture cases, its tolerance, a
/// function binding a [`Cmf`] to a model, and the case/prompt/split used for snapshot/restore:
///
/// ```ignore
/// test_support::causal_lm_parity_tests!(CASES, TOL, bind, ("qwen4_exp_a", 1, 20));
/// ```
#[macro_export]
macro_rules! causal_lm_parity_tests {
    ($cases:expr, $tol:expr, $bind:path, ($snap_case:expr, $snap_p:expr, $snap_k:expr)) => {
        use $crate::Profile as __Profile;
        use $crate::harness as __h;

        fn __each(mut f: impl FnMut(&str, &::cmf_format::Cmf) -> Vec<String>) -> Vec<String> {
            let mut failures = Vec::new();
            for case in $cases {
                __h::with_converted(case, __Profile::F32, |cmf| failures.extend(f(case, cmf)));
            }
            failures
        }

        #[test]
        fn f32_prefill_matches_transformers() {
            __h::assert_none(&__each(|case, cmf| {
                __h::prefill_parity(case, &$bind(cmf), $tol)
            }));
        }

        #[test]
        fn f32_cached_decode_and_greedy_match_transformers() {
            __h::assert_none(&__each(|case, cmf| {
                __h::decode_and_greedy_parity(case, &$bind(cmf), $tol)
            }));
        }

        /// Mid-window for every cache, so buffers and recurrent state matter.
        #[test]
        fn snapshot_restore_forgets_the_extra_tokens() {
            let failures = __h::with_converted($snap_case, __Profile::F32, |cmf| {
                __h::snapshot_restore_parity(
                    $snap_case,
                    &$bind(cmf),
                    $snap_p,
                    $snap_k,
                    &[1, 2, 3, 503, 7],
                    $tol,
                )
            });
            __h::assert_none(&failures);
        }

        /// Chunks of 7: every chunk starts mid-window.
        #[test]
        fn chunked_prefill_matches_one_shot() {
            __h::assert_none(&__each(|case, cmf| {
                __h::chunked_prefill_parity(case, &$bind(cmf), 7, $tol)
            }));
        }

        #[test]
        fn every_prefill_split_matches_one_shot() {
            let mut splits = 0;
            let failures = __each(|case, cmf| {
                let (f, n) = __h::every_split_parity(case, &$bind(cmf), $tol);
                splits += n;
                f
            });
            eprintln!("{splits} splits, each fed one at a time and as a chunk");
            __h::assert_none(&failures);
        }

        #[test]
        fn forward_last_is_the_last_row_of_forward() {
            __h::assert_none(&__each(|case, cmf| {
                __h::forward_last_is_last_row(case, &$bind(cmf))
            }));
        }

        #[test]
        fn bad_tokens_are_errors() {
            __h::assert_none(&__each(|_, cmf| __h::bad_tokens_are_refused(&$bind(cmf))));
        }
    };
}
