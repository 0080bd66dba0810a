//! `cortiq serve`: an OpenAI-compatible HTTP server (axum on tokio) over one model.
//!
//! Routes: `GET /health`, `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`,
//! each answering as OpenAI does (streaming as server-sent events ending with `data: [DONE]`,
//! `stream_options.include_usage` adding a usage chunk). Requests are checked field by field
//! ([`api`]); generation runs on the model's own thread ([`worker`]), one request at a time in
//! arrival order; a client that disconnects cancels its request before the next forward. One
//! log line per request (method, path, status, prompt and completion tokens, milliseconds).

pub mod anthropic;
pub mod api;
pub mod cache;
pub mod parse;
pub mod worker;

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use self::api::{BadRequest, Request, finish_reason};
use self::parse::{Piece, Splitter};
use self::worker::{Event, Job, Outcome, Worker};
use crate::generate::CancelToken;
use crate::sampling::Sampling;

/// What the routes share.
#[derive(Clone)]
pub struct ServerState {
    worker: Worker,
    model: Arc<String>,
    api_key: Option<Arc<String>>,
    defaults: Sampling,
    next_id: Arc<AtomicU64>,
    /// The cancel tokens of the requests in flight (what a shutdown stops).
    open: Arc<Mutex<HashMap<u64, CancelToken>>>,
    /// Set once a shutdown began: new requests get a 503.
    closing: CancelToken,
}

impl ServerState {
    /// The state for `worker` serving the model named `model`; `api_key` (when given) must
    /// come with every request (`Authorization: Bearer KEY` or `x-api-key: KEY`);
    /// `defaults` fill the sampling fields a request leaves out.
    pub fn new(
        worker: Worker,
        model: &str,
        api_key: Option<String>,
        defaults: Sampling,
    ) -> ServerState {
        ServerState {
            worker,
            model: Arc::new(model.to_string()),
            api_key: api_key.map(Arc::new),
            defaults,
            next_id: Arc::new(AtomicU64::new(1)),
            open: Arc::new(Mutex::new(HashMap::new())),
            closing: CancelToken::new(),
        }
    }

    /// Refuses new requests and cancels the ones in flight: their generations end at the next
    /// token, streams close with their finish chunk and `[DONE]`.
    pub fn close(&self) {
        self.closing.cancel();
        let open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        for c in open.values() {
            c.cancel();
        }
    }
}

/// Removes a request from the open set when its handling ends.
struct Registered {
    open: Arc<Mutex<HashMap<u64, CancelToken>>>,
    id: u64,
}

impl Registered {
    /// Adds request `id` (cancelled by `cancel`) to the open set until the guard drops.
    fn new(state: &ServerState, id: u64, cancel: &CancelToken) -> Registered {
        state
            .open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, cancel.clone());
        Registered {
            open: state.open.clone(),
            id,
        }
    }
}

impl Drop for Registered {
    /// The request's handling ended (answered, or its client gone): its generation stops too.
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = open.remove(&self.id) {
            c.cancel();
        }
    }
}

/// Largest request body (a long prompt is a few MB of JSON at most).
pub const MAX_BODY: usize = 32 << 20;

/// The routes.
pub fn router(state: ServerState) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .with_state(state)
}

/// Serves `router(state)` on `listener` until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, state: ServerState) -> std::io::Result<()> {
    axum::serve(listener, router(state)).await
}

/// Serves until `stop` resolves (SIGINT or SIGTERM for the command): then no new connection is
/// accepted, the requests in flight are cancelled ([`ServerState::close`]) and their responses
/// finish before this returns.
pub async fn serve_until(
    listener: tokio::net::TcpListener,
    state: ServerState,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let closer = state.clone();
    axum::serve(listener, router(state))
        .with_graceful_shutdown(async move {
            stop.await;
            closer.close();
        })
        .await
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn error(status: StatusCode, message: &str, kind: &str) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "param": null, "code": null}});
    (status, Json(body)).into_response()
}

/// The error type OpenAI gives a status.
fn error_kind(status: u16) -> &'static str {
    if (400..500).contains(&status) {
        "invalid_request_error"
    } else {
        "server_error"
    }
}

/// The response of a request the worker could not run.
fn failed(status: u16, message: &str) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    error(code, message, error_kind(status))
}

