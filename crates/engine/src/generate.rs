//! The one generation loop: prefill the new prompt ids onto a sequence state, then sample and
//! feed one token at a time until an EOS id, a stop string, the token limit or a cancellation,
//! streaming each token and each piece of text that is safe to show. `cortiq run` and
//! `cortiq chat` use it (so will the server and speculative decoding); none has a loop of its
//! own.
//!
//! Text is released through [`TextStream`] (never inside a UTF-8 sequence that byte-level
//! tokens split) and held back while it could still become a stop string; a stop string ends
//! the reply and is not part of it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::model::AnyState;
use crate::run::{RunError, Runner};
use crate::sampling::Sampler;

/// Stops a generation from another thread (a client that went away, Ctrl-C): the loop checks
/// it before every forward and ends with [`Finish::Cancelled`].
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    /// A token not cancelled yet.
    pub fn new() -> CancelToken {
        CancelToken::default()
    }

    /// Asks every generation holding a clone of this token to stop.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether [`Self::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// What a generation may do.
#[derive(Debug, Clone, Default)]
pub struct GenerateOptions {
    /// Most tokens to generate (an EOS that ends the reply counts).
    pub max_new: usize,
    /// Strings that end the reply (not included in its text); empty ones are ignored.
    pub stop: Vec<String>,
    /// Checked before every forward.
    pub cancel: Option<CancelToken>,
    /// Keep a snapshot of the state right after the prompt ([`Generation::prompt_state`]), for
    /// a caller that will extend the same prompt later (chat turns, a prompt cache).
    pub keep_prompt_state: bool,
    /// Prefill a prompt longer than this in chunks of this many tokens, reporting
    /// [`Event::Prefill`] after each (0: one call, no progress events).
    pub prefill_chunk: usize,
    /// An EOS id does not end the reply (it is generated like any token).
    pub ignore_eos: bool,
    /// Drafting with the model's MTP head (the same tokens, fewer trunk forwards).
    pub mtp: crate::speculative::MtpMode,
    /// Drafting by prompt lookup, up to this many tokens a step (0: off; not with `mtp`).
    pub lookup: usize,
    /// The ids the state already holds, where the caller knows them (prompt lookup searches
    /// them with the prompt and the reply).
    pub context: Vec<u32>,
}

impl GenerateOptions {
    /// Up to `max_new` tokens, no stop strings, no cancellation.
    pub fn new(max_new: usize) -> GenerateOptions {
        GenerateOptions {
            max_new,
            ..GenerateOptions::default()
        }
    }
}

/// What the loop hands its caller as it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event<'a> {
    /// A generated token id (the EOS that ends the reply included).
    Token(u32),
    /// Text that is complete and can no longer become part of a stop string.
    Text(&'a str),
    /// Prompt tokens prefilled so far, of the total (chunked prefill only).
    Prefill {
        /// Tokens done.
        done: usize,
        /// Tokens in the prompt.
        total: usize,
    },
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An EOS id was generated.
    Eos,
    /// A stop string appeared.
    Stop,
    /// `max_new` tokens were generated.
    Length,
    /// The [`CancelToken`] was cancelled.
    Cancelled,
}

/// What one generation did.
#[derive(Debug, Clone)]
pub struct Generation {
    /// The prompt ids fed this time (after whatever the state already held).
    pub prompt: Vec<u32>,
    /// The generated ids (the EOS that ended it included).
    pub tokens: Vec<u32>,
    /// The generated text (a stop string and what followed it removed).
    pub text: String,
    /// Why it ended.
    pub finish: Finish,
    /// The stop string that ended it ([`Finish::Stop`]).
    pub stop_string: Option<String>,
    /// Seconds spent on the prompt (prefill and the first sample).
    pub prompt_seconds: f64,
    /// Seconds spent generating after the prompt.
    pub gen_seconds: f64,
    /// The state right after the prompt, when [`GenerateOptions::keep_prompt_state`] asked.
    pub prompt_state: Option<AnyState>,
    /// What drafting did, when the generation drafted (`--mtp`, `--lookup`).
    pub drafts: Option<crate::speculative::DraftStats>,
}

