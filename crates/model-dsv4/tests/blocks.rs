//! Behaviour that the parity tests alone do not pin: the indexer's selection is really active in
//! the fixtures, weight binding names the tensor at fault, bad input is an error, the trace
//! reports every block, and the quantised profiles' agreement with transformers.

mod common;

use cmf_format::Cmf;
use common::{
    CASES, TOL, argmax, convert_fixture, fixture, ids, kl_div, max_abs, max_abs_diff, read_npy,
};
use model_dsv4::{BindError, CausalLm, ForwardError, Model, WeightError, Weights};
use serde_json::json;
use test_support::Profile;

/// With `index_topk` raised past the number of compressed entries every CSA query attends all
/// visible entries. The reference's logits must then differ beyond tolerance at positions that
/// see more than `index_topk` entries (so the fixtures exercise selection and our selecting
/// path is what matches them), and agree before.
#[test]
fn indexer_selection_is_active_in_every_fixture() {
    let dir = tempfile::tempdir().unwrap();
    for case in CASES {
        let path = convert_fixture(case, dir.path(), Profile::F32);
        let cmf = Cmf::open(&path).unwrap();
        let (mut config, _) = Weights::bind(&cmf).unwrap();
        let (topk, rate) = (
            config.index_topk,
            config.rate(model_dsv4::AttnKind::Csa).unwrap(),
        );
        config.index_topk = 10_000;
        let weights = Weights::bind_with(&cmf, &config).unwrap();
        let dense = Model::new(config, weights);
        let vocab = dense.config.vocab_size;
        let tokens = ids(case, 0);
        let want = read_npy(&fixture(case).join("expected/p0_prefill_logits.npy")).f32;
        let got = dense.forward_prefill(&tokens).unwrap();
        let tol = TOL * max_abs(&want);
        // Query p sees (p+1)/rate entries; all are kept while that is <= index_topk.
        let head = ((topk + 1) * rate - 1) * vocab;
        assert!(
            max_abs_diff(&got[..head], &want[..head]) <= tol,
            "{case}: prefix within index_topk must match"
        );
        let err = max_abs_diff(&got[head..], &want[head..]);
        eprintln!("{case}: dense CSA vs reference past index_topk: {err:.3e} (tol {tol:.3e})");
        assert!(
            err > 100.0 * tol,
            "{case}: dense CSA matched the reference ({err:.3e}); selection inactive?"
        );
    }
}

/// `deepseek_v4_c` pins the SwiGLU clamp and YaRN's `attention_factor`: with the clamp lifted,
/// or with cos/sin left unscaled, our logits leave the reference's by far more than the
/// tolerance (so matching them within it is evidence that both are applied as the reference
/// does).
#[test]
fn swiglu_clamp_and_yarn_scaling_are_active_in_fixture_c() {
    let case = "deepseek_v4_c";
    let dir = tempfile::tempdir().unwrap();
    let path = convert_fixture(case, dir.path(), Profile::F32);
    let cmf = Cmf::open(&path).unwrap();
    let (config, _) = Weights::bind(&cmf).unwrap();
    let rp = config.rope_compress().clone();
    assert!(matches!(rp.kind, model_dsv4::RopeKind::Yarn { .. }));
    // transformers' `0.1 ln(factor) + 1` for factor 4 (compress_attention_scaling 1.138629436).
    assert!((rp.attention_factor - 1.138_629_436).abs() < 1e-9, "{rp:?}");
    // `DeepseekV4RotaryEmbedding(config).compress_inv_freq` of the fixture's config: frequency
    // 0 extrapolated, 1-3 on the ramp (correction range [1, 4]), 4-7 interpolated (/ factor).
    let want_freq: [f64; 8] = [
        1.0,
        0.223606795,
        0.0374999978,
        0.00559017016,
        0.000624999986,
        0.000139754251,
        3.12500015e-05,
        6.98771282e-06,
    ];
    let got_freq = model_dsv4::ops::Rope::new(&rp, config.head_dim);
    assert_eq!(got_freq.inv_freq().len(), want_freq.len());
    for (i, (&g, &w)) in got_freq.inv_freq().iter().zip(&want_freq).enumerate() {
        assert!(
            (g as f64 - w).abs() <= 1e-6 * w,
            "inv_freq[{i}]: {g} vs {w}"
        );
    }
    let want = read_npy(&fixture(case).join("expected/p0_prefill_logits.npy")).f32;
    let tol = TOL * max_abs(&want);
    let tokens = ids(case, 0);
    let err_with = |c: model_dsv4::DeepseekV4Config| {
        let weights = Weights::bind_with(&cmf, &c).unwrap();
        let model = Model::new(c, weights);
        max_abs_diff(&model.forward_prefill(&tokens).unwrap(), &want)
    };
    let mut unclamped = config.clone();
    unclamped.swiglu_limit = f64::INFINITY;
    let mut unscaled = config.clone();
    unscaled.rope_compress.as_mut().unwrap().attention_factor = 1.0;
    for (what, c) in [
        ("no SwiGLU clamp", unclamped),
        ("attention_factor 1", unscaled),
    ] {
        let err = err_with(c);
        eprintln!("{case} with {what}: max|diff| {err:.3e} (tol {tol:.3e})");
        assert!(
            err > 100.0 * tol,
            "{case}: {what} still matches ({err:.3e})"
        );
    }
    assert!(err_with(config) <= tol);
}

