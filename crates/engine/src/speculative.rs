//! Drafting: the model's MTP head (or prompt lookup, [`DraftSource`]) drafts up to N tokens
//! after the one just sampled, the trunk checks them in one multi-row forward, and every draft that equals what
//! the sampler draws from the trunk's own logits is kept, with the sampler's draw after the
//! last kept one. The sampler is the one the plain loop runs, drawing from the same logits in
//! the same order, so a generation is token for token the one without drafting, with any
//! sampling settings and seed (the drafts only decide how many of its logits one forward
//! computes). A draft is greedy (one token), so a kept draft is accepted with probability
//! `p(draft)`, as speculative sampling's rule accepts a one-token draft.
//!
//! Rows past the last kept draft are rolled back: the attention caches are cut back to the
//! position, the recurrent state (GDN, PLE conv, n-gram context) is restored from a snapshot
//! taken before the check, and the kept rows are fed again (a forward of the kept rows; the
//! next step needs nothing else from it). A [`Monitor`] picks the depth of each head step from
//! the acceptance and the time each depth costs, turning drafting off while it does not pay and
//! back on (by probing) when it would; prompt lookup drafts wherever its context repeats, while
//! its drafts are kept. One loop ([`DraftSession`] over the [`Speculate`] trait) serves the CPU
//! and the device forward.

use std::str::FromStr;
use std::time::Instant;

use model_qwen4::{
    CausalLm, ForwardError, GpuModel, GpuRecurrent, GpuState, Model, MtpDeviceState, MtpHead,
    MtpState, Recurrent, SeqState,
};

use crate::model::AnyState;

use crate::generate::{CancelToken, Decoder, Event, GenerateOptions, Generation};
use crate::run::{RunError, Runner};
use crate::sampling::{Sampler, argmax};

/// Tests' stand-in for the head's choice of a draft: `(tokens generated before the step,
/// draft index) -> token` (the head still runs and keeps its cache; only its pick is replaced),
/// so every acceptance pattern can be forced.
pub(crate) type Oracle<'a> = dyn Fn(usize, usize) -> u32 + 'a;

/// Most tokens one step drafts (the check then feeds the sampled token and these: 8 rows, a
/// device frame).
pub const MAX_DEPTH: usize = 7;

/// Head entries left waiting while the monitor does not draft before they are made anyway
/// (bounds the streams kept: `H*D` floats each).
const MAX_PENDING: usize = 64;

/// The depth `auto` drafts up to.
pub const AUTO_DEPTH: usize = 3;

/// `--mtp`: how far the MTP head drafts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MtpMode {
    /// No drafting.
    #[default]
    Off,
    /// Up to [`AUTO_DEPTH`] drafts where the model has a head and the backend runs it;
    /// otherwise none.
    Auto,
    /// Up to this many drafts a step (the monitor may draft fewer, or none).
    Depth(usize),
}

impl FromStr for MtpMode {
    type Err = String;

    fn from_str(s: &str) -> Result<MtpMode, String> {
        match s {
            "off" | "0" => Ok(MtpMode::Off),
            "auto" => Ok(MtpMode::Auto),
            n => match n.parse::<usize>() {
                Ok(d) if (1..=MAX_DEPTH).contains(&d) => Ok(MtpMode::Depth(d)),
                _ => Err(format!(
                    "--mtp takes off, auto or a draft depth 1..={MAX_DEPTH}, not {n:?}"
                )),
            },
        }
    }
}

/// Drafting statistics of one generation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DraftStats {
    /// Steps that checked drafts.
    pub checks: usize,
    /// Tokens drafted.
    pub drafted: usize,
    /// Drafts kept.
    pub accepted: usize,
    /// Per draft position (1-based index - 1): drafts checked there (those after a miss are
    /// not), and kept.
    pub by_position: [(usize, usize); MAX_DEPTH],
}

impl DraftStats {
    /// Tokens a checking step produced on average (kept drafts plus the sampled one).
    pub fn mean_accepted_length(&self) -> f64 {
        if self.checks == 0 {
            return 0.0;
        }
        1.0 + self.accepted as f64 / self.checks as f64
    }
}

/// Picks each step's depth: per draft position the rate at which a draft there is kept (given
/// the ones before it were), per depth the seconds a step takes, and the depth that maximises
/// expected tokens per second. Depths not measured yet are tried; a probe now and then
/// measures another depth (each in turn), so a turned-off drafter comes back when text gets
/// predictable; probes that change nothing grow rarer (every 16 steps to every 256).
#[derive(Debug, Clone)]
pub struct Monitor {
    max: usize,
    keep: [f64; MAX_DEPTH],
    secs: Vec<Option<f64>>,
    steps: usize,
    /// Steps between probes: doubled (up to 256) by a probe that does not change the best
    /// depth, back to 16 when one does.
    interval: usize,
    next_probe: usize,
    /// The best depth when the probe now running was chosen.
    probing: Option<usize>,
    turn: usize,
}

impl Monitor {
    /// Up to `max` drafts a step.
    pub fn new(max: usize) -> Monitor {
        let max = max.min(MAX_DEPTH);
        Monitor {
            max,
            keep: [0.5; MAX_DEPTH],
            secs: vec![None; max + 1],
            steps: 0,
            interval: 16,
            next_probe: 16,
            probing: None,
            turn: 0,
        }
    }

