//! Routed experts split between VRAM and the CPU (a model larger than the VRAM budget): with
//! none, about half and all of each layer's experts resident, the device forward against the
//! CPU forward (an independent witness: its own routing and executor): logits of a prefill and
//! cached decode steps within the device forward's bound, greedy tokens identical, a batched
//! step equal to each sequence alone; the budget's own choice, and a budget too small for the
//! rest of the model refused with the minimum named. Runs on lavapipe in CI.

mod common;

use std::sync::Arc;

use cmf_format::Cmf;
use common::CASES;
use gpu_runtime::{GpuContext, GpuError, GpuOptions};
use model_qwen4::{CachePolicy, CausalLm, GpuModel, Model, Offload, Residency, Weights};
use test_support::Profile;
use test_support::harness as h;

const CTX: usize = 64;

/// The device forward's bound against the CPU's (tests/gpu.rs: f32 accumulation order).
const BOUND: f32 = 2e-5;

fn ctx(budget: Option<u64>) -> Arc<GpuContext> {
    let opts = GpuOptions {
        pipeline_cache_dir: None,
        vram_budget: budget,
        ..GpuOptions::default()
    };
    Arc::new(GpuContext::new(&opts).unwrap_or_else(|e| {
        panic!("a GPU adapter (lavapipe in CI): these tests have nothing to run without one: {e}")
    }))
}

fn cpu(cmf: &Cmf) -> Model<'_> {
    let (config, weights) = Weights::bind(cmf).unwrap();
    Model::new(config, weights)
}

fn with_resident(cmf: &Cmf, per_layer: usize) -> GpuModel<'_> {
    let c = cpu(cmf);
    let n = c.config.num_hidden_layers;
    GpuModel::with_residency(
        c,
        ctx(None),
        CTX,
        true,
        Residency::PerLayer(vec![per_layer; n]),
    )
    .unwrap_or_else(|u| panic!("upload: {}", u.error))
}

/// Prefill, three cached decode steps and 8 greedy tokens: `g` against `c`.
fn compare(case: &str, what: &str, c: &Model<'_>, g: &GpuModel<'_>) -> Vec<String> {
    let mut failures = Vec::new();
    let ids = test_support::ids(case, 0);
    let (mut sc, mut sg) = (c.new_state(), g.new_state());
    let steps: [&[u32]; 4] = [&ids[..13], &ids[13..14], &ids[14..15], &ids[15..16]];
    for (si, step) in steps.iter().enumerate() {
        let want = c.forward(step, &mut sc).unwrap();
        let got = g.forward(step, &mut sg).unwrap();
        let scale = test_support::max_abs(&want).max(1e-3);
        let err = test_support::max_abs_diff(&want, &got);
        if got.len() != want.len() || err > BOUND * scale {
            failures.push(format!(
                "{case} {what} step {si}: max|diff| {err:.3e} of {scale:.3e}"
            ));
        }
    }
    let mut want = test_support::argmax(&c.forward_last(&[ids[16]], &mut sc).unwrap()) as u32;
    let mut got = g.forward_greedy(&[ids[16]], &mut sg).unwrap();
    for i in 0..8 {
        if got != want {
            failures.push(format!("{case} {what}: greedy token {i}: {got} != {want}"));
            break;
        }
        want = test_support::argmax(&c.forward_last(&[want], &mut sc).unwrap()) as u32;
        got = g.forward_greedy(&[got], &mut sg).unwrap();
    }
    failures
}

#[test]
fn none_half_and_all_experts_resident_match_the_cpu() {
    let mut failures = Vec::new();
    for case in CASES {
        h::with_converted(case, Profile::F32, |cmf| {
            let c = cpu(cmf);
            let (ne, nl) = (c.config.num_experts, c.config.num_hidden_layers);
            for per_layer in [0, ne / 2, ne] {
                let g = with_resident(cmf, per_layer);
                assert_eq!(g.resident_experts(), (per_layer * nl, ne * nl));
                failures.extend(compare(case, &format!("{per_layer}/{ne} resident"), &c, &g));
                match g.expert_share() {
                    None => assert_eq!(per_layer, ne, "{case}: a share without cold experts"),
                    Some(s) => {
                        eprintln!(
                            "{case} {per_layer}/{ne} resident: {:.1}% in VRAM",
                            100.0 * s
                        );
                        assert!(per_layer < ne);
                        if per_layer == 0 {
                            assert_eq!(s, 0.0, "{case}: nothing resident");
                        } else {
                            assert!(s > 0.0 && s < 1.0, "{case}: share {s}");
                        }
                    }
                }
            }
        });
    }
    h::assert_none(&failures);
}

