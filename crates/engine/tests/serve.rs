//! `cortiq serve` over real HTTP on a local port, with the built-in demo model on the CPU: the
//! answers against the library's own generation of the same request (greedy, so the text is
//! determined), streaming against non-streaming, and malformed requests against the errors
//! they must get.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::OnceLock;

use common::{gpu_runner, http, runner, spawn_server};

use engine::chat::{Chat, Message};
use engine::generate::GenerateOptions;
use engine::sampling::{Sampler, Sampling};
use engine::serve::worker::WorkerOptions;
use serde_json::{Value, json};

const CTX: usize = 512;

/// A server on a free port (one per API key), for the whole test binary.
fn server(key: Option<&str>) -> u16 {
    static OPEN: OnceLock<u16> = OnceLock::new();
    static KEYED: OnceLock<u16> = OnceLock::new();
    let cell = if key.is_some() { &KEYED } else { &OPEN };
    *cell.get_or_init(|| spawn_server(runner(), WorkerOptions::new(CTX), key).0)
}

fn post(port: u16, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http(port, "POST", path, &body.to_string(), &[]);
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// The server-sent events' data lines.
fn events(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(|d| d.trim().to_string())
        .collect()
}

/// What the library generates greedily for a one-message conversation (the independent
/// witness of the chat endpoint).
fn witness_chat(user: &str, max_new: usize) -> (String, usize) {
    let r = runner();
    let mut chat = Chat::new(&r, None, Sampling::default()).unwrap();
    chat.messages = vec![Message::new("user", user)];
    let reply = chat.respond(max_new, &mut |_| {}).unwrap();
    (reply.text, reply.tokens)
}

#[test]
fn health_and_models() {
    let port = server(None);
    let (status, body) = http(port, "GET", "/health", "", &[]);
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["status"],
        "ok"
    );
    let (status, body) = http(port, "GET", "/v1/models", "", &[]);
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["data"][0]["id"], "demo");
    assert_eq!(http(port, "GET", "/v1/nothing", "", &[]).0, 404);
}

#[test]
fn greedy_chat_is_the_libraries_reply_whole_and_streamed() {
    let port = server(None);
    let (want, tokens) = witness_chat("To be, or not to be", 24);
    let req = json!({
        "model": "demo",
        "messages": [{"role": "user", "content": "To be, or not to be"}],
        "temperature": 0, "max_tokens": 24,
    });
    let (status, v) = post(port, "/v1/chat/completions", &req);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], want.as_str());
    assert_eq!(v["usage"]["completion_tokens"], tokens);
    let reason = v["choices"][0]["finish_reason"].as_str().unwrap();
    assert_eq!(reason, if tokens == 24 { "length" } else { "stop" });

    let mut req = req;
    req["stream"] = json!(true);
    req["stream_options"] = json!({"include_usage": true});
    let (status, body) = http(port, "POST", "/v1/chat/completions", &req.to_string(), &[]);
    assert_eq!(status, 200);
    let data = events(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, want);
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, vec![&json!(reason)]);
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], tokens);
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
}

#[test]
fn a_stop_string_ends_the_reply_before_it() {
    let port = server(None);
    let (full, _) = witness_chat("ROMEO:", 32);
    let Some(cut) = full.find('e') else {
        panic!("the witness reply has no 'e' to stop at: {full:?}")
    };
    let req = json!({
        "messages": [{"role": "user", "content": "ROMEO:"}],
        "temperature": 0, "max_tokens": 32, "stop": ["e"],
    });
    let (status, v) = post(port, "/v1/chat/completions", &req);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], &full[..cut]);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[test]
fn greedy_text_completion_is_the_libraries() {
    let port = server(None);
    let r = runner();
    let ids = r.encode("KING HENRY:").unwrap();
    let mut st = r.model.model().new_state();
    let mut sampler = Sampler::new(Sampling::default());
    let g = r
        .complete(
            &mut st,
            &ids,
            &mut sampler,
            &GenerateOptions::new(16),
            &mut |_| {},
        )
        .unwrap();
    let req = json!({"prompt": "KING HENRY:", "temperature": 0, "max_tokens": 16});
    let (status, v) = post(port, "/v1/completions", &req);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], g.text.as_str());
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    assert_eq!(v["usage"]["completion_tokens"], g.tokens.len());
}

