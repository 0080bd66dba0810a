//! The device-resident forward against two independent witnesses: transformers' f32 logits
//! (the shared harness, exactly as the CPU forward is held to them: prefill, cached decode,
//! greedy, every split, chunked prefill, snapshot/restore, `forward_last`, bad tokens), and the
//! CPU forward block by block over every named intermediate of the trace. Runs on lavapipe in
//! CI (`CORTIQ_REQUIRE_GPU=1` turns a missing adapter into a failure).

mod common;

use std::sync::{Arc, OnceLock};

use cmf_format::Cmf;
use common::{CASES, TOL};
use gpu_runtime::{GpuContext, GpuOptions};
use model_qwen4::{CausalLm, ForwardError, GpuModel, Model, Weights};
use test_support::Profile;
use test_support::harness as h;

/// Enough for every fixture prompt and its continuation.
const CTX: usize = 160;

fn ctx() -> Arc<GpuContext> {
    static CTX: OnceLock<Option<Arc<GpuContext>>> = OnceLock::new();
    context(&CTX, false)
}

/// A context whose short frames keep the hyper-connection norm a dispatch of its own, as long
/// frames do (`CORTIQ_HC_NORM=apart`).
fn ctx_norm_apart() -> Arc<GpuContext> {
    static CTX: OnceLock<Option<Arc<GpuContext>>> = OnceLock::new();
    context(&CTX, true)
}

fn context(cell: &OnceLock<Option<Arc<GpuContext>>>, hc_norm_apart: bool) -> Arc<GpuContext> {
    cell.get_or_init(|| {
        let opts = GpuOptions {
            pipeline_cache_dir: None,
            hc_norm_apart,
            ..GpuOptions::default()
        };
        match GpuContext::new(&opts) {
            Ok(c) => {
                eprintln!("adapter: {}", c.describe());
                Some(Arc::new(c))
            }
            Err(e) => {
                eprintln!("no GPU adapter: {e}");
                None
            }
        }
    })
    .clone()
    .expect("a GPU adapter (lavapipe in CI): these tests have nothing to run without one")
}

fn cpu(cmf: &Cmf) -> Model<'_> {
    let (config, weights) = Weights::bind(cmf).unwrap();
    Model::new(config, weights)
}

fn bind(cmf: &Cmf) -> GpuModel<'_> {
    GpuModel::new(cpu(cmf), ctx(), CTX).unwrap_or_else(|u| panic!("upload: {}", u.error))
}

fn each(mut f: impl FnMut(&str, &Cmf) -> Vec<String>) -> Vec<String> {
    let mut failures = Vec::new();
    for case in CASES {
        h::with_converted(case, Profile::F32, |cmf| failures.extend(f(case, cmf)));
    }
    failures
}

// The shared harness's checks (every prefill split excepted: it builds a state per split, and
// the device forward's frames of 8 are covered by chunked prefill and the 13-token prefills).

#[test]
fn f32_prefill_matches_transformers() {
    h::assert_none(&each(|case, cmf| h::prefill_parity(case, &bind(cmf), TOL)));
}

#[test]
fn f32_cached_decode_and_greedy_match_transformers() {
    h::assert_none(&each(|case, cmf| {
        h::decode_and_greedy_parity(case, &bind(cmf), TOL)
    }));
}

/// Restore by buffer copy == never having run the rolled-back tokens.
#[test]
fn snapshot_restore_forgets_the_extra_tokens() {
    let failures = h::with_converted("qwen4_exp_a", Profile::F32, |cmf| {
        h::snapshot_restore_parity("qwen4_exp_a", &bind(cmf), 1, 20, &[1, 2, 3, 503, 7], TOL)
    });
    h::assert_none(&failures);
}

#[test]
fn chunked_prefill_matches_one_shot() {
    h::assert_none(&each(|case, cmf| {
        h::chunked_prefill_parity(case, &bind(cmf), 7, TOL)
    }));
}

