//! Anthropic's Messages API on the same model: `POST /v1/messages` (whole, or streamed as
//! `message_start`, `content_block_start` / `content_block_delta` / `content_block_stop`,
//! `message_delta` with the stop reason and usage, `message_stop`) and
//! `POST /v1/messages/count_tokens`. A request is translated into the chat form the template
//! renders (system text, text / tool_use / tool_result / thinking blocks, tools as functions);
//! the reply is split as for the OpenAI routes into thinking, text and tool_use blocks.

use std::convert::Infallible;
use std::time::Instant;

use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Json, Response};
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use super::api::{self, BadRequest, Input, Request};
use super::parse::{Piece, Splitter};
use super::worker::{Event, Job, Outcome};
use super::{Registered, ServerState};
use crate::chat::Message;
use crate::generate::{CancelToken, Finish};
use crate::sampling::Sampling;

/// The response of a request the worker could not run.
fn failed(status: u16, message: &str) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let kind = if (400..500).contains(&status) {
        "invalid_request_error"
    } else {
        "api_error"
    };
    error(code, kind, message)
}

/// Anthropic's error body.
pub fn error(status: StatusCode, kind: &str, message: &str) -> Response {
    let body = json!({"type": "error", "error": {"type": kind, "message": message}});
    (status, Json(body)).into_response()
}

fn bad(e: &BadRequest) -> Response {
    let message = match &e.param {
        Some(p) => format!("{p}: {}", e.message),
        None => e.message.clone(),
    };
    error(StatusCode::BAD_REQUEST, "invalid_request_error", &message)
}

/// A block list's text (text blocks joined), for system prompts and tool results.
fn blocks_text(v: &Value, at: &str) -> Result<String, BadRequest> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut out = String::new();
            for (i, b) in blocks.iter().enumerate() {
                match (b.get("type").and_then(Value::as_str), b.get("text")) {
                    (Some("text"), Some(Value::String(t))) => out.push_str(t),
                    (kind, _) => {
                        return Err(BadRequest::new(
                            &format!("{at}[{i}]"),
                            format!("block of type {}: expected text", kind.unwrap_or("(none)")),
                        ));
                    }
                }
            }
            Ok(out)
        }
        Value::Null => Ok(String::new()),
        _ => Err(BadRequest::new(
            at,
            "expected a string or a list of text blocks",
        )),
    }
}

/// One Messages-API message as chat messages (a user turn's tool results become tool turns).
fn convert(m: &Value, i: usize, out: &mut Vec<Message>) -> Result<(), BadRequest> {
    let at = format!("messages[{i}]");
    let role = match m.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        other => {
            return Err(BadRequest::new(
                &format!("{at}.role"),
                format!("role {other:?}: expected user or assistant"),
            ));
        }
    };
    let blocks = match m.get("content") {
        Some(Value::String(s)) => {
            out.push(Message::new(role, s));
            return Ok(());
        }
        Some(Value::Array(b)) => b,
        _ => {
            return Err(BadRequest::new(
                &format!("{at}.content"),
                "expected a string or a list of content blocks",
            ));
        }
    };
    let mut msg = Message::new(role, "");
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let bat = format!("{at}.content[{j}]");
        match b.get("type").and_then(Value::as_str) {
            Some("text") => msg
                .content
                .push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
            Some("thinking") if role == "assistant" => {
                let t = b.get("thinking").and_then(Value::as_str).unwrap_or("");
                msg.reasoning_content
                    .get_or_insert_with(String::new)
                    .push_str(t);
            }
            Some("tool_use") if role == "assistant" => {
                let (Some(id), Some(name)) = (
                    b.get("id").and_then(Value::as_str),
                    b.get("name").and_then(Value::as_str),
                ) else {
                    return Err(BadRequest::new(
                        &bat,
                        "a tool_use block needs an id and a name",
                    ));
                };
                let input = b.get("input").cloned().unwrap_or(json!({}));
                calls.push(json!({"id": id, "type": "function",
                                  "function": {"name": name, "arguments": input}}));
            }
            Some("tool_result") if role == "user" => {
                let id = b
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        BadRequest::new(&bat, "a tool_result block needs a tool_use_id")
                    })?;
                let content = blocks_text(
                    b.get("content").unwrap_or(&Value::Null),
                    &format!("{bat}.content"),
                )?;
                // Text before the result keeps its place.
                if !msg.content.is_empty() {
                    out.push(std::mem::replace(&mut msg, Message::new(role, "")));
                }
                let mut t = Message::new("tool", &content);
                t.tool_call_id = Some(id.to_string());
                out.push(t);
            }
            other => {
                return Err(BadRequest::new(
                    &bat,
                    format!(
                        "block of type {} in a {role} message: expected text{}",
                        other.unwrap_or("(none)"),
                        if role == "user" {
                            " or tool_result"
                        } else {
                            ", thinking or tool_use"
                        }
                    ),
                ));
            }
        }
    }
    if !calls.is_empty() {
        msg.tool_calls = Some(Value::Array(calls));
    }
    if !msg.content.is_empty() || msg.tool_calls.is_some() || msg.reasoning_content.is_some() {
        out.push(msg);
    }
    Ok(())
}

