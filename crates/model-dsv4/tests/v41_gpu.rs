//! The deepseek_v41 device forward (`v41::GpuModel`) on both V4.1 fixtures: f32 logits against
//! transformers (prefill, cached decode, the greedy continuation), every intermediate against
//! the CPU forward block by block (prompts long enough that every sliding window wraps, every
//! KV source publishes entries and keys, the candidate blocks exclude entries and the top-k
//! drops some), chunked prefill, snapshot/restore (the Engram look-back included), experts
//! split between the global bank and the CPU, and the typed refusals. On lavapipe in CI.

mod common;

use common::gpu_ctx as ctx;

use cmf_format::Cmf;
use common::token_map;
use model_core::expert_cache::CachePolicy;
use model_dsv4::v41::gpu::GpuModel;
use model_dsv4::v41::{ForwardError, Model, Weights};
use model_dsv4::{CausalLm, ExpertPlacement, Residency};
use test_support::Profile;
use test_support::harness as h;

const CASES: [&str; 2] = ["deepseek_v41_a", "deepseek_v41_b"];

/// As the CPU forward's parity tests (tests/v41_parity.rs): ten times tighter than the issue's
/// 1e-4 x max|logit|.
const TOL: f32 = 1e-5;

const CTX: usize = 160;

/// The block-by-block bound (relative to each intermediate's max|value|). V4.1's fake
/// quantisers round the window latents, entries, keys and indexer queries onto FP8/FP4 grids:
/// a discontinuity that f32 summation order (an ulp upstream: the device's matvecs and
/// attention sum in another order than the CPU) can push a value across. One such rounding
/// moved by an ulp moves the later intermediates by up to 7.8e-4 of their scale (the largest
/// measured: an H100, deepseek_v41_a prompt 1, 39 tokens in; on lavapipe 1.7e-4, prompt 2 with
/// half the experts cold). Every V4.1 feature moves them by far more (switching off the
/// Engram, the indexer top-k or the candidate blocks moves the logits by 1.17 / 1.51 / 0.60 of
/// max|logit| ~2: `feature_probes` in the fixtures' cases.json), as does a wrong grid or scale
/// (a whole FP4 step, 1/6 of a block's range), so this bound still tells them apart.
const BLOCK_TOL: f32 = 1e-3;

fn cpu(cmf: &Cmf) -> Model<'_> {
    let (config, weights) = Weights::bind(cmf, Some(token_map(cmf))).unwrap();
    Model::new(config, weights)
}

fn bind(cmf: &Cmf) -> GpuModel<'_> {
    GpuModel::new(cpu(cmf), ctx(), CTX).unwrap_or_else(|u| panic!("upload: {}", u.error))
}

type Split = fn(usize, usize) -> Vec<usize>;

/// The model with `resident(layers, experts)` experts of each layer in the global bank, in
/// segments of about a third of its slots, changing while it runs as `policy` says.
fn bind_split(cmf: &Cmf, (resident, policy): (Split, CachePolicy)) -> GpuModel<'_> {
    let m = cpu(cmf);
    let (nl, ne) = (m.config.num_hidden_layers, m.config.n_routed_experts);
    let per = resident(nl, ne);
    let total: usize = per.iter().sum();
    let place = ExpertPlacement {
        residency: Residency::PerLayer(per),
        segment_slots: Some(total.div_ceil(3).max(1)),
        policy,
        warm: None,
    };
    GpuModel::with_experts(m, ctx(), CTX, &place).unwrap_or_else(|u| panic!("upload: {}", u.error))
}

