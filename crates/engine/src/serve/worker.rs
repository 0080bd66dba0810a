//! The thread that owns the model and schedules the requests on it: up to `parallel`
//! sequences are active at once, and every step feeds all of them together in one batched
//! forward ([`crate::model::AnyModel::forward_batch`]): a decoding sequence its next token, a
//! new one the next chunk of its prompt. Further requests queue in arrival order. Each
//! sequence's tokens go through the one generation loop's body ([`Decoder`]), its text sent
//! back as it is released. A request whose client went away (its event channel closed, its
//! cancel token set) ends before the next step and frees its slot.
//!
//! Prompts start from the [`PromptCache`] where an earlier prompt or reply is a prefix of
//! theirs; the states after each prompt and at the end of each reply go back into it.

use std::sync::mpsc::{self, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use super::api::{Input, Request};
use super::cache::PromptCache;
use crate::chat::{Chat, ChatError};
use crate::generate::{CancelToken, Decoder, Event as GenEvent, Finish, GenerateOptions};
use crate::model::{AnyModel, AnyState};
use crate::run::{RunError, Runner};
use crate::sampling::Sampler;
use crate::speculative::{AnySession, MtpMode, Plan, Stepped};

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
        /// How the model writes tool calls.
        tool_format: super::parse::ToolFormat,
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
    /// Prompt tokens taken from the prompt cache instead of prefilled.
    pub cached_tokens: usize,
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

/// How the model thread schedules.
#[derive(Debug, Clone, Copy)]
pub struct WorkerOptions {
    /// Tokens a sequence may hold, prompt plus reply.
    pub ctx: usize,
    /// Sequences decoded together (at least 1).
    pub parallel: usize,
    /// Prompt tokens a sequence feeds per step while others decode (a long prompt is
    /// prefilled in chunks so it does not stall them).
    pub prefill_chunk: usize,
    /// Bytes of sequence states the prompt cache may keep (0: off).
    pub cache_bytes: u64,
    /// Drafting with the MTP head for a sequence that decodes alone.
    pub mtp: MtpMode,
    /// Drafting by prompt lookup instead, up to this many tokens a step (0: off).
    pub lookup: usize,
}

impl WorkerOptions {
    /// Context `ctx`, 4 sequences, 512-token prefill chunks, a 2 GiB prompt cache.
    pub fn new(ctx: usize) -> WorkerOptions {
        WorkerOptions {
            ctx,
            parallel: 4,
            prefill_chunk: 512,
            cache_bytes: 2 << 30,
            mtp: MtpMode::Off,
            lookup: 0,
        }
    }
}

/// What the model thread is doing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    /// Sequences being generated.
    pub active: usize,
    /// Requests waiting for a slot.
    pub queued: usize,
    /// Sequences ended so far because they were cancelled (a client gone, a shutdown).
    pub cancelled: u64,
    /// Sequences ended so far in any way.
    pub ended: u64,
    /// Drafts checked so far (`--mtp`, `--lookup`).
    pub drafted: u64,
    /// Drafts kept so far.
    pub drafts_kept: u64,
}

/// The handle requests are submitted through (cheap to clone).
#[derive(Clone)]
pub struct Worker {
    tx: mpsc::Sender<Job>,
    load: Arc<Mutex<Load>>,
}

impl Worker {
    /// Starts the model thread.
    pub fn spawn(runner: Runner, opts: WorkerOptions) -> std::io::Result<Worker> {
        let (tx, rx) = mpsc::channel::<Job>();
        let load = Arc::new(Mutex::new(Load::default()));
        let shared = load.clone();
        std::thread::Builder::new()
            .name("cortiq-model".into())
            .spawn(move || Scheduler::new(&runner, opts, shared).run(&rx))?;
        Ok(Worker { tx, load })
    }

    /// Queues `job`; `false` when the model thread is gone.
    pub fn submit(&self, job: Job) -> bool {
        // Counted before it is sent: the model thread may take it at once.
        lock(&self.load).queued += 1;
        let sent = self.tx.send(job).is_ok();
        if !sent {
            lock(&self.load).queued -= 1;
        }
        sent
    }

    /// What the model thread is doing now.
    pub fn load(&self) -> Load {
        *lock(&self.load)
    }
}