    /// The depth with the most expected tokens per second so far.
    fn best(&self) -> usize {
        let rate = |d: usize| self.tokens(d) / self.secs[d].unwrap_or(f64::INFINITY);
        (0..=self.max)
            .max_by(|&a, &b| rate(a).total_cmp(&rate(b)))
            .unwrap_or(0)
    }

    /// Expected tokens of a step drafting `d`.
    fn tokens(&self, d: usize) -> f64 {
        let mut p = 1.0;
        let mut e = 1.0;
        for k in &self.keep[..d] {
            p *= k;
            e += p;
        }
        e
    }

    /// The depth of the next step.
    pub fn depth(&mut self) -> usize {
        if let Some(d) = self.secs.iter().position(Option::is_none) {
            return d;
        }
        let best = self.best();
        // A probe re-measures another depth, each in turn, so one slow measurement cannot
        // rule a depth out for good; probes that change nothing grow rarer.
        if self.steps >= self.next_probe && self.max > 0 {
            let other = self.turn % self.max;
            self.turn += 1;
            self.probing = Some(best);
            return if other >= best { other + 1 } else { other };
        }
        best
    }

    /// What a step of depth `d` did: `kept` of its drafts kept, in `secs` seconds.
    pub fn record(&mut self, d: usize, kept: usize, secs: f64) {
        const A: f64 = 0.1;
        self.steps += 1;
        let s = &mut self.secs[d];
        *s = Some(s.map_or(secs, |old| old + A * (secs - old)));
        // Positions 1..=kept were kept; position kept+1 (if drafted) was not.
        for i in 0..d.min(kept + 1) {
            let hit = if i < kept { 1.0 } else { 0.0 };
            self.keep[i] += A * (hit - self.keep[i]);
        }
        if let Some(before) = self.probing.take() {
            self.interval = if self.best() == before {
                (self.interval * 2).min(256)
            } else {
                16
            };
            self.next_probe = self.steps + self.interval;
        }
    }
}

/// What drafting runs on: the CPU forward or the device-resident one, each with its head.
#[derive(Clone, Copy)]
pub enum Drafter<'m> {
    /// The CPU forward and head.
    Cpu(&'m Model<'m>),
    /// The device forward and head.
    Gpu(&'m GpuModel<'m>),
}

/// What a generation drafts with: the backend, the most drafts a step, where they come from.
#[derive(Clone, Copy)]
pub struct Plan<'m> {
    /// The backend.
    pub drafter: Drafter<'m>,
    /// Most drafts a step.
    pub depth: usize,
    /// Where the drafts come from.
    pub source: DraftSource,
}

/// Whether a generation on `runner`'s model drafts, for `--mtp` and `--lookup` (prompt
/// lookup, up to `lookup` drafts a step; 0: off): `Some` where it can (a qwen4_exp model on
/// either backend, with an MTP head for `--mtp`); `Ok(None)` for off, or `--mtp auto` where it
/// cannot; an error when drafting was asked of a model that cannot, or both at once.
pub fn drafter<'m>(
    runner: &'m Runner,
    mode: MtpMode,
    lookup: usize,
) -> Result<Option<Plan<'m>>, RunError> {
    let (depth, source) = match (mode, lookup) {
        (MtpMode::Off, 0) => return Ok(None),
        (MtpMode::Off, n) if n <= MAX_DEPTH => (n, DraftSource::Lookup),
        (MtpMode::Off, n) => {
            return Err(RunError::Mtp(format!(
                "--lookup takes a draft depth 0..={MAX_DEPTH}, not {n}"
            )));
        }
        (_, n) if n > 0 => {
            return Err(RunError::Mtp(
                "--mtp and --lookup both draft: choose one".to_string(),
            ));
        }
        (MtpMode::Auto, _) => (AUTO_DEPTH, DraftSource::Head),
        (MtpMode::Depth(d), _) => (d, DraftSource::Head),
    };
    let head = source == DraftSource::Head;
    let why = match runner.model.model() {
        crate::model::AnyModel::Qwen4(m) if !head || m.mtp().is_some() => {
            let drafter = Drafter::Cpu(m);
            return Ok(Some(Plan {
                drafter,
                depth,
                source,
            }));
        }
        crate::model::AnyModel::Qwen4Gpu(g) if !head || g.model.mtp().is_some() => {
            let drafter = Drafter::Gpu(g);
            return Ok(Some(Plan {
                drafter,
                depth,
                source,
            }));
        }
        crate::model::AnyModel::Qwen4(_) | crate::model::AnyModel::Qwen4Gpu(_) => {
            "the model file has no MTP head (mtp.* tensors)"
        }
        crate::model::AnyModel::Dsv4(_)
        | crate::model::AnyModel::Dsv41(_)
        | crate::model::AnyModel::Dsv4Gpu(_)
        | crate::model::AnyModel::Dsv41Gpu(_) => "drafting is built for qwen4_exp models only",
    };
    match mode {
        MtpMode::Auto => {
            tracing::debug!("--mtp auto: not drafting: {why}");
            Ok(None)
        }
        _ => Err(RunError::Mtp(why.to_string())),
    }
}

