//! `cortiq inspect`, run as a process on files written here.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use engine::cmf_format::{Cmf, CmfWriter, Header, SidecarRef};
use engine::quant_codecs::{self, DType};

const F32_VALUES: [f32; 6] = [1.5, -2.25, 0.0, 3.0e-8, 1.0e6, -0.1];

fn weights(rows: usize, cols: usize) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
        .collect()
}

/// A small model: an f32 vector with known values, a q8_2f matrix, a q4tp matrix.
fn write_model(dir: &Path) -> PathBuf {
    let path = dir.join("model.cmf");
    let mut h = Header::new("tiny-test");
    h.quantization.profile = "mixed".into();
    h.provenance.converter = "engine tests".into();
    h.dims.hidden_size = Some(64);
    h.chat_template = Some("{{ messages }}".into());
    h.sidecars.push(SidecarRef {
        role: "mtp".into(),
        file: "model.mtp.cmf".into(),
        uid: 0xabc,
    });
    let mut w = CmfWriter::create(&path, h).unwrap();
    let f32_bytes: Vec<u8> = F32_VALUES.iter().flat_map(|v| v.to_le_bytes()).collect();
    w.add_tensor("model.norm.weight", DType::F32, &[6], &f32_bytes)
        .unwrap();
    let q8 = quant_codecs::quantize(DType::Q8_2f, 4, 16, &weights(4, 16)).unwrap();
    w.add_tensor("model.embed_tokens.weight", DType::Q8_2f, &[4, 16], &q8)
        .unwrap();
    let q4 = quant_codecs::quantize(DType::Q4tp, 8, 64, &weights(8, 64)).unwrap();
    w.add_tensor(
        "model.layers.0.mlp.down_proj.weight",
        DType::Q4tp,
        &[8, 64],
        &q4,
    )
    .unwrap();
    w.finish().unwrap()
}

fn cortiq(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cortiq"))
        .args(args)
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn plain_output_lists_metadata_tensors_and_totals() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path());
    let out = cortiq(&["inspect", path.to_str().unwrap()]);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    let s = text(&out.stdout);
    let uid = format!("{:016x}", Cmf::open(&path).unwrap().uid());
    for want in [
        "architecture  tiny-test",
        "quantization  mixed",
        "engine tests",
        "hidden_size=64",
        "chat template: yes",
        "tokenizer: no",
        "sidecar       mtp -> model.mtp.cmf",
        uid.as_str(),
        "model.layers.0.mlp.down_proj.weight",
        "q8_2f",
        "[8, 64]",
        "total",
    ] {
        assert!(s.contains(want), "missing {want:?} in:\n{s}");
    }
}

#[test]
fn json_output_parses_and_matches_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path());
    let v = json(&cortiq(&["inspect", "--json", path.to_str().unwrap()]));
    assert_eq!(v["architecture"], "tiny-test");
    assert_eq!(v["version"], 1);
    assert_eq!(v["size"], std::fs::metadata(&path).unwrap().len());
    assert_eq!(v["tensors"].as_array().unwrap().len(), 3);
    assert_eq!(v["tensors"][1]["dtype"], "q8_2f");
    assert_eq!(v["embedded"]["chat_template"], true);
    let totals = v["totals"].as_array().unwrap();
    let total = totals.last().unwrap();
    assert_eq!(total["dtype"], "total");
    assert_eq!(total["count"], 3);
    assert_eq!(total["elements"], 6 + 64 + 512);
    let f32_total = totals.iter().find(|t| t["dtype"] == "f32").unwrap();
    assert_eq!(f32_total["bits_per_weight"], 32.0);
    assert!(v["verify"].is_null());
}

#[test]
fn verify_passes_on_a_good_file_and_names_corrupt_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path());
    let out = cortiq(&["inspect", "--verify", path.to_str().unwrap()]);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    assert!(text(&out.stdout).contains("verify: all 3 tensors OK"));

    let cmf = Cmf::open(&path).unwrap();
    let off = cmf.tensor("model.embed_tokens.weight").unwrap().info.offset as usize;
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[off + 3] ^= 0x40;
    let bad = dir.path().join("corrupt.cmf");
    std::fs::write(&bad, &bytes).unwrap();
    let out = cortiq(&["inspect", "--verify", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let s = text(&out.stdout);
    assert!(s.contains("CORRUPT model.embed_tokens.weight"), "{s}");
    assert!(!s.contains("CORRUPT model.norm.weight"), "{s}");
    let out = cortiq(&["inspect", "--verify", "--json", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["verify"]["bad"][0]["name"], "model.embed_tokens.weight");
}

#[test]
fn bad_files_fail_with_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path());
    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.path().join("truncated.cmf");
    std::fs::write(&cut, &bytes[..bytes.len() - 10]).unwrap();
    let missing = dir.path().join("missing.cmf");
    let junk = dir.path().join("junk.cmf");
    std::fs::write(&junk, b"hello, not a model").unwrap();
    for (file, want) in [
        (&cut, "outside the file"),
        (&missing, "missing.cmf"),
        (&junk, "not a CMF file"),
    ] {
        let out = cortiq(&["inspect", file.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(2), "{}", file.display());
        let err = text(&out.stderr);
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(
            err.contains(want) && err.contains(file.file_name().unwrap().to_str().unwrap()),
            "{err}"
        );
        assert!(!err.contains("panicked"), "{err}");
        assert!(out.stdout.is_empty());
    }
    let out = cortiq(&["inspect", "--tensor", "nope", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("no tensor named \"nope\""));
}

#[test]
fn tensor_values_are_the_stored_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_model(dir.path());
    let p = path.to_str().unwrap();
    let v = json(&cortiq(&[
        "inspect",
        "--json",
        "--tensor",
        "model.norm.weight",
        "--values",
        "4",
        p,
    ]));
    let got: Vec<f32> = serde_json::from_value(v["tensor"]["values"].clone()).unwrap();
    assert_eq!(got, F32_VALUES[..4]);
    // Asking for more values than exist gives them all.
    let v = json(&cortiq(&[
        "inspect",
        "--json",
        "--tensor",
        "model.norm.weight",
        "--values",
        "100",
        p,
    ]));
    let got: Vec<f32> = serde_json::from_value(v["tensor"]["values"].clone()).unwrap();
    assert_eq!(got, F32_VALUES);
    // Text output prints them exactly too.
    let out = cortiq(&[
        "inspect",
        "--tensor",
        "model.norm.weight",
        "--values",
        "6",
        p,
    ]);
    let s = text(&out.stdout);
    assert!(
        s.contains("1.5") && s.contains("-2.25") && s.contains("3e-8") && s.contains("1000000.0"),
        "{s}"
    );

    let cmf = Cmf::open(&path).unwrap();
    for name in [
        "model.embed_tokens.weight",
        "model.layers.0.mlp.down_proj.weight",
    ] {
        let t = cmf.tensor(name).unwrap();
        let want = quant_codecs::dequantize(t.dtype(), t.shape(), t.bytes).unwrap();
        let v = json(&cortiq(&[
            "inspect", "--json", "--tensor", name, "--values", "40", p,
        ]));
        let got: Vec<f32> = serde_json::from_value(v["tensor"]["values"].clone()).unwrap();
        assert_eq!(got, want[..40], "{name}");
        assert_eq!(v["tensor"]["dtype"], t.dtype().name());
    }
}

#[test]
fn values_requires_tensor() {
    let out = cortiq(&["inspect", "--values", "3", "x.cmf"]);
    assert_eq!(out.status.code(), Some(2));
}
