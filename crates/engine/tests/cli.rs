//! The command line as a user meets it: a table of bad inputs (each must exit with status 2, say
//! what is wrong naming the flag, file or field, and leave nothing behind), then the
//! conventions (optional model, llama.cpp flags, generation defaults, seeds), the file checks
//! (directories, devices, FIFOs, oversized texts, corrupt tensors) and `convert`'s clean-up on
//! interrupts.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn cortiq(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cortiq"))
        .args(args)
        .stdin(Stdio::null())
        .env("CORTIQ_GPU", "cpu")
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn fixture_hf(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(case)
        .join("hf")
}

/// Converts `dir` (a checkpoint directory) to `out` with the binary.
fn convert(dir: &Path, out: &Path, quant: &str) {
    let o = Command::new(env!("CARGO_BIN_EXE_cortiq"))
        .args([
            "convert",
            dir.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ])
        .args(["--quant", quant, "--quiet"])
        .env("SOURCE_DATE_EPOCH", "0")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}

#[test]
fn bad_inputs_exit_2_with_a_message_naming_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let text = d.join("t.txt");
    std::fs::write(&text, "ROMEO. But soft, what light.").unwrap();
    // A 300 MiB sparse text: past the 256 MiB limit without using the disk.
    let big = d.join("big.txt");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(300 << 20)
        .unwrap();
    let fifo = d.join("fifo");
    let made_fifo = Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success());
    let (dp, tp, bp, fp) = (
        d.to_str().unwrap(),
        text.to_str().unwrap(),
        big.to_str().unwrap(),
        fifo.to_str().unwrap(),
    );
    let mut cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (vec!["run", "-p", "x", "--temp=-1"], vec!["--temp", ">= 0"]),
        (
            vec!["run", "-p", "x", "--temp", "-1"],
            vec!["--temp", ">= 0"],
        ),
        (
            vec!["run", "-p", "x", "--temp", "nan"],
            vec!["--temp", "finite"],
        ),
        (
            vec!["run", "-p", "x", "--temp", "inf"],
            vec!["--temp", "finite"],
        ),
        (
            vec!["run", "-p", "x", "--top-p", "2"],
            vec!["--top-p", "(0, 1]"],
        ),
        (
            vec!["run", "-p", "x", "--top-p", "-0.5"],
            vec!["--top-p", "(0, 1]"],
        ),
        (
            vec!["run", "-p", "x", "--min-p", "1.5"],
            vec!["--min-p", "[0, 1]"],
        ),
        (
            vec!["run", "-p", "x", "--repeat-penalty", "0"],
            vec!["--repeat-penalty", "> 0"],
        ),
        (
            vec!["run", "-p", "x", "-n", "0"],
            vec!["--max-tokens", ">= 1"],
        ),
        (
            vec!["run", "-p", "x", "-n", "-5"],
            vec!["--max-tokens", ">= 1"],
        ),
        (
            vec!["run", "-p", "x", "-t", "0"],
            vec!["--threads", "between 1"],
        ),
        (vec!["run", "-p", "x", "-c", "-1"], vec!["--ctx", ">= 1"]),
        (vec!["run"], vec!["--prompt"]),
        (vec!["run", dp, "-p", "x"], vec![dp, "is a directory"]),
        (
            vec!["run", "/dev/zero", "-p", "x"],
            vec!["/dev/zero", "not a regular file"],
        ),
        (vec!["run", "-f", dp], vec![dp, "a directory"]),
        (vec!["run", "-f", bp], vec![bp, "larger than"]),
        (
            vec!["run", "-p", "ROMEO. JULIET. NURSE.", "-c", "2"],
            vec!["--ctx 2 leaves no room"],
        ),
        (
            vec!["perplexity", "/dev/zero"],
            vec!["/dev/zero", "a device"],
        ),
        (vec!["perplexity", dp], vec![dp, "a directory"]),
        (vec!["perplexity", bp], vec![bp, "larger than"]),
        (
            vec!["perplexity", tp, "-c", "1"],
            vec!["--ctx", "at least 2"],
        ),
        (vec!["perplexity"], vec!["no text file"]),
        (vec!["inspect", dp], vec![dp, "is a directory"]),
        (vec!["logits", "--tokens", "1", "-o", dp], vec![dp]),
        (
            vec!["doctor", "--vram", "0"],
            vec!["--vram", "larger than 0"],
        ),
        (vec!["doctor", "--vram", "lots"], vec!["--vram", "16G"]),
        (
            vec!["bench", "kernels", "--seconds", "-1"],
            vec!["--seconds", "(0, 3600]"],
        ),
        (
            vec!["bench", "kernels", "--seconds", "nan"],
            vec!["--seconds", "finite"],
        ),
        (
            vec!["bench", "kernels", "--large", "0"],
            vec!["--large", "larger than 0"],
        ),
        (
            vec!["bench", "model", "--synthetic", "gpt-9", "-p", "0"],
            vec!["gpt-9", "qwen3.8-flash-next", "deepseek-v4-flash"],
        ),
        (vec!["convert", dp, "-o", dp], vec![dp, "is a directory"]),
        (
            vec!["convert", dp, "-o", "/nonexistent-cortiq-dir/x.cmf"],
            vec!["/nonexistent-cortiq-dir", "does not exist"],
        ),
    ];
    if made_fifo {
        cases.push((vec!["run", fp, "-p", "x"], vec![fp, "not a regular file"]));
        cases.push((vec!["perplexity", fp], vec![fp, "a FIFO"]));
    }
    let before: Vec<_> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let mut failures = Vec::new();
    for (args, needles) in &cases {
        let t0 = Instant::now();
        let o = cortiq(args);
        let err = stderr(&o);
        if o.status.code() != Some(2) {
            failures.push(format!(
                "{args:?}: exit {:?}, stderr {err}",
                o.status.code()
            ));
        }
        for n in needles {
            if !err.contains(n) {
                failures.push(format!("{args:?}: stderr does not mention {n:?}: {err}"));
            }
        }
        if err.contains("panicked") {
            failures.push(format!("{args:?}: panicked: {err}"));
        }
        // Bad input is refused before any work.
        if t0.elapsed() > Duration::from_secs(20) {
            failures.push(format!("{args:?}: took {:?}", t0.elapsed()));
        }
    }
    let after: Vec<_> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(before, after, "files were left behind");
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn the_embedded_model_serves_every_command_and_flags_read_like_llama_cpp() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(
        &text,
        "ROMEO.\nBut soft, what light through yonder window breaks?\n",
    )
    .unwrap();
    let npy = dir.path().join("l.npy");
    let o = cortiq(&["logits", "--tokens", "1,2,3", "-o", npy.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(npy.is_file());
    let o = cortiq(&[
        "perplexity",
        "-f",
        text.to_str().unwrap(),
        "-c",
        "8",
        "--limit",
        "12",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("PPL = "));
    // -f reads the prompt from a file: the same greedy text as -p.
    let prompt = dir.path().join("p.txt");
    std::fs::write(&prompt, "ROMEO.\n").unwrap();
    let a = cortiq(&[
        "run",
        "-f",
        prompt.to_str().unwrap(),
        "-n",
        "8",
        "--temp",
        "0",
        "-t",
        "1",
    ]);
    let b = cortiq(&["run", "-p", "ROMEO.\n", "-n", "8", "--temp", "0"]);
    assert!(a.status.success() && b.status.success(), "{}", stderr(&a));
    assert_eq!(a.stdout, b.stdout);
    // Sampling by default: the model's generation defaults (temperature 0.6 here) and a fresh
    // seed, printed; the printed seed repeats the run.
    let a = cortiq(&["run", "-p", "ROMEO.\n", "-n", "12"]);
    let err = stderr(&a);
    let seed = err
        .split("--seed ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or_else(|| panic!("no seed printed: {err}"))
        .to_string();
    let b = cortiq(&["run", "-p", "ROMEO.\n", "-n", "12", "--seed", &seed]);
    assert_eq!(a.stdout, b.stdout, "the printed seed repeats the run");
    // -c caps the generation at the context.
    let o = cortiq(&[
        "run", "-p", "ROMEO.\n", "-n", "50", "-c", "10", "--temp", "0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("generating at most"), "{}", stderr(&o));
    // inspect shows the generation defaults run and chat use.
    let o = cortiq(&["inspect"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("temperature=0.6") && out.contains("top_k=20"),
        "{out}"
    );
    // --vram takes the same suffixes everywhere (1T as well as 1.5G).
    let o = cortiq(&["doctor", "--backend", "cpu", "--vram", "1T"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// A config whose values are outside their domain is refused at load, naming the file and the
/// field; a tensor whose bytes no longer match its checksum stops generation, naming it.
#[test]
fn broken_configs_and_corrupt_tensors_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("hf");
    copy_dir(&fixture_hf("qwen4_exp_b"), &hf);
    let cfg_path = hf.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    cfg["text_config"]["rms_norm_eps"] = serde_json::json!(-1.0);
    std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    let bad = dir.path().join("bad-eps.cmf");
    convert(&hf, &bad, "f32");
    let o = cortiq(&["run", bad.to_str().unwrap(), "-p", "hello", "-n", "2"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("bad-eps.cmf") && err.contains("rms_norm_eps"),
        "{err}"
    );

    let good = dir.path().join("good.cmf");
    convert(&fixture_hf("qwen4_exp_b"), &good, "f32");
    let cmf = engine::cmf_format::Cmf::open(&good).unwrap();
    let info = cmf
        .tensors()
        .iter()
        .find(|t| t.name.ends_with("mlp.experts.1.down_proj.weight"))
        .unwrap()
        .clone();
    drop(cmf);
    let mut bytes = std::fs::read(&good).unwrap();
    bytes[info.offset as usize + 5] ^= 0x40;
    let corrupt = dir.path().join("corrupt.cmf");
    std::fs::write(&corrupt, bytes).unwrap();
    let o = cortiq(&["run", corrupt.to_str().unwrap(), "-p", "hello", "-n", "2"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&info.name) && err.contains("checksum"),
        "{err}"
    );
    let npy = dir.path().join("l.npy");
    let o = cortiq(&[
        "logits",
        corrupt.to_str().unwrap(),
        "--tokens",
        "1,2",
        "-o",
        npy.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains(&info.name), "{}", stderr(&o));
}

/// SIGTERM (and Ctrl-C) during a conversion removes its temporary file; a temporary file a dead
/// conversion left is removed by the next one.
#[cfg(unix)]
#[test]
fn convert_cleans_up_after_interrupts() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.cmf");
    // A dead conversion's leftover (no process has this id: ids stay below 2^22 on Linux).
    let stale = dir.path().join(".x.cmf.tmp-4194305");
    std::fs::write(&stale, b"partial").unwrap();
    // Idle for an hour: a live writer's file is never that old.
    std::fs::File::options()
        .write(true)
        .open(&stale)
        .unwrap()
        .set_modified(std::time::SystemTime::now() - Duration::from_secs(3600))
        .unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_cortiq"))
        .args(["convert", fixture_hf("shakespeare").to_str().unwrap(), "-o"])
        .arg(&out)
        .args(["--quant", "q2", "--quiet"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for this conversion's own temporary file, then interrupt.
    let own = dir.path().join(format!(".x.cmf.tmp-{}", child.id()));
    let t0 = Instant::now();
    while !own.exists() && t0.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(own.exists(), "the conversion never started writing");
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert!(!stale.exists(), "the stale file was not removed: {err}");
    assert!(err.contains("interrupted conversion"), "{err}");
    if o.status.code() == Some(130) {
        eprintln!("interrupted mid-conversion, as intended");
        assert!(err.contains("interrupted"), "{err}");
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert!(left.is_empty(), "left behind: {left:?}");
    } else {
        // The conversion won the race and finished: then the file is complete and valid.
        eprintln!("the conversion finished before the signal");
        assert!(o.status.success(), "{err}");
        engine::cmf_format::Cmf::open(&out)
            .unwrap()
            .verify()
            .unwrap();
    }
}

/// A message that does not fit the context ends that turn with a message, not the session.
#[test]
fn chat_survives_a_turn_past_the_context() {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_cortiq"))
        .args(["chat", "-c", "8", "--temp", "0", "-n", "4"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Good morrow, fair lady, how fares thy noble father?\n/help\n")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("context limit of 8"), "{err}");
    assert!(
        err.contains("commands:"),
        "the session went on to /help: {err}"
    );
}

/// `bench model --synthetic deepseek-v4-flash` at the release width (one layer of 8 experts, so
/// it runs in seconds) on the CPU: both tests run, and a decoded token reads at least the
/// lm_head (129,280 x 4,096 in q8_2f: one byte a weight and its scales).
#[test]
fn the_synthetic_deepseek_v4_flash_benches_on_the_cpu() {
    let o = cortiq(&[
        "bench",
        "model",
        "--synthetic",
        "deepseek-v4-flash",
        "--layers",
        "1",
        "--experts",
        "8",
        "--quant",
        "fp4",
        "-p",
        "2",
        "-n",
        "2",
        "-r",
        "1",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let tests: Vec<&str> = r["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["test"].as_str().unwrap())
        .collect();
    assert_eq!(tests, ["pp2", "tg2"], "{r}");
    assert!(r["records"][1]["tok_s"].as_f64().unwrap() > 0.0);
    let bytes = r["token_bytes"].as_u64().unwrap();
    assert!(bytes > 129_280 * 4_096, "{bytes}");
    assert!(r["model"].as_str().unwrap().contains("1 layers, 8 experts"));
}