/// What the drafting loop needs of a backend: the trunk's forward with every row's final
/// streams, the head (its cache, and a greedy draft), and the rollback of the trunk's
/// recurrent state. The CPU and the device forward implement it alike, so one loop (and one
/// set of exactness tests) serves both.
pub(crate) trait Speculate {
    /// A sequence.
    type State;
    /// The head's cache.
    type Head;
    /// What a rollback restores.
    type Snap;
    /// Floats of one row's streams (`H*D`).
    fn streams_width(&self) -> usize;
    /// The vocabulary.
    fn vocab(&self) -> usize;
    /// Tokens `st` holds.
    fn pos(&self, st: &Self::State) -> usize;
    /// Feeds `tokens`: the logits of every row (the last when `last_only`) and every row's
    /// streams.
    fn trunk(
        &self,
        tokens: &[u32],
        st: &mut Self::State,
        last_only: bool,
    ) -> Result<(Vec<f32>, Vec<f32>), ForwardError>;
    /// Feeds `tokens`: the logits of every row (the last when `last_only`), no streams.
    fn plain(
        &self,
        tokens: &[u32],
        st: &mut Self::State,
        last_only: bool,
    ) -> Result<Vec<f32>, ForwardError>;
    /// An empty head cache.
    fn new_head(&self) -> Result<Self::Head, ForwardError>;
    /// The head over rows (streams `hs`, the token after each): its output streams, and
    /// when `draft` the last row's greedy token.
    fn head(
        &self,
        hs: &[f32],
        tokens: &[u32],
        ms: &mut Self::Head,
        draft: bool,
    ) -> Result<(Vec<f32>, Option<u32>), ForwardError>;
    /// Cuts the head's cache to `n` entries.
    fn cut_head(&self, ms: &mut Self::Head, n: usize);
    /// Saves what a rollback to the current position needs into `snap`.
    fn save(&self, st: &Self::State, snap: &mut Option<Self::Snap>) -> Result<(), ForwardError>;
    /// Returns `st` to the position `snap` was saved at.
    fn rollback(&self, st: &mut Self::State, snap: &Self::Snap) -> Result<(), ForwardError>;
    /// A copy of `st` to hand back as the prompt's state.
    fn keep(&self, st: &Self::State) -> Result<AnyState, ForwardError>;
}

impl Speculate for Model<'_> {
    type State = SeqState;
    type Head = MtpState;
    type Snap = Recurrent;

    fn streams_width(&self) -> usize {
        self.config.hc_count * self.config.hidden_size
    }

    fn vocab(&self) -> usize {
        self.config.vocab_size
    }

    fn pos(&self, st: &SeqState) -> usize {
        st.pos
    }

    fn trunk(
        &self,
        tokens: &[u32],
        st: &mut SeqState,
        last_only: bool,
    ) -> Result<(Vec<f32>, Vec<f32>), ForwardError> {
        self.forward_streams(tokens, st, last_only)
    }

    fn plain(
        &self,
        tokens: &[u32],
        st: &mut SeqState,
        last_only: bool,
    ) -> Result<Vec<f32>, ForwardError> {
        if last_only {
            self.forward_last(tokens, st)
        } else {
            self.forward(tokens, st)
        }
    }

    fn new_head(&self) -> Result<MtpState, ForwardError> {
        Ok(MtpState::default())
    }

    fn head(
        &self,
        hs: &[f32],
        tokens: &[u32],
        ms: &mut MtpState,
        draft: bool,
    ) -> Result<(Vec<f32>, Option<u32>), ForwardError> {
        let out = self.mtp_forward(hs, tokens, ms, draft)?;
        Ok((out.streams, draft.then(|| argmax(&out.logits))))
    }

    fn cut_head(&self, ms: &mut MtpState, n: usize) {
        ms.truncate(self, n);
    }

    fn save(&self, st: &SeqState, snap: &mut Option<Recurrent>) -> Result<(), ForwardError> {
        *snap = Some(st.recurrent());
        Ok(())
    }

    fn rollback(&self, st: &mut SeqState, snap: &Recurrent) -> Result<(), ForwardError> {
        st.rollback(&self.config, snap);
        Ok(())
    }

    fn keep(&self, st: &SeqState) -> Result<AnyState, ForwardError> {
        Ok(AnyState::Qwen4(st.clone()))
    }
}

