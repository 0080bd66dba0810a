//! Splitting a reply into what the API returns apart: reasoning (`<think>...</think>`, returned
//! as `reasoning_content`), tool calls (returned as structured `tool_calls`) and the answer
//! text, as the text streams in. Tool calls come in the model family's own format
//! ([`ToolFormat`]): Qwen's `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks, or
//! DeepSeek's DSML (`<｜DSML｜tool_calls>` holding `<｜DSML｜invoke name="...">` elements whose
//! `<｜DSML｜parameter name="..." string="true|false">` children are the arguments: raw strings,
//! or JSON values). Text that could still be the start of a tag is held back until it is
//! known; a tool call that does not parse is returned as text, never an error.

use serde_json::Value;

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const TOOL_OPEN: &str = "<tool_call>";
const TOOL_CLOSE: &str = "</tool_call>";
const DSML_OPEN: &str = "<｜DSML｜tool_calls>";
const DSML_CLOSE: &str = "</｜DSML｜tool_calls>";
const DSML_INVOKE: &str = "<｜DSML｜invoke name=\"";
const DSML_INVOKE_CLOSE: &str = "</｜DSML｜invoke>";
const DSML_PARAM: &str = "<｜DSML｜parameter name=\"";
const DSML_PARAM_CLOSE: &str = "</｜DSML｜parameter>";

/// How a model family writes tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ToolFormat {
    /// Qwen's `<tool_call>` JSON blocks.
    #[default]
    Qwen,
    /// DeepSeek's DSML markup.
    Dsml,
}

impl ToolFormat {
    /// The format a chat template writes tool calls in (DSML where it mentions it).
    pub fn of_template(template: &str) -> ToolFormat {
        if template.contains("DSML") {
            ToolFormat::Dsml
        } else {
            ToolFormat::Qwen
        }
    }

    fn open(self) -> &'static str {
        match self {
            ToolFormat::Qwen => TOOL_OPEN,
            ToolFormat::Dsml => DSML_OPEN,
        }
    }

    fn close(self) -> &'static str {
        match self {
            ToolFormat::Qwen => TOOL_CLOSE,
            ToolFormat::Dsml => DSML_CLOSE,
        }
    }
}

/// One parsed piece of a reply, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// Answer text.
    Content(String),
    /// Reasoning text.
    Reasoning(String),
    /// A complete tool call: its name and its arguments as a JSON string.
    ToolCall {
        /// The function's name.
        name: String,
        /// The arguments, serialised.
        arguments: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Content,
    Think,
    Tool,
}

/// The streaming splitter of one reply.
#[derive(Debug, Clone)]
pub struct Splitter {
    mode: Mode,
    /// Text not yet classified (a possible tag prefix, or an open tool call's body).
    pending: String,
    /// Whether tags are looked for at all (`tools` given or a reasoning model): without them
    /// a reply is content as it comes.
    reasoning: bool,
    tools: bool,
    format: ToolFormat,
}