#[test]
fn forward_last_is_the_last_row_of_forward() {
    h::assert_none(&each(|case, cmf| {
        h::forward_last_is_last_row(case, &bind(cmf))
    }));
}

/// A prompt fed at once gives the logits of the same prompt fed in frames of 8, bit for bit: a
/// long frame runs every matvec as tiles of the 8-row kernel and every other op per row, in the
/// same order. Every row's logits (64 rows, then 2) and the last row's alone (64 rows, then
/// frames of 8). With the norm apart in short frames too: folded into a short frame's
/// hyper-connection matvecs its sums run in another order (`gpu_fused` bounds that).
#[test]
fn a_long_frame_equals_frames_of_8_bit_for_bit() {
    let failures = each(|case, cmf| {
        let g = GpuModel::new(cpu(cmf), ctx_norm_apart(), CTX)
            .unwrap_or_else(|u| panic!("upload: {}", u.error));
        // The default frames (CORTIQ_PROMPT_ROWS unset), or this test compares frames of 8.
        assert!(g.frame_rows() >= 64, "frames of {} rows", g.frame_rows());
        let ids = test_support::ids(case, 2);
        let in_eights = |ids: &[u32]| {
            let mut st = g.new_state();
            let mut out = Vec::new();
            for f in ids.chunks(8) {
                out.extend(g.forward(f, &mut st).unwrap());
            }
            out
        };
        let same = |what: &str, a: &[f32], b: &[f32]| {
            let differ = a
                .iter()
                .zip(b)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            (a.len() != b.len() || differ > 0).then(|| {
                format!(
                    "{case} {what}: {differ} logits differ ({} vs {} values)",
                    a.len(),
                    b.len()
                )
            })
        };
        let mut failures = Vec::new();
        let all = &ids[..66];
        let at_once = g.forward(all, &mut g.new_state()).unwrap();
        failures.extend(same("every row", &at_once, &in_eights(all)));
        let n = ids.len() / 8 * 8;
        let last = g.forward_last(&ids[..n], &mut g.new_state()).unwrap();
        let eights = in_eights(&ids[..n]);
        let v = last.len();
        failures.extend(same("the last row", &last, &eights[eights.len() - v..]));
        failures
    });
    h::assert_none(&failures);
}

/// The demo model at the q4 profile: a prompt in one frame of 64 rows runs the f16
/// hyper-connection and router matrices through the tiled matmat, the same prompt in frames of
/// 8 through the 8-row kernel (`common::long_frame_against_eights`). The q8_2f matrices on
/// int8 activations: gpu_int8.rs.
#[test]
fn a_long_frame_of_f16_matrices_runs_tiled_and_agrees_with_frames_of_8() {
    assert!(ctx().tiled_matmat, "CORTIQ_MATMAT=plain is set");
    let failures = h::with_converted("shakespeare", Profile::Q4, |cmf| {
        common::long_frame_against_eights(&bind(cmf), 1e-4)
    });
    h::assert_none(&failures);
}

#[test]
fn bad_tokens_are_errors() {
    let failures = h::with_converted("qwen4_exp_a", Profile::F32, |cmf| {
        h::bad_tokens_are_refused(&bind(cmf))
    });
    h::assert_none(&failures);
}

/// Every named intermediate of the GPU forward against the CPU forward's, for a prefill of two
/// frames (13 tokens: 8 + 5) and three decoded tokens, and for a prompt's frame of 32 rows
/// followed by a frame of 8: within `2e-5 x max|value|` of that
/// intermediate (f32 sums in another order: tree reductions, fused multiply-adds). The routed
/// experts run through the grouped kernels.
#[test]
fn every_block_matches_the_cpu_forward() {
    every_block_matches(true);
}

/// The same with one matrix per routed expert (the fallback of a bank too large for a
/// binding).
#[test]
fn every_block_matches_the_cpu_forward_without_expert_banks() {
    every_block_matches(false);
}

fn every_block_matches(banks: bool) {
    h::assert_none(&compare_blocks(&CASES, Profile::F32, banks, 2e-5));
}

