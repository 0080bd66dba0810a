//! Shared by the server tests: the demo model's runner, a live server on a free port, and a
//! minimal HTTP/1.1 exchange (so the tests speak to the server as any client does).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;

use engine::run::Runner;
use engine::sampling::Sampling;
use engine::serve::worker::{Worker, WorkerOptions};
use engine::serve::{ServerState, serve};

/// The built-in demo model on the CPU.
pub fn runner() -> Runner {
    Runner::from_cmf(engine::embedded_model().unwrap()).unwrap()
}

/// The built-in demo model on the GPU with a context of `ctx` tokens (lavapipe in CI, where
/// `CORTIQ_REQUIRE_GPU=1` makes a missing adapter a failure); `None` skips.
pub fn gpu_runner(ctx: usize) -> Option<Runner> {
    let place = engine::model::Placement {
        backend: engine::gpu_runtime::BackendChoice::Wgpu,
        vram: None,
        ctx: Some(ctx),
        ..Default::default()
    };
    match Runner::from_cmf_on(engine::embedded_model().unwrap(), &place) {
        Ok(r) if r.model.model().backend_name() == "gpu" => Some(r),
        _ if std::env::var("CORTIQ_REQUIRE_GPU").as_deref() == Ok("1") => {
            panic!("CORTIQ_REQUIRE_GPU=1 but the demo model did not go to a GPU")
        }
        _ => {
            eprintln!("no GPU, skipped");
            None
        }
    }
}

/// Starts a server for `runner` on a free loopback port (its own thread and runtime); returns
/// the port and the state (to watch its load).
pub fn spawn_server(runner: Runner, opts: WorkerOptions, key: Option<&str>) -> (u16, ServerState) {
    let worker = Worker::spawn(runner, opts).unwrap();
    let state = ServerState::new(worker, "demo", key.map(str::to_string), Sampling::default());
    let serving = state.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(l.local_addr().unwrap().port()).unwrap();
            serve(l, serving).await.unwrap();
        });
    });
    (rx.recv().unwrap(), state)
}

/// One HTTP/1.1 exchange: the status and the body (chunked transfer decoded).
pub fn http(
    port: u16,
    method: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    // A server may answer (a 413) and close before taking a whole oversized body: what it
    // sent is still read below.
    let _ = s.write_all(req.as_bytes());
    let mut raw = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) if raw.is_empty() => panic!("{method} {path}: {e}"),
            Err(_) => break,
        }
    }
    let raw = String::from_utf8(raw).unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").expect("a header block");
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        let mut out = String::new();
        let mut rest = rest;
        loop {
            let (size, tail) = rest.split_once("\r\n").unwrap();
            let n = usize::from_str_radix(size.trim(), 16).unwrap();
            if n == 0 {
                break;
            }
            out.push_str(&tail[..n]);
            rest = &tail[n + 2..];
        }
        out
    } else {
        rest.to_string()
    };
    (status, body)
}