impl Runner {
    /// Feeds `prompt` after whatever `state` holds, then generates with `sampler` as `opts`
    /// allow, calling `on_event` with every token and every releasable piece of text. `state`
    /// ends holding the prompt and every generated token but the last.
    pub fn complete(
        &self,
        state: &mut AnyState,
        prompt: &[u32],
        sampler: &mut Sampler,
        opts: &GenerateOptions,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<Generation, RunError> {
        if prompt.is_empty() {
            return Err(RunError::EmptyPrompt);
        }
        let cancelled = || opts.cancel.as_ref().is_some_and(CancelToken::is_cancelled);
        let model = self.model.model();

        let t0 = Instant::now();
        let mut g = Generation {
            prompt: prompt.to_vec(),
            tokens: Vec::new(),
            text: String::new(),
            finish: Finish::Cancelled,
            stop_string: None,
            prompt_seconds: 0.0,
            gen_seconds: 0.0,
            prompt_state: None,
            drafts: None,
        };
        if cancelled() {
            return Ok(g);
        }
        let integrity = self.model.integrity();
        integrity.check()?;
        if let Some(plan) = crate::speculative::drafter(self, opts.mtp, opts.lookup)? {
            use crate::speculative::Drafter;
            let how = (plan.depth, plan.source);
            match (plan.drafter, state) {
                (Drafter::Cpu(m), AnyState::Qwen4(st)) => {
                    self.complete_mtp(m, how, st, prompt, sampler, opts, on_event, &mut g, None)?
                }
                (Drafter::Gpu(m), AnyState::Qwen4Gpu(st)) => {
                    self.complete_mtp(m, how, st, prompt, sampler, opts, on_event, &mut g, None)?
                }
                _ => return Err(RunError::Forward(crate::model::ForwardError::StateMismatch)),
            }
            return Ok(g);
        }
        let chunk = match opts.prefill_chunk {
            0 => prompt.len(),
            c => c,
        };
        let mut logits = Vec::new();
        for (i, part) in prompt.chunks(chunk).enumerate() {
            if i > 0 && cancelled() {
                return Ok(g);
            }
            logits = model.forward_last(part, state)?;
            if chunk < prompt.len() {
                on_event(Event::Prefill {
                    done: (i * chunk + part.len()),
                    total: prompt.len(),
                });
            }
        }
        for &id in prompt {
            sampler.accept(id);
        }
        if opts.keep_prompt_state {
            g.prompt_state = Some(state.clone());
        }
        let mut next = sampler.sample(&logits);
        g.prompt_seconds = t0.elapsed().as_secs_f64();

        let t1 = Instant::now();
        let mut dec = Decoder::new(self, opts);
        while let Some(token) = dec.push(next, sampler, on_event) {
            integrity.check()?;
            let logits = model.forward(&[token], state)?;
            next = sampler.sample(&logits);
        }
        let d = dec.end(on_event);
        // A corrupt tensor found while the last tokens were made taints them too.
        integrity.check()?;
        g.finish_with(d, t1);
        Ok(g)
    }
}

impl Generation {
    /// Takes what the generation loop ended with, and its time since `t1`.
    pub(crate) fn finish_with(&mut self, d: Decoded, t1: Instant) {
        self.tokens = d.tokens;
        self.text = d.text;
        self.finish = d.finish;
        self.stop_string = d.stop_string;
        self.gen_seconds = t1.elapsed().as_secs_f64();
    }
}

/// How a [`Decoder`] ended.
#[derive(Debug, Clone)]
pub struct Decoded {
    /// The generated ids (the EOS that ended it included).
    pub tokens: Vec<u32>,
    /// The generated text (a stop string and what followed it removed).
    pub text: String,
    /// Why it ended.
    pub finish: Finish,
    /// The stop string that ended it.
    pub stop_string: Option<String>,
}

/// The body of the generation loop for one sequence, one sampled token at a time: it records
/// the token, releases the text that can no longer become a stop string, and decides whether
/// the sequence goes on. [`Runner::complete`] drives one; a server steps several, their
/// forwards batched.
pub struct Decoder<'r> {
    runner: &'r Runner,
    stop: Vec<String>,
    hold: usize,
    max_new: usize,
    ignore_eos: bool,
    cancel: Option<CancelToken>,
    stream: TextStream<'r>,
    shown: usize,
    tokens: Vec<u32>,
    text: String,
    stop_string: Option<String>,
    finish: Option<Finish>,
}

