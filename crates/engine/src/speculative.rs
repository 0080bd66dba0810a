//! Drafting with the model's MTP head: the head drafts up to N tokens after the one just
//! sampled, the trunk checks them in one multi-row forward, and every draft that equals what
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
//! next step needs nothing else from it). A [`Monitor`] picks the depth of each step from the
//! acceptance and the time each depth costs, turning drafting off while it does not pay and
//! back on (by probing) when it would.

use std::str::FromStr;
use std::time::Instant;

use model_qwen4::{
    ForwardError, GpuModel, GpuRecurrent, GpuState, Model, MtpDeviceState, MtpHead, MtpState,
    Recurrent, SeqState,
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
    /// Per draft position (1-based index - 1): drafts made there, and kept.
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

/// Whether `--mtp` drafts on `runner`'s model: `Some` where it is a qwen4_exp model with an
/// MTP head (on either backend); `Ok(None)` for off, or `auto` where it cannot; an error
/// when a depth was asked of a model that cannot.
pub fn drafter<'m>(
    runner: &'m Runner,
    mode: MtpMode,
) -> Result<Option<(Drafter<'m>, usize)>, RunError> {
    let depth = match mode {
        MtpMode::Off => return Ok(None),
        MtpMode::Auto => AUTO_DEPTH,
        MtpMode::Depth(d) => d,
    };
    let why = match runner.model.model() {
        crate::model::AnyModel::Qwen4(m) if m.mtp().is_some() => {
            return Ok(Some((Drafter::Cpu(m), depth)));
        }
        crate::model::AnyModel::Qwen4Gpu(g) if g.model.mtp().is_some() => {
            return Ok(Some((Drafter::Gpu(g), depth)));
        }
        crate::model::AnyModel::Qwen4(_) | crate::model::AnyModel::Qwen4Gpu(_) => {
            "the model file has no MTP head (mtp.* tensors)"
        }
        crate::model::AnyModel::Dsv4(_) => "MTP drafting is built for qwen4_exp models only",
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

/// One sequence's drafting: the head's cache (an entry per trunk position from where the
/// session began: positions before have no streams, so the head attends to what it sees from
/// there, its positions counted from there), the entries not made yet, the trunk's streams at
/// the last position fed, the monitor and the statistics. [`Runner::complete_mtp`] runs one
/// over a whole generation; the server runs one while a sequence decodes alone.
pub(crate) struct DraftSession<B: Speculate> {
    ms: B::Head,
    /// The trunk position of the head's first entry.
    base: usize,
    /// The head's entries not made yet: trunk streams `[n, H*D]` and the token after each.
    pending_hs: Vec<f32>,
    pending: Vec<u32>,
    /// The trunk's streams at the last position fed (`None` before the first forward).
    hs_last: Option<Vec<f32>>,
    snap: Option<B::Snap>,
    monitor: Monitor,
    /// What it has drafted so far.
    pub stats: DraftStats,
}

impl<B: Speculate> DraftSession<B> {
    /// A session for `st` from its current position, drafting up to `max_depth`.
    pub fn new(m: &B, st: &B::State, max_depth: usize) -> Result<Self, ForwardError> {
        Ok(DraftSession {
            ms: m.new_head()?,
            base: m.pos(st),
            pending_hs: Vec::new(),
            pending: Vec::new(),
            hs_last: None,
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
        // The row before this part, when its entry waits, now has its successor.
        if let Some(hs) = self.hs_last.take() {
            self.pending_hs.extend_from_slice(&hs);
            self.pending.push(part[0]);
        }
        self.flush(m)?;
        let (logits, streams) = m.trunk(part, st, true)?;
        let pairs = after.len().min(part.len());
        if pairs > 0 {
            m.head(&streams[..pairs * hd], &after[..pairs], &mut self.ms, false)?;
        }
        // The last row's entry waits for its successor when it is not known yet.
        if pairs < part.len() {
            self.hs_last = Some(streams[(part.len() - 1) * hd..].to_vec());
        }
        Ok(logits)
    }

    /// Makes the waiting head entries.
    fn flush(&mut self, m: &B) -> Result<(), ForwardError> {
        if !self.pending.is_empty() {
            m.head(&self.pending_hs, &self.pending, &mut self.ms, false)?;
            (self.pending_hs, self.pending) = (Vec::new(), Vec::new());
        }
        Ok(())
    }

    /// One step: feeds `token` (the one the decoder just took), with as many drafts after it
    /// as the monitor picks (at most what is left of the reply, `dec`'s room), and keeps the
    /// drafts the sampler draws itself from the trunk's logits (each pushed to `dec`). Rows
    /// past the last kept one are rolled back.
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
        let hd = m.streams_width();
        let step = Instant::now();
        // Drafting past the reply's limit is wasted: the check would drop it. Nothing is
        // drafted before the trunk's streams are known (a session's first step).
        let depth = match &self.hs_last {
            Some(_) => self.monitor.depth().min(dec.room()),
            None => 0,
        };
        // `token` goes in at position `at`. The head's entry at `at - 1` is the trunk's
        // streams there and `token`. Entries wait while the monitor does not draft (the
        // head's cache must stay whole, but a step that does not draft need not pay for
        // them): the next drafting step makes them all in one multi-row call, then each
        // draft's entry, from the head's own output and the draft.
        let at = m.pos(st);
        let mut rows = vec![token];
        if let Some(hs) = self.hs_last.take() {
            self.pending_hs.extend_from_slice(&hs);
            self.pending.push(token);
        }
        if depth == 0 {
            if self.pending.len() >= MAX_PENDING {
                self.flush(m)?;
            }
            let (l, streams) = m.trunk(&rows, st, true)?;
            let next = sampler.sample(&l);
            self.hs_last = Some(streams);
            self.monitor.record(0, 0, step.elapsed().as_secs_f64());
            return Ok(Stepped::Sampled(next));
        }
        let (first, mut draft) = m.head(&self.pending_hs, &self.pending, &mut self.ms, true)?;
        // The waiting entries belong to the steps that did not draft: not this step's cost.
        let step = Instant::now();
        (self.pending_hs, self.pending) = (Vec::new(), Vec::new());
        let mut x = first[first.len() - hd..].to_vec();
        for i in 0..depth {
            let tok = match oracle {
                Some(o) => o(dec.generated().len(), i),
                None => draft.expect("the head drafts when asked"),
            };
            rows.push(tok);
            if i + 1 < depth {
                (x, draft) = m.head(&x, &[tok], &mut self.ms, true)?;
            }
        }
        m.save(st, &mut self.snap)?;
        let (l, streams) = m.trunk(&rows, st, false)?;
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
                m.trunk(&rows[..keep_rows], st, true)?;
            }
        }
        // The head's entries for the kept rows (the trunk's streams with the token after
        // each) replace the drafts' own.
        m.cut_head(&mut self.ms, at - self.base);
        if ended {
            return Ok(Stepped::Ended);
        }
        self.pending_hs.extend_from_slice(&streams[..kept * hd]);
        self.pending.extend_from_slice(&rows[1..=kept]);
        self.hs_last = Some(streams[kept * hd..(kept + 1) * hd].to_vec());
        self.monitor
            .record(depth, kept, step.elapsed().as_secs_f64());
        Ok(Stepped::Sampled(next))
    }
}

/// A drafting session on either backend (what the server keeps for a sequence decoding
/// alone).
pub(crate) enum AnySession<'m> {
    /// On the CPU forward.
    Cpu(DraftSession<Model<'m>>),
    /// On the device forward.
    Gpu(DraftSession<GpuModel<'m>>),
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
    /// A session for the sequence in `st` from its current position.
    pub(crate) fn session(self, st: &AnyState, depth: usize) -> Result<AnySession<'m>, RunError> {
        Ok(match (self, st) {
            (Drafter::Cpu(m), AnyState::Qwen4(st)) => {
                AnySession::Cpu(DraftSession::new(m, st, depth)?)
            }
            (Drafter::Gpu(m), AnyState::Qwen4Gpu(st)) => {
                AnySession::Gpu(DraftSession::new(m, &**st, depth)?)
            }
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
    /// [`Runner::complete`] with the MTP head drafting (the model and depth from
    /// [`drafter`]): the same tokens, fewer trunk forwards where drafts are kept. `state` ends
    /// as the plain loop leaves it (the prompt and every generated token but the last).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn complete_mtp<B: Speculate>(
        &self,
        m: &B,
        max_depth: usize,
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
        let mut session = DraftSession::new(m, st, max_depth)?;
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
        let prompt = r.encode("The quick brown fox").unwrap();
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
                for (miss, at) in [(0, 0), (2, 0), (3, 1), (2, 2), (5, 3)] {
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
                            depth,
                            seq,
                            &prompt,
                            &mut s,
                            &opts,
                            &mut |_| {},
                            &mut g,
                            Some(&oracle),
                        )
                        .unwrap();
                        let what = format!("max {max_new} miss {miss}@{at} depth {depth}");
                        assert_eq!(g.tokens, truth, "{what}");
                        assert_eq!(g.finish, plain.finish, "{what}");
                        let d = g.drafts.unwrap();
                        if miss == 0 && max_new > 3 {
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
