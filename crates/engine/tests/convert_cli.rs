//! `cortiq convert` as a user runs it: the binary converts a fixture that `inspect --verify`
//! then accepts; a refused or failed conversion (a bad config, a full disk) exits with status
//! 2 and says why, leaving nothing.
//! (The converter itself is tested in crates/cmf-convert/tests.)

use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(case)
        .join("hf")
}

#[test]
fn binary_converts_and_inspect_verify_passes() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("ds.cmf");
    let bin = env!("CARGO_BIN_EXE_cortiq");
    let o = Command::new(bin)
        .args(["convert", fixture("deepseek_v4_b").to_str().unwrap(), "-o"])
        .arg(&out)
        .args(["--quant", "fp4", "--quiet"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = Command::new(bin)
        .arg("inspect")
        .arg(&out)
        .arg("--verify")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// A V4.1 checkpoint converts and inspects (its Engram tables stay mxfp8), and the model
/// commands run it on the CPU: run, chat, perplexity and logits each finish with output.
#[test]
fn a_v41_checkpoint_converts_inspects_and_runs() {
    use std::io::Write;
    use std::process::Stdio;
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("v41.cmf");
    let bin = env!("CARGO_BIN_EXE_cortiq");
    let o = Command::new(bin)
        .args(["convert", fixture("deepseek_v41_a").to_str().unwrap(), "-o"])
        .arg(&out)
        .args(["--quant", "q4", "--quiet"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = Command::new(bin)
        .arg("inspect")
        .arg(&out)
        .arg("--verify")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let listing = String::from_utf8_lossy(&o.stdout);
    assert!(
        listing.contains("model.engram_tables.1.weight") && listing.contains("mxfp8"),
        "{listing}"
    );
    let text = tmp.path().join("text.txt");
    std::fs::write(
        &text,
        "Call me Ishmael. Some years ago, never mind how long.",
    )
    .unwrap();
    let text = text.to_str().unwrap();
    let npy = tmp.path().join("logits.npy");
    let npy_s = npy.to_str().unwrap();
    for (args, stdout_has) in [
        (vec!["run", "-n", "4", "--temp", "0", "-p", "hi"], ""),
        (vec!["perplexity", "-f", text], "ppl ="),
        (vec!["logits", "--tokens", "5,17,42", "-o", npy_s], ""),
    ] {
        let o = Command::new(bin)
            .args(&args[..1])
            .arg("-m")
            .arg(&out)
            .args(&args[1..])
            .output()
            .unwrap();
        let (so, se) = (
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
        );
        assert!(o.status.success(), "{args:?}: {se}");
        assert!(
            format!("{so}{se}").to_lowercase().contains(stdout_has),
            "{args:?}: {so}{se}"
        );
    }
    // [3, 512] float32 after the .npy header.
    assert!(std::fs::metadata(&npy).unwrap().len() > 3 * 512 * 4);
    let mut child = Command::new(bin)
        .args(["chat", "--temp", "0", "-n", "4", "-m"])
        .arg(&out)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Hello there\nWhat now?\n")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let so = String::from_utf8_lossy(&o.stdout);
    assert!(
        so.contains("> Hello there") && so.contains("> What now?"),
        "{so}"
    );
}

#[test]
fn binary_exits_non_zero_and_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    // A checkpoint directory whose config names an architecture nobody converts.
    let dir = tmp.path().join("nope");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("config.json"), r#"{"model_type": "nope"}"#).unwrap();
    // An empty safetensors shard: an 8-byte header length, then the header `{}`.
    let mut shard = 2u64.to_le_bytes().to_vec();
    shard.extend_from_slice(b"{}");
    std::fs::write(dir.join("model.safetensors"), shard).unwrap();
    let out = tmp.path().join("x.cmf");
    let o = Command::new(env!("CARGO_BIN_EXE_cortiq"))
        .arg("convert")
        .arg(&dir)
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("unknown model_type") && err.lines().count() == 1,
        "{err}"
    );
    assert!(!out.exists());
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("x.cmf"))
        .collect();
    assert!(left.is_empty());
}

#[cfg(unix)]
#[test]
fn a_full_disk_is_an_error_naming_the_tensor_and_leaves_nothing() {
    // A file-size limit makes writes fail with EFBIG part-way, as a full disk makes them fail
    // with ENOSPC: the same error path. SIGXFSZ is ignored so the write returns the error.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.cmf");
    let script = format!(
        "trap '' XFSZ; ulimit -f 40; exec '{}' convert '{}' -o '{}' --quant f32 --quiet",
        env!("CARGO_BIN_EXE_cortiq"),
        fixture("qwen4_exp_a").display(),
        out.display()
    );
    let r = std::process::Command::new("sh")
        .arg("-c")
        .arg(&script)
        .output()
        .unwrap();
    assert_eq!(r.status.code(), Some(2), "{r:?}");
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(
        err.contains("writing tensor") && err.contains("out.cmf"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "files left behind"
    );
}