/// Every traced intermediate, GPU against CPU, over `cases` converted with `profile`; the
/// failures (an intermediate off by more than `tol x max|value|`).
pub fn compare_blocks(cases: &[&str], profile: Profile, banks: bool, tol: f32) -> Vec<String> {
    let mut failures = Vec::new();
    for &case in cases {
        test_support::harness::with_converted(case, profile, |cmf| {
            let c = cpu(cmf);
            let g = GpuModel::with_banks(cpu(cmf), ctx(), CTX, banks)
                .unwrap_or_else(|u| panic!("upload: {}", u.error));
            let layers = c.config.num_hidden_layers;
            assert_eq!(g.grouped_layers(), if banks { layers } else { 0 });
            g.set_tracing(true);
            // Frames of 8 and 5 rows then three decoded tokens; and, in a second sequence, a
            // prompt's frame of 32 rows (the matvecs in tiles of 8) then a frame of 8.
            let (short, long) = (test_support::ids(case, 0), test_support::ids(case, 2));
            let short: [&[u32]; 4] = [&short[..13], &short[13..14], &short[14..15], &short[15..16]];
            let long: [&[u32]; 2] = [&long[..32], &long[32..40]];
            let mut names = 0;
            for (seq, steps) in [(0, &short[..]), (1, &long[..])] {
                let (mut sc, mut sg) = (c.new_state(), g.new_state());
                for (si, step) in steps.iter().enumerate() {
                    let what = format!("{case} sequence {seq} step {si}");
                    let (n, f) = test_support::harness::compare_step(
                        &what, &c, &mut sc, &g, &mut sg, step, tol,
                    );
                    names += n;
                    failures.extend(f);
                }
            }
            eprintln!("{case} {profile:?}: {names} intermediates compared");
        });
    }
    failures
}

/// The quantised profiles (q8_2f, q4tp, q2tp, mxfp4 and f16 matrices), f32 activations on
/// both sides: the device decoders against the CPU's, block by block.
#[test]
fn quantised_profiles_match_the_cpu_forward_block_by_block() {
    let mut failures = Vec::new();
    for profile in [Profile::Q8, Profile::Q4, Profile::Q2, Profile::Fp4] {
        failures.extend(compare_blocks(&["qwen4_exp_a"], profile, true, 2e-5));
    }
    h::assert_none(&failures);
}

/// The steady decode loop creates nothing: after the first step of each shape, no frame is
/// recorded again (buffers and bind groups are only made when one is).
#[test]
fn steady_decode_records_no_new_frames() {
    test_support::harness::with_converted("qwen4_exp_a", Profile::F32, |cmf| {
        let g = bind(cmf);
        let mut st = g.new_state();
        let mut tok = g
            .forward_greedy(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &mut st)
            .unwrap();
        tok = g.forward_greedy(&[tok], &mut st).unwrap();
        let after_warmup = st.recorded_frames();
        for _ in 0..16 {
            tok = g.forward_greedy(&[tok], &mut st).unwrap();
        }
        assert_eq!(st.recorded_frames(), after_warmup);
        // Frames of 8 and 3 rows, then the 1-row decode frame.
        assert_eq!(after_warmup, 3);
    });
}

/// The token chosen on the device is the argmax of the CPU's logits, step after step.
#[test]
fn device_greedy_matches_the_cpu() {
    test_support::harness::with_converted("qwen4_exp_b", test_support::Profile::F32, |cmf| {
        let c = cpu(cmf);
        let g = bind(cmf);
        let ids = test_support::ids("qwen4_exp_b", 0);
        let (mut sc, mut sg) = (c.new_state(), g.new_state());
        let mut want = test_support::argmax(&c.forward_last(&ids[..11], &mut sc).unwrap()) as u32;
        let mut got = g.forward_greedy(&ids[..11], &mut sg).unwrap();
        for _ in 0..12 {
            assert_eq!(got, want);
            want = test_support::argmax(&c.forward_last(&[want], &mut sc).unwrap()) as u32;
            got = g.forward_greedy(&[got], &mut sg).unwrap();
        }
    });
}