#[test]
fn malformed_requests_get_a_400_naming_the_field() {
    let port = server(None);
    let (status, body) = http(port, "POST", "/v1/chat/completions", "{not json", &[]);
    assert_eq!(status, 400);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    for (req, param) in [
        (json!({"messages": []}), "messages"),
        (
            json!({"messages": [{"role": "user", "content": "a"}], "n": 3}),
            "n",
        ),
        (
            json!({"messages": [{"role": "user", "content": "a"}], "temperature": "hot"}),
            "temperature",
        ),
        (json!({"messages": [{"content": "a"}]}), "messages[0].role"),
        (
            json!({"messages": [{"role": "user", "content": "a"}], "presence_penalty": 3}),
            "presence_penalty",
        ),
        (
            json!({"messages": [{"role": "user", "content": "a"}], "frequency_penalty": "x"}),
            "frequency_penalty",
        ),
        (
            json!({"messages": [{"role": "user", "content": "a"}], "ignore_eos": 1}),
            "ignore_eos",
        ),
    ] {
        let (status, v) = post(port, "/v1/chat/completions", &req);
        assert_eq!(status, 400, "{req}");
        assert_eq!(v["error"]["param"], param, "{req}: {v}");
    }
    let (status, v) = post(port, "/v1/completions", &json!({"max_tokens": 3}));
    assert_eq!(status, 400);
    assert_eq!(v["error"]["param"], "prompt");
    // A prompt past the context is refused, not truncated.
    let long = "the ".repeat(4 * CTX);
    let (status, v) = post(
        port,
        "/v1/completions",
        &json!({"prompt": long, "max_tokens": 3}),
    );
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("context"));
    // Streamed too: the status line waits for the first event, so the error is a 400.
    let chat = json!({"messages": [{"role": "user", "content": long}], "stream": true});
    let (status, v) = post(port, "/v1/chat/completions", &chat);
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error");
}

#[test]
fn an_api_key_is_required_when_set() {
    let port = server(Some("sesame"));
    let req = json!({"prompt": "A", "max_tokens": 2, "temperature": 0}).to_string();
    assert_eq!(http(port, "POST", "/v1/completions", &req, &[]).0, 401);
    let wrong = [("Authorization", "Bearer nope")];
    assert_eq!(http(port, "POST", "/v1/completions", &req, &wrong).0, 401);
    let bearer = [("Authorization", "Bearer sesame")];
    assert_eq!(http(port, "POST", "/v1/completions", &req, &bearer).0, 200);
    let x_key = [("x-api-key", "sesame")];
    assert_eq!(http(port, "GET", "/v1/models", "", &x_key).0, 200);
    assert_eq!(http(port, "GET", "/health", "", &[]).0, 200);
}

#[test]
fn unserved_models_oversized_bodies_and_oversized_max_tokens_are_refused() {
    let port = server(None);
    let req = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "a"}]});
    let (status, v) = post(port, "/v1/chat/completions", &req);
    assert_eq!(status, 404);
    assert_eq!(v["error"]["param"], "model");
    assert_eq!(v["error"]["code"], "model_not_found");
    let big = format!(
        "{{\"prompt\": \"{}\"}}",
        "a".repeat(engine::serve::MAX_BODY + 1)
    );
    let (status, body) = http(port, "POST", "/v1/completions", &big, &[]);
    assert_eq!(status, 413);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("body"));
    let req = json!({"prompt": "A", "max_tokens": CTX});
    let (status, v) = post(port, "/v1/completions", &req);
    assert_eq!(status, 400);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_tokens")
    );
}