fn bad_request(e: &BadRequest) -> Response {
    (StatusCode::BAD_REQUEST, Json(e.body())).into_response()
}

fn authorised(state: &ServerState, headers: &HeaderMap) -> bool {
    let Some(key) = &state.api_key else {
        return true;
    };
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let bearer = header("authorization").and_then(|v| v.strip_prefix("Bearer "));
    bearer == Some(key.as_str()) || header("x-api-key") == Some(key.as_str())
}

fn log(path: &str, status: u16, outcome: Option<&Outcome>, t0: Instant) {
    tracing::info!(
        method = "POST",
        path,
        status,
        prompt_tokens = outcome.map_or(0, |o| o.prompt_tokens),
        completion_tokens = outcome.map_or(0, |o| o.completion_tokens),
        ms = t0.elapsed().as_millis() as u64,
        "request"
    );
}

async fn health(State(state): State<ServerState>) -> Json<Value> {
    tracing::info!(method = "GET", path = "/health", status = 200, "request");
    let load = state.worker.load();
    Json(json!({
        "status": "ok", "slots_busy": load.active, "queued": load.queued,
        "drafted": load.drafted, "drafts_kept": load.drafts_kept,
    }))
}

impl ServerState {
    /// What the model thread is doing.
    pub fn load(&self) -> worker::Load {
        self.worker.load()
    }
}

async fn models(State(state): State<ServerState>, headers: HeaderMap) -> Response {
    if !authorised(&state, &headers) {
        return error(
            StatusCode::UNAUTHORIZED,
            "invalid API key",
            "authentication_error",
        );
    }
    tracing::info!(method = "GET", path = "/v1/models", status = 200, "request");
    Json(json!({"object": "list", "data": [{
        "id": *state.model, "object": "model", "created": 0, "owned_by": "cortiq"
    }]}))
    .into_response()
}

/// Which endpoint's format a response takes.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Text,
}

/// The body, or the error response for one over [`MAX_BODY`] (or unreadable).
fn body_or_error(body: Result<Bytes, BytesRejection>, path: &str) -> Result<Bytes, Box<Response>> {
    body.map_err(|e| {
        let status = e.status();
        tracing::info!(method = "POST", path, status = status.as_u16(), "request");
        let message = format!(
            "the request body: {} (at most {MAX_BODY} bytes)",
            e.body_text()
        );
        Box::new(error(status, &message, "invalid_request_error"))
    })
}

async fn messages(
    State(state): State<ServerState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    anthropic_route(state, headers, body, false).await
}

async fn count_tokens(
    State(state): State<ServerState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    anthropic_route(state, headers, body, true).await
}

async fn anthropic_route(
    state: ServerState,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    count: bool,
) -> Response {
    let path = if count {
        "/v1/messages/count_tokens"
    } else {
        "/v1/messages"
    };
    if !authorised(&state, &headers) {
        log(path, 401, None, Instant::now());
        return anthropic::error(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid API key",
        );
    }
    let body = match body {
        Ok(b) => b,
        Err(e) => {
            log(path, e.status().as_u16(), None, Instant::now());
            let msg = format!(
                "the request body: {} (at most {MAX_BODY} bytes)",
                e.body_text()
            );
            return anthropic::error(e.status(), "invalid_request_error", &msg);
        }
    };
    let parsed = anthropic::messages_request(&body, &state.defaults, count);
    anthropic::handle(state, parsed, count).await
}

