//! The fused decode kernels (`CORTIQ_FUSED_OPS`: GDN's `gdn_step`, the MoE output in the
//! shared expert's down projection, one quantiser for a MoE block's routed and shared experts)
//! compute the sums and codes of the kernels they replace in the same order: the device
//! forward with them and without gives the same logits, bit for bit, on the trained demo model
//! at the profiles whose routed experts run on int8 activations (where all three apply), over
//! a prompt in frames of 8 and 3 rows and decode steps, under `--act auto` (what the binary
//! runs: int8 activations on the device for every quantised matrix). Its own test binary: two
//! GPU contexts, and the activation choice is process-wide.
//!
//! A hyper-connection site's norm folded into its front and read-out (`CORTIQ_HC_NORM`) is the
//! same math with the sums in another order: the logits move by rounding only.
//!
//! Likewise a short frame's independent dispatches writing outputs of their own (so they run
//! side by side, `CORTIQ_CONCURRENT`) against every dispatch on the shared work buffers: the
//! same kernels in the same order of additions, so the same bits; a step that read a shared
//! buffer where its producer wrote the layer's own would read a stale value and differ.

use std::sync::Arc;

use cmf_format::Cmf;
use gpu_runtime::{GpuContext, GpuOptions};
use model_qwen4::{CausalLm, GpuModel, Model, Weights};
use test_support::Profile;
use test_support::harness as h;

fn cpu(cmf: &Cmf) -> Model<'_> {
    let (config, weights) = Weights::bind(cmf).unwrap();
    Model::new(config, weights)
}

fn context(split_ops: bool) -> Option<Arc<GpuContext>> {
    context_with(GpuOptions {
        split_ops,
        ..GpuOptions::default()
    })
}

fn context_with(opts: GpuOptions) -> Option<Arc<GpuContext>> {
    let opts = GpuOptions {
        pipeline_cache_dir: None,
        ..opts
    };
    match GpuContext::new(&opts) {
        Ok(c) => Some(Arc::new(c)),
        Err(e) => {
            assert_ne!(
                std::env::var("CORTIQ_REQUIRE_GPU").as_deref(),
                Ok("1"),
                "CORTIQ_REQUIRE_GPU=1 but no GPU: {e}"
            );
            None
        }
    }
}

/// Where the two contexts' forwards of the demo model at `profiles` differ in any bit: the
/// token ids `ids` fed in frames of `lens` rows.
fn differences(
    a_ctx: &Arc<GpuContext>,
    b_ctx: &Arc<GpuContext>,
    profiles: &[Profile],
    ids: &[u32],
    lens: &[usize],
) -> Vec<String> {
    let mut differ = Vec::new();
    for &profile in profiles {
        h::with_converted("shakespeare", profile, |cmf| {
            let up = |ctx: &Arc<GpuContext>| {
                GpuModel::new(cpu(cmf), ctx.clone(), 64)
                    .unwrap_or_else(|u| panic!("upload: {}", u.error))
            };
            let (a, b) = (up(a_ctx), up(b_ctx));
            let (mut sa, mut sb) = (a.new_state(), b.new_state());
            let mut at = 0;
            for &n in lens {
                let step = &ids[at..at + n];
                at += n;
                let la = a.forward(step, &mut sa).unwrap();
                let lb = b.forward(step, &mut sb).unwrap();
                assert_eq!(la.len(), lb.len());
                let same = la.iter().zip(&lb).all(|(x, y)| x.to_bits() == y.to_bits());
                if !same {
                    let d = test_support::max_abs_diff(&la, &lb);
                    differ.push(format!("{profile:?} step of {n}: {d:.3e}"));
                }
            }
        });
    }
    differ
}

#[test]
fn fused_and_separate_kernels_give_the_same_logits_bit_for_bit() {
    quant_codecs::ops::set_act_choice(quant_codecs::ops::ActChoice::Auto);
    let (Some(fused), Some(split)) = (context(false), context(true)) else {
        return;
    };
    assert!(fused.fused_ops && !split.fused_ops);
    let ids: Vec<u32> = (0..13).map(|i| 40 + 37 * i).collect();
    let profiles = [Profile::Q4, Profile::Q2, Profile::Fp4];
    let differ = differences(&fused, &split, &profiles, &ids, &[11, 1, 1]);
    assert!(differ.is_empty(), "fused logits differ: {differ:?}");
}