/// `POST /v1/messages` (and its count): the request in the chat form.
pub fn messages_request(
    body: &[u8],
    defaults: &Sampling,
    count: bool,
) -> Result<Request, BadRequest> {
    let obj = api::object(body)?;
    if !count && obj.get("max_tokens").is_none_or(Value::is_null) {
        return Err(BadRequest::new("max_tokens", "required"));
    }
    let list: Vec<Value> = api::field(&obj, "messages", "a list of messages")?
        .ok_or_else(|| BadRequest::new("messages", "expected a list of messages"))?;
    if list.is_empty() {
        return Err(BadRequest::new("messages", "expected at least one message"));
    }
    let mut messages = Vec::new();
    if let Some(system) = obj.get("system") {
        let text = blocks_text(system, "system")?;
        if !text.is_empty() {
            messages.push(Message::new("system", &text));
        }
    }
    for (i, m) in list.iter().enumerate() {
        convert(m, i, &mut messages)?;
    }
    // The shared fields under their OpenAI names.
    let mut common = Map::new();
    for k in [
        "model",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "max_tokens",
    ] {
        if let Some(v) = obj.get(k) {
            common.insert(k.to_string(), v.clone());
        }
    }
    let stop: Vec<String> =
        api::field(&obj, "stop_sequences", "a list of strings")?.unwrap_or_default();
    let tools = match obj.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(t)) => t
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let name = t.get("name").and_then(Value::as_str).ok_or_else(|| {
                    BadRequest::new(&format!("tools[{i}].name"), "expected a string")
                })?;
                Ok(json!({"type": "function", "function": {
                    "name": name,
                    "description": t.get("description").cloned().unwrap_or(Value::Null),
                    "parameters": t.get("input_schema").cloned().unwrap_or(json!({})),
                }}))
            })
            .collect::<Result<_, BadRequest>>()?,
        Some(_) => return Err(BadRequest::new("tools", "expected a list of tools")),
    };
    let tools = match obj
        .get("tool_choice")
        .and_then(|c| c.get("type"))
        .and_then(Value::as_str)
    {
        Some("none") => Vec::new(),
        Some("tool") => {
            let name = obj
                .get("tool_choice")
                .and_then(|c| c.get("name"))
                .and_then(Value::as_str);
            let chosen: Vec<Value> = tools
                .into_iter()
                .filter(|t| t.pointer("/function/name").and_then(Value::as_str) == name)
                .collect();
            if chosen.is_empty() {
                return Err(BadRequest::new(
                    "tool_choice",
                    "the named tool is not among the tools",
                ));
            }
            chosen
        }
        _ => tools,
    };
    let c = api::common_fields(&common)?;
    let mut req = api::common(c, Input::Chat(messages), defaults)?;
    req.tools = (!tools.is_empty()).then_some(Value::Array(tools));
    req.count_only = count;
    req.stop = stop.into_iter().filter(|s| !s.is_empty()).collect();
    Ok(req)
}

/// The request's stop sequence that ended the reply (not one of the model's own stop
/// strings, which end a turn as its end-of-turn token does).
/// Anthropic's usage: `input_tokens` counts the prompt tokens not read from the cache.
fn usage(o: &Outcome) -> Value {
    json!({
        "input_tokens": o.prompt_tokens - o.cached_tokens,
        "cache_read_input_tokens": o.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": o.completion_tokens,
    })
}

fn matched<'a>(o: &'a Outcome, stops: &[String]) -> Option<&'a str> {
    o.stop_string
        .as_deref()
        .filter(|s| stops.iter().any(|t| t == s))
}

fn stop_reason(o: &Outcome, calls: usize, stops: &[String]) -> &'static str {
    if calls > 0 {
        return "tool_use";
    }
    match o.finish {
        Finish::Length => "max_tokens",
        Finish::Stop if matched(o, stops).is_some() => "stop_sequence",
        _ => "end_turn",
    }
}

/// A tool_use block's input: the arguments parsed (they are JSON by construction).
fn input(arguments: &str) -> Value {
    serde_json::from_str(arguments).unwrap_or(json!({}))
}

