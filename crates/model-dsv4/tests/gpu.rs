//! The deepseek_v4 device forward ([`GpuModel`]) on every fixture: f32 logits against
//! transformers (prefill, cached decode, greedy), every intermediate against the CPU forward
//! block by block (prompts long enough that every sliding window wraps, every compressor
//! emits and the indexer's top-k drops entries), chunked prefill, snapshot/restore, and the
//! typed refusals. On lavapipe in CI: a missing adapter fails these tests.

mod common;

use common::gpu_ctx as ctx;

use cmf_format::Cmf;
use common::{CASES, TOL};
use model_core::expert_cache::CachePolicy;
use model_dsv4::{CausalLm, ExpertPlacement, ForwardError, GpuModel, Model, Residency, Weights};
use test_support::Profile;
use test_support::harness as h;

const CTX: usize = 160;

fn cpu(cmf: &Cmf) -> Model<'_> {
    let (config, weights) = Weights::bind(cmf).unwrap();
    Model::new(config, weights)
}

fn bind(cmf: &Cmf) -> GpuModel<'_> {
    GpuModel::new(cpu(cmf), ctx(), CTX).unwrap_or_else(|u| panic!("upload: {}", u.error))
}

/// The model with `resident(layers, experts)` experts of each layer in the global bank, in
/// segments of about a quarter of its slots (several segments even on a small model: the
/// fixed set of bindings on lavapipe), changing while it runs as `policy` says.
fn bind_split(cmf: &Cmf, (resident, policy): (Split, CachePolicy)) -> GpuModel<'_> {
    let m = cpu(cmf);
    let (nl, ne) = (m.config.num_hidden_layers, m.config.n_routed_experts);
    let per = resident(nl, ne);
    let total: usize = per.iter().sum();
    let place = ExpertPlacement {
        residency: Residency::PerLayer(per),
        segment_slots: Some(total.div_ceil(4).max(1)),
        policy,
        warm: None,
    };
    GpuModel::with_experts(m, ctx(), CTX, &place).unwrap_or_else(|u| panic!("upload: {}", u.error))
}

/// No expert resident, half of each layer's (the learned cache admitting experts while it
/// runs, and the static residents), the first layer's on the CPU and the rest resident
/// (`--n-cpu-moe 1`), and all of them.
fn splits() -> [(&'static str, (Split, CachePolicy)); 5] {
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
        (
            "first layer cold",
            (
                |nl, ne| (0..nl).map(|l| if l == 0 { 0 } else { ne }).collect(),
                learned,
            ),
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

/// Mid-window for every cache (prompt 1 of deepseek_v4_a at 21 tokens).
#[test]
fn snapshot_restore_forgets_the_extra_tokens() {
    let failures = h::with_converted("deepseek_v4_a", Profile::F32, |cmf| {
        h::snapshot_restore_parity("deepseek_v4_a", &bind(cmf), 1, 21, &[1, 2, 3, 503, 7], TOL)
    });
    h::assert_none(&failures);
}

/// Chunks of 7: every chunk starts mid-window, and frames of 7 and 8 rows complete several
/// compressor windows each.
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
    let failures = h::with_converted("deepseek_v4_a", Profile::F32, |cmf| {
        h::bad_tokens_are_refused(&bind(cmf))
    });
    h::assert_none(&failures);
}

/// Every traced intermediate (the mHC sites' block inputs, attention and MoE outputs, the
/// streams after each block, the head, the logits), GPU against CPU, over a 13-token prefill
/// in frames of 8 and 5 and then single-token decode steps up to position 40: past the
/// sliding window (8 or 16), several HCA entries, and CSA queries that see more entries than
/// `index_topk`.
fn compare_blocks(cases: &[&str], profile: Profile, tol: f32) -> Vec<String> {
    compare_blocks_with(cases, profile, tol, None)
}

type Split = fn(usize, usize) -> Vec<usize>;

/// [`compare_blocks`] with the routed experts resident as `split` says (all, without one).
fn compare_blocks_with(
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
            let ids = test_support::ids(case, 0);
            let mut steps: Vec<Vec<u32>> = vec![ids[..13].to_vec()];
            steps.extend((13..40).map(|p| vec![ids[p % ids.len()]]));
            let (mut sc, mut sg) = (c.new_state(), g.new_state());
            let mut names = 0;
            for (si, step) in steps.iter().enumerate() {
                let what = format!("{case} {profile:?} step {si}");
                let (n, f) = h::compare_step(&what, &c, &mut sc, &g, &mut sg, step, tol);
                names += n;
                failures.extend(f);
            }
            eprintln!("{case} {profile:?}: {names} intermediates compared");
        });
    }
    failures
}