/// A batched step (several sequences' rows in one frame) with half the experts on the CPU:
/// each sequence's logits equal the CPU forward's for it alone.
#[test]
fn a_batched_step_with_cold_experts_matches_each_sequence_alone() {
    h::with_converted("qwen4_exp_a", Profile::F32, |cmf| {
        let c = cpu(cmf);
        let g = with_resident(cmf, c.config.num_experts / 2);
        let prompts: Vec<Vec<u32>> = (0..3)
            .map(|i| test_support::ids("qwen4_exp_a", i))
            .collect();
        let mut cs: Vec<_> = prompts.iter().map(|_| c.new_state()).collect();
        let mut gs: Vec<_> = prompts.iter().map(|_| g.new_state()).collect();
        let mut next = Vec::new();
        for ((p, sc), sg) in prompts.iter().zip(&mut cs).zip(&mut gs) {
            let l = c.forward_last(&p[..9], sc).unwrap();
            g.forward_last(&p[..9], sg).unwrap();
            next.push(test_support::argmax(&l) as u32);
        }
        let mut seqs: Vec<(u32, &mut model_qwen4::GpuState)> =
            next.iter().copied().zip(gs.iter_mut()).collect();
        let got = g.forward_rows(&mut seqs).unwrap();
        for ((tok, sc), gl) in next.iter().zip(&mut cs).zip(&got) {
            let want = c.forward_last(&[*tok], sc).unwrap();
            let scale = test_support::max_abs(&want);
            let err = test_support::max_abs_diff(&want, gl);
            assert!(err <= BOUND * scale, "max|diff| {err:.3e} of {scale:.3e}");
        }
    });
}

/// `Residency::Budget`: what is left of the VRAM budget after every other weight holds
/// about half the experts, so about half are resident, and the forward still matches; a
/// budget below the rest of the model is refused naming what it needs.
#[test]
fn the_budget_places_what_fits_and_refuses_too_little() {
    h::with_converted("qwen4_exp_b", Profile::F32, |cmf| {
        let c = cpu(cmf);
        let w = &c.weights;
        let (ne, nl) = (c.config.num_experts, c.config.num_hidden_layers);
        let rest = w.bytes_per_token(0);
        let experts = w.bytes_per_token(ne) - rest;
        // What the device holds with every expert resident, less half the experts.
        let full = GpuModel::new(cpu(cmf), ctx(None), CTX)
            .unwrap_or_else(|u| panic!("upload: {}", u.error))
            .resident_bytes();
        let budget = full - experts / 2;
        let g = GpuModel::with_residency(cpu(cmf), ctx(Some(budget)), CTX, true, Residency::Budget)
            .unwrap_or_else(|u| panic!("upload: {}", u.error));
        let (hot, all) = g.resident_experts();
        assert_eq!(all, ne * nl);
        assert!(
            hot > 0 && hot < all,
            "{hot} of {all} resident at half the experts' bytes"
        );
        eprintln!("budget {budget} B: {hot} of {all} experts resident");
        h::assert_none(&compare("qwen4_exp_b", "budget", &c, &g));

        let small = rest / 2;
        let err = match GpuModel::with_residency(
            cpu(cmf),
            ctx(Some(small)),
            CTX,
            true,
            Residency::Budget,
        ) {
            Ok(_) => panic!("a budget of half the non-expert weights was taken"),
            Err(u) => u.error,
        };
        let GpuError::BudgetTooSmall { needed_mib, .. } = err else {
            panic!("expected BudgetTooSmall, got {err}");
        };
        assert_eq!(needed_mib, rest.div_ceil(1 << 20));
        assert!(err.to_string().contains("--vram"), "{err}");
    });
}

