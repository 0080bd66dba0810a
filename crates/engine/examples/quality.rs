//! Prints, for every random-weight fixture and conversion profile, the prefill logits' agreement
//! with transformers (max|diff| relative to max|logit|, top-1 agreement, mean KL(ref || ours)) as a
//! markdown table (docs/quality.md). One code path for both architectures (`AnyModel`); an
//! argument keeps only the cases starting with it.
//!
//!     cargo run --release -p engine --example quality [-- qwen4_exp|deepseek_v4]

use engine::cmf_format::Cmf;
use engine::convert::{ConvertOptions, Profile, convert};
use engine::logits::read_npy;
use engine::model::AnyModel;
use std::path::{Path, PathBuf};

fn f32s(path: &Path) -> Vec<f32> {
    let a = read_npy(path).unwrap();
    assert_eq!(
        a.f32.len(),
        a.shape.iter().product::<usize>(),
        "{path:?}: not <f4"
    );
    a.f32
}

fn ids(path: &Path) -> Vec<u32> {
    read_npy(path)
        .unwrap()
        .i64
        .iter()
        .map(|&i| i as u32)
        .collect()
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let z: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
    x.iter().map(|&v| v as f64 - m - z).collect()
}

fn argmax(v: &[f32]) -> usize {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b })
}

const CASES: [&str; 6] = [
    "qwen4_exp_a",
    "qwen4_exp_b",
    "qwen4_exp_c",
    "deepseek_v4_a",
    "deepseek_v4_b",
    "deepseek_v4_c",
];

fn main() {
    let only = std::env::args().nth(1).unwrap_or_default();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    let dir = tempfile::tempdir().unwrap();
    println!("| case | profile | max\\|diff\\| / max\\|logit\\| | top-1 agreement | mean KL |");
    println!("|---|---|---|---|---|");
    for case in CASES.into_iter().filter(|c| c.starts_with(&only)) {
        for profile in [
            Profile::F32,
            Profile::Bf16,
            Profile::F16,
            Profile::Q8,
            Profile::Q4,
            Profile::Q2,
            Profile::Fp4,
        ] {
            let out = dir.path().join(format!("{case}-{profile:?}.cmf"));
            convert(
                &ConvertOptions::new(root.join(case).join("hf"), out.clone(), profile),
                &mut |_| {},
            )
            .unwrap();
            let cmf = Cmf::open(&out).unwrap();
            let model = AnyModel::bind(&cmf).unwrap();
            let v = model.vocab_size();
            let (mut rows, mut agree, mut kl, mut rel) = (0usize, 0usize, 0f64, 0f32);
            for p in 0..3 {
                let exp = root.join(case).join("expected");
                let want = f32s(&exp.join(format!("p{p}_prefill_logits.npy")));
                let got = model
                    .forward_prefill(&ids(&exp.join(format!("p{p}_ids.npy"))))
                    .unwrap();
                let max_ref = want.iter().fold(0f32, |m, x| m.max(x.abs()));
                let diff = got
                    .iter()
                    .zip(&want)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                rel = rel.max(diff / max_ref);
                for (g, w) in got.chunks(v).zip(want.chunks(v)) {
                    rows += 1;
                    agree += usize::from(argmax(g) == argmax(w));
                    let (lp, lq) = (log_softmax(w), log_softmax(g));
                    kl += lp
                        .iter()
                        .zip(&lq)
                        .map(|(a, b)| a.exp() * (a - b))
                        .sum::<f64>();
                }
            }
            println!(
                "| {case} | {profile:?} | {rel:.2e} | {:.2}% | {:.2e} |",
                100.0 * agree as f64 / rows as f64,
                kl / rows as f64
            );
        }
    }
}
