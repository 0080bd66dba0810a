//! The official `openai` and `anthropic` Python packages drive a live `cortiq serve` (the
//! built-in demo model, an API key required): chat whole and streamed, text completions,
//! tools and tool turns, the messages API with the SDK's own stream accumulator, token
//! counting, and the errors the SDKs raise. The expected replies are the engine library's own
//! greedy generations of the same requests (tests/clients/clients.py does the checking).
//!
//! The Python used is `$CORTIQ_PYTHON` (else `python3`). Without the packages the test is
//! skipped, unless `CORTIQ_REQUIRE_PYCLIENTS=1` (set by `.ci/run`, which installs them in a
//! virtual environment): then it fails.

mod common;

use std::path::Path;
use std::process::Command;

use common::{runner, spawn_server};
use engine::chat::{Chat, Message};
use engine::generate::GenerateOptions;
use engine::sampling::{Sampler, Sampling};
use engine::serve::worker::WorkerOptions;
use serde_json::json;

const KEY: &str = "sk-cortiq-test";
const MAX: usize = 16;

fn python() -> Option<String> {
    let py = std::env::var("CORTIQ_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .args(["-c", "import openai, anthropic"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(py);
    }
    let why = format!("{py} cannot import openai and anthropic");
    if std::env::var("CORTIQ_REQUIRE_PYCLIENTS").is_ok_and(|v| v == "1") {
        panic!("CORTIQ_REQUIRE_PYCLIENTS=1 but {why}");
    }
    eprintln!("skipped: {why} (pip install openai anthropic, or set CORTIQ_PYTHON)");
    None
}

#[test]
fn the_official_python_clients_work_against_the_server() {
    let Some(py) = python() else {
        return;
    };
    let r = runner();
    let user = "To be, or not to be";
    let mut chat = Chat::new(&r, None, Sampling::default()).unwrap();
    chat.messages = vec![Message::new("user", user)];
    let prompt_tokens = chat.prompt_ids().unwrap().len();
    let reply = chat.respond(MAX, &mut |_| {}).unwrap();
    let prompt = "KING HENRY:";
    let ids = r.encode(prompt).unwrap();
    let mut st = r.model.model().new_state();
    let mut sampler = Sampler::new(Sampling::default());
    let text = r
        .complete(
            &mut st,
            &ids,
            &mut sampler,
            &GenerateOptions::new(MAX),
            &mut |_| {},
        )
        .unwrap();
    let expected = json!({
        "user": user, "max_tokens": MAX, "chat": reply.text, "chat_tokens": reply.tokens,
        "prompt_tokens": prompt_tokens, "prompt": prompt, "text": text.text,
    });
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("expected.json");
    std::fs::write(&file, expected.to_string()).unwrap();

    let (port, _) = spawn_server(r, WorkerOptions::new(512), Some(KEY));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/clients/clients.py");
    let out = Command::new(&py)
        .arg(&script)
        .arg(port.to_string())
        .arg(&file)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "clients.py failed\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.trim_end().ends_with("checks"), "{stdout}");
    eprintln!("{}", stdout.trim_end());
}
