//! `cortiq chat`: a conversation rendered through the model's own chat template (Jinja, via
//! minijinja), one sequence state kept across turns.
//!
//! Each turn renders the whole conversation with `add_generation_prompt`, tokenises it, and reuses
//! the state saved after the previous turn's prompt when the new ids extend those (the usual
//! case): only the reply as the template renders it and the new message are prefilled. When they
//! do not (a template that rewrites history), the conversation is prefilled from scratch: slower,
//! never wrong. A reply ends at an EOS id or at one of the generation defaults' `stop_strings`
//! (which is not part of the reply).

use serde::Serialize;

use crate::generate::{Event, GenerateOptions};
use crate::model::AnyState;
use crate::run::{RunError, Runner};
use crate::sampling::{Sampler, Sampling};

/// One message.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text.
    pub content: String,
    /// An assistant turn's tool calls (OpenAI's `tool_calls` objects, as templates read them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A tool turn's answer to this call id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool turn's function name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant turn's reasoning.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl Message {
    /// A message of `role` with `content` and nothing else.
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.to_string(),
            content: content.to_string(),
            ..Message::default()
        }
    }
}

/// Why a turn failed.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The file has no chat template.
    #[error(
        "{file}: no chat template embedded (convert from a checkpoint whose tokenizer_config.json has one)"
    )]
    NoTemplate {
        /// The model file.
        file: String,
    },
    /// The template does not parse or render.
    #[error("chat template: {0}")]
    Template(#[from] minijinja::Error),
    /// Tokenising or the forward pass.
    #[error(transparent)]
    Run(#[from] RunError),
    /// The conversation no longer fits the context limit.
    #[error(
        "the conversation is {tokens} tokens, at the context limit of {limit}: /reset starts over"
    )]
    Context {
        /// Tokens of the rendered conversation.
        tokens: usize,
        /// The limit.
        limit: usize,
    },
}

/// What one reply did.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The reply's text (stop string removed).
    pub text: String,
    /// Tokens generated.
    pub tokens: usize,
    /// Why the reply ended.
    pub finish: crate::generate::Finish,
    /// The stop string that ended it.
    pub stop_string: Option<String>,
    /// Prompt tokens prefilled this turn (after reuse).
    pub prefilled: usize,
    /// Prompt tokens reused from the previous turn's state.
    pub reused: usize,
    /// Seconds of prefill.
    pub prompt_seconds: f64,
    /// Seconds of generation.
    pub gen_seconds: f64,
}

/// A conversation with one model.
pub struct Chat<'r> {
    runner: &'r Runner,
    env: minijinja::Environment<'static>,
    /// The conversation so far.
    pub messages: Vec<Message>,
    /// Strings that end a reply (the model's own, from its generation config; a caller may
    /// add more).
    pub stop: Vec<String>,
    /// Cancels the reply being generated (a client that went away).
    pub cancel: Option<crate::generate::CancelToken>,
    /// Tool definitions the template offers the model (OpenAI's `tools` list).
    pub tools: Option<serde_json::Value>,
    bos: String,
    eos: String,
    /// The rendered prompt's ids of the last turn and the state right after them.
    saved: Option<(Vec<u32>, AnyState)>,
    sampler: Sampler,
    /// Most tokens the conversation may hold, prompt and reply (`None`: no limit).
    pub ctx_limit: Option<usize>,
    /// Chunk size of a long prefill ([`GenerateOptions::prefill_chunk`]; 0 = one call).
    pub prefill_chunk: usize,
    /// Drafting with the MTP head ([`GenerateOptions::mtp`]).
    pub mtp: crate::speculative::MtpMode,
    /// Drafting by prompt lookup ([`GenerateOptions::lookup`]).
    pub lookup: usize,
}

/// A Jinja environment holding the chat template as `chat`, with what Hugging Face templates
/// expect of Python's Jinja2.
fn environment(src: String) -> Result<minijinja::Environment<'static>, minijinja::Error> {
    let mut env = minijinja::Environment::new();
    // Hugging Face templates are Jinja2 run by Python: they call str/list/dict methods
    // (`content.strip()`, `.split(...)`, `.startswith(...)`) that pycompat provides.
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_template_owned("chat", src)?;
    Ok(env)
}

/// The token text of the config's `key` id (the first, when it is a list), for templates that
/// write `bos_token` / `eos_token`.
fn special(runner: &Runner, config: &serde_json::Value, key: &str) -> String {
    let id = match config.get(key) {
        Some(serde_json::Value::Number(n)) => n.as_u64(),
        Some(serde_json::Value::Array(a)) => a.first().and_then(serde_json::Value::as_u64),
        _ => None,
    };
    id.and_then(|i| runner.tokenizer.id_to_token(i as u32))
        .unwrap_or_default()
}