fn lock(load: &Mutex<Load>) -> std::sync::MutexGuard<'_, Load> {
    load.lock().unwrap_or_else(|p| p.into_inner())
}

/// An active sequence.
struct Slot<'r> {
    events: UnboundedSender<Event>,
    cancel: CancelToken,
    state: AnyState,
    sampler: Sampler,
    decoder: Decoder<'r>,
    /// The prompt's ids.
    prompt: Vec<u32>,
    /// The ids the state holds (prompt ids fed so far, then fed reply tokens).
    held: Vec<u32>,
    /// Prompt ids reused from the cache.
    cached: usize,
    /// The token to feed next, once the prompt is in.
    next: Option<u32>,
    /// The logits after the whole prompt, when the cache had them (no forward needed).
    ready: Option<Vec<f32>>,
    /// Its drafting session while it decodes alone (dropped when another sequence joins:
    /// the batched forward returns no streams for the head).
    draft: Option<AnySession<'r>>,
    /// Drafts checked and kept, over its sessions.
    drafted: (usize, usize),
    t0: Instant,
}

impl Slot<'_> {
    /// The ids this step feeds: the next token, or up to `budget` more prompt ids (the budget
    /// is what they take of it).
    fn feed(&self, budget: &mut usize) -> Vec<u32> {
        match (self.next, &self.ready) {
            (Some(t), _) => vec![t],
            (None, Some(_)) => Vec::new(),
            (None, None) => {
                let done = self.held.len();
                let n = (self.prompt.len() - done).min(*budget);
                *budget -= n;
                self.prompt[done..done + n].to_vec()
            }
        }
    }
}

struct Scheduler<'r> {
    runner: &'r Runner,
    opts: WorkerOptions,
    cache: PromptCache,
    /// States of finished sequences, kept for reuse (a device state keeps its buffers and
    /// recorded frames).
    pool: Vec<AnyState>,
    load: Arc<Mutex<Load>>,
    /// How a sequence decoding alone drafts, where `--mtp` or `--lookup` asks and the model
    /// can.
    drafter: Option<Plan<'r>>,
}

impl<'r> Scheduler<'r> {
    fn new(runner: &'r Runner, opts: WorkerOptions, load: Arc<Mutex<Load>>) -> Scheduler<'r> {
        // The command line checks an explicit depth against the model before it starts.
        let drafter =
            crate::speculative::drafter(runner, opts.mtp, opts.lookup).unwrap_or_else(|e| {
                tracing::warn!("{e}: not drafting");
                None
            });
        Scheduler {
            runner,
            opts,
            cache: PromptCache::new(opts.cache_bytes),
            pool: Vec::new(),
            load,
            drafter,
        }
    }

    fn model(&self) -> &'r AnyModel<'r> {
        self.runner.model.model()
    }

    fn run(&mut self, rx: &mpsc::Receiver<Job>) {
        let mut slots: Vec<Slot<'r>> = Vec::new();
        let mut open = true;
        while open || !slots.is_empty() {
            // Wait for work when idle; take what is queued while slots are free.
            if slots.is_empty() {
                match rx.recv() {
                    Ok(job) => self.admit(job, &mut slots),
                    Err(_) => break,
                }
            }
            while slots.len() < self.opts.parallel.max(1) {
                match rx.try_recv() {
                    Ok(job) => self.admit(job, &mut slots),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            if !slots.is_empty() {
                // A panic in one step fails the sequences in it, not the server.
                let stepped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    self.step(&mut slots)
                }));
                if stepped.is_err() {
                    self.abort_all(&mut slots);
                }
            }
        }
    }