#[test]
fn every_block_matches_the_cpu_forward() {
    h::assert_none(&compare_blocks(&CASES, Profile::F32, 2e-5));
}

/// The steady decode loop creates nothing: after the first step of each shape, no frame is
/// recorded again.
#[test]
fn steady_decode_records_no_new_frames() {
    h::with_converted("deepseek_v4_a", Profile::F32, |cmf| {
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
        // Frames of 8 rows (no head) and 3 rows (the last row's logits), then the decode frame.
        assert_eq!(after_warmup, 3);
    });
}

/// Past the allocated context, a state from another model: typed errors, nothing run.
#[test]
fn context_overflow_and_foreign_states_are_refused() {
    h::with_converted("deepseek_v4_a", Profile::F32, |cmf| {
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

/// The trained demo model (fixtures/deepseek_v4_shakespeare, whose logits are far from tied):
/// the device's greedy continuation of a held-out prompt is the CPU's, token for token, on the
/// fp4 conversion users run (mxfp4 experts, q8_2f projections, f16 mHC and router) and on the
/// exact `source` one.
#[test]
fn trained_demo_greedy_text_matches_the_cpu() {
    let case = "deepseek_v4_shakespeare";
    // `<i4` ids after the .npy header (the harness's reader takes i64 and f32 only).
    let path = test_support::fixture(case).join("expected/heldout_ids.npy");
    let bytes = std::fs::read(path).unwrap();
    let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let prompt: Vec<u32> = bytes[10 + hlen..]
        .chunks_exact(4)
        .take(24)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    for profile in [Profile::Fp4, Profile::Source] {
        h::with_converted(case, profile, |cmf| {
            let c = cpu(cmf);
            let g = bind(cmf);
            let greedy = |m: &dyn Fn(&[u32]) -> Vec<f32>| -> Vec<u32> {
                let mut out = Vec::new();
                let mut next = test_support::argmax(&m(&prompt)) as u32;
                for _ in 0..32 {
                    out.push(next);
                    next = test_support::argmax(&m(&[next])) as u32;
                }
                out
            };
            let sc = std::cell::RefCell::new(c.new_state());
            let want = greedy(&|t| c.forward_last(t, &mut sc.borrow_mut()).unwrap());
            let sg = std::cell::RefCell::new(g.new_state());
            let got = greedy(&|t| g.forward_last(t, &mut sg.borrow_mut()).unwrap());
            assert_eq!(got, want, "{profile:?}");
            let distinct: std::collections::BTreeSet<_> = want.iter().collect();
            assert!(
                distinct.len() > 4,
                "{profile:?}: a degenerate continuation {want:?}"
            );
        });
    }
}

/// The quantised and exact-source profiles (q8_2f, q4tp, q2tp, mxfp4 experts; f16 mHC and
/// router; bf16 from FP8), f32 activations on both sides: the device decoders against the
/// CPU's, block by block.
#[test]
fn quantised_profiles_match_the_cpu_forward_block_by_block() {
    let mut failures = Vec::new();
    for profile in [
        Profile::Q8,
        Profile::Q4,
        Profile::Q2,
        Profile::Fp4,
        Profile::Source,
    ] {
        failures.extend(compare_blocks(&["deepseek_v4_a"], profile, 2e-5));
    }
    h::assert_none(&failures);
}

/// The global expert bank with cold experts computed on the CPU (item 2): with no expert,
/// half of them, the first layer's none and all of them resident, every intermediate of
/// every layer still matches the CPU forward (the cold slots' outputs are the CPU's own, the
/// resident ones the device kernels'), on every fixture and on q4 and fp4 experts; and the
/// counters see the cold slots.
#[test]
fn experts_split_between_the_bank_and_the_cpu_match_the_cpu_block_by_block() {
    let mut failures = Vec::new();
    for (what, split) in splits() {
        for (cases, profile) in [
            (&CASES[..], Profile::F32),
            (&["deepseek_v4_a"][..], Profile::Q4),
            (&["deepseek_v4_a"][..], Profile::Fp4),
        ] {
            eprintln!("{what}:");
            failures.extend(compare_blocks_with(cases, profile, 2e-5, Some(split)));
        }
        h::with_converted("deepseek_v4_a", Profile::F32, |cmf| {
            let g = bind_split(cmf, split);
            let (resident, all) = g.resident_experts();
            let mut st = g.new_state();
            g.forward(&test_support::ids("deepseek_v4_a", 0)[..9], &mut st)
                .unwrap();
            let s = g.cold_stats();
            assert_eq!(
                s.routed,
                9 * (g.model.config.num_experts_per_tok * g.model.config.num_hidden_layers) as u64
            );
            match resident {
                0 => assert_eq!(s.cold, s.routed, "{what}: every slot cold"),
                r if r == all => assert_eq!(s.cold, 0, "{what}: no slot cold"),
                _ => assert!(s.cold > 0 && s.cold < s.routed, "{what}: {s:?}"),
            }
            // Half resident: the learned cache trades residents for the experts routed to
            // (none of its residents has been routed to before the first frame), the static
            // one never does.
            if what.starts_with("half") {
                let learned = split.1 == CachePolicy::Learned;
                assert_eq!(s.admitted > 0, learned, "{what}: {s:?}");
            }
            if resident > 0 {
                let (segments, binding) = g.bank_binding().unwrap();
                eprintln!("{what}: {resident} of {all} resident, {segments} segments, {binding:?}");
                assert!(segments >= 2, "{what}: the bank spans several segments");
            }
        });
    }
    h::assert_none(&failures);
}

/// Item 4: with budgets that leave no expert, about half and all of them resident, the
/// trained demo's greedy text is identical (and the CPU's).
#[test]
fn trained_demo_greedy_text_is_the_same_whatever_is_resident() {
    let case = "deepseek_v4_shakespeare";
    let path = test_support::fixture(case).join("expected/heldout_ids.npy");
    let bytes = std::fs::read(path).unwrap();
    let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let prompt: Vec<u32> = bytes[10 + hlen..]
        .chunks_exact(4)
        .take(24)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect();
    h::with_converted(case, Profile::Fp4, |cmf| {
        let c = cpu(cmf);
        let greedy = |m: &dyn Fn(&[u32]) -> Vec<f32>| -> Vec<u32> {
            let mut out = Vec::new();
            let mut next = test_support::argmax(&m(&prompt)) as u32;
            for _ in 0..32 {
                out.push(next);
                next = test_support::argmax(&m(&[next])) as u32;
            }
            out
        };
        let sc = std::cell::RefCell::new(c.new_state());
        let want = greedy(&|t| c.forward_last(t, &mut sc.borrow_mut()).unwrap());
        for (what, split) in splits() {
            let g = bind_split(cmf, split);
            let sg = std::cell::RefCell::new(g.new_state());
            let got = greedy(&|t| g.forward_last(t, &mut sg.borrow_mut()).unwrap());
            assert_eq!(got, want, "{what}");
        }
    });
}

/// The synthetic model `cortiq bench model --synthetic deepseek-v4-flash` runs (here at the
/// first fixture's small geometry, fp4 experts from a pool of distinct copies, skewed
/// routing): on the device with half of each layer's experts resident, block by block as the
/// CPU forward of the same weights.
#[test]
fn a_synthetic_model_with_half_its_experts_resident_matches_the_cpu() {
    use model_dsv4::synthetic::Synthetic;
    let dir = test_support::fixture("deepseek_v4_a");
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("hf/config.json")).unwrap()).unwrap();
    let dtype_of = |name: &str, _: usize, cols: usize| {
        if name.contains(".mlp.experts.") && cols.is_multiple_of(32) {
            quant_codecs::DType::Mxfp4
        } else {
            quant_codecs::DType::F16
        }
    };
    let s = Synthetic::new(&config, Box::new(dtype_of), 0.3, 5).unwrap();
    assert_eq!(s.pool(), 5);
    let model = || Model::new(s.config.clone(), s.weights().unwrap());
    let (nl, ne) = (s.config.num_hidden_layers, s.config.n_routed_experts);
    let place = ExpertPlacement {
        residency: Residency::PerLayer(vec![ne / 2; nl]),
        segment_slots: Some((nl * ne / 2).div_ceil(3)),
        ..Default::default()
    };
    let g = GpuModel::with_experts(model(), ctx(), CTX, &place)
        .unwrap_or_else(|u| panic!("upload: {}", u.error));
    g.set_tracing(true);
    let c = model();
    let (mut sc, mut sg) = (c.new_state(), g.new_state());
    let ids = test_support::ids("deepseek_v4_a", 0);
    let mut failures = Vec::new();
    let mut steps: Vec<Vec<u32>> = vec![ids[..11].to_vec()];
    steps.extend((11..24).map(|p| vec![ids[p % ids.len()]]));
    for (si, step) in steps.iter().enumerate() {
        let what = format!("synthetic step {si}");
        failures.extend(h::compare_step(&what, &c, &mut sc, &g, &mut sg, step, 2e-5).1);
    }
    let st = g.cold_stats();
    assert!(st.cold > 0 && st.cold < st.routed, "{st:?}");
    h::assert_none(&failures);
}

/// Learned expert scores carry over (#16 item 3 for DeepSeek): a run with half of each
/// layer's experts resident learns scores; a model placed with them starts with each layer's
/// best-scored experts resident (ties to the lower id) instead of the first ids, and a static
/// placement ignores them.
#[test]
fn learned_scores_start_the_next_run_warm() {
    h::with_converted("deepseek_v4_a", Profile::F32, |cmf| {
        let first = cpu(cmf);
        let (nl, ne) = (
            first.config.num_hidden_layers,
            first.config.n_routed_experts,
        );
        let place = |policy, warm| ExpertPlacement {
            residency: Residency::PerLayer(vec![ne / 2; nl]),
            segment_slots: None,
            policy,
            warm,
        };
        let g = GpuModel::with_experts(first, ctx(), CTX, &place(CachePolicy::Learned, None))
            .unwrap_or_else(|u| panic!("upload: {}", u.error));
        let mut st = g.new_state();
        g.forward(&test_support::ids("deepseek_v4_a", 0)[..24], &mut st)
            .unwrap();
        let scores = g.expert_scores();
        assert_eq!(scores.len(), nl);
        let warm = GpuModel::with_experts(
            cpu(cmf),
            ctx(),
            CTX,
            &place(CachePolicy::Learned, Some(scores.clone())),
        )
        .unwrap_or_else(|u| panic!("upload: {}", u.error));
        let cold = GpuModel::with_experts(
            cpu(cmf),
            ctx(),
            CTX,
            &place(CachePolicy::Static, Some(scores.clone())),
        )
        .unwrap_or_else(|u| panic!("upload: {}", u.error));
        let mut moved = 0;
        for (il, s) in scores.iter().enumerate() {
            assert_eq!(s.len(), ne, "layer {il}: a score per expert");
            let mut best: Vec<u32> = (0..ne as u32).collect();
            best.sort_by(|&a, &b| s[b as usize].total_cmp(&s[a as usize]).then(a.cmp(&b)));
            best.truncate(ne / 2);
            best.sort_unstable();
            assert_eq!(warm.learned_residents(il), Some(best.clone()), "layer {il}");
            moved += usize::from(best != (0..(ne / 2) as u32).collect::<Vec<_>>());
            assert_eq!(cold.learned_residents(il), None, "static: not learned");
        }
        assert!(moved > 0, "the scores changed no layer's residents");
        // Same answers either way.
        let ids = &test_support::ids("deepseek_v4_a", 1)[..12];
        let a = warm.forward(ids, &mut warm.new_state()).unwrap();
        let b = g.forward(ids, &mut g.new_state()).unwrap();
        let err = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(err < 1e-4, "{err}");
    });
}