/// Past the allocated context, a state from another model: typed errors, nothing run.
#[test]
fn context_overflow_and_foreign_states_are_refused() {
    test_support::harness::with_converted("qwen4_exp_a", test_support::Profile::F32, |cmf| {
        let g = bind(cmf);
        let other = bind(cmf);
        let mut st = g.new_state();
        let long = vec![1u32; CTX + 1];
        match g.forward(&long, &mut st) {
            Err(ForwardError::Context { needed, ctx }) => {
                assert_eq!((needed, ctx), (CTX + 1, CTX))
            }
            r => panic!("expected a context error, got {:?}", r.map(|v| v.len())),
        }
        assert_eq!(st.pos, 0, "a refused forward must not advance the state");
        let mut foreign = other.new_state();
        assert!(matches!(
            g.forward(&[1, 2], &mut foreign),
            Err(ForwardError::StateMismatch(_))
        ));
    });
}

/// `GpuState::restore` copies a snapshot back into the state's own buffers (its recorded
/// frames stay valid): the continuation equals the one-shot prefill's logits, as if the
/// rolled-back tokens had never run.
#[test]
fn restore_in_place_forgets_the_extra_tokens() {
    let failures = h::with_converted("qwen4_exp_c", Profile::F32, |cmf| {
        let g = bind(cmf);
        let ids = test_support::ids("qwen4_exp_c", 0);
        let k = 11;
        let want = g.forward_prefill(&ids).unwrap();
        let mut st = g.new_state();
        g.forward(&ids[..k], &mut st).unwrap();
        let snap = st.clone();
        g.forward(&[5, 9, 200, 3, 3, 3, 1, 2, 4], &mut st).unwrap();
        st.restore(&snap).unwrap();
        assert_eq!(st.pos, k);
        let got = g.forward(&ids[k..], &mut st).unwrap();
        let v = g.vocab_size();
        let err = test_support::max_abs_diff(&got, &want[k * v..]);
        let scale = test_support::max_abs(&want);
        if err > TOL * scale {
            vec![format!(
                "restored continuation: max|diff| {err:.3e} (scale {scale:.3e})"
            )]
        } else {
            Vec::new()
        }
    });
    h::assert_none(&failures);
}