async fn chat_completions(
    State(state): State<ServerState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body_or_error(body, "/v1/chat/completions") {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let parsed = api::chat_request(&body, &state.defaults);
    handle(state, headers, parsed, Kind::Chat).await
}

async fn completions(
    State(state): State<ServerState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body_or_error(body, "/v1/completions") {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let parsed = api::completion_request(&body, &state.defaults);
    handle(state, headers, parsed, Kind::Text).await
}

async fn handle(
    state: ServerState,
    headers: HeaderMap,
    parsed: Result<Request, BadRequest>,
    kind: Kind,
) -> Response {
    let t0 = Instant::now();
    let path = match kind {
        Kind::Chat => "/v1/chat/completions",
        Kind::Text => "/v1/completions",
    };
    if !authorised(&state, &headers) {
        log(path, 401, None, t0);
        return error(
            StatusCode::UNAUTHORIZED,
            "invalid API key",
            "authentication_error",
        );
    }
    let request = match parsed {
        Ok(r) => r,
        Err(e) => {
            log(path, 400, None, t0);
            return bad_request(&e);
        }
    };
    if let Some(m) = request
        .model
        .as_deref()
        .filter(|m| *m != state.model.as_str())
    {
        log(path, 404, None, t0);
        let body = json!({"error": {
            "message": format!("model {m:?} is not served here; this server serves {:?} \
                                (GET /v1/models)", state.model),
            "type": "invalid_request_error", "param": "model", "code": "model_not_found",
        }});
        return (StatusCode::NOT_FOUND, Json(body)).into_response();
    }
    let n = state.next_id.fetch_add(1, Ordering::Relaxed);
    let cancel = CancelToken::new();
    // Registered before the check: a shutdown either sees this request or is seen by it.
    let registered = Registered::new(&state, n, &cancel);
    if state.closing.is_cancelled() {
        log(path, 503, None, t0);
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is shutting down",
            "server_error",
        );
    }
    let id = match kind {
        Kind::Chat => format!("chatcmpl-{n}"),
        Kind::Text => format!("cmpl-{n}"),
    };
    let model = request
        .model
        .clone()
        .unwrap_or_else(|| (*state.model).clone());
    let (stream, include_usage) = (request.stream, request.include_usage);
    let tools = request.tools.is_some();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let job = Job {
        request,
        events: tx,
        cancel: cancel.clone(),
    };
    if !state.worker.submit(job) {
        log(path, 503, None, t0);
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the model thread has stopped",
            "server_error",
        );
    }
    let shape = Shape {
        id,
        model,
        created: now(),
        kind,
        tools,
    };
    if stream {
        // The first event decides the status line: a request that fails before generating
        // (a prompt past the context, a template error) gets its 4xx, not a 200 stream.
        match rx.recv().await {
            Some(Event::Failed(status, message)) => {
                log(path, status, None, t0);
                return failed(status, &message);
            }
            Some(first) => {
                return stream_response(
                    shape,
                    first,
                    rx,
                    cancel,
                    include_usage,
                    path,
                    t0,
                    registered,
                );
            }
            None => {}
        }
    }
    match collect(&mut rx, shape.tools).await {
        Some(Ok((pieces, o))) => {
            log(path, 200, Some(&o), t0);
            return Json(shape.whole(pieces, &o)).into_response();
        }
        Some(Err((status, message))) => {
            log(path, status, None, t0);
            return failed(status, &message);
        }
        None => {}
    }
    log(path, 500, None, t0);
    error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the generation ended without a result",
        "server_error",
    )
}

/// A response's identity and format.
struct Shape {
    id: String,
    model: String,
    created: u64,
    kind: Kind,
    /// Tools were offered: `<tool_call>` blocks become `tool_calls`.
    tools: bool,
}

fn usage(o: &Outcome) -> Value {
    json!({
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "total_tokens": o.prompt_tokens + o.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": o.cached_tokens},
    })
}

