//! The OpenAI-compatible wire format: what `/v1/chat/completions` and `/v1/completions`
//! accept, checked field by field into a [`Job`](super::worker::Job), and the JSON they answer
//! with. Unknown fields are ignored (clients send many); a field of the wrong type, a value out
//! of range, or an option the engine does not have is a 400 naming the field.

use serde::Deserialize;
use serde_json::{Value, json};

use crate::chat::Message;
use crate::sampling::Sampling;

/// A request the server refuses, with the field at fault (OpenAI's error object).
#[derive(Debug, Clone, PartialEq)]
pub struct BadRequest {
    /// What is wrong, for a person.
    pub message: String,
    /// The field (`messages[1].content`), when one is at fault.
    pub param: Option<String>,
}

impl BadRequest {
    pub(crate) fn new(param: &str, message: impl Into<String>) -> BadRequest {
        BadRequest {
            message: message.into(),
            param: Some(param.to_string()),
        }
    }

    /// `{"error": {...}}` as OpenAI writes it.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": "invalid_request_error",
            "param": self.param,
            "code": null,
        }})
    }
}

/// The fields both endpoints share.
#[derive(Debug, Clone, Default)]
pub(crate) struct Common {
    pub(crate) model: Option<String>,
    pub(crate) stream: Option<bool>,
    include_usage: bool,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    seed: Option<u64>,
    pub(crate) max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    pub(crate) stop: Option<Stop>,
    n: Option<u64>,
    repetition_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    ignore_eos: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(crate) enum Stop {
    One(String),
    Many(Vec<String>),
}

/// Field `name` of `obj` as a `T` (absent or null: `None`); a value of another type is a 400
/// naming the field.
pub(crate) fn field<T: for<'de> Deserialize<'de>>(
    obj: &serde_json::Map<String, Value>,
    name: &str,
    expected: &str,
) -> Result<Option<T>, BadRequest> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => serde_json::from_value(v.clone())
            .map(Some)
            .map_err(|_| BadRequest::new(name, format!("{name} = {v}: expected {expected}"))),
    }
}

pub(crate) fn common_fields(obj: &serde_json::Map<String, Value>) -> Result<Common, BadRequest> {
    let opts: Option<StreamOptions> = field(obj, "stream_options", "an object")?;
    Ok(Common {
        model: field(obj, "model", "a string")?,
        stream: field(obj, "stream", "true or false")?,
        include_usage: opts.is_some_and(|o| o.include_usage),
        temperature: field(obj, "temperature", "a number")?,
        top_p: field(obj, "top_p", "a number")?,
        top_k: field(obj, "top_k", "an integer")?,
        min_p: field(obj, "min_p", "a number")?,
        seed: field(obj, "seed", "a non-negative integer")?,
        max_tokens: field(obj, "max_tokens", "a positive integer")?,
        max_completion_tokens: field(obj, "max_completion_tokens", "a positive integer")?,
        stop: field(obj, "stop", "a string or a list of strings")?,
        n: field(obj, "n", "an integer")?,
        repetition_penalty: field(obj, "repetition_penalty", "a number")?,
        presence_penalty: field(obj, "presence_penalty", "a number")?,
        frequency_penalty: field(obj, "frequency_penalty", "a number")?,
        ignore_eos: field(obj, "ignore_eos", "true or false")?,
    })
}

/// What a request asks for, checked.
#[derive(Debug, Clone)]
pub struct Request {
    /// The model name the client gave (echoed back).
    pub model: Option<String>,
    /// Server-sent events instead of one JSON answer.
    pub stream: bool,
    /// A last event with the token counts.
    pub include_usage: bool,
    /// Sampling.
    pub sampling: Sampling,
    /// Most tokens to generate (`None`: up to the context).
    pub max_tokens: Option<usize>,
    /// Strings that end the reply.
    pub stop: Vec<String>,
    /// The conversation (chat) or the prompt text (completions).
    pub input: Input,
    /// Tool definitions for the template (chat; `None` when there are none or
    /// `tool_choice` is `none`).
    pub tools: Option<Value>,
    /// Only count the prompt's tokens (`/v1/messages/count_tokens`).
    pub count_only: bool,
    /// Generate past end-of-sequence tokens (llama-server's and vLLM's `ignore_eos`: fixed
    /// lengths for benchmarks and load tests).
    pub ignore_eos: bool,
}

