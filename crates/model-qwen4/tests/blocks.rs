//! Behaviour that the parity tests alone do not pin: QSA selection is really active in the
//! fixtures, the PLE hash constants equal the reference's stored buffers and released values,
//! weight binding names the tensor at fault, bad input is an error, quantised profiles agree.

mod common;

use cmf_format::Cmf;
use common::{CASES, argmax, convert_fixture, fixture, ids, max_abs, max_abs_diff, read_npy};
use model_qwen4::ple::PleHash;
use model_qwen4::{BindError, CausalLm, Model, Qwen4ExpTextConfig, WeightError, Weights};
use serde_json::json;
use test_support::Profile;

/// With the budget raised past the prompt every block is selected (dense attention). The
/// reference's logits must then differ beyond tolerance at positions past the budget (so the
/// fixtures exercise selection and our sparse path is what matches them), and agree while the
/// prompt still fits in the budget.
#[test]
fn qsa_selection_is_active_in_every_fixture() {
    let dir = tempfile::tempdir().unwrap();
    for case in CASES {
        let path = convert_fixture(case, dir.path(), Profile::F32);
        let cmf = Cmf::open(&path).unwrap();
        let (mut config, _) = Weights::bind(&cmf).unwrap();
        let qsa = config.qsa().unwrap();
        config.indexer_budget = Some(qsa.ratio * 1000);
        let weights = Weights::bind_with(&cmf, &config).unwrap();
        let dense = Model::new(config, weights);
        let vocab = dense.config.vocab_size;
        let tokens = ids(case, 2);
        let want = read_npy(&fixture(case).join("expected/p2_prefill_logits.npy")).f32;
        let got = dense.forward_prefill(&tokens).unwrap();
        let tol = 1e-4 * max_abs(&want);
        // Query p sees (p+1)/ratio complete blocks; all are kept while that is <= budget/ratio.
        let dense_rows = (qsa.block_topk() + 1) * qsa.ratio - 1;
        let head = dense_rows * vocab;
        assert!(
            max_abs_diff(&got[..head], &want[..head]) <= tol,
            "{case}: prefix within the budget must match"
        );
        let err = max_abs_diff(&got[head..], &want[head..]);
        assert!(
            err > 100.0 * tol,
            "{case}: dense attention matched the QSA reference ({err:.3e}); selection inactive?"
        );
    }
}

/// The released constants (reference-arch.md §3.6, recomputed there and equal to the GGUF KV
/// `ple.layer_multipliers` of the release).
#[test]
fn ple_hash_constants_match_the_release() {
    let c = Qwen4ExpTextConfig::from_json(&json!({
        "vocab_size": 248320, "hidden_size": 2560, "num_hidden_layers": 48,
        "num_attention_heads": 24, "linear_num_value_heads": 48, "ple_layer_ids": [2],
        "eos_token_id": 248044, "split_ngram_parts": 128,
        "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 128,
        "indexer_budget": 2048, "indexer_compress_ratio": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    }))
    .unwrap();
    let h = PleHash::new(&c, 0);
    assert_eq!(
        h.multipliers,
        vec![23703573157769, 20109073645365, 8052911324071]
    );
    assert_eq!(
        h.vocab_sizes,
        vec![
            20000003, 20000023, 20000033, 20000047, 20000059, 20000063, 20000069, 20000077,
            20000081, 20000093, 20000107, 20000147, 20000153, 20000159, 20000161, 20000171
        ]
    );
    assert_eq!(h.padded_rows, 320_001_536);
}