/// SIGTERM while a stream is open: the stream ends with its finish chunk and `[DONE]`, the
/// process exits 0.
#[cfg(unix)]
#[test]
fn sigterm_ends_open_streams_cleanly_and_exits_0() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_cortiq"))
        .args(["serve", "--port", "0", "--backend", "cpu", "-c", "8192"])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let port: u16 = loop {
        let mut line = String::new();
        assert!(err.read_line(&mut line).unwrap() > 0, "serve exited early");
        if let Some(rest) = line.split("http://127.0.0.1:").nth(1) {
            break rest.split_whitespace().next().unwrap().parse().unwrap();
        }
    };
    // Drain the log so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in err.lines() {});
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    // A stalled server fails the test instead of hanging it.
    s.set_read_timeout(Some(std::time::Duration::from_secs(120)))
        .unwrap();
    let body = json!({"prompt": "ROMEO:", "max_tokens": 6000, "stream": true}).to_string();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    // Wait for the first event, then ask the server to stop.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream closed before its first event");
        got.extend_from_slice(&buf[..n]);
    }
    let pid = child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    s.read_to_end(&mut got).unwrap();
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.contains("[DONE]"),
        "the stream did not end cleanly: ...{}",
        &text[text.len().saturating_sub(300)..]
    );
    assert!(text.contains("\"finish_reason\":\"stop\""));
    let status = child.wait().unwrap();
    assert!(status.success(), "serve exited with {status}");
}

#[test]
fn tools_and_tool_turns_are_accepted_and_checked() {
    let port = server(None);
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let req = json!({
        "messages": [
            {"role": "user", "content": "Weather in Verona?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Verona\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "tools": tools, "temperature": 0, "max_tokens": 8,
    });
    let (status, v) = post(port, "/v1/chat/completions", &req);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    for (bad, param) in [
        (json!({"tools": [{"type": "function"}]}), "tools[0]"),
        (
            json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (json!({"tools": tools, "tool_choice": 3}), "tool_choice"),
    ] {
        let mut req = bad;
        req["messages"] = json!([{"role": "user", "content": "a"}]);
        let (status, v) = post(port, "/v1/chat/completions", &req);
        assert_eq!(status, 400, "{req}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }
}

#[test]
fn anthropic_messages_whole_streamed_and_counted() {
    let port = server(None);
    let (want, tokens) = witness_chat("To be, or not to be", 24);
    let req = json!({
        "model": "demo", "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "To be, or not to be"}]}],
    });
    let (status, v) = post(port, "/v1/messages", &req);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert_eq!(v["content"][0]["type"], "text");
    assert_eq!(v["content"][0]["text"], want.as_str());
    assert_eq!(v["usage"]["output_tokens"], tokens);
    let reason = if tokens == 24 {
        "max_tokens"
    } else {
        "end_turn"
    };
    assert_eq!(v["stop_reason"], reason);

    let mut req = req;
    req["stream"] = json!(true);
    let (status, body) = http(port, "POST", "/v1/messages", &req.to_string(), &[]);
    assert_eq!(status, 200);
    let names: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("event:").map(str::trim))
        .collect();
    assert_eq!(names.first(), Some(&"message_start"));
    assert_eq!(names[1], "content_block_start");
    assert_eq!(
        &names[names.len() - 3..],
        &["content_block_stop", "message_delta", "message_stop"]
    );
    let data: Vec<Value> = events(&body)
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let text: String = data
        .iter()
        .filter(|d| d["type"] == "content_block_delta")
        .map(|d| d["delta"]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, want);
    let delta = data.iter().find(|d| d["type"] == "message_delta").unwrap();
    assert_eq!(delta["delta"]["stop_reason"], reason);
    assert_eq!(delta["usage"]["output_tokens"], tokens);

    // count_tokens: the rendered conversation's tokens, as the library counts them.
    let r = runner();
    let mut chat = Chat::new(&r, None, Sampling::default()).unwrap();
    chat.messages = vec![
        Message::new("system", "Be brief."),
        Message::new("user", "Hello"),
    ];
    let n = chat.prompt_ids().unwrap().len();
    let req = json!({"model": "demo", "system": "Be brief.", "messages": [{"role": "user", "content": "Hello"}]});
    let (status, v) = post(port, "/v1/messages/count_tokens", &req);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["input_tokens"], n);
}

#[test]
fn anthropic_errors_and_tool_turns() {
    let port = server(None);
    let (status, v) = post(
        port,
        "/v1/messages",
        &json!({"messages": [{"role": "user", "content": "a"}]}),
    );
    assert_eq!(status, 400);
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_tokens")
    );
    let image = json!({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]});
    let (status, v) = post(port, "/v1/messages", &image);
    assert_eq!(status, 400);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("messages[0].content[0]")
    );
    let turns = json!({
        "max_tokens": 4, "temperature": 0,
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Verona"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
        ],
    });
    let (status, v) = post(port, "/v1/messages", &turns);
    assert_eq!(status, 200, "{v}");
    // A stop sequence ends the reply before it and is reported.
    let (full, _) = witness_chat("ROMEO:", 32);
    let cut = full.find('e').expect("the witness reply has an 'e'");
    let req = json!({"max_tokens": 32, "temperature": 0, "stop_sequences": ["zzz", "e"],
                     "messages": [{"role": "user", "content": "ROMEO:"}]});
    let (status, v) = post(port, "/v1/messages", &req);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["content"][0]["text"], &full[..cut]);
    assert_eq!(v["stop_reason"], "stop_sequence");
    assert_eq!(v["stop_sequence"], "e");
    // Anthropic takes more stop sequences than OpenAI's 4.
    let many = json!({"max_tokens": 2, "stop_sequences": ["a", "b", "c", "d", "e", "f"],
                      "messages": [{"role": "user", "content": "x"}]});
    let (status, v) = post(port, "/v1/messages", &many);
    assert_eq!(status, 200, "{v}");
    // Streamed, a prompt past the context is a 400 before any event.
    let long = "the ".repeat(4 * CTX);
    let req =
        json!({"max_tokens": 2, "stream": true, "messages": [{"role": "user", "content": long}]});
    let (status, v) = post(port, "/v1/messages", &req);
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["type"], "error");
    let (status, v) = post(
        port,
        "/v1/messages",
        &json!({"model": "claude-x", "max_tokens": 4, "messages": [{"role": "user", "content": "a"}]}),
    );
    assert_eq!(status, 404);
    assert_eq!(v["error"]["type"], "not_found_error");
}

