//! A bounded load test on loopback: many streaming clients at once against one server (the
//! demo model on the CPU, 4 parallel slots, a 32 MiB prompt cache), mixing the OpenAI chat
//! and text streams, the Anthropic event stream and whole answers, some clients hanging up
//! mid-stream. Every request that is not abandoned must succeed (a 200 whose stream ends
//! properly, no error event); every slot must be free at the end; resident memory after the
//! warm-up (the first quarter) must not keep growing.
//!
//! CI runs it short (16 clients, 15 s). The run docs/perf.md reports is
//! `CORTIQ_LOAD_CLIENTS=64 CORTIQ_LOAD_SECONDS=300 cargo test -p engine --test load --
//! --nocapture` (the test profile is optimised). Nothing here is a speed bar: the figures are printed, not asserted.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{http, runner, spawn_server};
use engine::serve::worker::WorkerOptions;
use serde_json::{Value, json};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Resident memory of this process (server and clients), bytes.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb << 10)
}

const PROMPTS: [&str; 6] = [
    "ROMEO:",
    "To be, or not to be",
    "Now is the winter of our discontent",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "KING RICHARD III:",
];

#[derive(Default)]
struct Tally {
    done: u64,
    abandoned: u64,
    tokens: u64,
    failures: Vec<String>,
}

/// One request of kind `i % 4` (OpenAI chat stream, text stream, Anthropic stream, whole
/// chat); checks its answer and returns its completion tokens.
fn request(port: u16, i: u64, max_tokens: u64, prompt: &str) -> Result<u64, String> {
    let chat = json!([{"role": "system", "content": "You are a player."},
                      {"role": "user", "content": prompt}]);
    let (path, body) = match i % 4 {
        0 => (
            "/v1/chat/completions",
            json!({"messages": chat, "max_tokens": max_tokens, "stream": true,
                   "stream_options": {"include_usage": true}, "temperature": 0.8}),
        ),
        1 => (
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true,
                   "stream_options": {"include_usage": true}}),
        ),
        2 => (
            "/v1/messages",
            json!({"messages": [{"role": "user", "content": prompt}], "system": "You are a player.",
                   "max_tokens": max_tokens, "stream": true}),
        ),
        _ => (
            "/v1/chat/completions",
            json!({"messages": chat, "max_tokens": max_tokens, "temperature": 0}),
        ),
    };
    let (status, text) = http(port, "POST", path, &body.to_string(), &[]);
    if status != 200 {
        return Err(format!("{path}: status {status}: {text}"));
    }
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    let parsed: Vec<Value> = data
        .iter()
        .filter(|d| **d != "[DONE]")
        .map(|d| serde_json::from_str(d).map_err(|e| format!("{path}: bad event {d}: {e}")))
        .collect::<Result<_, _>>()?;
    if parsed.iter().any(|v| v.get("error").is_some()) {
        return Err(format!("{path}: error event in {text}"));
    }
    match i % 4 {
        0 | 1 => {
            if data.last() != Some(&"[DONE]") {
                return Err(format!("{path}: stream did not end with [DONE]: {text}"));
            }
            let usage = parsed.iter().rev().find_map(|v| v["usage"].as_object());
            usage
                .and_then(|u| u["completion_tokens"].as_u64())
                .ok_or_else(|| format!("{path}: no usage chunk"))
        }
        2 => {
            let last = parsed.last().map(|v| v["type"].clone());
            if last != Some(json!("message_stop")) {
                return Err(format!(
                    "{path}: stream did not end with message_stop: {text}"
                ));
            }
            parsed
                .iter()
                .find(|v| v["type"] == "message_delta")
                .and_then(|v| v["usage"]["output_tokens"].as_u64())
                .ok_or_else(|| format!("{path}: no message_delta usage"))
        }
        _ => {
            let v: Value = serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))?;
            v["usage"]["completion_tokens"]
                .as_u64()
                .ok_or_else(|| format!("{path}: no usage in {text}"))
        }
    }
}