/// The longest suffix of `s` that is a proper prefix of `tag` (held back: it may yet become
/// the tag).
fn partial_tag(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

impl Splitter {
    /// A splitter that finds reasoning (when `reasoning`) and tool calls (when `tools`);
    /// `in_think` when the prompt already opened the reasoning block (a template that ends
    /// its generation prompt with an open `<think>`: see [`opens_reasoning`]).
    pub fn new(reasoning: bool, tools: bool, in_think: bool) -> Splitter {
        Self::with_format(reasoning, tools, in_think, ToolFormat::Qwen)
    }

    /// [`Splitter::new`] for tool calls written in `format`.
    pub fn with_format(
        reasoning: bool,
        tools: bool,
        in_think: bool,
        format: ToolFormat,
    ) -> Splitter {
        Splitter {
            mode: if in_think && reasoning {
                Mode::Think
            } else {
                Mode::Content
            },
            pending: String::new(),
            reasoning,
            tools,
            format,
        }
    }

    /// Adds released text; returns the pieces now known.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            let tags: Vec<&str> = match self.mode {
                Mode::Content => {
                    let mut t = Vec::new();
                    if self.reasoning {
                        t.push(THINK_OPEN);
                    }
                    if self.tools {
                        t.push(self.format.open());
                    }
                    t
                }
                Mode::Think => vec![THINK_CLOSE],
                Mode::Tool => vec![self.format.close()],
            };
            // The earliest tag in the pending text.
            let found = tags
                .iter()
                .filter_map(|t| self.pending.find(t).map(|i| (i, *t)))
                .min_by_key(|(i, _)| *i);
            match found {
                Some((i, tag)) => {
                    let before = self.pending[..i].to_string();
                    let rest = self.pending[i + tag.len()..].to_string();
                    match (self.mode, tag) {
                        (Mode::Content, THINK_OPEN) => {
                            push_text(&mut out, Mode::Content, before);
                            self.mode = Mode::Think;
                        }
                        (Mode::Content, _) => {
                            push_text(&mut out, Mode::Content, before);
                            self.mode = Mode::Tool;
                        }
                        (Mode::Think, _) => {
                            push_text(&mut out, Mode::Think, before);
                            self.mode = Mode::Content;
                        }
                        (Mode::Tool, _) => {
                            out.extend(tool_calls(self.format, &before));
                            self.mode = Mode::Content;
                        }
                    }
                    self.pending = rest;
                }
                None => {
                    // Release all but a possible tag prefix (an open tool call keeps its
                    // whole body until it closes).
                    if self.mode == Mode::Tool {
                        break;
                    }
                    let hold = tags
                        .iter()
                        .map(|t| partial_tag(&self.pending, t))
                        .max()
                        .unwrap_or(0);
                    let cut = self.pending.len() - hold;
                    let released = self.pending[..cut].to_string();
                    self.pending.drain(..cut);
                    push_text(&mut out, self.mode, released);
                    break;
                }
            }
        }
        out
    }

    /// The end of the reply: what is still held back.
    pub fn finish(&mut self) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.pending);
        let mut out = Vec::new();
        match self.mode {
            // An unclosed tool call is text as the model wrote it.
            Mode::Tool => push_text(
                &mut out,
                Mode::Content,
                format!("{}{rest}", self.format.open()),
            ),
            mode => push_text(&mut out, mode, rest),
        }
        out
    }
}

/// Whether a rendered prompt ends by opening a reasoning block (a template's generation
/// prompt `...<think>\n`), so the reply starts inside it. Only the end counts: a `<think>` a
/// user wrote in a message does not.
pub fn opens_reasoning(prompt: &str) -> bool {
    prompt.trim_end().ends_with(THINK_OPEN)
}

fn push_text(out: &mut Vec<Piece>, mode: Mode, text: String) {
    if text.is_empty() {
        return;
    }
    out.push(match mode {
        Mode::Think => Piece::Reasoning(text),
        _ => Piece::Content(text),
    });
}

/// A closed tool-call block's body as its calls, or (when it does not parse) the block as
/// text.
fn tool_calls(format: ToolFormat, body: &str) -> Vec<Piece> {
    match format {
        ToolFormat::Qwen => vec![tool_call(body)],
        ToolFormat::Dsml => dsml_calls(body)
            .unwrap_or_else(|| vec![Piece::Content(format!("{DSML_OPEN}{body}{DSML_CLOSE}"))]),
    }
}

/// `s` after a `"`-terminated attribute value: the value and the rest.
fn attribute(s: &str) -> Option<(&str, &str)> {
    let end = s.find('"')?;
    Some((&s[..end], &s[end + 1..]))
}

/// A DSML block's invokes (`None` when anything in it is not DSML: then it is text).
fn dsml_calls(body: &str) -> Option<Vec<Piece>> {
    let mut calls = Vec::new();
    let mut rest = body.trim_start();
    while !rest.is_empty() {
        let (name, after) = attribute(rest.strip_prefix(DSML_INVOKE)?)?;
        let after = after.trim_start().strip_prefix('>')?;
        let end = after.find(DSML_INVOKE_CLOSE)?;
        let mut params = after[..end].trim_start();
        let mut args = serde_json::Map::new();
        while !params.is_empty() {
            let (pname, p) = attribute(params.strip_prefix(DSML_PARAM)?)?;
            let p = p.trim_start();
            // `string="true"`: the value as written; otherwise a JSON value (a bare word that
            // is not JSON stays a string).
            let (raw, p) = match p.strip_prefix("string=\"") {
                Some(q) => {
                    let (flag, q) = attribute(q)?;
                    (flag == "true", q.trim_start())
                }
                None => (false, p),
            };
            let p = p.strip_prefix('>')?;
            let vend = p.find(DSML_PARAM_CLOSE)?;
            let text = &p[..vend];
            let value = if raw {
                Value::String(text.to_string())
            } else {
                serde_json::from_str(text.trim())
                    .unwrap_or_else(|_| Value::String(text.to_string()))
            };
            args.insert(pname.to_string(), value);
            params = p[vend + DSML_PARAM_CLOSE.len()..].trim_start();
        }
        if name.is_empty() {
            return None;
        }
        calls.push(Piece::ToolCall {
            name: name.to_string(),
            arguments: Value::Object(args).to_string(),
        });
        rest = after[end + DSML_INVOKE_CLOSE.len()..].trim_start();
    }
    (!calls.is_empty()).then_some(calls)
}