impl Shape {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Text, _) => "text_completion",
        }
    }

    fn frame(&self, choices: Value, chunk: bool) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    fn call_id(&self, i: usize) -> String {
        format!("call_{}_{i}", self.id)
    }

    fn call(&self, i: usize, name: &str, arguments: &str, index: bool) -> Value {
        let mut c = json!({
            "id": self.call_id(i), "type": "function",
            "function": {"name": name, "arguments": arguments},
        });
        if index {
            c["index"] = json!(i);
        }
        c
    }

    /// The finish reason: `tool_calls` when the reply called a tool.
    fn reason(&self, o: &Outcome, calls: usize) -> &'static str {
        if calls > 0 {
            "tool_calls"
        } else {
            finish_reason(o.finish)
        }
    }

    /// The non-streaming answer.
    fn whole(&self, pieces: Vec<Piece>, o: &Outcome) -> Value {
        let (content, reasoning, calls) = parse::merge(pieces);
        let choice = match self.kind {
            Kind::Chat => {
                let mut message = json!({"role": "assistant", "content": content});
                if content.is_empty() && !calls.is_empty() {
                    message["content"] = Value::Null;
                }
                if !reasoning.is_empty() {
                    message["reasoning_content"] = json!(reasoning);
                }
                if !calls.is_empty() {
                    let list: Vec<Value> = calls
                        .iter()
                        .enumerate()
                        .map(|(i, (n, a))| self.call(i, n, a, false))
                        .collect();
                    message["tool_calls"] = json!(list);
                }
                json!({"index": 0, "message": message,
                       "finish_reason": self.reason(o, calls.len())})
            }
            Kind::Text => json!({
                "index": 0, "text": content, "logprobs": null,
                "finish_reason": finish_reason(o.finish),
            }),
        };
        let mut v = self.frame(json!([choice]), false);
        v["usage"] = usage(o);
        v
    }

    /// A chunk with `delta` (chat) or `text` (completions), and at the end the finish reason.
    fn chunk(&self, delta: Value, finish: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Chat => json!({"index": 0, "delta": delta, "finish_reason": finish}),
            Kind::Text => json!({
                "index": 0, "text": delta.get("content").and_then(Value::as_str).unwrap_or(""),
                "logprobs": null, "finish_reason": finish,
            }),
        };
        self.frame(json!([choice]), true)
    }

    /// The delta of one parsed piece (`calls` numbers the tool calls so far).
    fn delta(&self, p: &Piece, calls: &mut usize) -> Value {
        match p {
            Piece::Content(t) => json!({"content": t}),
            Piece::Reasoning(t) => json!({"reasoning_content": t}),
            Piece::ToolCall { name, arguments } => {
                let c = self.call(*calls, name, arguments, true);
                *calls += 1;
                json!({"tool_calls": [c]})
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn stream_response(
    shape: Shape,
    first: Event,
    mut rx: mpsc::UnboundedReceiver<Event>,
    cancel: CancelToken,
    include_usage: bool,
    path: &'static str,
    t0: Instant,
    registered: Registered,
) -> Response {
    let (out, out_rx) = mpsc::unbounded_channel::<Result<SseEvent, Infallible>>();
    tokio::spawn(async move {
        let _registered = registered;
        let data = |v: Value| Ok(SseEvent::default().data(v.to_string()));
        // The chat format opens with the role.
        let opening = json!({"role": "assistant", "content": ""});
        if shape.kind == Kind::Chat && out.send(data(shape.chunk(opening, None))).is_err() {
            cancel.cancel();
            return;
        }
        let mut split = Splitter::new(false, false, false);
        let mut calls = 0;
        let mut first = Some(first);
        loop {
            let ev = match next_event(&mut first, &mut rx, &out).await {
                Next::Event(e) => e,
                Next::End => break,
                Next::Gone => {
                    cancel.cancel();
                    log(path, 499, None, t0);
                    return;
                }
            };
            let pieces = match ev {
                Event::Started {
                    reasoning,
                    in_think,
                    tool_format,
                    ..
                } => {
                    split = Splitter::with_format(reasoning, shape.tools, in_think, tool_format);
                    continue;
                }
                Event::Text(t) => split.push(&t),
                Event::Done(o) => {
                    for p in split.finish() {
                        let _ = out.send(data(shape.chunk(shape.delta(&p, &mut calls), None)));
                    }
                    let reason = shape.reason(&o, calls);
                    let _ = out.send(data(shape.chunk(json!({}), Some(reason))));
                    if include_usage {
                        let mut u = shape.frame(json!([]), true);
                        u["usage"] = usage(&o);
                        let _ = out.send(data(u));
                    }
                    let _ = out.send(Ok(SseEvent::default().data("[DONE]")));
                    log(path, 200, Some(&o), t0);
                    return;
                }
                Event::Failed(status, message) => {
                    // The status line has gone out: the error travels as an event.
                    let body = json!({"error": {"message": message, "type": error_kind(status),
                        "param": null, "code": null}});
                    let _ = out.send(data(body));
                    let _ = out.send(Ok(SseEvent::default().data("[DONE]")));
                    log(path, status, None, t0);
                    return;
                }
            };
            for p in pieces {
                if out
                    .send(data(shape.chunk(shape.delta(&p, &mut calls), None)))
                    .is_err()
                {
                    // The client went away: stop generating.
                    cancel.cancel();
                    log(path, 499, None, t0);
                    return;
                }
            }
        }
    });
    Sse::new(tokio_stream::wrappers::UnboundedReceiverStream::new(out_rx)).into_response()
}

/// A whole (not streamed) answer: the request's events until it ends, split into pieces as
/// they come; the pieces and the outcome, or why it failed (`None`: the worker dropped the
/// request without either).
pub(crate) async fn collect(
    rx: &mut mpsc::UnboundedReceiver<Event>,
    tools: bool,
) -> Option<Result<(Vec<Piece>, Outcome), (u16, String)>> {
    let mut split = Splitter::new(false, false, false);
    let mut pieces = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Started {
                reasoning,
                in_think,
                tool_format,
                ..
            } => split = Splitter::with_format(reasoning, tools, in_think, tool_format),
            Event::Text(t) => pieces.extend(split.push(&t)),
            Event::Done(o) => {
                pieces.extend(split.finish());
                return Some(Ok((pieces, o)));
            }
            Event::Failed(status, message) => return Some(Err((status, message))),
        }
    }
    None
}

/// What a streaming response gets next from its request.
pub(crate) enum Next {
    /// The worker's next event.
    Event(Event),
    /// The worker dropped the channel.
    End,
    /// The client went away.
    Gone,
}

/// The next event of a streamed request (`first`, then the worker's channel), noticing a
/// client that goes away at once rather than at the next piece sent to it.
pub(crate) async fn next_event<T>(
    first: &mut Option<Event>,
    rx: &mut mpsc::UnboundedReceiver<Event>,
    out: &mpsc::UnboundedSender<T>,
) -> Next {
    if let Some(e) = first.take() {
        return Next::Event(e);
    }
    tokio::select! {
        e = rx.recv() => e.map_or(Next::End, Next::Event),
        _ = out.closed() => Next::Gone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::Finish;

    fn shape(tools: bool) -> Shape {
        Shape {
            id: "chatcmpl-7".into(),
            model: "m".into(),
            created: 1,
            kind: Kind::Chat,
            tools,
        }
    }

    const OUTCOME: Outcome = Outcome {
        finish: Finish::Eos,
        stop_string: None,
        prompt_tokens: 3,
        cached_tokens: 0,
        completion_tokens: 9,
    };

    #[test]
    fn a_whole_answer_carries_reasoning_and_tool_calls_apart() {
        let pieces = vec![
            Piece::Reasoning("weigh it".into()),
            Piece::ToolCall {
                name: "get_weather".into(),
                arguments: r#"{"city":"Verona"}"#.into(),
            },
        ];
        let v = shape(true).whole(pieces, &OUTCOME);
        let m = &v["choices"][0]["message"];
        assert_eq!(m["content"], Value::Null);
        assert_eq!(m["reasoning_content"], "weigh it");
        assert_eq!(m["tool_calls"][0]["id"], "call_chatcmpl-7_0");
        assert_eq!(m["tool_calls"][0]["function"]["name"], "get_weather");
        assert_eq!(
            m["tool_calls"][0]["function"]["arguments"],
            r#"{"city":"Verona"}"#
        );
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(v["usage"]["total_tokens"], 12);
        let plain = shape(false).whole(vec![Piece::Content("hi".into())], &OUTCOME);
        assert_eq!(plain["choices"][0]["message"]["content"], "hi");
        assert!(plain["choices"][0]["message"].get("tool_calls").is_none());
        assert_eq!(plain["choices"][0]["finish_reason"], "stop");
    }

    #[test]
    fn streamed_tool_calls_have_stable_ids_and_indices() {
        let s = shape(true);
        let mut calls = 0;
        let call = |n: &str| Piece::ToolCall {
            name: n.into(),
            arguments: "{}".into(),
        };
        let a = s.delta(&call("a"), &mut calls);
        let b = s.delta(&call("b"), &mut calls);
        assert_eq!(a["tool_calls"][0]["index"], 0);
        assert_eq!(b["tool_calls"][0]["index"], 1);
        assert_eq!(b["tool_calls"][0]["id"], s.call_id(1));
        assert_eq!(s.reason(&OUTCOME, calls), "tool_calls");
        let r = s.delta(&Piece::Reasoning("x".into()), &mut calls);
        assert_eq!(r, json!({"reasoning_content": "x"}));
    }
}