/// The prompt of a request.
#[derive(Debug, Clone)]
pub enum Input {
    /// Messages, rendered with the model's chat template.
    Chat(Vec<Message>),
    /// Text, tokenised as it is.
    Text(String),
}

/// The body as a JSON object.
pub(crate) fn object(body: &[u8]) -> Result<serde_json::Map<String, Value>, BadRequest> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(BadRequest {
            message: "the request body must be a JSON object".into(),
            param: None,
        }),
        Err(e) => Err(BadRequest {
            message: format!("the request body is not valid JSON: {e}"),
            param: None,
        }),
    }
}

pub(crate) fn common(c: Common, input: Input, defaults: &Sampling) -> Result<Request, BadRequest> {
    if let Some(n) = c.n.filter(|&n| n != 1) {
        return Err(BadRequest::new(
            "n",
            format!("n = {n}: this server generates one choice per request (n = 1)"),
        ));
    }
    let temperature = c.temperature.unwrap_or(defaults.temperature);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(BadRequest::new(
            "temperature",
            format!("temperature = {temperature}: expected 0 to 2"),
        ));
    }
    let top_p = c.top_p.unwrap_or(defaults.top_p);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(BadRequest::new(
            "top_p",
            format!("top_p = {top_p}: expected more than 0, at most 1"),
        ));
    }
    let top_k = match c.top_k {
        None => defaults.top_k,
        Some(-1) => 0,
        Some(k) if k >= 0 => k as usize,
        Some(k) => {
            return Err(BadRequest::new(
                "top_k",
                format!("top_k = {k}: expected 0 or more (or -1 for all)"),
            ));
        }
    };
    let min_p = c.min_p.unwrap_or(defaults.min_p);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(BadRequest::new(
            "min_p",
            format!("min_p = {min_p}: expected 0 to 1"),
        ));
    }
    let repeat_penalty = c.repetition_penalty.unwrap_or(defaults.repeat_penalty);
    if repeat_penalty <= 0.0 || !repeat_penalty.is_finite() {
        return Err(BadRequest::new(
            "repetition_penalty",
            format!("repetition_penalty = {repeat_penalty}: expected more than 0"),
        ));
    }
    // OpenAI's range for both.
    let penalty = |name: &str, v: Option<f32>| match v {
        None => Ok(0.0),
        Some(x) if (-2.0..=2.0).contains(&x) => Ok(x),
        Some(x) => Err(BadRequest::new(
            name,
            format!("{name} = {x}: expected -2 to 2"),
        )),
    };
    let presence_penalty = penalty("presence_penalty", c.presence_penalty)?;
    let frequency_penalty = penalty("frequency_penalty", c.frequency_penalty)?;
    let max_tokens = match c.max_completion_tokens.or(c.max_tokens) {
        Some(0) => {
            let field = if c.max_completion_tokens.is_some() {
                "max_completion_tokens"
            } else {
                "max_tokens"
            };
            return Err(BadRequest::new(field, "expected at least 1"));
        }
        m => m.map(|m| m as usize),
    };
    let stop = match c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > 4 {
        return Err(BadRequest::new(
            "stop",
            format!("{} stop strings: at most 4", stop.len()),
        ));
    }
    Ok(Request {
        model: c.model,
        stream: c.stream.unwrap_or(false),
        include_usage: c.include_usage,
        sampling: Sampling {
            temperature,
            top_k,
            top_p,
            min_p,
            repeat_penalty,
            seed: c.seed.unwrap_or_else(crate::sampling::fresh_seed),
            repeat_last_n: defaults.repeat_last_n,
            presence_penalty,
            frequency_penalty,
        },
        max_tokens,
        stop: stop.into_iter().filter(|s| !s.is_empty()).collect(),
        input,
        tools: None,
        count_only: false,
        ignore_eos: c.ignore_eos.unwrap_or(false),
    })
}