impl Speculate for GpuModel<'_> {
    type State = GpuState;
    type Head = MtpDeviceState;
    type Snap = GpuRecurrent;

    fn streams_width(&self) -> usize {
        self.model.config.hc_count * self.model.config.hidden_size
    }

    fn vocab(&self) -> usize {
        self.model.config.vocab_size
    }

    fn pos(&self, st: &GpuState) -> usize {
        st.pos
    }

    fn trunk(
        &self,
        tokens: &[u32],
        st: &mut GpuState,
        last_only: bool,
    ) -> Result<(Vec<f32>, Vec<f32>), ForwardError> {
        self.forward_streams(tokens, st, last_only)
    }

    fn plain(
        &self,
        tokens: &[u32],
        st: &mut GpuState,
        last_only: bool,
    ) -> Result<Vec<f32>, ForwardError> {
        if last_only {
            self.forward_last(tokens, st)
        } else {
            self.forward(tokens, st)
        }
    }

    fn new_head(&self) -> Result<MtpDeviceState, ForwardError> {
        self.new_mtp_state()
    }

    fn head(
        &self,
        hs: &[f32],
        tokens: &[u32],
        ms: &mut MtpDeviceState,
        draft: bool,
    ) -> Result<(Vec<f32>, Option<u32>), ForwardError> {
        let head = if draft {
            MtpHead::Argmax
        } else {
            MtpHead::None
        };
        let out = self.mtp_forward(hs, tokens, ms, head)?;
        Ok((out.streams, out.token))
    }

    fn cut_head(&self, ms: &mut MtpDeviceState, n: usize) {
        ms.truncate(n);
    }

    fn save(&self, st: &GpuState, snap: &mut Option<GpuRecurrent>) -> Result<(), ForwardError> {
        st.save_recurrent(snap)
    }

    fn rollback(&self, st: &mut GpuState, snap: &GpuRecurrent) -> Result<(), ForwardError> {
        st.rollback(snap)
    }

    fn keep(&self, st: &GpuState) -> Result<AnyState, ForwardError> {
        Ok(AnyState::Qwen4Gpu(Box::new(st.try_clone()?)))
    }
}

/// How a drafting step ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stepped {
    /// The sampler's draw after the last row kept, not pushed yet (the plain loop's `next`).
    Sampled(u32),
    /// A kept draft ended the reply (pushed, never fed).
    Ended,
}

/// Where a session's drafts come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftSource {
    /// The model's MTP head.
    Head,
    /// Prompt lookup: the tokens that followed the last place the context's last 2..=4
    /// tokens occurred before (no model work; pays on text that repeats its context: code,
    /// edits, quotes).
    Lookup,
}

/// The longest and shortest n-gram prompt lookup matches on.
const LOOKUP_NGRAM: (usize, usize) = (4, 2);

/// The running rate of kept first drafts under which prompt lookup mostly stops drafting.
const LOOKUP_MIN_KEEP: f64 = 0.5;

/// Below [`LOOKUP_MIN_KEEP`], one match in this many is still checked.
const LOOKUP_PROBE: usize = 8;

/// Up to `max` drafts by prompt lookup: the tokens after the most recent earlier occurrence of
/// `history`'s last n tokens (the longest n in [`LOOKUP_NGRAM`] that occurs).
pub fn lookup_drafts(history: &[u32], max: usize) -> Vec<u32> {
    let (longest, shortest) = LOOKUP_NGRAM;
    for n in (shortest..=longest.min(history.len().saturating_sub(1))).rev() {
        let tail = &history[history.len() - n..];
        // The most recent occurrence that ends before the tail starts to repeat it.
        let found = (0..history.len() - n)
            .rev()
            .find(|&j| &history[j..j + n] == tail);
        if let Some(j) = found {
            let from = j + n;
            return history[from..(from + max).min(history.len())].to_vec();
        }
    }
    Vec::new()
}

/// What a session proposes drafts from.
enum Proposer<H> {
    /// The MTP head: its cache (an entry per trunk position from `base`, where the session
    /// began: positions before have no streams, so the head attends to what it sees from
    /// there, its positions counted from there), the entries not made yet (trunk streams
    /// `[n, H*D]` and the token after each), and the trunk's streams at the last position fed
    /// (`None` before the first forward, or while its entry is made).
    Head {
        ms: H,
        base: usize,
        pending_hs: Vec<f32>,
        pending: Vec<u32>,
        hs_last: Option<Vec<f32>>,
    },
    /// Prompt lookup over the tokens the session has seen, with the running rate at which its
    /// first draft is kept and the matches passed over since the last check.
    Lookup {
        history: Vec<u32>,
        keep1: f64,
        passed: usize,
    },
}

/// One sequence's drafting: where its drafts come from, the monitor and the statistics.
/// [`Runner::complete_mtp`] runs one over a whole generation; the server runs one while a
/// sequence decodes alone.
pub(crate) struct DraftSession<B: Speculate> {
    proposer: Proposer<B::Head>,
    snap: Option<B::Snap>,
    monitor: Monitor,
    /// What it has drafted so far.
    pub stats: DraftStats,
}

/// How a check of drafted rows ended.
struct Checked {
    /// Drafts kept.
    kept: usize,
    /// A kept draft ended the reply.
    ended: bool,
    /// The sampler's draw after the last kept row.
    next: u32,
    /// The rows' trunk streams (when asked for).
    streams: Vec<f32>,
}

impl<B: Speculate> DraftSession<B> {
    /// A session for `st` from its current position, drafting up to `max_depth` from
    /// `source`; `context` is what `st` holds, where known (prompt lookup searches it).
    pub fn new(
        m: &B,
        st: &B::State,
        max_depth: usize,
        source: DraftSource,
        context: &[u32],
    ) -> Result<Self, ForwardError> {
        let proposer = match source {
            DraftSource::Head => Proposer::Head {
                ms: m.new_head()?,
                base: m.pos(st),
                pending_hs: Vec::new(),
                pending: Vec::new(),
                hs_last: None,
            },
            DraftSource::Lookup => Proposer::Lookup {
                history: context.to_vec(),
                keep1: LOOKUP_MIN_KEEP + 0.1,
                passed: 0,
            },
        };
        Ok(DraftSession {
            proposer,
            snap: None,
            monitor: Monitor::new(max_depth),
            stats: DraftStats::default(),
        })
    }