#[test]
fn weight_binding_names_the_tensor_at_fault() {
    let dir = tempfile::tempdir().unwrap();
    let path = convert_fixture("deepseek_v4_b", dir.path(), Profile::F32);
    let cmf = Cmf::open(&path).unwrap();
    let (config, _) = Weights::bind(&cmf).unwrap();

    let mut more_experts = config.clone();
    more_experts.n_routed_experts += 1;
    match Weights::bind_with(&cmf, &more_experts) {
        Err(WeightError::Bind(BindError::Missing(name))) => {
            assert_eq!(name, "model.layers.0.mlp.experts.4.gate_up_proj.weight")
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("bound a model with a missing expert"),
    }
    let mut wider = config.clone();
    wider.q_lora_rank += 1;
    match Weights::bind_with(&cmf, &wider) {
        Err(WeightError::Bind(BindError::Shape {
            name,
            expected,
            found,
        })) => {
            assert_eq!(name, "model.layers.0.self_attn.q_a_proj.weight");
            assert_eq!(expected, vec![33, 64]);
            assert_eq!(found, vec![32, 64]);
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("bound a model with a wrong shape"),
    }
    let mut fewer_experts = config.clone();
    fewer_experts.n_routed_experts = 1;
    fewer_experts.num_experts_per_tok = 1;
    assert!(Weights::bind_with(&cmf, &fewer_experts).is_err());

    let qwen = convert_fixture("qwen4_exp_b", dir.path(), Profile::F32);
    let qwen = Cmf::open(&qwen).unwrap();
    match Weights::bind(&qwen) {
        Err(e @ WeightError::Architecture(_)) => {
            assert_eq!(
                e.to_string(),
                "not a deepseek_v4 model: the CMF architecture is `qwen4_exp`"
            )
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("bound a qwen4_exp model"),
    }
}

/// A copy of `src` at `dst` whose `tid2eid` of layer 0 lives in the header's `integer_tensors`
/// (as the converter stores integers f32 cannot hold) with `shape` and `data` as given.
fn with_header_tid2eid(
    src: &Cmf,
    dst: &std::path::Path,
    shape: serde_json::Value,
    data: Vec<i64>,
) -> Cmf {
    let name = "model.layers.0.mlp.gate.tid2eid";
    let mut header = src.header().clone();
    header.extra.insert(
        "integer_tensors".into(),
        serde_json::json!({ name: { "shape": shape, "data": data } }),
    );
    let mut w = cmf_format::CmfWriter::create(dst, header).unwrap();
    for t in src.tensors() {
        if t.name != name {
            let v = src.tensor(&t.name).unwrap();
            w.add_tensor(&t.name, v.dtype(), v.shape(), v.bytes)
                .unwrap();
        }
    }
    w.finish().unwrap();
    Cmf::open(dst).unwrap()
}

/// A header-stored `tid2eid` must hold exactly as many values as its shape says, each a valid
/// expert id; a malformed one is a [`WeightError`] naming it, never a panic in routing.
#[test]
fn malformed_header_tid2eid_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = convert_fixture("deepseek_v4_a", dir.path(), Profile::F32);
    let cmf = Cmf::open(&path).unwrap();
    let (config, weights) = Weights::bind(&cmf).unwrap();
    let stored = match &weights.layers[0].moe.routing {
        model_dsv4::weights::Routing::Hash(t) => t.iter().map(|&x| x as i64).collect::<Vec<_>>(),
        model_dsv4::weights::Routing::Scored(_) => panic!("layer 0 of deepseek_v4_a is hash_moe"),
    };
    let (v, k) = (config.vocab_size, config.num_experts_per_tok);
    let name = "model.layers.0.mlp.gate.tid2eid";

    // The same table moved to the header binds and routes exactly as before.
    let good = with_header_tid2eid(
        &cmf,
        &dir.path().join("good.cmf"),
        json!([v, k]),
        stored.clone(),
    );
    let (_, w) = Weights::bind(&good).unwrap();
    assert!(matches!(&w.layers[0].moe.routing,
        model_dsv4::weights::Routing::Hash(t) if t.iter().map(|&x| x as i64).eq(stored.iter().copied())));

    let integer_error = |cmf: &Cmf| match Weights::bind(cmf) {
        Err(e @ WeightError::Bind(BindError::Integer { .. })) => {
            let WeightError::Bind(BindError::Integer { name: n, .. }) = &e else {
                unreachable!()
            };
            assert_eq!(n, name);
            e.to_string()
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("bound a malformed tid2eid"),
    };
    // Declared [V, k] but one row short.
    let short = with_header_tid2eid(
        &cmf,
        &dir.path().join("short.cmf"),
        json!([v, k]),
        stored[..(v - 1) * k].to_vec(),
    );
    let msg = integer_error(&short);
    assert!(
        msg.contains(&format!("holds {} values", (v - 1) * k)),
        "{msg}"
    );
    // An expert id outside [0, E).
    let mut bad = stored.clone();
    bad[7] = config.n_routed_experts as i64;
    let bad = with_header_tid2eid(&cmf, &dir.path().join("bad.cmf"), json!([v, k]), bad);
    let msg = integer_error(&bad);
    assert!(msg.contains("outside"), "{msg}");
    // A wrong declared shape is a shape error naming the tensor.
    let wrong = with_header_tid2eid(
        &cmf,
        &dir.path().join("wrong.cmf"),
        json!([v, k + 1]),
        stored,
    );
    assert!(
        matches!(Weights::bind(&wrong), Err(WeightError::Bind(BindError::Shape { name: n, .. })) if n == name)
    );
}

/// A state from another model, even one with as many layers and the same head dim, or one whose
/// caches no longer follow from its position, is an error rather than a panic or silent garbage.
#[test]
fn a_foreign_or_altered_state_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let open = |case: &str| {
        let path = convert_fixture(case, dir.path(), Profile::F32);
        Cmf::open(&path).unwrap()
    };
    let (cmf_b, cmf_c) = (open("deepseek_v4_b"), open("deepseek_v4_c"));
    let (cb, wb) = Weights::bind(&cmf_b).unwrap();
    let (cc, wc) = Weights::bind(&cmf_c).unwrap();
    // Both have 3 layers of head_dim 32, in a different order of kinds.
    assert_eq!(
        (cb.num_hidden_layers, cb.head_dim),
        (cc.num_hidden_layers, cc.head_dim)
    );
    let (b, c) = (Model::new(cb, wb), Model::new(cc, wc));
    let tokens = ids("deepseek_v4_b", 0);
    let mismatch = |r: Result<Vec<f32>, ForwardError>| match r {
        Err(e @ ForwardError::StateMismatch(_)) => e.to_string(),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("ran on a foreign state"),
    };
    let mut st_b = model_dsv4::SeqState::new(&b.config);
    b.forward(&tokens[..13], &mut st_b).unwrap();
    let msg = mismatch(c.forward(&tokens[13..14], &mut st_b.clone()));
    assert!(msg.contains("does not belong"), "{msg}");
    mismatch(c.forward(&tokens[..1], &mut model_dsv4::SeqState::new(&b.config)));
    // The state's own model continues fine; an edited position is caught.
    b.forward(&tokens[13..14], &mut st_b.clone()).unwrap();
    let mut moved = st_b.clone();
    moved.pos += 1;
    let msg = mismatch(b.forward(&tokens[13..14], &mut moved));
    assert!(msg.contains("layer 0"), "{msg}");
    let mut cut = st_b.clone();
    cut.layers[2].comp.buffer_kv.clear();
    mismatch(b.forward(&tokens[13..14], &mut cut));
}

/// The trace names every intermediate, layer by layer, with the widths of the block it reports.
#[test]
fn trace_reports_every_block_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let path = convert_fixture("deepseek_v4_b", dir.path(), Profile::F32);
    let cmf = Cmf::open(&path).unwrap();
    let (config, weights) = Weights::bind(&cmf).unwrap();
    let model = Model::new(config, weights);
    let c = &model.config;
    let (t, n, d, v) = (5usize, c.hc_mult, c.hidden_size, c.vocab_size);
    let mut seen = Vec::new();
    let mut st = model_dsv4::SeqState::new(c);
    let logits = model
        .forward_traced(&[1, 2, 3, 4, 5], &mut st, &mut |name, il, data| {
            seen.push((name.to_string(), il, data.len()))
        })
        .unwrap();
    let mut want = Vec::new();
    for il in 0..3 {
        want.extend([
            ("attn_input".to_string(), il, t * d),
            ("attn_out".to_string(), il, t * d),
            ("attn_streams".to_string(), il, t * n * d),
            ("mlp_input".to_string(), il, t * d),
            ("moe_out".to_string(), il, t * d),
            ("layer_out".to_string(), il, t * n * d),
        ]);
    }
    want.push(("head_out".to_string(), 3, t * d));
    want.push(("logits".to_string(), 3, t * v));
    assert_eq!(seen, want);
    assert_eq!(logits.len(), t * v);
}

/// (top-1 agreement, mean KL(ref || ours)) of a profile's prefill logits over the 3 prompts.
fn agreement(case: &str, profile: Profile) -> (f64, f64) {
    let dir = tempfile::tempdir().unwrap();
    let path = convert_fixture(case, dir.path(), profile);
    let cmf = Cmf::open(&path).unwrap();
    let (config, weights) = Weights::bind(&cmf).unwrap();
    let model = Model::new(config, weights);
    let vocab = model.config.vocab_size;
    let (mut rows, mut agree, mut kl) = (0usize, 0usize, 0f64);
    for p in 0..3 {
        let want = read_npy(&fixture(case).join(format!("expected/p{p}_prefill_logits.npy"))).f32;
        let got = model.forward_prefill(&ids(case, p)).unwrap();
        for (g, w) in got.chunks(vocab).zip(want.chunks(vocab)) {
            rows += 1;
            agree += usize::from(argmax(g) == argmax(w));
            kl += kl_div(w, g);
        }
    }
    (agree as f64 / rows as f64, kl / rows as f64)
}

// The q8 bar (top-1 >= 99%, mean KL <= 1e-3) is measured where it means something: on the
// trained deepseek_v4 demo model (crates/engine/tests/shakespeare.rs). On these random-weight
// fixtures q8 gives top-1 88-91% (the lightning indexer's top-3/4 choices have score gaps down
// to 2.4e-4, which q8 noise flips); docs/quality.md has the table.

/// bf16/f16 are exact for bf16 source weights except the f32 HC/sink/position-bias tensors,
/// which they round.
#[test]
fn half_profiles_agree_with_transformers() {
    for case in CASES {
        for profile in [Profile::Bf16, Profile::F16] {
            let (top1, kl) = agreement(case, profile);
            eprintln!("{case} {profile:?}: top-1 {top1:.4}, mean KL {kl:.3e}");
            assert!(
                kl <= 1e-4 && top1 >= 0.98,
                "{case} {profile:?}: {top1} {kl}"
            );
        }
    }
}
