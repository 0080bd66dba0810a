//! Drafting with the MTP head changes nothing but speed: on every qwen4_exp fixture with an MTP
//! head added (pseudo-random, so its drafts are mostly rejected and every rollback path runs),
//! `--mtp 1..=4` (and prompt lookup, `--lookup 3`) generates, token for token, what plain
//! decoding generates, greedy and sampled (temperature, top-p, repeat penalty, a seed), through
//! the reply's limit and EOS, over two chat-like turns that reuse the state; and the state each
//! leaves is the same sequence.

use engine::generate::GenerateOptions;
use engine::model::Placement;
use engine::run::Runner;
use engine::sampling::{Sampler, Sampling};
use engine::speculative::MtpMode;
use test_support::Profile;
use test_support::mtp::convert_with_mtp_head;

const CASES: [&str; 3] = ["qwen4_exp_a", "qwen4_exp_b", "qwen4_exp_c"];

fn generate(
    r: &Runner,
    (mtp, lookup): (MtpMode, usize),
    sampling: Sampling,
    max_new: usize,
) -> (Vec<u32>, Vec<u32>, Vec<f32>) {
    let m = r.model.model();
    let mut st = m.new_state();
    let mut sampler = Sampler::new(sampling);
    let opts = GenerateOptions {
        mtp,
        lookup,
        ..GenerateOptions::new(max_new)
    };
    // Repeats itself, so prompt lookup finds drafts from the first step.
    let first = r
        .encode("The quick brown fox and the quick brown fox and the quick brown")
        .unwrap();
    let g1 = r
        .complete(&mut st, &first, &mut sampler, &opts, &mut |_| {})
        .unwrap();
    assert_eq!(g1.drafts.is_some(), mtp != MtpMode::Off || lookup > 0);
    // The second turn: the last token of the first and a new message, on the same state.
    let mut second = vec![*g1.tokens.last().unwrap()];
    second.extend(r.encode(" and then").unwrap());
    let g2 = r
        .complete(&mut st, &second, &mut sampler, &opts, &mut |_| {})
        .unwrap();
    assert_eq!(
        st.pos(),
        first.len() + g1.tokens.len() - 1 + second.len() + g2.tokens.len() - 1
    );
    // What the state holds: the logits it gives for one more token.
    let probe = m.forward_last(&[3], &mut st).unwrap();
    (g1.tokens, g2.tokens, probe)
}

#[test]
fn drafting_generates_exactly_what_plain_decoding_generates() {
    drafting_is_exact(&Placement::cpu(), &[1, 2, 17], &[1, 2, 3, 4]);
}

/// The same on the device (lavapipe in CI): the trunk's check frames, the head, the rollback
/// of the recurrent state and the cut of the head's cache all on the GPU.
#[test]
fn drafting_on_the_gpu_generates_exactly_what_plain_decoding_generates() {
    let opts = engine::gpu_runtime::GpuOptions {
        pipeline_cache_dir: None,
        ..Default::default()
    };
    if let Err(e) = engine::gpu_runtime::GpuContext::new(&opts) {
        assert!(
            std::env::var("CORTIQ_REQUIRE_GPU").as_deref() != Ok("1"),
            "CORTIQ_REQUIRE_GPU=1 but no GPU: {e}"
        );
        eprintln!("no GPU, skipped: {e}");
        return;
    }
    let place = Placement {
        backend: engine::gpu_runtime::BackendChoice::Wgpu,
        vram: None,
        ctx: Some(128),
        ..Default::default()
    };
    drafting_is_exact(&place, &[2, 17], &[1, 3, 4]);
}

fn drafting_is_exact(place: &Placement, lengths: &[usize], depths: &[usize]) {
    let dir = tempfile::tempdir().unwrap();
    for (i, case) in CASES.iter().enumerate() {
        let path = convert_with_mtp_head(case, dir.path(), Profile::F32, i as u64 + 1);
        let r = Runner::from_cmf_on(cmf_format::Cmf::open(&path).unwrap(), place).unwrap();
        let backend = r.model.model().backend_name();
        assert_eq!(
            backend == "gpu",
            place.backend != engine::gpu_runtime::BackendChoice::Cpu
        );
        let greedy = Sampling {
            temperature: 0.0,
            ..Sampling::default()
        };
        let sampled = Sampling {
            temperature: 0.9,
            top_p: 0.95,
            repeat_penalty: 1.1,
            seed: 42 + i as u64,
            ..Sampling::default()
        };
        for (name, s) in [("greedy", greedy), ("sampled", sampled)] {
            for &max_new in lengths {
                let want = generate(&r, (MtpMode::Off, 0), s, max_new);
                let modes = depths.iter().map(|&d| (MtpMode::Depth(d), 0));
                for mode in modes.chain([(MtpMode::Off, 3)]) {
                    let depth = format!("{mode:?}");
                    let got = generate(&r, mode, s, max_new);
                    assert_eq!(
                        got.0, want.0,
                        "{backend} {case} {name} max {max_new} mode {depth}: turn 1"
                    );
                    assert_eq!(
                        got.1, want.1,
                        "{backend} {case} {name} max {max_new} mode {depth}: turn 2"
                    );
                    let err = test_support::max_abs_diff(&got.2, &want.2);
                    assert!(
                        err <= 1e-5 * test_support::max_abs(&want.2),
                        "{backend} {case} {name} max {max_new} mode {depth}: the states differ ({err:.3e})"
                    );
                }
            }
        }
    }
}

/// `--mtp N` on a model without a head is an error naming the flag; `auto` decodes plainly.
#[test]
fn drafting_without_a_head() {
    let r = Runner::from_cmf(engine::embedded_model().unwrap()).unwrap();
    if let engine::model::AnyModel::Qwen4(m) = r.model.model()
        && m.mtp().is_some()
    {
        return;
    }
    let m = r.model.model();
    let ids = r.encode("ROMEO:").unwrap();
    let mut sampler = Sampler::new(Sampling::default());
    let opts = GenerateOptions {
        mtp: MtpMode::Depth(2),
        ..GenerateOptions::new(4)
    };
    let e = r
        .complete(&mut m.new_state(), &ids, &mut sampler, &opts, &mut |_| {})
        .unwrap_err();
    assert!(
        e.to_string().contains("--mtp") && e.to_string().contains("MTP head"),
        "{e}"
    );
    let opts = GenerateOptions {
        mtp: MtpMode::Auto,
        ..GenerateOptions::new(4)
    };
    let g = r
        .complete(&mut m.new_state(), &ids, &mut sampler, &opts, &mut |_| {})
        .unwrap();
    assert!(g.drafts.is_none());
    assert_eq!(g.tokens.len(), 4);
}