    /// Feeds prompt ids `part` through the trunk and returns the last row's logits; `after`
    /// are the ids known to follow its rows (the rest of the prompt, possibly empty), whose
    /// head entries are made at once; the entry of a last row without a known successor waits
    /// for the next step.
    pub fn prefill(
        &mut self,
        m: &B,
        st: &mut B::State,
        part: &[u32],
        after: &[u32],
    ) -> Result<Vec<f32>, ForwardError> {
        let hd = m.streams_width();
        let Proposer::Head {
            ms,
            pending_hs,
            pending,
            hs_last,
            ..
        } = &mut self.proposer
        else {
            let Proposer::Lookup { history, .. } = &mut self.proposer else {
                unreachable!()
            };
            history.extend_from_slice(part);
            return m.plain(part, st, true);
        };
        // The row before this part, when its entry waits, now has its successor.
        if let Some(hs) = hs_last.take() {
            pending_hs.extend_from_slice(&hs);
            pending.push(part[0]);
        }
        if !pending.is_empty() {
            m.head(pending_hs, pending, ms, false)?;
            (*pending_hs, *pending) = (Vec::new(), Vec::new());
        }
        let (logits, streams) = m.trunk(part, st, true)?;
        let pairs = after.len().min(part.len());
        if pairs > 0 {
            m.head(&streams[..pairs * hd], &after[..pairs], ms, false)?;
        }
        // The last row's entry waits for its successor when it is not known yet.
        if pairs < part.len() {
            *hs_last = Some(streams[(part.len() - 1) * hd..].to_vec());
        }
        Ok(logits)
    }