/// A `<tool_call>` block's body as a call, or (not a JSON object with a string `name`) the
/// block as text.
fn tool_call(body: &str) -> Piece {
    let parsed: Option<Value> = serde_json::from_str(body.trim()).ok();
    match parsed {
        Some(Value::Object(o)) => match o.get("name").and_then(Value::as_str) {
            Some(name) => {
                let arguments = match o.get("arguments").or_else(|| o.get("parameters")) {
                    Some(Value::String(s)) => s.clone(),
                    Some(v) => v.to_string(),
                    None => "{}".to_string(),
                };
                Piece::ToolCall {
                    name: name.to_string(),
                    arguments,
                }
            }
            None => Piece::Content(format!("{TOOL_OPEN}{body}{TOOL_CLOSE}")),
        },
        _ => Piece::Content(format!("{TOOL_OPEN}{body}{TOOL_CLOSE}")),
    }
}

/// Adjacent pieces of one kind merged (what a whole, non-streamed answer holds).
pub fn merge(pieces: Vec<Piece>) -> (String, String, Vec<(String, String)>) {
    let (mut content, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
    for p in pieces {
        match p {
            Piece::Content(t) => content.push_str(&t),
            Piece::Reasoning(t) => reasoning.push_str(&t),
            Piece::ToolCall { name, arguments } => calls.push((name, arguments)),
        }
    }
    (content, reasoning, calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reply fed in every split into pieces of `n` bytes (on char boundaries), merged.
    fn split_by(text: &str, n: usize, in_think: bool) -> (String, String, Vec<(String, String)>) {
        let mut s = Splitter::new(true, true, in_think);
        let mut pieces = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for chunk in chars.chunks(n) {
            let c: String = chunk.iter().collect();
            pieces.extend(s.push(&c));
        }
        pieces.extend(s.finish());
        merge(pieces)
    }

    #[test]
    fn reasoning_tool_calls_and_content_in_any_chunking() {
        let reply = "<think>I should look it up.</think>Let me check.\n<tool_call>\n\
                     {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Verona\"}}\n\
                     </tool_call>\n<tool_call>{\"name\": \"now\"}</tool_call>";
        for n in [1, 2, 3, 5, 7, 1000] {
            let (content, reasoning, calls) = split_by(reply, n, false);
            assert_eq!(reasoning, "I should look it up.", "chunks of {n}");
            assert_eq!(content, "Let me check.\n\n", "chunks of {n}");
            assert_eq!(
                calls,
                vec![
                    (
                        "get_weather".to_string(),
                        r#"{"city":"Verona"}"#.to_string()
                    ),
                    ("now".to_string(), "{}".to_string())
                ],
                "chunks of {n}"
            );
        }
    }

    #[test]
    fn reasoning_the_prompt_opened_and_text_that_only_looks_like_a_tag() {
        let (content, reasoning, calls) = split_by("hmm, 2 < 3</think>Yes: a <b> tag", 2, true);
        assert_eq!(reasoning, "hmm, 2 < 3");
        assert_eq!(content, "Yes: a <b> tag");
        assert!(calls.is_empty());
        // Reasoning is only what a tag (or the prompt) opened: a stray close is text.
        let (content, reasoning, _) = split_by("thinking</think>answer", 3, false);
        assert_eq!(content, "thinking</think>answer");
        assert!(reasoning.is_empty());
        // A trailing partial tag is text at the end.
        let (content, _, _) = split_by("see <tool_ca", 4, false);
        assert_eq!(content, "see <tool_ca");
    }

    #[test]
    fn only_a_prompt_that_ends_with_think_opens_reasoning() {
        assert!(opens_reasoning("<|im_start|>assistant\n<think>\n"));
        assert!(!opens_reasoning(
            "user: what does <think> do?<|im_start|>assistant\n"
        ));
        assert!(!opens_reasoning("<think>\n\n</think>\n\n"));
    }

    #[test]
    fn malformed_tool_calls_are_text() {
        for bad in [
            "<tool_call>{not json}</tool_call>",
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "<tool_call>[1, 2]</tool_call>",
        ] {
            let (content, _, calls) = split_by(bad, 3, false);
            assert!(calls.is_empty(), "{bad}");
            assert_eq!(content, bad);
        }
        // Never closed: text as written.
        let (content, _, calls) = split_by("<tool_call>{\"name\": \"x\"", 3, false);
        assert!(calls.is_empty());
        assert_eq!(content, "<tool_call>{\"name\": \"x\"");
    }

    #[test]
    fn dsml_tool_calls_in_any_chunking() {
        let reply = "<think>Check both.</think>On it.\n<｜DSML｜tool_calls>\n\
                     <｜DSML｜invoke name=\"get_weather\">\n\
                     <｜DSML｜parameter name=\"city\" string=\"true\">杭州</｜DSML｜parameter>\n\
                     <｜DSML｜parameter name=\"days\" string=\"false\">5</｜DSML｜parameter>\n\
                     <｜DSML｜parameter name=\"opts\" string=\"false\">{\"unit\": \"C\"}</｜DSML｜parameter>\n\
                     </｜DSML｜invoke>\n<｜DSML｜invoke name=\"now\">\n</｜DSML｜invoke>\n\
                     </｜DSML｜tool_calls>";
        for n in [1, 2, 3, 5, 7, 1000] {
            let mut s = Splitter::with_format(true, true, false, ToolFormat::Dsml);
            let chars: Vec<char> = reply.chars().collect();
            let mut pieces = Vec::new();
            for chunk in chars.chunks(n) {
                pieces.extend(s.push(&chunk.iter().collect::<String>()));
            }
            pieces.extend(s.finish());
            let (content, reasoning, calls) = merge(pieces);
            assert_eq!(reasoning, "Check both.", "chunks of {n}");
            assert_eq!(content, "On it.\n", "chunks of {n}");
            assert_eq!(calls.len(), 2, "chunks of {n}");
            assert_eq!(calls[0].0, "get_weather");
            let args: Value = serde_json::from_str(&calls[0].1).unwrap();
            assert_eq!(
                args,
                serde_json::json!({"city": "杭州", "days": 5, "opts": {"unit": "C"}})
            );
            assert_eq!(calls[1], ("now".to_string(), "{}".to_string()));
        }
        // A Qwen block is text to a DSML model, and malformed DSML is text as written.
        for bad in [
            "<tool_call>{\"name\": \"x\"}</tool_call>",
            "<｜DSML｜tool_calls>junk</｜DSML｜tool_calls>",
            "<｜DSML｜tool_calls><｜DSML｜invoke name=\"a\"><｜DSML｜parameter name=\"p\">1\
             </｜DSML｜invoke></｜DSML｜tool_calls>",
        ] {
            let mut s = Splitter::with_format(false, true, false, ToolFormat::Dsml);
            let mut p = s.push(bad);
            p.extend(s.finish());
            let (content, _, calls) = merge(p);
            assert!(calls.is_empty(), "{bad}");
            assert_eq!(content, bad);
        }
        assert_eq!(
            ToolFormat::of_template("{{ '<｜DSML｜tool_calls>' }}"),
            ToolFormat::Dsml
        );
        assert_eq!(ToolFormat::of_template("<tool_call>"), ToolFormat::Qwen);
    }

    #[test]
    fn without_tools_or_reasoning_tags_are_text() {
        let mut s = Splitter::new(false, false, false);
        let mut p = s.push("<think>x</think><tool_call>{\"name\":\"a\"}</tool_call>");
        p.extend(s.finish());
        let (content, reasoning, calls) = merge(p);
        assert_eq!(
            content,
            "<think>x</think><tool_call>{\"name\":\"a\"}</tool_call>"
        );
        assert!(reasoning.is_empty() && calls.is_empty());
    }
}
