//! `cortiq run` against transformers: the embedded tokenizer encodes each fixture prompt to the
//! ids transformers used, greedy generation reproduces transformers' 16-token continuation, and
//! the binary streams its text.

use std::path::{Path, PathBuf};
use std::process::Command;

use engine::cmf_format::Cmf;
use engine::convert::{ConvertOptions, Profile, convert};
use engine::run::{RunError, Runner};
use engine::sampling::Sampling;

/// The container example (`cargo xtask tiny-cmf`): an architecture no model crate runs.
const TINY_EXAMPLE: &[u8] = include_bytes!("../../../assets/tiny.cmf");

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(case)
}

fn converted(case: &str, dir: &Path) -> PathBuf {
    let out = dir.join(format!("{case}.cmf"));
    convert(
        &ConvertOptions::new(fixture(case).join("hf"), out.clone(), Profile::F32),
        &mut |_| {},
    )
    .unwrap();
    out
}

fn prompts(case: &str) -> Vec<(String, Vec<u32>, Vec<u32>)> {
    let cases: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture(case).join("expected/cases.json")).unwrap())
            .unwrap();
    let ids = |v: &serde_json::Value| {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    cases["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["text"].is_string())
        .map(|p| {
            (
                p["text"].as_str().unwrap().to_string(),
                ids(&p["ids"]),
                ids(&p["greedy_ids"]),
            )
        })
        .collect()
}

#[test]
fn greedy_generation_matches_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let (mut checked, mut checked_ds) = (0, 0);
    for case in [
        "qwen4_exp_a",
        "qwen4_exp_b",
        "qwen4_exp_c",
        "deepseek_v4_a",
        "deepseek_v4_b",
    ] {
        let path = converted(case, dir.path());
        let cmf = Cmf::open(&path).unwrap();
        let runner = Runner::from_cmf(cmf).unwrap();
        for (text, ids, greedy) in prompts(case) {
            let enc = runner.encode(&text).unwrap();
            if enc != ids {
                // A prompt rendered from a chat template carries specials the plain text lacks.
                continue;
            }
            let mut streamed = Vec::new();
            let g = runner
                .generate(&enc, greedy.len(), Sampling::default(), &mut |t| {
                    streamed.push(t)
                })
                .unwrap();
            // Transformers' continuation does not stop at EOS; compare up to ours.
            assert_eq!(g.tokens[..], greedy[..g.tokens.len()], "{case}: {text:?}");
            assert_eq!(streamed, g.tokens);
            checked += 1;
            checked_ds += usize::from(case.starts_with("deepseek"));
        }
    }
    assert!(
        checked_ds >= 2,
        "only {checked_ds} deepseek_v4 prompts checked"
    );
    assert!(
        checked >= 3,
        "only {checked} prompts tokenised to transformers' ids"
    );
}

#[test]
fn the_binary_streams_the_greedy_text() {
    let dir = tempfile::tempdir().unwrap();
    let path = converted("qwen4_exp_a", dir.path());
    let (text, _, greedy) = prompts("qwen4_exp_a").remove(0);
    let out = Command::new(env!("CARGO_BIN_EXE_cortiq"))
        .args([
            "run",
            path.to_str().unwrap(),
            "-p",
            &text,
            "-n",
            "16",
            "--temp",
            "0",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let cmf = Cmf::open(&path).unwrap();
    let runner = Runner::from_cmf(cmf).unwrap();
    let want = runner.tokenizer.decode(&greedy, true).unwrap();
    let got = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        got.trim_end_matches('\n'),
        want.trim_end_matches('\u{FFFD}'),
        "stdout"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tok/s"), "{err}");
}

#[test]
fn bad_requests_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    // The container example assets/tiny.cmf has no tokenizer (and is not a qwen4_exp model).
    let tiny = Cmf::from_bytes(TINY_EXAMPLE).unwrap();
    assert!(matches!(
        Runner::from_cmf(tiny),
        Err(RunError::Tokenizer { .. })
    ));
    let path = converted("qwen4_exp_b", dir.path());
    let cmf = Cmf::open(&path).unwrap();
    let runner = Runner::from_cmf(cmf).unwrap();
    assert!(matches!(
        runner.generate(&[], 4, Sampling::default(), &mut |_| {}),
        Err(RunError::EmptyPrompt)
    ));
    let vocab = runner.model.model().vocab_size() as u32;
    assert!(matches!(
        runner.generate(&[vocab], 4, Sampling::default(), &mut |_| {}),
        Err(RunError::Forward(_))
    ));
    let out = Command::new(env!("CARGO_BIN_EXE_cortiq"))
        .args([
            "run",
            dir.path().join("missing.cmf").to_str().unwrap(),
            "-p",
            "x",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}