    /// One step: feeds `token` (the one the decoder just took), with as many drafts after it
    /// as the monitor picks and the source has (at most what is left of the reply, `dec`'s
    /// room), and keeps the drafts the sampler draws itself from the trunk's logits (each
    /// pushed to `dec`). Rows past the last kept one are rolled back.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        m: &B,
        st: &mut B::State,
        token: u32,
        sampler: &mut Sampler,
        dec: &mut Decoder<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
        oracle: Option<&Oracle<'_>>,
    ) -> Result<Stepped, ForwardError> {
        let step = Instant::now();
        match &mut self.proposer {
            Proposer::Lookup {
                history,
                keep1,
                passed,
            } => {
                history.push(token);
                // A match is itself the evidence a lookup draft needs (the text is repeating
                // its context): the whole depth is drafted wherever one is found, while first
                // drafts are kept at least half the time (a check that keeps nothing costs
                // more than a plain step); below that, one draft of one match in 8 is still
                // checked, to notice when the text starts repeating.
                let mut drafts = lookup_drafts(history, self.monitor.max.min(dec.room()));
                if !drafts.is_empty() && *keep1 < LOOKUP_MIN_KEEP {
                    *passed += 1;
                    // A probe checks one draft: a miss costs a 2-row check.
                    drafts.truncate(if *passed < LOOKUP_PROBE { 0 } else { 1 });
                }
                let mut rows = vec![token];
                rows.extend(drafts.iter().enumerate().map(|(i, &t)| match oracle {
                    Some(o) => o(dec.generated().len(), i),
                    None => t,
                }));
                if rows.len() == 1 {
                    let next = sampler.sample(&m.plain(&rows, st, true)?);
                    self.monitor.record(0, 0, step.elapsed().as_secs_f64());
                    return Ok(Stepped::Sampled(next));
                }
                let c = self.check(m, st, &rows, false, sampler, dec, on_event)?;
                let Proposer::Lookup {
                    history,
                    keep1,
                    passed,
                } = &mut self.proposer
                else {
                    unreachable!()
                };
                history.extend_from_slice(&rows[1..=c.kept]);
                *keep1 = 0.8 * *keep1 + 0.2 * f64::from(u8::from(c.kept > 0));
                *passed = 0;
                let depth = rows.len() - 1;
                self.monitor
                    .record(depth, c.kept, step.elapsed().as_secs_f64());
                Ok(if c.ended {
                    Stepped::Ended
                } else {
                    Stepped::Sampled(c.next)
                })
            }
            Proposer::Head { .. } => {
                let cap = self.monitor.depth().min(dec.room());
                self.head_step(m, st, token, cap, sampler, dec, on_event, oracle)
            }
        }
    }

    /// [`DraftSession::step`] with the MTP head.
    #[allow(clippy::too_many_arguments)]
    fn head_step(
        &mut self,
        m: &B,
        st: &mut B::State,
        token: u32,
        cap: usize,
        sampler: &mut Sampler,
        dec: &mut Decoder<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
        oracle: Option<&Oracle<'_>>,
    ) -> Result<Stepped, ForwardError> {
        let hd = m.streams_width();
        let step = Instant::now();
        let Proposer::Head {
            ms,
            pending_hs,
            pending,
            hs_last,
            ..
        } = &mut self.proposer
        else {
            unreachable!("called for the head")
        };
        // Nothing is drafted before the trunk's streams are known (a session's first step).
        let depth = if hs_last.is_some() { cap } else { 0 };
        // `token` goes in at position `at`. The head's entry at `at - 1` is the trunk's
        // streams there and `token`. Entries wait while the monitor does not draft (the
        // head's cache must stay whole, but a step that does not draft need not pay for
        // them): the next drafting step makes them all in one multi-row call, then each
        // draft's entry, from the head's own output and the draft.
        let at = m.pos(st);
        let mut rows = vec![token];
        if let Some(hs) = hs_last.take() {
            pending_hs.extend_from_slice(&hs);
            pending.push(token);
        }
        if depth == 0 {
            if pending.len() >= MAX_PENDING {
                m.head(pending_hs, pending, ms, false)?;
                (*pending_hs, *pending) = (Vec::new(), Vec::new());
            }
            let (l, streams) = m.trunk(&rows, st, true)?;
            let next = sampler.sample(&l);
            *hs_last = Some(streams);
            self.monitor.record(0, 0, step.elapsed().as_secs_f64());
            return Ok(Stepped::Sampled(next));
        }
        let (first, mut draft) = m.head(pending_hs, pending, ms, true)?;
        // The waiting entries belong to the steps that did not draft: not this step's cost.
        let step = Instant::now();
        (*pending_hs, *pending) = (Vec::new(), Vec::new());
        let mut x = first[first.len() - hd..].to_vec();
        for i in 0..depth {
            let tok = match oracle {
                Some(o) => o(dec.generated().len(), i),
                None => draft.expect("the head drafts when asked"),
            };
            rows.push(tok);
            if i + 1 < depth {
                (x, draft) = m.head(&x, &[tok], ms, true)?;
            }
        }
        let c = self.check(m, st, &rows, true, sampler, dec, on_event)?;
        let Proposer::Head {
            ms,
            base,
            pending_hs,
            pending,
            hs_last,
        } = &mut self.proposer
        else {
            unreachable!("called for the head")
        };
        // The head's entries for the kept rows (the trunk's streams with the token after
        // each) replace the drafts' own.
        m.cut_head(ms, at - *base);
        if c.ended {
            return Ok(Stepped::Ended);
        }
        let kept = c.kept;
        pending_hs.extend_from_slice(&c.streams[..kept * hd]);
        pending.extend_from_slice(&rows[1..=kept]);
        *hs_last = Some(c.streams[kept * hd..(kept + 1) * hd].to_vec());
        self.monitor
            .record(depth, kept, step.elapsed().as_secs_f64());
        Ok(Stepped::Sampled(c.next))
    }

    /// Feeds `rows` (a token and its drafts) in one forward, keeps the drafts the sampler
    /// draws itself (pushing each to `dec`), and rolls back the rows past the last kept one
    /// (the recurrent state restored from a save made before the rows, the kept rows fed
    /// again). `streams`: the trunk's streams of the rows are wanted.
    #[allow(clippy::too_many_arguments)]
    fn check(
        &mut self,
        m: &B,
        st: &mut B::State,
        rows: &[u32],
        streams: bool,
        sampler: &mut Sampler,
        dec: &mut Decoder<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<Checked, ForwardError> {
        let depth = rows.len() - 1;
        m.save(st, &mut self.snap)?;
        let (l, hs) = if streams {
            m.trunk(rows, st, false)?
        } else {
            (m.plain(rows, st, false)?, Vec::new())
        };
        let v = m.vocab();
        let mut kept = 0;
        let mut ended = false;
        let mut next;
        loop {
            next = sampler.sample(&l[kept * v..(kept + 1) * v]);
            if kept < depth && next == rows[kept + 1] {
                kept += 1;
                if dec.push(next, sampler, on_event).is_none() {
                    ended = true;
                    break;
                }
                continue;
            }
            break;
        }
        let stats = &mut self.stats;
        stats.checks += 1;
        stats.drafted += depth;
        stats.accepted += kept;
        for (i, p) in stats.by_position.iter_mut().take(depth).enumerate() {
            if i <= kept {
                p.0 += 1;
                p.1 += usize::from(i < kept);
            }
        }
        // Rows fed that the sequence keeps: the sampled token and the kept drafts; when the
        // reply ended on a kept draft, that one is its last token, never fed.
        let keep_rows = if ended { kept } else { kept + 1 };
        if keep_rows < rows.len() {
            m.rollback(st, self.snap.as_ref().expect("saved before the check"))?;
            if keep_rows > 0 {
                m.plain(&rows[..keep_rows], st, true)?;
            }
        }
        Ok(Checked {
            kept,
            ended,
            next,
            streams: hs,
        })
    }
}