/// A batched decode step (one row per sequence, up to 8 to a frame, each sequence at its own
/// position) gives every sequence the logits the CPU forward gives it fed alone: 9 sequences
/// with prompts of 1..9 tokens (two frames: 8 rows and a lone one), then the set changing
/// (a sequence leaving, one fed on its own between batched steps). A combination's step is
/// recorded once; dropping a state drops the steps that bind it.
#[test]
fn batched_decode_matches_each_sequence_alone() {
    let failures = each(|case, cmf| {
        let c = cpu(cmf);
        let g = bind(cmf);
        let ids = test_support::ids(case, 0);
        let v = g.vocab_size();
        let n = 9;
        let mut cpu_states: Vec<_> = (0..n).map(|_| c.new_state()).collect();
        let mut gpu_states: Vec<_> = (0..n).map(|_| g.new_state()).collect();
        for (k, (sc, sg)) in cpu_states.iter_mut().zip(&mut gpu_states).enumerate() {
            c.forward(&ids[..k + 1], sc).unwrap();
            g.forward(&ids[..k + 1], sg).unwrap();
        }
        let mut failures = Vec::new();
        let mut live: Vec<usize> = (0..n).collect();
        let mut recorded_after_first = 0;
        for step in 0..6 {
            if step == 3 {
                // Sequence 2 leaves; sequence 5 is fed alone once, then rejoins.
                live.retain(|&k| k != 2);
                let tok = ids[(5 + step) % ids.len()];
                let want = c.forward_last(&[tok], &mut cpu_states[5]).unwrap();
                let got = g
                    .forward_rows(&mut [(tok, &mut gpu_states[5])])
                    .unwrap()
                    .remove(0);
                let err = test_support::max_abs_diff(&got, &want);
                if err > TOL * test_support::max_abs(&want) {
                    failures.push(format!("{case}: lone step: max|diff| {err:.3e}"));
                }
            }
            let toks: Vec<u32> = live
                .iter()
                .map(|&k| ids[(k * 3 + step) % ids.len()])
                .collect();
            // `live` is in order: the states it names, in its order.
            let mut batch: Vec<(u32, &mut _)> = gpu_states
                .iter_mut()
                .enumerate()
                .filter(|(k, _)| live.contains(k))
                .zip(&toks)
                .map(|((_, st), &tok)| (tok, st))
                .collect();
            let got = g.forward_rows(&mut batch).unwrap();
            drop(batch);
            assert_eq!(got.len(), live.len());
            for ((&k, &tok), row) in live.iter().zip(&toks).zip(&got) {
                assert_eq!(row.len(), v);
                let want = c.forward_last(&[tok], &mut cpu_states[k]).unwrap();
                let err = test_support::max_abs_diff(row, &want);
                let scale = test_support::max_abs(&want);
                if err > TOL * scale {
                    failures.push(format!(
                        "{case}: step {step}, sequence {k} (pos {}): max|diff| {err:.3e} \
                         (scale {scale:.3e})",
                        gpu_states[k].pos
                    ));
                }
                assert_eq!(gpu_states[k].pos, cpu_states[k].pos);
            }
            if step == 0 {
                recorded_after_first = g.batched_graphs();
                // Two frames: 8 rows, and the ninth sequence alone on its own path.
                assert_eq!(recorded_after_first, 1);
            }
            if step == 2 {
                assert_eq!(
                    g.batched_graphs(),
                    recorded_after_first,
                    "steady steps record nothing"
                );
            }
        }
        let before = g.batched_graphs();
        assert_eq!(before, 2, "the set before and after sequence 2 left");
        drop(gpu_states.remove(2));
        assert_eq!(g.batched_graphs(), 1, "the dropped state's step is gone");
        failures
    });
    h::assert_none(&failures);
}

