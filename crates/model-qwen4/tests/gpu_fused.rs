//! The fused decode kernels (`CORTIQ_FUSED_OPS`: GDN's `gdn_step`, the MoE output in the
//! shared expert's down projection, one quantiser for a MoE block's routed and shared experts)
//! compute the sums and codes of the kernels they replace in the same order: the device
//! forward with them and without gives the same logits, bit for bit, on the trained demo model
//! at the profiles whose routed experts run on int8 activations (where all three apply), over
//! a prompt in frames of 8 and 3 rows and decode steps, under `--act auto` (what the binary
//! runs: int8 activations on the device for every quantised matrix). Its own test binary: two
//! GPU contexts, and the activation choice is process-wide.

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
    let opts = GpuOptions {
        pipeline_cache_dir: None,
        split_ops,
        ..GpuOptions::default()
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

#[test]
fn fused_and_separate_kernels_give_the_same_logits_bit_for_bit() {
    quant_codecs::ops::set_act_choice(quant_codecs::ops::ActChoice::Auto);
    let (Some(fused), Some(split)) = (context(false), context(true)) else {
        return;
    };
    assert!(fused.fused_ops && !split.fused_ops);
    let mut differ = Vec::new();
    for profile in [Profile::Q4, Profile::Q2, Profile::Fp4] {
        h::with_converted("shakespeare", profile, |cmf| {
            let up = |ctx: &Arc<GpuContext>| {
                GpuModel::new(cpu(cmf), ctx.clone(), 64)
                    .unwrap_or_else(|u| panic!("upload: {}", u.error))
            };
            let (a, b) = (up(&fused), up(&split));
            let ids: Vec<u32> = (0..13).map(|i| 40 + 37 * i).collect();
            let (mut sa, mut sb) = (a.new_state(), b.new_state());
            for step in [&ids[..11], &ids[11..12], &ids[12..13]] {
                let la = a.forward(step, &mut sa).unwrap();
                let lb = b.forward(step, &mut sb).unwrap();
                assert_eq!(la.len(), lb.len());
                let same = la.iter().zip(&lb).all(|(x, y)| x.to_bits() == y.to_bits());
                if !same {
                    let d = test_support::max_abs_diff(&la, &lb);
                    differ.push(format!("{profile:?} step of {}: {d:.3e}", step.len()));
                }
            }
        });
    }
    assert!(differ.is_empty(), "fused logits differ: {differ:?}");
}