impl<'r> Chat<'r> {
    /// A new conversation (optionally starting with a system message).
    pub fn new(
        runner: &'r Runner,
        system: Option<&str>,
        sampling: Sampling,
    ) -> Result<Self, ChatError> {
        let cmf = runner.model.cmf();
        let h = cmf.header();
        let src = h
            .chat_template
            .clone()
            .ok_or_else(|| ChatError::NoTemplate {
                file: cmf.display_path().display().to_string(),
            })?;
        let env = environment(src)?;
        let stop = h
            .generation
            .as_ref()
            .and_then(|g| g.get("stop_strings"))
            .map(|v| match v {
                serde_json::Value::String(s) => vec![s.clone()],
                serde_json::Value::Array(a) => a
                    .iter()
                    .filter_map(|s| s.as_str().map(str::to_string))
                    .collect(),
                _ => Vec::new(),
            })
            .unwrap_or_default()
            .into_iter()
            // An empty stop string would end every reply before it starts.
            .filter(|s: &String| !s.is_empty())
            .collect();
        let messages = system
            .map(|s| Message::new("system", s))
            .into_iter()
            .collect();
        Ok(Chat {
            runner,
            env,
            messages,
            stop,
            bos: special(runner, &h.config, "bos_token_id"),
            eos: special(runner, &h.config, "eos_token_id"),
            cancel: None,
            tools: None,
            saved: None,
            sampler: Sampler::new(sampling),
            ctx_limit: None,
            prefill_chunk: 0,
            mtp: crate::speculative::MtpMode::default(),
            lookup: 0,
        })
    }

    /// The text the template makes of the conversation, ready for the assistant's turn.
    pub fn render(&self) -> Result<String, ChatError> {
        let t = self.env.get_template("chat")?;
        Ok(t.render(minijinja::context! {
            messages => &self.messages,
            tools => &self.tools,
            add_generation_prompt => true,
            bos_token => &self.bos,
            eos_token => &self.eos,
        })?)
    }

    /// Forgets the conversation (keeps the system message).
    pub fn reset(&mut self) {
        self.messages.retain(|m| m.role == "system");
        self.saved = None;
        self.sampler.reset_history();
    }

    /// Adds the user's message and generates the reply, handing each printable piece to
    /// `on_text` as it completes.
    pub fn reply(
        &mut self,
        user: &str,
        max_new: usize,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Reply, ChatError> {
        self.messages.push(Message::new("user", user));
        let reply = self.generate_reply(max_new, on_text);
        if reply.is_err() {
            // A failed turn leaves the conversation as it was.
            self.messages.pop();
        }
        reply
    }

    /// Generates the assistant's turn after the conversation as it stands (`messages` set by
    /// the caller, ending with a user or tool turn), without adding a user message; the reply
    /// is appended to `messages`.
    pub fn respond(
        &mut self,
        max_new: usize,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Reply, ChatError> {
        self.generate_reply(max_new, on_text)
    }

    /// The ids of the conversation as the template renders it for the assistant's turn.
    pub fn prompt_ids(&self) -> Result<Vec<u32>, ChatError> {
        let prompt = self.render()?;
        Ok(self
            .runner
            .tokenizer
            .encode(prompt.as_str(), false)
            .map_err(|e| RunError::Tokenizer {
                file: String::new(),
                message: e.to_string(),
            })?
            .get_ids()
            .to_vec())
    }

    fn generate_reply(
        &mut self,
        max_new: usize,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Reply, ChatError> {
        let ids = self.prompt_ids()?;
        if ids.is_empty() {
            return Err(RunError::EmptyPrompt.into());
        }
        let mut max_new = max_new;
        if let Some(limit) = self.ctx_limit {
            if ids.len() >= limit {
                return Err(ChatError::Context {
                    tokens: ids.len(),
                    limit,
                });
            }
            max_new = max_new.min(limit - ids.len());
        }
        let (mut st, reused) = match self.saved.take() {
            // Keep at least one token to prefill: its logits start the reply.
            Some((prev, st)) if prev.len() < ids.len() && ids.starts_with(&prev) => {
                (st, prev.len())
            }
            _ => (self.runner.model.model().new_state(), 0),
        };
        let opts = GenerateOptions {
            max_new,
            stop: self.stop.clone(),
            cancel: self.cancel.clone(),
            keep_prompt_state: true,
            prefill_chunk: self.prefill_chunk,
            mtp: self.mtp,
            lookup: self.lookup,
            context: ids[..reused].to_vec(),
            ..GenerateOptions::default()
        };
        let g = self.runner.complete(
            &mut st,
            &ids[reused..],
            &mut self.sampler,
            &opts,
            &mut |e| {
                if let Event::Text(piece) = e {
                    on_text(piece);
                }
            },
        )?;
        if let Some(prompt_state) = g.prompt_state {
            self.saved = Some((ids.clone(), prompt_state));
        }
        self.messages.push(Message::new("assistant", &g.text));
        Ok(Reply {
            text: g.text,
            tokens: g.tokens.len(),
            finish: g.finish,
            stop_string: g.stop_string.clone(),
            prefilled: ids.len() - reused,
            reused,
            prompt_seconds: g.prompt_seconds,
            gen_seconds: g.gen_seconds,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_may_use_python_string_methods() {
        let src = "{%- for m in messages %}{% if m.content.startswith('<think>') %}T{% endif %}\
                   [{{ m.role.upper() }}:{{ m.content.split('</think>')[-1].strip() }}]\
                   {%- endfor %}{% if add_generation_prompt %}>{% endif %}";
        let env = environment(src.to_string()).unwrap();
        let out = env
            .get_template("chat")
            .unwrap()
            .render(minijinja::context! {
                messages => vec![
                    Message::new("user", "  hi  "),
                    Message::new("assistant", "<think>x</think> yo"),
                ],
                add_generation_prompt => true,
            })
            .unwrap();
        assert_eq!(out, "[USER:hi]T[ASSISTANT:yo]>");
    }

    #[test]
    fn raise_exception_is_an_error() {
        let env = environment("{{ raise_exception('no system role') }}".to_string()).unwrap();
        let err = env.get_template("chat").unwrap().render(()).unwrap_err();
        assert!(err.to_string().contains("no system role"), "{err}");
    }
}