/// A chat message's `content`: a string, or a list of `{"type": "text", "text": ...}` parts.
pub(crate) fn content_text(v: &Value, at: &str) -> Result<String, BadRequest> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (i, p) in parts.iter().enumerate() {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => out.push_str(t),
                    (kind, _) => {
                        return Err(BadRequest::new(
                            &format!("{at}[{i}]"),
                            format!(
                                "content part of type {}: only text parts are supported",
                                kind.unwrap_or("(none)")
                            ),
                        ));
                    }
                }
            }
            Ok(out)
        }
        _ => Err(BadRequest::new(
            at,
            "expected a string or a list of text parts",
        )),
    }
}

/// `POST /v1/chat/completions`: `messages` (roles system, developer, user, assistant, tool)
/// and the common fields; sampling fields a request leaves out take `defaults` (the model's
/// generation defaults, as `cortiq run` uses them).
pub fn chat_request(body: &[u8], defaults: &Sampling) -> Result<Request, BadRequest> {
    let obj = object(body)?;
    let c = common_fields(&obj)?;
    let list: Vec<Value> = field(&obj, "messages", "a list of messages")?
        .ok_or_else(|| BadRequest::new("messages", "expected a list of messages"))?;
    if list.is_empty() {
        return Err(BadRequest::new("messages", "expected at least one message"));
    }
    let mut messages = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| BadRequest::new(&format!("{at}.role"), "expected a role (a string)"))?;
        let role = match role {
            "developer" => "system",
            "system" | "user" | "assistant" | "tool" => role,
            other => {
                return Err(BadRequest::new(
                    &format!("{at}.role"),
                    format!("role {other:?}: expected system, developer, user, assistant or tool"),
                ));
            }
        };
        let content = content_text(
            m.get("content").unwrap_or(&Value::Null),
            &format!("{at}.content"),
        )?;
        let text = |k: &str| -> Result<Option<String>, BadRequest> {
            match m.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(BadRequest::new(&format!("{at}.{k}"), "expected a string")),
            }
        };
        let tool_calls = match m.get("tool_calls") {
            None | Some(Value::Null) => None,
            Some(Value::Array(calls)) => Some(Value::Array(tool_calls_for_template(
                calls,
                &format!("{at}.tool_calls"),
            )?)),
            Some(_) => {
                return Err(BadRequest::new(
                    &format!("{at}.tool_calls"),
                    "expected a list of tool calls",
                ));
            }
        };
        messages.push(Message {
            role: role.to_string(),
            content,
            tool_calls,
            tool_call_id: text("tool_call_id")?,
            name: text("name")?,
            reasoning_content: text("reasoning_content")?,
        });
    }
    let tools = tools_offered(&obj)?;
    let mut req = common(c, Input::Chat(messages), defaults)?;
    req.tools = tools;
    Ok(req)
}

/// The `tools` a request offers, narrowed by `tool_choice` (`none`: none; a named function:
/// only it).
fn tools_offered(obj: &serde_json::Map<String, Value>) -> Result<Option<Value>, BadRequest> {
    const FUNCTION: &str = "expected {\"type\": \"function\", \"function\": {\"name\": ...}}";
    let tools = match obj.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(t)) => {
            for (i, tool) in t.iter().enumerate() {
                if tool
                    .pointer("/function/name")
                    .and_then(Value::as_str)
                    .is_none()
                {
                    return Err(BadRequest::new(&format!("tools[{i}]"), FUNCTION));
                }
            }
            t.clone()
        }
        Some(_) => return Err(BadRequest::new("tools", "expected a list of tools")),
    };
    let tools = match obj.get("tool_choice") {
        None | Some(Value::Null) => tools,
        Some(Value::String(c)) if c == "none" => Vec::new(),
        Some(Value::String(c)) if c == "auto" || c == "required" => tools,
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| BadRequest::new("tool_choice", FUNCTION))?;
            let chosen: Vec<Value> = tools
                .into_iter()
                .filter(|t| t.pointer("/function/name").and_then(Value::as_str) == Some(name))
                .collect();
            if chosen.is_empty() {
                return Err(BadRequest::new(
                    "tool_choice",
                    format!("function {name:?} is not among the tools"),
                ));
            }
            chosen
        }
        Some(v) => {
            return Err(BadRequest::new(
                "tool_choice",
                format!("tool_choice = {v}: expected none, auto, required or a function"),
            ));
        }
    };
    Ok((!tools.is_empty()).then_some(Value::Array(tools)))
}