/// Sends a streaming request and hangs up after its first bytes.
fn abandon(port: u16, prompt: &str) -> Result<(), String> {
    let body = json!({"prompt": prompt, "max_tokens": 200, "stream": true, "ignore_eos": true})
        .to_string();
    let mut s = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| e.to_string())?;
    let mut buf = [0u8; 64];
    match s.read(&mut buf) {
        Ok(n) if n > 0 && buf.starts_with(b"HTTP/1.1 200") => Ok(()),
        Ok(n) => Err(format!(
            "abandoned request: {}",
            String::from_utf8_lossy(&buf[..n])
        )),
        Err(e) => Err(e.to_string()),
    }
}

#[test]
fn concurrent_streaming_clients_all_succeed_and_memory_stays_flat() {
    let clients = env("CORTIQ_LOAD_CLIENTS", 16);
    let seconds = env("CORTIQ_LOAD_SECONDS", 15);
    let opts = WorkerOptions {
        cache_bytes: 32 << 20,
        ..WorkerOptions::new(1024)
    };
    let (port, state) = spawn_server(runner(), opts, None);
    let tally = Arc::new(Mutex::new(Tally::default()));
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(seconds);

    let samples = Arc::new(Mutex::new(Vec::<(f64, u64)>::new()));
    let sampler = {
        let samples = samples.clone();
        std::thread::spawn(move || {
            while Instant::now() < deadline {
                samples
                    .lock()
                    .unwrap()
                    .push((t0.elapsed().as_secs_f64(), rss()));
                std::thread::sleep(Duration::from_millis(500));
            }
        })
    };
    let handles: Vec<_> = (0..clients)
        .map(|c| {
            let tally = tally.clone();
            std::thread::spawn(move || {
                let mut i = c;
                while Instant::now() < deadline {
                    i += 1;
                    let prompt = PROMPTS[(i as usize * 7 + c as usize) % PROMPTS.len()];
                    if i % 9 == 0 {
                        let r = abandon(port, prompt);
                        let mut t = tally.lock().unwrap();
                        match r {
                            Ok(()) => t.abandoned += 1,
                            Err(e) => t.failures.push(e),
                        }
                        continue;
                    }
                    let max_tokens = 8 + (i * 13 + c * 5) % 40;
                    let r = request(port, i, max_tokens, prompt);
                    let mut t = tally.lock().unwrap();
                    match r {
                        Ok(n) => {
                            t.done += 1;
                            t.tokens += n;
                        }
                        Err(e) => t.failures.push(e),
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    sampler.join().unwrap();
    let elapsed = t0.elapsed().as_secs_f64();
    // The abandoned requests' slots are freed at the model thread's next step.
    let wait = Instant::now();
    while state.load().active + state.load().queued > 0 && wait.elapsed().as_secs() < 120 {
        std::thread::sleep(Duration::from_millis(50));
    }
    let load = state.load();
    let t = tally.lock().unwrap();
    let samples = samples.lock().unwrap();
    let warm = samples
        .iter()
        .filter(|s| s.0 <= seconds as f64 / 4.0)
        .map(|s| s.1)
        .max()
        .unwrap_or(0);
    let peak = samples.iter().map(|s| s.1).max().unwrap_or(0);
    let last = samples.last().map_or(0, |s| s.1);
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    eprintln!(
        "load: {clients} clients, {elapsed:.0} s: {} requests done, {} abandoned, {} failed; \
         {} completion tokens ({:.1} tok/s, {:.2} req/s); resident memory after warm-up {:.1} MiB, \
         peak {:.1} MiB, end {:.1} MiB; model thread: {load:?}",
        t.done,
        t.abandoned,
        t.failures.len(),
        t.tokens,
        t.tokens as f64 / elapsed,
        t.done as f64 / elapsed,
        mib(warm),
        mib(peak),
        mib(last),
    );
    assert!(
        t.failures.is_empty(),
        "{} failed requests, first: {:?}",
        t.failures.len(),
        &t.failures[..t.failures.len().min(3)]
    );
    assert!(t.done > 0 && t.abandoned > 0, "the run did something");
    assert_eq!((load.active, load.queued), (0, 0), "every slot freed");
    assert!(
        load.cancelled >= t.abandoned,
        "every abandoned request was cancelled: {load:?}"
    );
    // Flat: what grows past the warm-up is allocator noise, not a leak per request.
    assert!(
        peak <= warm + (96 << 20).max(warm / 4),
        "resident memory grew from {:.1} MiB after warm-up to {:.1} MiB",
        mib(warm),
        mib(peak)
    );
}