/// A drafting session on either backend (what the server keeps for a sequence decoding
/// alone).
pub(crate) enum AnySession<'m> {
    /// On the CPU forward.
    Cpu(Box<DraftSession<Model<'m>>>),
    /// On the device forward.
    Gpu(Box<DraftSession<GpuModel<'m>>>),
}

impl<'m> AnySession<'m> {
    /// What it has drafted so far.
    pub fn stats(&self) -> DraftStats {
        match self {
            AnySession::Cpu(s) => s.stats,
            AnySession::Gpu(s) => s.stats,
        }
    }
}

impl<'m> Drafter<'m> {
    /// A session for the sequence in `st` (which holds `context`) from its current position.
    pub(crate) fn session(
        self,
        st: &AnyState,
        (depth, source): (usize, DraftSource),
        context: &[u32],
    ) -> Result<AnySession<'m>, RunError> {
        Ok(match (self, st) {
            (Drafter::Cpu(m), AnyState::Qwen4(st)) => {
                AnySession::Cpu(Box::new(DraftSession::new(m, st, depth, source, context)?))
            }
            (Drafter::Gpu(m), AnyState::Qwen4Gpu(st)) => AnySession::Gpu(Box::new(
                DraftSession::new(m, &**st, depth, source, context)?,
            )),
            _ => return Err(RunError::Forward(crate::model::ForwardError::StateMismatch)),
        })
    }

    /// [`DraftSession::step`] on the sequence in `st`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn step(
        self,
        session: &mut AnySession<'m>,
        st: &mut AnyState,
        token: u32,
        sampler: &mut Sampler,
        dec: &mut Decoder<'_>,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<Stepped, RunError> {
        Ok(match (self, session, st) {
            (Drafter::Cpu(m), AnySession::Cpu(s), AnyState::Qwen4(st)) => {
                s.step(m, st, token, sampler, dec, on_event, None)?
            }
            (Drafter::Gpu(m), AnySession::Gpu(s), AnyState::Qwen4Gpu(st)) => {
                s.step(m, st, token, sampler, dec, on_event, None)?
            }
            _ => return Err(RunError::Forward(crate::model::ForwardError::StateMismatch)),
        })
    }
}