/// The handler of both routes.
pub async fn handle(
    state: ServerState,
    parsed: Result<Request, BadRequest>,
    count: bool,
) -> Response {
    let t0 = Instant::now();
    let path = if count {
        "/v1/messages/count_tokens"
    } else {
        "/v1/messages"
    };
    let request = match parsed {
        Ok(r) => r,
        Err(e) => {
            super::log(path, 400, None, t0);
            return bad(&e);
        }
    };
    if let Some(m) = request
        .model
        .as_deref()
        .filter(|m| *m != state.model.as_str())
    {
        super::log(path, 404, None, t0);
        let msg = format!(
            "model {m:?} is not served here; this server serves {:?}",
            state.model
        );
        return error(StatusCode::NOT_FOUND, "not_found_error", &msg);
    }
    let n = state
        .next_id
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let cancel = CancelToken::new();
    // Registered before the check: a shutdown either sees this request or is seen by it.
    let registered = Registered::new(&state, n, &cancel);
    if state.closing.is_cancelled() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "overloaded_error",
            "the server is shutting down",
        );
    }
    let (stream, tools, stops) = (
        request.stream,
        request.tools.is_some(),
        request.stop.clone(),
    );
    let model = request
        .model
        .clone()
        .unwrap_or_else(|| (*state.model).clone());
    let (tx, mut rx) = mpsc::unbounded_channel();
    if !state.worker.submit(Job {
        request,
        events: tx,
        cancel: cancel.clone(),
    }) {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "api_error",
            "the model thread has stopped",
        );
    }
    let id = format!("msg_{n:024}");
    if stream && !count {
        // The first event decides the status line (a request that fails before generating
        // gets its 4xx, not a 200 stream).
        match rx.recv().await {
            Some(Event::Failed(status, message)) => {
                super::log(path, status, None, t0);
                return failed(status, &message);
            }
            Some(first) => {
                return stream_messages(
                    id, n, model, tools, stops, first, rx, cancel, path, t0, registered,
                );
            }
            None => {}
        }
    }
    match super::collect(&mut rx, tools).await {
        Some(Ok((pieces, o))) => {
            super::log(path, 200, Some(&o), t0);
            if count {
                return Json(json!({"input_tokens": o.prompt_tokens})).into_response();
            }
            let mut content = Vec::new();
            let mut calls = 0;
            for p in pieces {
                match p {
                    Piece::Reasoning(t) => {
                        content.push(json!({"type": "thinking", "thinking": t, "signature": ""}))
                    }
                    Piece::Content(t) => content.push(json!({"type": "text", "text": t})),
                    Piece::ToolCall { name, arguments } => {
                        content.push(
                            json!({"type": "tool_use", "id": format!("toolu_{n}_{calls}"),
                                            "name": name, "input": input(&arguments)}),
                        );
                        calls += 1;
                    }
                }
            }
            // Adjacent pieces of one kind arrive separately: merge text and thinking runs.
            let content = merge_blocks(content);
            return Json(json!({
                "id": id, "type": "message", "role": "assistant", "model": model,
                "content": content,
                "stop_reason": stop_reason(&o, calls, &stops), "stop_sequence": matched(&o, &stops),
                "usage": usage(&o),
            }))
            .into_response();
        }
        Some(Err((status, message))) => {
            super::log(path, status, None, t0);
            return failed(status, &message);
        }
        None => {}
    }
    error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "api_error",
        "the generation ended without a result",
    )
}

fn merge_blocks(blocks: Vec<Value>) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    for b in blocks {
        let kind = b["type"].as_str().unwrap_or("").to_string();
        let key = if kind == "text" { "text" } else { "thinking" };
        match out.last_mut() {
            Some(last) if last["type"] == kind && kind != "tool_use" => {
                let joined = format!(
                    "{}{}",
                    last[key].as_str().unwrap_or(""),
                    b[key].as_str().unwrap_or("")
                );
                last[key] = json!(joined);
            }
            _ => out.push(b),
        }
    }
    out
}

/// The open content block of a stream.
#[derive(PartialEq, Clone, Copy)]
enum Open {
    None,
    Text,
    Thinking,
}