/// The MTP head on the device against the CPU head (every fixture with a pseudo-random head):
/// the trunk's final streams read back with its logits, the head over all prompt rows in one
/// call (frames of 8, each stream's projection in runs of 8 matvec rows), a chained draft's
/// greedy token on the device, and its cache cut back and run again.
#[test]
fn the_mtp_head_on_the_device_matches_the_cpu_head() {
    use model_qwen4::{MtpHead, MtpState};
    let mut failures = Vec::new();
    for (i, case) in CASES.iter().enumerate() {
        test_support::mtp::with_mtp_head(case, Profile::F32, 3 + i as u64, |cmf| {
            let c = cpu(cmf);
            let g = bind(cmf);
            let mut fail = |what: &str, got: &[f32], want: &[f32]| {
                let err = test_support::max_abs_diff(got, want);
                let scale = test_support::max_abs(want);
                if got.len() != want.len() || err > TOL * scale {
                    failures.push(format!(
                        "{case}: {what}: max|diff| {err:.3e} (scale {scale:.3e}, {} vs {} values)",
                        got.len(),
                        want.len()
                    ));
                }
            };
            let ids = test_support::ids(case, 0);
            let n = (ids.len() - 1).min(19);
            let hd = c.config.hc_count * c.config.hidden_size;
            let mut cs = c.new_state();
            let (cl, chs) = c.forward_streams(&ids[..n], &mut cs, false).unwrap();
            let mut gs = g.new_state();
            let (gl, ghs) = g.forward_streams(&ids[..n], &mut gs, false).unwrap();
            fail("trunk logits", &gl, &cl);
            fail("trunk streams", &ghs, &chs);
            // The streams of frames with no head and with the last row's head, and of a
            // one-row step (what the drafting loop's prefill and plain steps read).
            let mut cs2 = c.new_state();
            let (cl2, chs2) = c.forward_streams(&ids[..n], &mut cs2, true).unwrap();
            let mut gs2 = g.new_state();
            let (gl2, ghs2) = g.forward_streams(&ids[..n], &mut gs2, true).unwrap();
            fail("last-row logits", &gl2, &cl2);
            fail("streams of a last-row forward", &ghs2, &chs2);
            let (cl3, chs3) = c.forward_streams(&ids[n..n + 1], &mut cs2, true).unwrap();
            let (gl3, ghs3) = g.forward_streams(&ids[n..n + 1], &mut gs2, true).unwrap();
            fail("a one-row step's logits", &gl3, &cl3);
            fail("a one-row step's streams", &ghs3, &chs3);

            let mut cm = MtpState::default();
            let cw = c
                .mtp_forward(&chs[..(n - 1) * hd], &ids[1..n], &mut cm, true)
                .unwrap();
            let mut gm = g.new_mtp_state().unwrap();
            let gw = g
                .mtp_forward(&chs[..(n - 1) * hd], &ids[1..n], &mut gm, MtpHead::Logits)
                .unwrap();
            fail("head streams over the prompt", &gw.streams, &cw.streams);
            fail("head logits", &gw.logits, &cw.logits);
            assert_eq!(gm.len(), n - 1);

            // A chained draft from the head's own last output.
            let x = &cw.streams[(n - 2) * hd..];
            let tok = test_support::argmax(&cw.logits) as u32;
            let cd = c.mtp_forward(x, &[tok], &mut cm, true).unwrap();
            let gd = g.mtp_forward(x, &[tok], &mut gm, MtpHead::Argmax).unwrap();
            fail("chained draft streams", &gd.streams, &cd.streams);
            let picked = gd.token.expect("asked for") as usize;
            let best = cd.logits[test_support::argmax(&cd.logits)];
            // Near-ties may break either way: the pick must be a best within the tolerance.
            let gap = best - cd.logits[picked];
            assert!(
                gap <= TOL * test_support::max_abs(&cd.logits),
                "{case}: the device's draft {picked} is {gap:.3e} below the best"
            );

            // Cut back to before the draft and run it again: the same rows.
            gm.truncate(n - 1);
            let again = g.mtp_forward(x, &[tok], &mut gm, MtpHead::Logits).unwrap();
            fail("the cut cache's rerun", &again.logits, &cd.logits);
        });
    }
    h::assert_none(&failures);
}

/// A rollback on the device (the recurrent state saved before the rows, copied back after;
/// the attention caches only see their position reset) continues with transformers' logits,
/// as if the rolled-back tokens had never run, also across an indexer block boundary and
/// after a saved snapshot's buffers are reused.
#[test]
fn device_rollback_forgets_the_rolled_back_tokens() {
    let failures = each(|case, cmf| {
        let g = bind(cmf);
        let ids = test_support::ids(case, 0);
        let want = g.forward_prefill(&ids).unwrap();
        let v = g.vocab_size();
        let mut out = Vec::new();
        let mut snap = None;
        let mut st = g.new_state();
        for (k, extra) in [(3usize, 1usize), (5, 8), (9, 3)] {
            let k = k.min(ids.len() - 1);
            g.reset(&mut st);
            g.forward(&ids[..k], &mut st).unwrap();
            st.save_recurrent(&mut snap).unwrap();
            let junk: Vec<u32> = (0..extra as u32).map(|i| (i * 37 + 5) % v as u32).collect();
            g.forward(&junk, &mut st).unwrap();
            st.rollback(snap.as_ref().unwrap()).unwrap();
            assert_eq!(st.pos, k);
            let got = g.forward(&ids[k..], &mut st).unwrap();
            let err = test_support::max_abs_diff(&got, &want[k * v..]);
            let scale = test_support::max_abs(&want);
            if err > TOL * scale {
                out.push(format!(
                    "{case}: k {k}, {extra} rolled back: max|diff| {err:.3e}"
                ));
            }
        }
        out
    });
    h::assert_none(&failures);
}