/// Requests running together (their tokens batched into shared forward steps, prompts of
/// different lengths prefilled beside decoding ones) each get the reply they get alone: the
/// library's greedy generation of the same prompt.
#[test]
fn concurrent_requests_each_get_their_own_reply() {
    // The shared server, and one whose prompts trickle in 5 ids a step shared by all (so
    // prompts are fed in pieces while others decode) through 3 slots (so requests queue).
    let tight = WorkerOptions {
        parallel: 3,
        prefill_chunk: 5,
        ..WorkerOptions::new(CTX)
    };
    for port in [server(None), spawn_server(runner(), tight, None).0] {
        concurrent_replies(port);
    }
}

/// The same on the GPU: the decoding sequences' rows share device frames (each with its own
/// caches and position), prompts fed in pieces beside them, and every reply is still the
/// library's greedy one on the CPU.
#[test]
fn concurrent_requests_on_the_gpu_each_get_their_own_reply() {
    let tight = WorkerOptions {
        parallel: 4,
        prefill_chunk: 5,
        ..WorkerOptions::new(CTX)
    };
    for opts in [WorkerOptions::new(CTX), tight] {
        let Some(gpu) = gpu_runner(CTX) else { return };
        concurrent_replies(spawn_server(gpu, opts, None).0);
    }
}