    /// Takes a request: checks and renders it, then makes it a slot (or answers it at once).
    fn admit(&mut self, job: Job, slots: &mut Vec<Slot<'r>>) {
        let events = job.events.clone();
        {
            let mut load = lock(&self.load);
            load.queued = load.queued.saturating_sub(1);
        }
        let prepared = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.prepare(job)));
        match prepared {
            Ok(Ok(Some(slot))) => {
                slots.push(slot);
                lock(&self.load).active += 1;
            }
            Ok(Ok(None)) => {}
            Ok(Err((status, message))) => {
                let _ = events.send(Event::Failed(status, message));
            }
            Err(_) => {
                let _ = events.send(Event::Failed(500, "internal error while preparing".into()));
            }
        }
    }

    fn prepare(&mut self, job: Job) -> Result<Option<Slot<'r>>, (u16, String)> {
        let Job {
            request,
            events,
            cancel,
        } = job;
        let runner = self.runner;
        let ctx = self.opts.ctx;
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
        let (prompt, mut stop, started) = match &request.input {
            Input::Chat(messages) => {
                let mut chat = Chat::new(runner, None, request.sampling).map_err(|e| match e {
                    ChatError::NoTemplate { .. } => (400, format!("{e}: use /v1/completions")),
                    e => (500, e.to_string()),
                })?;
                chat.messages = messages.clone();
                chat.tools = request.tools.clone();
                let rendered = chat.render().map_err(|e| (400, e.to_string()))?;
                let prompt = chat.prompt_ids().map_err(|e| (400, e.to_string()))?;
                let template = runner.model.cmf().header().chat_template.clone();
                let template = template.unwrap_or_default();
                let started = Event::Started {
                    reasoning: template.contains("</think>"),
                    in_think: super::parse::opens_reasoning(&rendered),
                    tool_format: super::parse::ToolFormat::of_template(&template),
                    prompt_tokens: prompt.len(),
                };
                (prompt, chat.stop, Some(started))
            }
            Input::Text(text) => (
                runner
                    .encode(text)
                    .map_err(|e| (status_of_run(&e), e.to_string()))?,
                Vec::new(),
                None,
            ),
        };
        if request.count_only {
            let _ = events.send(Event::Done(Outcome {
                finish: Finish::Length,
                stop_string: None,
                prompt_tokens: prompt.len(),
                cached_tokens: 0,
                completion_tokens: 0,
            }));
            return Ok(None);
        }
        if prompt.is_empty() {
            return Err((400, RunError::EmptyPrompt.to_string()));
        }
        // A tokenizer's added tokens can lie past the model's head: refused here, alone,
        // rather than failing the batch it would join.
        let vocab = self.model().vocab_size();
        if let Some(&id) = prompt.iter().find(|&&id| id as usize >= vocab) {
            return Err((
                400,
                format!("the prompt holds token id {id}, past the model's vocabulary of {vocab}"),
            ));
        }
        let max_new = limit(prompt.len())?;
        // The first event decides a stream's status: only a request that will run starts.
        if let Some(started) = started {
            let _ = events.send(started);
        }
        stop.extend(request.stop.iter().cloned());

        let model = self.model();
        let mut state = self.pool.pop().unwrap_or_else(|| model.new_state());
        let mut held = Vec::new();
        let mut ready = None;
        let restored = match self.cache.lookup(&prompt) {
            Some((n, snap, logits)) => {
                ready = logits.map(<[f32]>::to_vec);
                model.restore(&mut state, snap).map(|()| n)
            }
            None => Ok(0),
        };
        match restored {
            Ok(n) if n > 0 => held.extend_from_slice(&prompt[..n]),
            // A snapshot that does not restore is only a lost shortcut.
            _ => {
                ready = None;
                model.reset(&mut state);
            }
        }
        let cached = held.len();
        let mut sampler = Sampler::new(request.sampling);
        for &id in &held {
            sampler.accept(id);
        }
        let opts = GenerateOptions {
            max_new,
            stop,
            cancel: Some(cancel.clone()),
            ignore_eos: request.ignore_eos,
            ..GenerateOptions::default()
        };
        Ok(Some(Slot {
            events,
            cancel,
            state,
            sampler,
            decoder: Decoder::new(runner, &opts),
            prompt,
            held,
            cached,
            next: None,
            ready,
            draft: None,
            drafted: (0, 0),
            t0: Instant::now(),
        }))
    }

    /// One batched forward over every active sequence, then each one's token.
    fn step(&mut self, slots: &mut Vec<Slot<'r>>) {
        // Requests cancelled (or whose client left) end before the forward.
        let mut i = 0;
        while i < slots.len() {
            if slots[i].cancel.is_cancelled() || slots[i].events.is_closed() {
                let slot = slots.swap_remove(i);
                self.finish(slot, None);
            } else {
                i += 1;
            }
        }
        if slots.is_empty() {
            return;
        }
        if let Err(e) = self.runner.model.integrity().check() {
            self.fail_all(slots, &e.to_string());
            return;
        }
        // A sequence decoding alone drafts (when `--mtp` or `--lookup` asks): its token
        // and drafts go through the trunk in one check, with the streams the head reads.
        if let (Some(plan), [slot]) = (self.drafter, &mut slots[..])
            && let Some(token) = slot.next
        {
            if let Err(e) = self.draft_step(plan, slot, token) {
                self.fail_all(slots, &e.to_string());
            } else if slot.next.is_none() {
                let slot = slots.swap_remove(0);
                self.finish(slot, None);
            }
            return;
        }
        for slot in slots.iter_mut() {
            if let Some(d) = slot.draft.take() {
                let st = d.stats();
                slot.drafted.0 += st.drafted;
                slot.drafted.1 += st.accepted;
            }
        }
        // Prompts share one budget of ids per step, so a step (and every decoding sequence
        // waiting on it) stays short however many prompts arrive; a slot whose prompt the
        // cache answered whole has its logits already.
        let mut budget = self.opts.prefill_chunk.max(1);
        let feeds: Vec<Vec<u32>> = slots.iter().map(|s| s.feed(&mut budget)).collect();
        let mut seqs: Vec<(&[u32], &mut AnyState)> = feeds
            .iter()
            .map(Vec::as_slice)
            .zip(slots.iter_mut().map(|s| &mut s.state))
            .filter(|(f, _)| !f.is_empty())
            .collect();
        // (A panic here is caught around the whole step: `abort_all`.)
        let mut logits = match self.model().forward_batch(&mut seqs) {
            Ok(l) => l.into_iter(),
            Err(e) => {
                self.fail_all(slots, &e.to_string());
                return;
            }
        };
        let mut ended = Vec::new();
        for (i, (slot, fed)) in slots.iter_mut().zip(feeds).enumerate() {
            let logits = match (slot.ready.take(), fed.is_empty()) {
                (Some(l), _) => l,
                // Waiting for the prompt budget.
                (None, true) => continue,
                (None, false) => logits.next().expect("one logits row per fed sequence"),
            };
            slot.held.extend_from_slice(&fed);
            if slot.next.is_none() && slot.held.len() < slot.prompt.len() {
                continue;
            }
            if slot.next.is_none() {
                // The prompt is in: its state (and these logits) is what a later prompt may
                // extend or repeat.
                for &id in &slot.prompt[slot.cached..] {
                    slot.sampler.accept(id);
                }
                if !fed.is_empty()
                    && self.cache.takes(slot.state.bytes())
                    && let Ok(snap) = self.runner.model.model().snapshot(&slot.state)
                {
                    let l = Some(logits.clone());
                    self.cache.insert(slot.held.clone(), snap, l);
                }
            }
            let token = slot.sampler.sample(&logits);
            let mut on_event = text_sink(&slot.events, &slot.cancel);
            slot.next = slot.decoder.push(token, &mut slot.sampler, &mut on_event);
            if slot.next.is_none() {
                ended.push(i);
            }
        }
        for &i in ended.iter().rev() {
            let slot = slots.swap_remove(i);
            self.finish(slot, None);
        }
    }

    /// One drafting step of the only active sequence, decoding: feeds `token` and the drafts,
    /// pushes the kept drafts and the sampled token to its decoder.
    fn draft_step(
        &mut self,
        plan: Plan<'r>,
        slot: &mut Slot<'r>,
        token: u32,
    ) -> Result<(), RunError> {
        let drafter = plan.drafter;
        if slot.draft.is_none() {
            let how = (plan.depth, plan.source);
            slot.draft = Some(drafter.session(&slot.state, how, &slot.held)?);
        }
        let session = slot.draft.as_mut().expect("made above");
        let (pos, generated) = (slot.state.pos(), slot.decoder.generated().len());
        let mut on_event = text_sink(&slot.events, &slot.cancel);
        let stepped = drafter.step(
            session,
            &mut slot.state,
            token,
            &mut slot.sampler,
            &mut slot.decoder,
            &mut on_event,
        )?;
        // The rows the state kept: `token` (the decoder's last token before the step) and
        // the kept drafts after it.
        let kept = slot.state.pos() - pos;
        let fed = &slot.decoder.generated()[generated - 1..generated - 1 + kept];
        slot.held.extend_from_slice(fed);
        slot.next = match stepped {
            Stepped::Sampled(n) => slot.decoder.push(n, &mut slot.sampler, &mut on_event),
            Stepped::Ended => None,
        };
        Ok(())
    }

    /// Ends a sequence: its last text and outcome (or `failure`) go out, its state goes to the
    /// prompt cache, its buffers back to the pool.
    fn finish(&mut self, slot: Slot<'r>, failure: Option<(u16, String)>) {
        let Slot {
            events,
            cancel,
            state,
            decoder,
            prompt,
            held,
            cached,
            t0,
            draft,
            mut drafted,
            ..
        } = slot;
        if let Some(d) = draft {
            let st = d.stats();
            drafted.0 += st.drafted;
            drafted.1 += st.accepted;
        }
        // A corrupt tensor found while the last tokens were made taints them too.
        let failure = failure.or_else(|| {
            self.runner
                .model
                .integrity()
                .check()
                .err()
                .map(|e| (500, e.to_string()))
        });
        // A failed request gets its error, not the text held back before it.
        let d = match failure {
            None => decoder.end(&mut text_sink(&events, &cancel)),
            Some(_) => decoder.end(&mut |_| {}),
        };
        {
            let mut load = lock(&self.load);
            load.active = load.active.saturating_sub(1);
            load.ended += 1;
            load.cancelled += u64::from(failure.is_none() && d.finish == Finish::Cancelled);
            load.drafted += drafted.0 as u64;
            load.drafts_kept += drafted.1 as u64;
        }
        let failed = failure.is_some();
        let ev = match failure {
            Some((status, message)) => Event::Failed(status, message),
            None => Event::Done(Outcome {
                finish: d.finish,
                stop_string: d.stop_string,
                prompt_tokens: prompt.len(),
                cached_tokens: cached,
                completion_tokens: d.tokens.len(),
            }),
        };
        let _ = events.send(ev);
        tracing::debug!(
            prompt = prompt.len(),
            cached,
            generated = d.tokens.len(),
            drafted = drafted.0,
            kept = drafted.1,
            ms = t0.elapsed().as_millis() as u64,
            "sequence ended"
        );
        // A sequence that failed may have a state a forward left half-way: never kept. One
        // that fed nothing holds what the cache already has.
        let reusable = !failed && held.len() > cached && held.len() == state.pos();
        match state {
            AnyState::Qwen4Gpu(_) | AnyState::Dsv4Gpu(_) => {
                if reusable && self.cache.takes(state.bytes()) {
                    // A snapshot the device cannot make is only a lost shortcut.
                    if let Ok(snap) = self.model().snapshot(&state) {
                        self.cache.insert(held, snap, None);
                    }
                }
                self.pool.push(state);
            }
            state if reusable => self.cache.insert(held, state, None),
            _ => {}
        }
    }

    /// Ends every sequence with a 500 saying `message` (their states are not kept).
    fn fail_all(&mut self, slots: &mut Vec<Slot<'r>>, message: &str) {
        for slot in slots.drain(..) {
            self.finish(slot, Some((500, message.to_string())));
        }
    }

    /// Fails every sequence at once (the model thread caught a panic): their requests get a
    /// 500, their states are dropped.
    fn abort_all(&mut self, slots: &mut Vec<Slot<'r>>) {
        let mut load = lock(&self.load);
        for slot in slots.drain(..) {
            let _ = slot
                .events
                .send(Event::Failed(500, "internal error while generating".into()));
            load.active = load.active.saturating_sub(1);
            load.ended += 1;
        }
    }
}

/// Sends a sequence's released text to its request; a request whose receiver is gone is
/// cancelled.
fn text_sink<'a>(
    events: &'a UnboundedSender<Event>,
    cancel: &'a CancelToken,
) -> impl FnMut(GenEvent<'_>) + 'a {
    move |e| {
        if let GenEvent::Text(t) = e
            && !t.is_empty()
            && events.send(Event::Text(t.to_string())).is_err()
        {
            cancel.cancel();
        }
    }
}

fn status_of_run(e: &RunError) -> u16 {
    match e {
        RunError::EmptyPrompt | RunError::Tokenizer { .. } => 400,
        _ => 500,
    }
}