impl<'r> Decoder<'r> {
    /// A generation as `opts` allows (`max_new`, `stop`, `cancel`).
    pub fn new(runner: &'r Runner, opts: &GenerateOptions) -> Decoder<'r> {
        let stop: Vec<String> = opts
            .stop
            .iter()
            .filter(|s| !s.is_empty())
            .cloned()
            .collect();
        // Hold back what could still become a stop string.
        let hold = stop
            .iter()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .saturating_sub(1);
        Decoder {
            runner,
            stop,
            hold,
            max_new: opts.max_new,
            ignore_eos: opts.ignore_eos,
            cancel: opts.cancel.clone(),
            stream: TextStream::new(&runner.tokenizer),
            shown: 0,
            tokens: Vec::new(),
            text: String::new(),
            stop_string: None,
            finish: None,
        }
    }

    /// Tokens the reply may still take.
    pub fn room(&self) -> usize {
        self.max_new.saturating_sub(self.tokens.len())
    }

    /// Takes `next`, the token sampled from the last logits: reports it and any text it
    /// completes; returns the token to feed for the next logits, or `None` when the
    /// generation ended (EOS, a stop string, the limit, a cancellation).
    pub fn push(
        &mut self,
        next: u32,
        sampler: &mut Sampler,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Option<u32> {
        if self.finish.is_some() {
            return None;
        }
        let finish = self.step(next, sampler, on_event);
        self.finish = finish;
        finish.is_none().then_some(next)
    }

    fn step(
        &mut self,
        next: u32,
        sampler: &mut Sampler,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Option<Finish> {
        if self.tokens.len() >= self.max_new {
            return Some(Finish::Length);
        }
        self.tokens.push(next);
        sampler.accept(next);
        on_event(Event::Token(next));
        if !self.ignore_eos && self.runner.eos.contains(&next) {
            return Some(Finish::Eos);
        }
        if let Some(piece) = self.stream.push(next) {
            self.text.push_str(&piece);
            // The earliest stop string (the first listed among equals) ends the text.
            let found = self
                .stop
                .iter()
                .filter_map(|s| self.text.find(s.as_str()).map(|i| (i, s)))
                .min_by_key(|&(i, _)| i);
            let cut = found.map(|(i, _)| i);
            if let Some((i, s)) = found {
                self.stop_string = Some(s.clone());
                self.text.truncate(i);
            }
            let mut safe = if cut.is_some() {
                self.text.len()
            } else {
                self.text.len().saturating_sub(self.hold)
            };
            while !self.text.is_char_boundary(safe) {
                safe -= 1;
            }
            if safe > self.shown {
                on_event(Event::Text(&self.text[self.shown..safe]));
                self.shown = safe;
            }
            if cut.is_some() {
                return Some(Finish::Stop);
            }
        }
        if self.tokens.len() == self.max_new {
            return Some(Finish::Length);
        }
        if self.cancel.as_ref().is_some_and(CancelToken::is_cancelled) {
            return Some(Finish::Cancelled);
        }
        None
    }

    /// Ends the generation (as it stands: one not finished counts as cancelled), releasing
    /// the text held back.
    pub fn end(self, on_event: &mut dyn FnMut(Event<'_>)) -> Decoded {
        if self.shown < self.text.len() {
            on_event(Event::Text(&self.text[self.shown..]));
        }
        Decoded {
            tokens: self.tokens,
            text: self.text,
            finish: self.finish.unwrap_or(Finish::Cancelled),
            stop_string: self.stop_string,
        }
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> &[u32] {
        &self.tokens
    }
}

/// Turns a growing list of token ids into text pieces to print: a piece is released only when
/// the decoded text does not end inside a UTF-8 sequence (byte-level tokens can split one).
pub struct TextStream<'t> {
    tokenizer: &'t tokenizers::Tokenizer,
    ids: Vec<u32>,
    printed: usize,
}

impl<'t> TextStream<'t> {
    /// An empty stream.
    pub fn new(tokenizer: &'t tokenizers::Tokenizer) -> Self {
        TextStream {
            tokenizer,
            ids: Vec::new(),
            printed: 0,
        }
    }

    /// Adds a token; returns the new text that is complete, if any.
    pub fn push(&mut self, id: u32) -> Option<String> {
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids, true).ok()?;
        if text.ends_with('\u{FFFD}')
            || text.len() <= self.printed
            || !text.is_char_boundary(self.printed)
        {
            return None;
        }
        let piece = text[self.printed..].to_string();
        self.printed = text.len();
        Some(piece)
    }
}