/// Experts admitted into the banks while running (each policy that admits, up to every cold
/// expert of a frame; the learned one also prefetching the next layer's likeliest experts):
/// the uploads land in the slots the map names before the layer routes, so the answers stay
/// the CPU's; the static policy admits nothing.
#[test]
fn admissions_while_running_keep_the_answers() {
    h::with_converted("qwen4_exp_c", Profile::F32, |cmf| {
        let c = cpu(cmf);
        let (ne, nl) = (c.config.num_experts, c.config.num_hidden_layers);
        for (policy, prefetch) in [
            (CachePolicy::Lru, 0),
            (CachePolicy::Learned, 0),
            (CachePolicy::Learned, 2),
            (CachePolicy::Static, 0),
        ] {
            let offload = Offload {
                policy,
                max_admissions: ne,
                prefetch,
                ..Offload::with(Residency::PerLayer(vec![ne / 2; nl]))
            };
            let g = GpuModel::with_offload(cpu(cmf), ctx(None), CTX, true, offload)
                .unwrap_or_else(|u| panic!("upload: {}", u.error));
            let what = format!("{policy:?}, prefetching {prefetch}");
            h::assert_none(&compare("qwen4_exp_c", &what, &c, &g));
            let stats = g.offload_stats();
            eprintln!("{what}: {stats:?}");
            assert_eq!(
                stats.admitted > 0,
                policy != CachePolicy::Static,
                "{stats:?}"
            );
            // Prefetches land before their layer routes: the answers above are the proof.
            assert_eq!(stats.prefetched > 0, prefetch > 0, "{stats:?}");
            assert_eq!(g.resident_experts(), (ne / 2 * nl, ne * nl));
            // Every admission reached the device's map, and every eviction: an expert the
            // device still counted cold would only cost speed, so the answers cannot show it.
            let maps = g.slot_maps().expect("slot maps");
            assert_eq!(maps.len(), nl);
            for (il, (device, host)) in maps.iter().enumerate() {
                assert_eq!(device, host, "{what}: layer {il}'s slot map");
            }
            let scores = g.expert_scores();
            assert_eq!(scores.len(), nl);
            assert!(
                scores
                    .iter()
                    .all(|s| s.len() == ne && s.iter().any(|&v| v > 0.0))
            );
        }
    });
}

/// Admissions the device refuses (their copies aimed past the bank: a validation error, as a
/// failed upload would raise): each retires its slot, both experts it concerned are computed
/// on the CPU, and the answers stay the CPU's.
#[test]
fn a_refused_admission_leaves_its_experts_on_the_cpu() {
    h::with_converted("qwen4_exp_c", Profile::F32, |cmf| {
        let c = cpu(cmf);
        let (ne, nl) = (c.config.num_experts, c.config.num_hidden_layers);
        let offload = Offload {
            policy: CachePolicy::Lru,
            max_admissions: ne,
            ..Offload::with(Residency::PerLayer(vec![ne / 2; nl]))
        };
        let g = GpuModel::with_offload(cpu(cmf), ctx(None), CTX, true, offload)
            .unwrap_or_else(|u| panic!("upload: {}", u.error));
        g.inject_upload_faults(3);
        h::assert_none(&compare("qwen4_exp_c", "refused uploads", &c, &g));
        let stats = g.offload_stats();
        assert_eq!(stats.failed, 3, "{stats:?}");
        assert!(stats.admitted > 0, "{stats:?}");
        assert_eq!(g.resident_experts(), (ne / 2 * nl - 3, ne * nl));
    });
}

/// Every traced intermediate with half of each layer's experts on the CPU (the frame broken at
/// every layer, the taps read span by span), GPU against CPU, within the device forward's bound.
#[test]
fn every_block_matches_the_cpu_with_half_the_experts_on_the_cpu() {
    h::with_converted("qwen4_exp_a", Profile::F32, |cmf| {
        let c = cpu(cmf);
        let g = with_resident(cmf, c.config.num_experts / 2);
        g.set_tracing(true);
        let ids = test_support::ids("qwen4_exp_a", 0);
        let (mut sc, mut sg) = (c.new_state(), g.new_state());
        let mut failures = Vec::new();
        let mut names = 0;
        for (si, step) in [&ids[..13], &ids[13..14]].into_iter().enumerate() {
            let what = format!("step {si}");
            let (n, f) =
                test_support::harness::compare_step(&what, &c, &mut sc, &g, &mut sg, step, BOUND);
            names += n;
            failures.extend(f);
        }
        assert!(names > 10, "{names} intermediates");
        h::assert_none(&failures);
    });
}