/// `--mtp`: a request decoding alone drafts with the demo model's head (its token and drafts
/// checked in one trunk forward, rejected rows rolled back) and answers exactly as without
/// drafting, on the CPU and the GPU; requests decoding together are batched instead (drafting
/// resumes when one is left alone); a sampled request with a seed gets the reply a server
/// without drafting gives it; a later turn starts from the state a drafting reply left in the
/// prompt cache.
#[test]
fn drafting_replies_are_the_plain_replies() {
    for gpu in [false, true] {
        let r = if gpu {
            let Some(r) = gpu_runner(CTX) else { return };
            r
        } else {
            runner()
        };
        let opts = WorkerOptions {
            parallel: 2,
            mtp: engine::speculative::MtpMode::Depth(3),
            ..WorkerOptions::new(CTX)
        };
        let (port, state) = spawn_server(r.clone(), opts, None);
        let mut first_prompt = 0;
        for p in ["ROMEO:", "To be, or not to be"] {
            let req = json!({
                "messages": [{"role": "user", "content": p}],
                "temperature": 0, "max_tokens": 40,
            });
            let (status, v) = post(port, "/v1/chat/completions", &req);
            assert_eq!(status, 200, "{v}");
            if first_prompt == 0 {
                first_prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
            }
            let (want, tokens) = witness_chat(p, 40);
            assert_eq!(
                v["choices"][0]["message"]["content"],
                want.as_str(),
                "gpu {gpu}: {p}"
            );
            assert_eq!(v["usage"]["completion_tokens"], tokens, "gpu {gpu}: {p}");
        }
        let load = state.load();
        assert!(load.drafts_kept > 0, "gpu {gpu}: no draft kept: {load:?}");

        let (want_first, _) = witness_chat("ROMEO:", 40);
        let turns = vec![
            Message::new("user", "ROMEO:"),
            Message::new("assistant", &want_first),
            Message::new("user", "And then, JULIET?"),
        ];
        let second = json!({
            "messages": serde_json::to_value(&turns).unwrap(),
            "temperature": 0, "max_tokens": 24,
        });
        let (status, v) = post(port, "/v1/chat/completions", &second);
        assert_eq!(status, 200, "{v}");
        // Past the first turn's prompt: the state the drafting reply left was reused.
        let cached = &v["usage"]["prompt_tokens_details"]["cached_tokens"];
        assert!(cached.as_u64().unwrap() > first_prompt, "gpu {gpu}: {v}");
        let lib = runner();
        let mut chat = Chat::new(&lib, None, Sampling::default()).unwrap();
        chat.messages = turns;
        let want = chat.respond(24, &mut |_| {}).unwrap();
        assert_eq!(
            v["choices"][0]["message"]["content"],
            want.text.as_str(),
            "gpu {gpu}"
        );

        concurrent_replies(port);

        let sampled = json!({
            "messages": [{"role": "user", "content": "KING HENRY:\nWhat news?"}],
            "temperature": 0.8, "seed": 11, "max_tokens": 32,
        });
        let plain = WorkerOptions {
            parallel: 2,
            ..WorkerOptions::new(CTX)
        };
        let plain_port = spawn_server(r, plain, None).0;
        let (s1, got) = post(port, "/v1/chat/completions", &sampled);
        let (s2, want) = post(plain_port, "/v1/chat/completions", &sampled);
        assert_eq!((s1, s2), (200, 200), "{got} {want}");
        assert_eq!(
            got["choices"][0]["message"]["content"], want["choices"][0]["message"]["content"],
            "gpu {gpu}: sampled"
        );
    }
}

/// `--lookup`: the same for prompt-lookup drafting, on text completions (the demo model's
/// greedy text repeats itself, so drafts are found and kept).
#[test]
fn lookup_drafting_replies_are_the_plain_replies() {
    let opts = WorkerOptions {
        lookup: 4,
        ..WorkerOptions::new(CTX)
    };
    let (port, state) = spawn_server(runner(), opts, None);
    let r = runner();
    for p in ["ROMEO:", "To be, or not to be"] {
        let req = json!({"prompt": p, "temperature": 0, "max_tokens": 64});
        let (status, v) = post(port, "/v1/completions", &req);
        assert_eq!(status, 200, "{v}");
        let greedy = Sampling {
            temperature: 0.0,
            ..Sampling::default()
        };
        let ids = r.encode(p).unwrap();
        let want = r
            .complete(
                &mut r.model.model().new_state(),
                &ids,
                &mut Sampler::new(greedy),
                &GenerateOptions::new(64),
                &mut |_| {},
            )
            .unwrap();
        assert_eq!(v["choices"][0]["text"], want.text.as_str(), "{p}");
    }
    let load = state.load();
    assert!(load.drafts_kept > 0, "no draft kept: {load:?}");
}