/// No expert resident, half of each layer's (learned and static), and all of them.
fn splits() -> [(&'static str, (Split, CachePolicy)); 4] {
    let learned = CachePolicy::Learned;
    [
        ("none resident", (|nl, _| vec![0; nl], learned)),
        (
            "half resident, learned",
            (|nl, ne| vec![ne / 2; nl], learned),
        ),
        (
            "half resident, static",
            (|nl, ne| vec![ne / 2; nl], CachePolicy::Static),
        ),
        ("all resident", (|nl, ne| vec![ne; nl], learned)),
    ]
}

fn each(mut f: impl FnMut(&str, &Cmf) -> Vec<String>) -> Vec<String> {
    let mut failures = Vec::new();
    for case in CASES {
        h::with_converted(case, Profile::F32, |cmf| failures.extend(f(case, cmf)));
    }
    failures
}

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

/// Mid-window and mid-group (prompt 1 of deepseek_v41_a at 21 tokens): the device caches and
/// the host's n-gram look-back come back together.
#[test]
fn snapshot_restore_forgets_the_extra_tokens() {
    let failures = h::with_converted("deepseek_v41_a", Profile::F32, |cmf| {
        h::snapshot_restore_parity("deepseek_v41_a", &bind(cmf), 1, 21, &[1, 2, 3, 503, 7], TOL)
    });
    h::assert_none(&failures);
}

/// Chunks of 7: every chunk starts mid-window, and frames of 7 and 8 rows complete several
/// groups of each KV source.
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

#[test]
fn bad_tokens_are_errors() {
    let failures = h::with_converted("deepseek_v41_a", Profile::F32, |cmf| {
        h::bad_tokens_are_refused(&bind(cmf))
    });
    h::assert_none(&failures);
}

/// Every traced intermediate (the block inputs after the single-pass collapses, attention and
/// MoE outputs, the streams, the head, the logits), GPU against CPU, over a 13-token prefill in
/// frames of 8 and 5 and then single-token decode steps up to position 40: past the sliding
/// window (8 or 6), the ratio-2 and ratio-1 sources' entries, the candidate blocks and the
/// top-k (6 or 4 of up to 40 entries) both dropping entries.
fn compare_blocks(
    cases: &[&str],
    profile: Profile,
    tol: f32,
    split: Option<(Split, CachePolicy)>,
) -> Vec<String> {
    let mut failures = Vec::new();
    for &case in cases {
        h::with_converted(case, profile, |cmf| {
            let c = cpu(cmf);
            let g = match split {
                Some(split) => bind_split(cmf, split),
                None => bind(cmf),
            };
            g.set_tracing(true);
            for prompt in 0..3 {
                let ids = test_support::ids(case, prompt);
                let mut steps: Vec<Vec<u32>> = vec![ids[..13].to_vec()];
                steps.extend((13..40).map(|p| vec![ids[p % ids.len()]]));
                let (mut sc, mut sg) = (c.new_state(), g.new_state());
                let mut names = 0;
                for (si, step) in steps.iter().enumerate() {
                    let what = format!("{case} {profile:?} p{prompt} step {si}");
                    let (n, f) = h::compare_step(&what, &c, &mut sc, &g, &mut sg, step, tol);
                    names += n;
                    failures.extend(f);
                }
                eprintln!("{case} {profile:?} p{prompt}: {names} intermediates compared");
                assert!(names > 0);
            }
        });
    }
    failures
}

#[test]
fn every_block_matches_the_cpu_forward() {
    h::assert_none(&compare_blocks(&CASES, Profile::F32, BLOCK_TOL, None));
}

/// Quantised weights (q4tp, and the FP4 experts), f32 activations on both sides.
#[test]
fn quantised_profiles_match_the_cpu_forward_block_by_block() {
    let mut failures = Vec::new();
    for profile in [Profile::Q4, Profile::Fp4] {
        failures.extend(compare_blocks(
            &["deepseek_v41_a"],
            profile,
            BLOCK_TOL,
            None,
        ));
    }
    h::assert_none(&failures);
}

/// The global expert bank and the cold path (item 3 on item 2's machinery): with no expert,
/// half of them and all of them resident, every intermediate matches the CPU forward, the
/// greedy continuation is transformers', and the counters see the cold slots.
#[test]
fn experts_split_between_the_bank_and_the_cpu_match_the_cpu() {
    let mut failures = Vec::new();
    for (what, split) in splits() {
        eprintln!("{what}:");
        failures.extend(compare_blocks(&CASES, Profile::F32, BLOCK_TOL, Some(split)));
        for case in CASES {
            h::with_converted(case, Profile::F32, |cmf| {
                let g = bind_split(cmf, split);
                failures.extend(h::decode_and_greedy_parity(case, &g, TOL));
                let (resident, all) = g.resident_experts();
                let s = g.cold_stats();
                assert!(s.routed > 0);
                match resident {
                    0 => assert_eq!(s.cold, s.routed, "{what}: every slot cold"),
                    r if r == all => assert_eq!(s.cold, 0, "{what}: no slot cold"),
                    _ => assert!(s.cold > 0 && s.cold < s.routed, "{what}: {s:?}"),
                }
            });
        }
    }
    h::assert_none(&failures);
}

/// The steady decode loop creates nothing: after the first step of each shape, no frame is
/// recorded again.
#[test]
fn steady_decode_records_no_new_frames() {
    h::with_converted("deepseek_v41_a", Profile::F32, |cmf| {
        let g = bind(cmf);
        let mut st = g.new_state();
        g.forward_last(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &mut st)
            .unwrap();
        g.forward_last(&[4], &mut st).unwrap();
        let after_warmup = st.recorded_frames();
        for t in 0..16 {
            g.forward_last(&[t + 5], &mut st).unwrap();
        }
        assert_eq!(st.recorded_frames(), after_warmup);
        assert_eq!(after_warmup, 3);
    });
}

/// Past the allocated context, a state from another model: typed errors, nothing run.
#[test]
fn context_overflow_and_foreign_states_are_refused() {
    use model_dsv4::ForwardError as Device;
    h::with_converted("deepseek_v41_a", Profile::F32, |cmf| {
        let g = bind(cmf);
        let other = bind(cmf);
        let mut st = g.new_state();
        let long = vec![5u32; CTX + 1];
        match g.forward(&long, &mut st) {
            Err(ForwardError::Device(Device::Context { needed, ctx })) => {
                assert_eq!((needed, ctx), (CTX + 1, CTX))
            }
            r => panic!("expected a context error, got {:?}", r.map(|v| v.len())),
        }
        assert_eq!(st.pos, 0, "a refused forward must not advance the state");
        let mut foreign = other.new_state();
        assert!(matches!(
            g.forward(&[5, 6], &mut foreign),
            Err(ForwardError::Device(Device::StateMismatch(_)))
        ));
    });
}
