//! Prefill logits against transformers' own forward (fixtures/*/expected, f32 profile).

mod common;

use cmf_format::Cmf;
use common::{CASES, convert_fixture, fixture, read_npy};
use model_qwen4::{Model, Weights};
use test_support::Profile;

#[test]
fn f32_prefill_matches_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for case in CASES {
        let path = convert_fixture(case, dir.path(), Profile::F32);
        let cmf = Cmf::open(&path).unwrap();
        let (config, weights) = Weights::bind(&cmf).unwrap();
        let model = Model::new(config, weights);
        let vocab = model.config.vocab_size;
        for p in 0..3 {
            let exp = fixture(case).join("expected");
            let ids = read_npy(&exp.join(format!("p{p}_ids.npy"))).i64;
            let want = read_npy(&exp.join(format!("p{p}_prefill_logits.npy")));
            assert_eq!(want.shape, vec![ids.len(), vocab]);
            let tokens: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
            let got = model.forward_prefill(&tokens).unwrap();
            let max_ref = want.f32.iter().fold(0f32, |m, v| m.max(v.abs()));
            let (mut worst, mut at) = (0f32, 0);
            for (i, (a, b)) in got.iter().zip(&want.f32).enumerate() {
                let e = (a - b).abs();
                if e.is_nan() || e > worst {
                    worst = if e.is_nan() { f32::INFINITY } else { e };
                    at = i;
                }
            }
            let tol = 1e-4 * max_ref;
            eprintln!(
                "{case} p{p}: T={} max|diff| {worst:.3e} (tol {tol:.3e}) worst at row {} col {}",
                tokens.len(),
                at / vocab,
                at % vocab
            );
            if worst > tol {
                failures.push(format!(
                    "{case} p{p}: {worst:.3e} > {tol:.3e} at row {}",
                    at / vocab
                ));
            }
        }
    }
    assert!(failures.is_empty(), "parity failures: {failures:#?}");
}