fn concurrent_replies(port: u16) {
    let prompts = [
        "ROMEO:",
        "To be, or not to be",
        "Now is the winter of our discontent",
        "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
        "KING RICHARD III:",
        "First Citizen:\nBefore we proceed any further, hear me speak.",
    ];
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let req = json!({
                "messages": [{"role": "user", "content": p}],
                "temperature": 0, "max_tokens": 20,
            });
            std::thread::spawn(move || post(port, "/v1/chat/completions", &req))
        })
        .collect();
    for (p, h) in prompts.iter().zip(handles) {
        let (status, v) = h.join().unwrap();
        assert_eq!(status, 200, "{v}");
        let (want, tokens) = witness_chat(p, 20);
        assert_eq!(v["choices"][0]["message"]["content"], want.as_str(), "{p}");
        assert_eq!(v["usage"]["completion_tokens"], tokens, "{p}");
    }
}

/// A conversation's second turn starts from the state the first left in the prompt cache
/// (reported as cached prompt tokens) and answers exactly as a fresh prefill does (the
/// library's own chat, which prefills what it does not hold); a repeated prompt is answered
/// from the cache whole.
#[test]
fn the_prompt_cache_serves_later_turns_and_repeats_unchanged() {
    let port = server(None);
    let first = json!({
        "messages": [{"role": "user", "content": "Speak, HAMLET:"}],
        "temperature": 0, "max_tokens": 12,
    });
    let (status, v) = post(port, "/v1/chat/completions", &first);
    assert_eq!(status, 200, "{v}");
    let reply = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let second_messages = vec![
        Message::new("user", "Speak, HAMLET:"),
        Message::new("assistant", &reply),
        Message::new("user", "And then, OPHELIA?"),
    ];
    let second = json!({
        "messages": serde_json::to_value(&second_messages).unwrap(),
        "temperature": 0, "max_tokens": 12,
    });
    let (status, v) = post(port, "/v1/chat/completions", &second);
    assert_eq!(status, 200, "{v}");
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0 && cached < prompt, "cached {cached} of {prompt}");
    let r = runner();
    let mut chat = Chat::new(&r, None, Sampling::default()).unwrap();
    chat.messages = second_messages;
    let want = chat.respond(12, &mut |_| {}).unwrap();
    assert_eq!(want.reused, 0, "the witness prefills from zero");
    assert_eq!(v["choices"][0]["message"]["content"], want.text.as_str());

    let (status, again) = post(port, "/v1/chat/completions", &second);
    assert_eq!(status, 200, "{again}");
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        prompt
    );
    assert_eq!(again["choices"][0]["message"], v["choices"][0]["message"]);
}

/// A client that goes away mid-stream frees its slot: with one slot, a request sent after
/// the disconnect is answered while the abandoned one could still have thousands of tokens
/// to go.
#[test]
fn a_disconnected_client_frees_its_slot() {
    let opts = WorkerOptions {
        parallel: 1,
        ..WorkerOptions::new(4096)
    };
    let (port, watch) = spawn_server(runner(), opts, None);
    let long = json!({
        "prompt": "ROMEO:", "max_tokens": 4000, "stream": true,
        "temperature": 1.0, "seed": 7, "ignore_eos": true,
    })
    .to_string();
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{long}",
        long.len()
    )
    .unwrap();
    let mut buf = [0u8; 256];
    assert!(s.read(&mut buf).unwrap() > 0, "the stream started");
    assert_eq!(watch.load().active, 1);
    drop(s);
    // The next request takes the one slot once the abandoned generation is cancelled (a
    // generation that ran its 4000 tokens would end as `length`, not count as cancelled).
    let (status, v) = post(
        port,
        "/v1/completions",
        &json!({"prompt": "JULIET:", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    let load = watch.load();
    assert_eq!(
        (load.cancelled, load.ended, load.active),
        (1, 2, 0),
        "{load:?}"
    );
}