#[test]
fn weight_binding_names_the_tensor_at_fault() {
    let dir = tempfile::tempdir().unwrap();
    let path = convert_fixture("qwen4_exp_b", dir.path(), Profile::F32);
    let cmf = Cmf::open(&path).unwrap();
    let (config, _) = Weights::bind(&cmf).unwrap();

    let mut more_experts = config.clone();
    more_experts.num_experts += 1;
    match Weights::bind_with(&cmf, &more_experts) {
        Err(WeightError::Bind(BindError::Missing(name))) => {
            assert_eq!(name, "model.layers.0.mlp.experts.4.gate_up_proj.weight")
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("bound a model with a missing expert"),
    }
    let mut wider = config.clone();
    wider.moe_intermediate_size += 1;
    match Weights::bind_with(&cmf, &wider) {
        Err(WeightError::Bind(BindError::Shape {
            name,
            expected,
            found,
        })) => {
            assert_eq!(name, "model.layers.0.mlp.experts.0.gate_up_proj.weight");
            assert_eq!(expected, vec![34, 32]);
            assert_eq!(found, vec![32, 32]);
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("bound a model with a wrong shape"),
    }
    let mut other_seed = config.clone();
    other_seed.seed += 1;
    match Weights::bind_with(&cmf, &other_seed) {
        Err(WeightError::PleBuffer { name, .. }) => {
            assert_eq!(name, "model.layers.0.ple.ple_embedding.layer_multipliers")
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("hash multipliers not checked against the stored buffer"),
    }

    let ds = convert_fixture("deepseek_v4_a", dir.path(), Profile::F32);
    let ds = Cmf::open(&ds).unwrap();
    assert!(matches!(Weights::bind(&ds), Err(WeightError::Architecture(a)) if a == "deepseek_v4"));
}

/// q8 profile against transformers: mean KL(ref || ours) <= 1e-3 (issue 4's bound), and top-1
/// agreement >= 99% on the rows whose reference top-1/top-2 margin exceeds 5% of max|logit|.
///
/// Issue 4 asks for >= 99% top-1 on ALL rows, which these random-weight fixtures cannot give any
/// 8-bit format: their logits span only ~±1, ~18% of rows have a top-1 margin below 0.01, and the
/// q8_2f logit error is ~0.01 (f32/f16/bf16 are exact to 1e-6). Raw top-1 is printed (a: ~0.956).
#[test]
fn q8_profile_agrees_with_transformers() {
    let dir = tempfile::tempdir().unwrap();
    for case in CASES {
        let path = convert_fixture(case, dir.path(), Profile::Q8);
        let cmf = Cmf::open(&path).unwrap();
        let (config, weights) = Weights::bind(&cmf).unwrap();
        let model = Model::new(config, weights);
        let vocab = model.config.vocab_size;
        let (mut rows, mut agree, mut kl) = (0usize, 0usize, 0f64);
        let (mut worst, mut dec_rows, mut dec_agree) = (0f32, 0usize, 0usize);
        for p in 0..3 {
            let want =
                read_npy(&fixture(case).join(format!("expected/p{p}_prefill_logits.npy"))).f32;
            let got = model.forward_prefill(&ids(case, p)).unwrap();
            for (g, w) in got.chunks(vocab).zip(want.chunks(vocab)) {
                rows += 1;
                agree += usize::from(argmax(g) == argmax(w));
                worst = worst.max(max_abs_diff(g, w));
                if margin(w) > 0.05 * max_abs(&want) {
                    dec_rows += 1;
                    dec_agree += usize::from(argmax(g) == argmax(w));
                }
                kl += kl_div(w, g);
            }
        }
        let (top1, mean_kl) = (agree as f64 / rows as f64, kl / rows as f64);
        eprintln!(
            "{case} q8: top-1 {top1:.4}, mean KL {mean_kl:.3e}, max|diff| {worst:.3e}, decisive rows {dec_agree}/{dec_rows}"
        );
        let decisive = dec_agree as f64 / dec_rows.max(1) as f64;
        assert!(
            dec_rows > rows / 3,
            "{case}: too few decisive rows ({dec_rows}/{rows}) for the check to mean anything"
        );
        assert!(
            decisive >= 0.99 && mean_kl <= 1e-3,
            "{case} q8: decisive top-1 {decisive}, KL {mean_kl} (raw top-1 {top1})"
        );
    }
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let z: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
    x.iter().map(|&v| v as f64 - m - z).collect()
}

fn kl_div(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let (lp, lq) = (log_softmax(p_logits), log_softmax(q_logits));
    lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum()
}

/// Reference top-1 minus top-2 logit.
fn margin(x: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in x {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    a - b
}

/// The trace names every intermediate, layer by layer, with the widths of the block it reports.
#[test]
fn trace_reports_every_block_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let path = convert_fixture("qwen4_exp_b", dir.path(), Profile::F32);
    let cmf = Cmf::open(&path).unwrap();
    let (config, weights) = Weights::bind(&cmf).unwrap();
    let model = Model::new(config, weights);
    let (t, h, d, v) = (
        5usize,
        model.config.hc_count,
        model.config.hidden_size,
        model.config.vocab_size,
    );
    let mut seen = Vec::new();
    let mut st = model_qwen4::SeqState::new(&model.config);
    let logits = model
        .forward_traced(&[1, 2, 3, 4, 5], &mut st, &mut |name, il, data| {
            seen.push((name.to_string(), il, data.len()))
        })
        .unwrap();
    let mut want = vec![("ple_streams".to_string(), 0, t * h * d)];
    for il in 0..2 {
        want.extend([
            ("attn_input".to_string(), il, t * d),
            ("attn_out".to_string(), il, t * d),
            ("attn_streams".to_string(), il, t * h * d),
            ("mlp_input".to_string(), il, t * d),
            ("moe_out".to_string(), il, t * d),
            ("layer_out".to_string(), il, t * h * d),
        ]);
    }
    want.push(("head_out".to_string(), 2, t * d));
    want.push(("logits".to_string(), 2, t * v));
    assert_eq!(seen, want);
    assert_eq!(logits.len(), t * v);
}