#[test]
fn own_outputs_and_shared_work_buffers_give_the_same_logits_bit_for_bit() {
    quant_codecs::ops::set_act_choice(quant_codecs::ops::ActChoice::Auto);
    let serial = GpuOptions {
        serial_dispatches: true,
        ..GpuOptions::default()
    };
    let (Some(side), Some(serial)) = (context_with(GpuOptions::default()), context_with(serial))
    else {
        return;
    };
    assert!(side.concurrent && !serial.concurrent);
    let ids: Vec<u32> = (0..14).map(|i| 31 + 41 * i).collect();
    // Frames of 8 and 4 rows, then decode steps (every frame short enough).
    let differ = differences(
        &side,
        &serial,
        &[Profile::Q8, Profile::Q4],
        &ids,
        &[8, 4, 1, 1],
    );
    assert!(differ.is_empty(), "logits differ: {differ:?}");
}

/// The L2 prefetch of each hyper-connection site's matrices (`CORTIQ_PREFETCH=hc`) reads them
/// and writes nothing a forward reads: the same bits, and it records (a binding it got wrong
/// would fail validation there).
#[test]
fn prefetched_hyper_connections_give_the_same_logits_bit_for_bit() {
    quant_codecs::ops::set_act_choice(quant_codecs::ops::ActChoice::Auto);
    let prefetch = GpuOptions {
        prefetch_hc: true,
        ..GpuOptions::default()
    };
    let (Some(plain), Some(pf)) = (context_with(GpuOptions::default()), context_with(prefetch))
    else {
        return;
    };
    assert!(pf.prefetch_hc && !plain.prefetch_hc);
    let ids: Vec<u32> = (0..10).map(|i| 23 + 53 * i).collect();
    let differ = differences(&pf, &plain, &[Profile::Q4], &ids, &[8, 1, 1]);
    assert!(differ.is_empty(), "logits differ: {differ:?}");
}

/// The hyper-connection norm folded into each site's front and read-out (default) against a
/// dispatch of its own (`CORTIQ_HC_NORM=apart`): the same math with its sums in another order,
/// so the logits differ (the folded kernels ran) but only by rounding, within the bound the
/// device forward keeps against transformers (1e-4 of the largest logit), over frames of 8
/// and 3 rows (folded) and decode steps, and (f32 weights) a frame of 16 after them (which
/// keeps the norm apart, on caches the folded frames wrote).
#[test]
fn folded_and_separate_hyper_connection_norms_agree_to_rounding() {
    quant_codecs::ops::set_act_choice(quant_codecs::ops::ActChoice::Auto);
    let apart = GpuOptions {
        hc_norm_apart: true,
        ..GpuOptions::default()
    };
    let (Some(folded), Some(apart)) = (context_with(GpuOptions::default()), context_with(apart))
    else {
        return;
    };
    assert!(folded.fold_hc_norm && !apart.fold_hc_norm);
    let ids: Vec<u32> = (0..29).map(|i| 17 + 43 * i).collect();
    // The profiles whose hyper-connection matrices are floats (q8's are q8_2f: norm apart).
    for profile in [Profile::F32, Profile::Q4] {
        h::with_converted("shakespeare", profile, |cmf| {
            let up = |ctx: &Arc<GpuContext>| {
                GpuModel::new(cpu(cmf), ctx.clone(), 64)
                    .unwrap_or_else(|u| panic!("upload: {}", u.error))
            };
            let (a, b) = (up(&folded), up(&apart));
            let (mut sa, mut sb) = (a.new_state(), b.new_state());
            let mut at = 0;
            let mut moved = false;
            // q4 then a frame of 16 (norm apart in both) moves its logits by ~4e-2 on lavapipe:
            // the rows' ~1e-6 differences in the caches flip a rounding of the int8
            // activations or a near-tied routing choice there, a step no bound on rounding
            // covers; f32 weights have neither (2e-6 at every frame, the 16 included).
            let frames: &[usize] = if profile == Profile::F32 {
                &[8, 3, 1, 1, 16]
            } else {
                &[8, 3, 1, 1]
            };
            for &n in frames {
                let step = &ids[at..at + n];
                at += n;
                let la = a.forward(step, &mut sa).unwrap();
                let lb = b.forward(step, &mut sb).unwrap();
                assert_eq!(la.len(), lb.len());
                let max = lb.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = test_support::max_abs_diff(&la, &lb);
                assert!(
                    d <= 1e-4 * max,
                    "{profile:?} step of {n}: logits differ by {d:.3e} (largest {max:.3})"
                );
                moved |= la.iter().zip(&lb).any(|(x, y)| x.to_bits() != y.to_bits());
            }
            assert!(moved, "{profile:?}: the folded norm never ran");
        });
    }
}