#[allow(clippy::too_many_arguments)]
fn stream_messages(
    id: String,
    n: u64,
    model: String,
    tools: bool,
    stops: Vec<String>,
    first: Event,
    mut rx: mpsc::UnboundedReceiver<Event>,
    cancel: CancelToken,
    path: &'static str,
    t0: Instant,
    registered: Registered,
) -> Response {
    let (out, out_rx) = mpsc::unbounded_channel::<Result<SseEvent, Infallible>>();
    tokio::spawn(async move {
        let _registered = registered;
        let ev = |name: &str, v: Value| Ok(SseEvent::default().event(name).data(v.to_string()));
        let mut split = Splitter::new(false, false, false);
        let (mut index, mut open, mut calls) = (0usize, Open::None, 0usize);
        // Sends the events of one piece; false when the client is gone.
        let send_piece = |p: Piece,
                          index: &mut usize,
                          open: &mut Open,
                          calls: &mut usize|
         -> bool {
            let mut sent = Vec::new();
            let want = match &p {
                Piece::Content(_) => Open::Text,
                Piece::Reasoning(_) => Open::Thinking,
                Piece::ToolCall { .. } => Open::None,
            };
            if *open != Open::None && *open != want {
                sent.push(ev(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": *index}),
                ));
                *index += 1;
                *open = Open::None;
            }
            match p {
                Piece::Content(t) | Piece::Reasoning(t) => {
                    let thinking = want == Open::Thinking;
                    if *open == Open::None {
                        let block = if thinking {
                            json!({"type": "thinking", "thinking": ""})
                        } else {
                            json!({"type": "text", "text": ""})
                        };
                        sent.push(ev("content_block_start", json!({"type": "content_block_start", "index": *index, "content_block": block})));
                        *open = want;
                    }
                    let delta = if thinking {
                        json!({"type": "thinking_delta", "thinking": t})
                    } else {
                        json!({"type": "text_delta", "text": t})
                    };
                    sent.push(ev(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": *index, "delta": delta}),
                    ));
                }
                Piece::ToolCall { name, arguments } => {
                    let block = json!({"type": "tool_use", "id": format!("toolu_{n}_{calls}"), "name": name, "input": {}});
                    sent.push(ev("content_block_start", json!({"type": "content_block_start", "index": *index, "content_block": block})));
                    let delta = json!({"type": "input_json_delta", "partial_json": input(&arguments).to_string()});
                    sent.push(ev(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": *index, "delta": delta}),
                    ));
                    sent.push(ev(
                        "content_block_stop",
                        json!({"type": "content_block_stop", "index": *index}),
                    ));
                    *index += 1;
                    *calls += 1;
                }
            }
            sent.into_iter().all(|e| out.send(e).is_ok())
        };
        let mut first = Some(first);
        loop {
            let e = match super::next_event(&mut first, &mut rx, &out).await {
                super::Next::Event(e) => e,
                super::Next::End => break,
                super::Next::Gone => {
                    cancel.cancel();
                    super::log(path, 499, None, t0);
                    return;
                }
            };
            let pieces = match e {
                Event::Started {
                    reasoning,
                    in_think,
                    tool_format,
                    prompt_tokens,
                } => {
                    split = Splitter::with_format(reasoning, tools, in_think, tool_format);
                    let start = json!({"type": "message_start", "message": {
                        "id": id, "type": "message", "role": "assistant", "model": model,
                        "content": [], "stop_reason": null, "stop_sequence": null,
                        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}});
                    if out.send(ev("message_start", start)).is_err() {
                        cancel.cancel();
                        return;
                    }
                    continue;
                }
                Event::Text(t) => split.push(&t),
                Event::Done(o) => {
                    for p in split.finish() {
                        send_piece(p, &mut index, &mut open, &mut calls);
                    }
                    if open != Open::None {
                        let _ = out.send(ev(
                            "content_block_stop",
                            json!({"type": "content_block_stop", "index": index}),
                        ));
                    }
                    let delta = json!({"type": "message_delta",
                        "delta": {"stop_reason": stop_reason(&o, calls, &stops), "stop_sequence": matched(&o, &stops)},
                        "usage": usage(&o)});
                    let _ = out.send(ev("message_delta", delta));
                    let _ = out.send(ev("message_stop", json!({"type": "message_stop"})));
                    super::log(path, 200, Some(&o), t0);
                    return;
                }
                Event::Failed(status, message) => {
                    let kind = if status == 400 {
                        "invalid_request_error"
                    } else {
                        "api_error"
                    };
                    let _ = out.send(ev(
                        "error",
                        json!({"type": "error", "error": {"type": kind, "message": message}}),
                    ));
                    super::log(path, status, None, t0);
                    return;
                }
            };
            for p in pieces {
                if !send_piece(p, &mut index, &mut open, &mut calls) {
                    cancel.cancel();
                    super::log(path, 499, None, t0);
                    return;
                }
            }
        }
    });
    Sse::new(tokio_stream::wrappers::UnboundedReceiverStream::new(out_rx)).into_response()
}