impl Runner {
    /// [`Runner::complete`] with drafting (the model, depth and source from [`drafter`]): the same tokens, fewer trunk forwards where drafts are kept. `state` ends
    /// as the plain loop leaves it (the prompt and every generated token but the last).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn complete_mtp<B: Speculate>(
        &self,
        m: &B,
        (max_depth, source): (usize, DraftSource),
        st: &mut B::State,
        prompt: &[u32],
        sampler: &mut Sampler,
        opts: &GenerateOptions,
        on_event: &mut dyn FnMut(Event<'_>),
        g: &mut Generation,
        oracle: Option<&Oracle<'_>>,
    ) -> Result<(), RunError> {
        let cancelled = || opts.cancel.as_ref().is_some_and(CancelToken::is_cancelled);
        let integrity = self.model.integrity();
        let t0 = Instant::now();
        let mut session = DraftSession::new(m, st, max_depth, source, &opts.context)?;
        let chunk = match opts.prefill_chunk {
            0 => prompt.len(),
            c => c,
        };
        let mut logits = Vec::new();
        let mut done = 0;
        for (i, part) in prompt.chunks(chunk).enumerate() {
            if i > 0 && cancelled() {
                return Ok(());
            }
            // The last prompt row's entry waits for the sampled token.
            logits = session.prefill(m, st, part, &prompt[done + 1..])?;
            done += part.len();
            if chunk < prompt.len() {
                on_event(Event::Prefill {
                    done,
                    total: prompt.len(),
                });
            }
        }
        for &id in prompt {
            sampler.accept(id);
        }
        if opts.keep_prompt_state {
            g.prompt_state = Some(m.keep(st)?);
        }
        let mut next = sampler.sample(&logits);
        g.prompt_seconds = t0.elapsed().as_secs_f64();

        let t1 = Instant::now();
        let mut dec = Decoder::new(self, opts);
        while let Some(token) = dec.push(next, sampler, on_event) {
            integrity.check()?;
            match session.step(m, st, token, sampler, &mut dec, on_event, oracle)? {
                Stepped::Sampled(n) => next = n,
                Stepped::Ended => break,
            }
        }
        let d = dec.end(on_event);
        integrity.check()?;
        g.finish_with(d, t1);
        g.drafts = Some(session.stats);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::AnyState;
    use crate::sampling::Sampling;

    /// Drafts that are the plain run's own next tokens, wrong at chosen places: every draft
    /// kept (with the sampled bonus token), the reply ending on a kept draft, a miss at each
    /// draft position, and the output and the state left are still the plain run's.
    #[test]
    fn forced_acceptance_patterns_keep_the_output_and_the_state() {
        let dir = tempfile::tempdir().unwrap();
        let path = test_support::mtp::convert_with_mtp_head(
            "qwen4_exp_b",
            dir.path(),
            test_support::Profile::F32,
            3,
        );
        let r = Runner::from_cmf(cmf_format::Cmf::open(&path).unwrap()).unwrap();
        let crate::model::AnyModel::Qwen4(m) = r.model.model() else {
            panic!("a CPU qwen4_exp model")
        };
        // Repeats itself: prompt lookup drafts from the first step.
        let prompt = r
            .encode("The quick brown fox and the quick brown fox and the quick brown")
            .unwrap();
        for sampling in [
            Sampling {
                temperature: 0.0,
                ..Sampling::default()
            },
            Sampling {
                temperature: 1.0,
                seed: 9,
                ..Sampling::default()
            },
        ] {
            for max_new in [3, 12, 20] {
                let opts = GenerateOptions::new(max_new);
                let mut plain_st = r.model.model().new_state();
                let mut s = Sampler::new(sampling);
                let plain = r.complete(&mut plain_st, &prompt, &mut s, &opts, &mut |_| {});
                let plain = plain.unwrap();
                let truth = plain.tokens.clone();
                // (wrong every `miss` steps' draft `at`), or never wrong.
                let cases = [(0, 0), (2, 0), (3, 1), (2, 2), (5, 3)];
                let sources = [DraftSource::Head, DraftSource::Lookup];
                for ((miss, at), source) in cases.into_iter().flat_map(|c| sources.map(|s| (c, s)))
                {
                    for depth in [1, 3, 5] {
                        let oracle = |done: usize, i: usize| -> u32 {
                            let t = truth.get(done + i).copied().unwrap_or(0);
                            if miss > 0 && i == at && done.is_multiple_of(miss) {
                                (t + 1) % 7
                            } else {
                                t
                            }
                        };
                        let mut st = r.model.model().new_state();
                        let AnyState::Qwen4(seq) = &mut st else {
                            unreachable!()
                        };
                        let mut g = Generation {
                            prompt: prompt.clone(),
                            tokens: Vec::new(),
                            text: String::new(),
                            finish: crate::generate::Finish::Cancelled,
                            stop_string: None,
                            prompt_seconds: 0.0,
                            gen_seconds: 0.0,
                            prompt_state: None,
                            drafts: None,
                        };
                        let mut s = Sampler::new(sampling);
                        r.complete_mtp(
                            m,
                            (depth, source),
                            seq,
                            &prompt,
                            &mut s,
                            &opts,
                            &mut |_| {},
                            &mut g,
                            Some(&oracle),
                        )
                        .unwrap();
                        let what =
                            format!("{source:?} max {max_new} miss {miss}@{at} depth {depth}");
                        assert_eq!(g.tokens, truth, "{what}");
                        assert_eq!(g.finish, plain.finish, "{what}");
                        let d = g.drafts.unwrap();
                        // (Lookup drafts only where the context repeats, which this random
                        // model's text seldom does: the demo model's tests keep them.)
                        if miss == 0 && max_new > 3 && source == DraftSource::Head {
                            assert!(d.accepted > 0, "{what}: nothing kept");
                        }
                        let m = r.model.model();
                        let want = m.forward_last(&[5], &mut plain_st.clone()).unwrap();
                        let got = m.forward_last(&[5], &mut st).unwrap();
                        let err = test_support::max_abs_diff(&got, &want);
                        assert!(
                            err <= 1e-5 * test_support::max_abs(&want),
                            "{what}: state {err:.3e}"
                        );
                    }
                }
            }
        }
    }

    /// The monitor drafts deep where drafts are kept, turns drafting off where they are not
    /// (here: a step of any depth costs twice a plain one), and keeps probing every depth.
    /// Prompt lookup copies what followed the most recent earlier occurrence of the longest
    /// matching tail (4 down to 2 tokens), as far as the history goes; no match, no drafts.
    #[test]
    fn lookup_drafts_follow_the_latest_longest_match() {
        // Tail [1, 2]: occurs at 0 (followed by 3, 4) and at 4 (followed by 9): the latest.
        assert_eq!(
            lookup_drafts(&[1, 2, 3, 4, 1, 2, 9, 7, 1, 2], 3),
            vec![9, 7, 1]
        );
        // A 3-token match wins over a later 2-token one.
        let h = [5, 1, 2, 8, 6, 0, 1, 2, 3, 5, 1, 2];
        assert_eq!(lookup_drafts(&h, 2), vec![8, 6]);
        // Drafts stop at the end of the history.
        assert_eq!(lookup_drafts(&[4, 5, 4, 5], 5), vec![4, 5]);
        assert_eq!(lookup_drafts(&[1, 2, 3, 4], 3), Vec::<u32>::new());
        assert_eq!(lookup_drafts(&[7], 3), Vec::<u32>::new());
        assert_eq!(lookup_drafts(&[], 3), Vec::<u32>::new());
    }

    #[test]
    fn the_monitor_follows_acceptance_and_cost() {
        let mut m = Monitor::new(3);
        let mut seen = [0usize; 4];
        for _ in 0..400 {
            let d = m.depth();
            seen[d] += 1;
            m.record(d, d, if d == 0 { 1.0 } else { 1.2 });
        }
        assert!(seen[3] > 300, "always kept: deepest wins ({seen:?})");
        let mut m = Monitor::new(3);
        let mut seen = [0usize; 4];
        for _ in 0..400 {
            let d = m.depth();
            seen[d] += 1;
            m.record(d, 0, if d == 0 { 1.0 } else { 2.0 });
        }
        assert!(seen[0] > 300, "never kept: off ({seen:?})");
        assert!(
            seen[1..].iter().all(|&n| n >= 2),
            "every depth probed ({seen:?})"
        );
        assert!(
            seen[0] > 390,
            "probes that change nothing grow rare ({seen:?})"
        );
    }
}
