//! The thread that owns the model: requests queue in order and run one at a time through the
//! one generation loop (`Runner::complete`, via `Chat::respond` for chat), each piece of text
//! sent back as it is released. A request whose client went away (its event channel closed) is
//! cancelled before the next forward.

use std::sync::mpsc;

use tokio::sync::mpsc::UnboundedSender;

use super::api::{Input, Request};
use crate::chat::{Chat, ChatError};
use crate::generate::{CancelToken, Event as GenEvent, Finish, GenerateOptions};
use crate::run::{RunError, Runner};
use crate::sampling::Sampler;

/// What a job reports, in order: text pieces, then one `Done` or `Failed`.
#[derive(Debug, Clone)]
pub enum Event {
    /// Chat only, before any text: whether the model's template writes reasoning blocks, and
    /// whether the prompt left one open (the reply starts inside it).
    Started {
        /// The template knows `<think>`.
        reasoning: bool,
        /// The rendered prompt ends inside a `<think>` block.
        in_think: bool,
        /// Prompt tokens.
        prompt_tokens: usize,
    },
    /// Text that is final (never part of a stop string).
    Text(String),
    /// The generation ended.
    Done(Outcome),
    /// The request could not run: an HTTP status and why.
    Failed(u16, String),
}

/// How a generation ended and what it counted.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Why it ended.
    pub finish: Finish,
    /// The stop string that ended it (one of the model's or the request's).
    pub stop_string: Option<String>,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
}

/// One request for the model thread.
pub struct Job {
    /// What to generate.
    pub request: Request,
    /// Where the events go.
    pub events: UnboundedSender<Event>,
    /// Set when the client goes away.
    pub cancel: CancelToken,
}

/// The handle requests are submitted through (cheap to clone).
#[derive(Clone)]
pub struct Worker {
    tx: mpsc::Sender<Job>,
}

impl Worker {
    /// Starts the model thread; `ctx` bounds prompt plus reply.
    pub fn spawn(runner: Runner, ctx: usize) -> std::io::Result<Worker> {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("cortiq-model".into())
            .spawn(move || {
                for job in rx {
                    let events = job.events.clone();
                    // A panic in one request fails that request, not the server.
                    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        run(&runner, ctx, job)
                    }));
                    let ev = match result {
                        Ok(Ok(outcome)) => Event::Done(outcome),
                        Ok(Err((status, message))) => Event::Failed(status, message),
                        Err(_) => Event::Failed(500, "internal error while generating".into()),
                    };
                    let _ = events.send(ev);
                }
            })?;
        Ok(Worker { tx })
    }

    /// Queues `job`; `false` when the model thread is gone.
    pub fn submit(&self, job: Job) -> bool {
        self.tx.send(job).is_ok()
    }
}

fn status_of_run(e: &RunError) -> u16 {
    match e {
        RunError::EmptyPrompt | RunError::Tokenizer { .. } => 400,
        _ => 500,
    }
}

fn run(runner: &Runner, ctx: usize, job: Job) -> Result<Outcome, (u16, String)> {
    let Job {
        request,
        events,
        cancel,
    } = job;
    let cancel_on_close = cancel.clone();
    let started = events.clone();
    let mut send = move |t: &str| {
        if !t.is_empty() && events.send(Event::Text(t.to_string())).is_err() {
            cancel_on_close.cancel();
        }
    };
    // The prompt must leave room in the context, and an explicit max_tokens must fit beside
    // it (as OpenAI answers); without one the reply may fill the rest.
    let limit = |prompt: usize| -> Result<usize, (u16, String)> {
        if prompt >= ctx {
            return Err((
                400,
                format!("the prompt is {prompt} tokens; the context is {ctx} tokens (--ctx)"),
            ));
        }
        match request.max_tokens {
            Some(m) if m > ctx - prompt => Err((
                400,
                format!(
                    "max_tokens {m} with a prompt of {prompt} tokens passes the context of \
                     {ctx} tokens (--ctx)"
                ),
            )),
            m => Ok(m.unwrap_or(ctx - prompt)),
        }
    };
    match &request.input {
        Input::Chat(messages) => {
            let mut chat = Chat::new(runner, None, request.sampling).map_err(|e| match e {
                ChatError::NoTemplate { .. } => (400, format!("{e}: use /v1/completions")),
                e => (500, e.to_string()),
            })?;
            chat.messages = messages.clone();
            chat.stop.extend(request.stop.iter().cloned());
            chat.cancel = Some(cancel);
            chat.ctx_limit = Some(ctx);
            chat.tools = request.tools.clone();
            let rendered = chat.render().map_err(|e| (400, e.to_string()))?;
            let prompt = chat.prompt_ids().map_err(|e| (400, e.to_string()))?;
            if request.count_only {
                return Ok(Outcome {
                    finish: Finish::Length,
                    stop_string: None,
                    prompt_tokens: prompt.len(),
                    completion_tokens: 0,
                });
            }
            let max_new = limit(prompt.len())?;
            let template = runner.model.cmf().header().chat_template.clone();
            let _ = started.send(Event::Started {
                reasoning: template.is_some_and(|t| t.contains("</think>")),
                in_think: super::parse::opens_reasoning(&rendered),
                prompt_tokens: prompt.len(),
            });
            let reply = chat.respond(max_new, &mut send);
            let reply = reply.map_err(|e| match &e {
                ChatError::Context { .. } => (400, e.to_string()),
                ChatError::Run(r) => (status_of_run(r), e.to_string()),
                _ => (500, e.to_string()),
            })?;
            Ok(Outcome {
                finish: reply.finish,
                stop_string: reply.stop_string.clone(),
                prompt_tokens: reply.prefilled + reply.reused,
                completion_tokens: reply.tokens,
            })
        }
        Input::Text(prompt) => {
            let ids = runner
                .encode(prompt)
                .map_err(|e| (status_of_run(&e), e.to_string()))?;
            let max_new = limit(ids.len())?;
            let model = runner.model.model();
            let mut st = model.new_state();
            let opts = GenerateOptions {
                max_new,
                stop: request.stop.clone(),
                cancel: Some(cancel),
                ..GenerateOptions::default()
            };
            let mut sampler = Sampler::new(request.sampling);
            let g = runner
                .complete(&mut st, &ids, &mut sampler, &opts, &mut |e| {
                    if let GenEvent::Text(t) = e {
                        send(t);
                    }
                })
                .map_err(|e| (status_of_run(&e), e.to_string()))?;
            Ok(Outcome {
                finish: g.finish,
                stop_string: g.stop_string.clone(),
                prompt_tokens: ids.len(),
                completion_tokens: g.tokens.len(),
            })
        }
    }
}