/// An assistant message's `tool_calls` as templates read them: each call's `arguments`
/// (a JSON string on the wire) parsed into an object where it is one.
fn tool_calls_for_template(calls: &[Value], at: &str) -> Result<Vec<Value>, BadRequest> {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut f = c
                .get("function")
                .ok_or_else(|| {
                    BadRequest::new(&format!("{at}[{i}].function"), "expected a function call")
                })?
                .clone();
            if let Some(Value::String(a)) = f.get("arguments")
                && let Ok(v) = serde_json::from_str::<Value>(a)
            {
                f["arguments"] = v;
            }
            let mut c = c.clone();
            c["function"] = f;
            Ok(c)
        })
        .collect()
}

/// `POST /v1/completions`: `prompt` (a string, or a list of one string) and the common fields.
pub fn completion_request(body: &[u8], defaults: &Sampling) -> Result<Request, BadRequest> {
    let obj = object(body)?;
    let c = common_fields(&obj)?;
    let prompt = match obj.get("prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            a[0].as_str().unwrap_or_default().to_string()
        }
        Some(Value::Array(a)) => {
            return Err(BadRequest::new(
                "prompt",
                format!(
                    "{} prompts: this server takes one prompt per request",
                    a.len()
                ),
            ));
        }
        _ => return Err(BadRequest::new("prompt", "expected a string")),
    };
    if prompt.is_empty() {
        return Err(BadRequest::new("prompt", "expected a non-empty prompt"));
    }
    common(c, Input::Text(prompt), defaults)
}

/// OpenAI's `finish_reason` for how a generation ended.
pub fn finish_reason(f: crate::generate::Finish) -> &'static str {
    use crate::generate::Finish;
    match f {
        Finish::Eos | Finish::Stop | Finish::Cancelled => "stop",
        Finish::Length => "length",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_checked_and_named() {
        let ok = chat_request(
            br#"{"messages":[{"role":"user","content":"hi"}],"temperature":0,"stop":"x","max_tokens":5,"extra":1}"#,
            &Sampling::default(),
        )
        .unwrap();
        assert_eq!(ok.sampling.temperature, 0.0);
        assert_eq!(ok.stop, vec!["x".to_string()]);
        assert_eq!(ok.max_tokens, Some(5));
        let param = |body: &str| {
            chat_request(body.as_bytes(), &Sampling::default())
                .unwrap_err()
                .param
        };
        assert_eq!(param(r#"{"messages":[]}"#).as_deref(), Some("messages"));
        assert_eq!(param(r#"{"temperature":0}"#).as_deref(), Some("messages"));
        assert_eq!(
            param(r#"{"messages":[{"role":"user","content":"a"}],"n":2}"#).as_deref(),
            Some("n")
        );
        assert_eq!(
            param(r#"{"messages":[{"role":"robot","content":"a"}]}"#).as_deref(),
            Some("messages[0].role")
        );
        assert_eq!(
            param(r#"{"messages":[{"role":"user","content":5}]}"#).as_deref(),
            Some("messages[0].content")
        );
        assert_eq!(
            param(r#"{"messages":[{"role":"user","content":"a"}],"temperature":"hot"}"#).as_deref(),
            Some("temperature")
        );
        assert_eq!(
            param(r#"{"messages":[{"role":"user","content":"a"}],"top_p":0}"#).as_deref(),
            Some("top_p")
        );
        assert!(chat_request(b"{not json", &Sampling::default()).is_err());
        let parts = chat_request(
            br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#,
            &Sampling::default(),
        )
        .unwrap();
        match parts.input {
            Input::Chat(m) => assert_eq!(m[0].content, "ab"),
            Input::Text(_) => panic!("a chat request"),
        }
        assert_eq!(
            completion_request(br#"{"prompt":["a","b"]}"#, &Sampling::default())
                .unwrap_err()
                .param
                .as_deref(),
            Some("prompt")
        );
    }
}
