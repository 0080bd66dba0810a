//! Routed experts split between VRAM and the CPU on the device path (a model larger than the
//! VRAM budget): how many stay resident ([`Offload`], [`Residency`]), the frame's cold path
//! (a frame with breaks submitted span by span, the cold experts computed on the CPU while the
//! GPU computes the resident ones), the admissions that move experts into a layer's bank
//! through the staging ring, and the counters ([`OffloadStats`]).

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, mpsc};

use gpu_runtime::ops::graph::{Break, Graph, Tap};
use gpu_runtime::readback;
use gpu_runtime::staging::{Staged, StagingRing};
use quant_codecs::MAX_BATCH;
use quant_codecs::team::Team;

use crate::config::Qwen4ExpTextConfig;
use crate::device::Device;
use crate::expert_cache::{Admission, CachePolicy};
use crate::forward::ForwardError;
use crate::gpu::{GpuModel, readback_buffer, unsupported};
use crate::moe::{NONE_SLOT, Upload};
use crate::prefetch::CoRouting;

/// Where a model's routed experts live when they do not all fit in VRAM.
#[derive(Debug, Clone, PartialEq)]
pub struct Offload {
    /// How many of each layer's experts are resident.
    pub residency: Residency,
    /// How the resident ones change while running.
    pub policy: CachePolicy,
    /// Experts admitted into a layer's bank per frame at most (each an upload of its bytes).
    pub max_admissions: usize,
    /// Per layer, each expert's score from an earlier run ([`GpuModel::expert_scores`]): the
    /// initial residents are the highest.
    pub warm: Option<Vec<Vec<f32>>>,
    /// With the learned policy: how many of the next layer's likeliest experts to upload when
    /// a layer's routing comes back ([`crate::prefetch`]).
    pub prefetch: usize,
}

impl Default for Offload {
    /// As many experts as the budget holds, the learned policy, [`DEFAULT_ADMISSIONS`].
    fn default() -> Offload {
        Offload {
            residency: Residency::Budget,
            policy: CachePolicy::default(),
            max_admissions: DEFAULT_ADMISSIONS,
            warm: None,
            prefetch: std::env::var("CORTIQ_PREFETCH")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(DEFAULT_PREFETCH),
        }
    }
}

impl Offload {
    /// The default offload with `residency`.
    pub fn with(residency: Residency) -> Offload {
        Offload {
            residency,
            ..Offload::default()
        }
    }
}

/// [`Offload::max_admissions`]' default: one expert per layer and frame (a q4 expert of the
/// release geometry is 2.6 MB on the bus).
pub const DEFAULT_ADMISSIONS: usize = 1;

/// [`Offload::prefetch`]'s default (`CORTIQ_PREFETCH` overrides it).
pub const DEFAULT_PREFETCH: usize = 0;

/// Counters of the cold path ([`GpuModel::offload_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OffloadStats {
    /// Routed (token row, expert) slots run.
    pub routed: u64,
    /// Those computed on the CPU.
    pub cold: u64,
    /// Bytes of the experts the CPU computed (each once per frame and layer).
    pub cold_bytes: u64,
    /// The CPU's time on them.
    pub cold_seconds: f64,
    /// Experts uploaded into banks while running.
    pub admitted: u64,
    /// Admissions the device refused (their slots retired; their experts computed on the
    /// CPU).
    pub failed: u64,
    /// Of the uploads, prefetches (the next layer's likeliest experts).
    pub prefetched: u64,
    /// The GPU's seconds in the frames' spans (`CORTIQ_OFFLOAD_PROFILE=1` on an adapter with
    /// timestamp queries; else 0).
    pub gpu_seconds: f64,
    /// Of those, the seconds in the spans that end at a layer's routing (everything up to
    /// the router: what the cold experts wait for), the rest being the resident experts and
    /// the shared expert that run beside them.
    pub gpu_routing_seconds: f64,
    /// The host's seconds in the frames' submissions (with the admissions' commits).
    pub submit_seconds: f64,
    /// Of those, the submissions of spans that end at a layer's routing (each made after the
    /// layer before it had its cold outputs: on the token's critical path).
    pub route_submit_seconds: f64,
    /// Of all, the seconds inside `queue.submit` itself (the rest: committing admissions).
    pub queue_submit_seconds: f64,
    /// Submissions made.
    pub submissions: u64,
    /// The host's seconds waiting for layers' readbacks.
    pub wait_seconds: f64,
    /// The host's seconds in the cold experts with the admission decision beside them (from
    /// a layer's readback to its outputs' writes).
    pub join_seconds: f64,
}

/// How many of each layer's routed experts live in VRAM (the rest are computed on the CPU).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Residency {
    /// All of them when the VRAM budget holds them after every other weight; else as many
    /// per layer as what is left holds, the same number in every layer.
    #[default]
    Budget,
    /// These many in each layer (at most the expert count), whatever the budget says.
    PerLayer(Vec<usize>),
}

/// The cold path's buffers and counters.
pub(crate) struct ColdPath {
    /// Where a layer's cold slots (`[8k]` u32), routed experts (`[8k]` u32) and MoE input
    /// (`[8, D]`) are read back (locked for a frame).
    stage: Mutex<wgpu::Buffer>,
    /// Admitted experts' bytes on their way into the banks.
    ring: StagingRing,
    /// A layer's cold outputs on their way into the expert outputs: one mapped slot a layer,
    /// copied by the next span's submission. (`queue.write_buffer` creates, maps and later
    /// destroys a staging buffer per call: one per cold slot, ~180 a token at 12G.)
    outs: StagingRing,
    policy: CachePolicy,
    max_admissions: usize,
    /// Experts of the next layer prefetched per layer and frame, and what predicts them.
    prefetch: usize,
    corouting: Mutex<CoRouting>,
    prefetched: AtomicU64,
    /// Routed (token row, expert) slots run so far, and those computed on the CPU.
    pub(crate) routed: AtomicU64,
    cold: AtomicU64,
    /// Experts uploaded into a bank while running, and those the device refused.
    admitted: AtomicU64,
    failed: AtomicU64,
    /// The bytes of the experts the CPU computed (each once per frame), and its time on them.
    cold_bytes: AtomicU64,
    cold_ns: AtomicU64,
    /// Admissions still to be aimed past their bank ([`GpuModel::inject_upload_faults`]).
    faults: AtomicUsize,
    /// Whether the thread pool is kept awake while the host waits for a layer's readback
    /// (`CORTIQ_WARM_POOL=1`, hardware adapters only: off by default, since it measured
    /// slower on the H200, 24.6 against 26.5 tok/s at 12G, docs/perf.md).
    warm_pool: bool,
    /// Who computes a layer's cold experts ([`ColdSchedule`]).
    schedule: ColdSchedule,
    /// With `CORTIQ_ROUTING_TRACE=FILE`: every layer's routing, one line a frame (`layer:
    /// ids...`), for replaying cache policies offline (`cortiq bench cache`).
    trace: Option<Mutex<std::io::BufWriter<std::fs::File>>>,
    /// With `CORTIQ_OFFLOAD_PROFILE=1` on an adapter with timestamp queries: every span of a
    /// frame timed on the GPU, for the GPU's busy time beside the host's waits.
    clock: Option<Mutex<SpanClock>>,
    /// The GPU's time in the frames' spans (with `clock`), the host's time waiting for
    /// readbacks, and its time in the cold experts and the admission decision side by side.
    gpu_ns: AtomicU64,
    gpu_routing_ns: AtomicU64,
    submit_ns: AtomicU64,
    route_submit_ns: AtomicU64,
    queue_submit_ns: AtomicU64,
    submissions: AtomicU64,
    wait_ns: AtomicU64,
    join_ns: AtomicU64,
}

/// Who computes a layer's cold experts: all of them in one parallel region, each expert's
/// down released when its own gate/up is done ([`RoutedExperts::experts_rows_on`]), on a
/// [`Team`] whose threads spin between layers (the default), or on rayon's pool
/// (`CORTIQ_COLD_SCHEDULE=each`: each expert's projections split over the threads in turn,
/// the experts in parallel; `together`: the team's region on rayon). All three give the same
/// bits; the rayon ones are kept to measure against.
///
/// [`RoutedExperts::experts_rows_on`]: model_core::experts::RoutedExperts::experts_rows_on
enum ColdSchedule {
    Team(Team),
    Each,
    Together,
}

impl ColdSchedule {
    /// The schedule the environment asks for (the team: [`Team::from_env`]).
    fn from_env(software: bool) -> ColdSchedule {
        match std::env::var("CORTIQ_COLD_SCHEDULE").as_deref() {
            Ok("each") => ColdSchedule::Each,
            Ok("together") => ColdSchedule::Together,
            // Without the integer kernels the experts take the f32 path, one expert a task,
            // each splitting its rows over rayon's pool: a team spinning beside that pool
            // only takes its cores (2-core box, the f32 kernels: 10 experts 6.2 ms on the
            // team, 4.4 ms each on rayon).
            _ if !quant_codecs::ops::fast_int8() => ColdSchedule::Each,
            _ => {
                let team = Team::from_env(software);
                tracing::debug!("cold experts: {team:?}");
                ColdSchedule::Team(team)
            }
        }
    }
}

/// Timestamp queries for the spans of one frame (a pair a span) and the buffers they are
/// resolved and read back through.
struct SpanClock {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    read: wgpu::Buffer,
    /// Spans that can be timed in a frame; later ones go untimed.
    spans: u32,
}

impl SpanClock {
    fn new(ctx: &gpu_runtime::GpuContext, spans: u32) -> SpanClock {
        let bytes = u64::from(spans) * 16;
        let buffer = |label, usage| {
            ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes,
                usage,
                mapped_at_creation: false,
            })
        };
        SpanClock {
            set: ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("span timestamps"),
                ty: wgpu::QueryType::Timestamp,
                count: 2 * spans,
            }),
            resolve: buffer(
                "span timestamps",
                wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            ),
            read: buffer(
                "span timestamps read",
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            ),
            spans,
        }
    }

    /// Nanoseconds of GPU time in each of the first `spans` spans of the frame that has run.
    fn busy_ns(&self, ctx: &gpu_runtime::GpuContext, spans: u32) -> Result<Vec<u64>, ForwardError> {
        let raw = readback::read_mapped(ctx, &self.read, 4 * spans as usize)?;
        let ticks: &[u64] = bytemuck::cast_slice(&raw);
        let period = f64::from(ctx.queue.get_timestamp_period());
        Ok(ticks
            .chunks_exact(2)
            .map(|p| (p[1].saturating_sub(p[0]) as f64 * period) as u64)
            .collect())
    }
}

impl ColdPath {
    /// The cold path of a model whose experts take `slot_bytes` each in a bank; `partial`:
    /// whether some are on the CPU (else the staging ring is a token one, never used).
    pub(crate) fn new(
        dev: &Device,
        c: &Qwen4ExpTextConfig,
        offload: &Offload,
        slot_bytes: u64,
        partial: bool,
    ) -> ColdPath {
        let stage = readback_buffer(
            &dev.ctx,
            MAX_BATCH * (2 * c.num_experts_per_tok + c.hidden_size),
        );
        // Each admission holds a slot from its staging until the submission with its copies
        // has run: two layers' worth is enough for the host never to wait on one.
        let admits = partial && offload.policy != CachePolicy::Static;
        let prefetch = if partial && offload.policy == CachePolicy::Learned {
            offload.prefetch
        } else {
            0
        };
        let ring = if admits {
            let slots = 2 * (offload.max_admissions.max(1) + prefetch) + 2;
            // The expert's two matrices and its two map words, each at a 256-byte offset.
            StagingRing::with_slots(&dev.ctx, slots, slot_bytes + 1024)
        } else {
            StagingRing::with_slots(&dev.ctx, 1, 256)
        };
        // A slot is busy from a layer's cold experts until the span after them has run; the
        // next layers' take the others (a layer finding none ready queues writes instead).
        let outs = StagingRing::with_slots(
            &dev.ctx,
            if partial { 4 } else { 1 },
            (MAX_BATCH * c.num_experts_per_tok * (c.hidden_size * 4).next_multiple_of(256)) as u64,
        );
        ColdPath {
            stage: Mutex::new(stage),
            ring,
            outs,
            policy: offload.policy,
            max_admissions: offload.max_admissions,
            prefetch,
            corouting: Mutex::new(CoRouting::new(
                if prefetch > 0 { c.num_hidden_layers } else { 0 },
                c.num_experts,
            )),
            prefetched: AtomicU64::new(0),
            routed: AtomicU64::new(0),
            cold: AtomicU64::new(0),
            admitted: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            cold_bytes: AtomicU64::new(0),
            cold_ns: AtomicU64::new(0),
            faults: AtomicUsize::new(0),
            // A software adapter's GPU is the CPU: spinning threads would take its cores.
            warm_pool: !dev.ctx.is_software()
                && std::env::var("CORTIQ_WARM_POOL").is_ok_and(|v| v == "1"),
            schedule: if partial {
                ColdSchedule::from_env(dev.ctx.is_software())
            } else {
                ColdSchedule::Each
            },
            trace: std::env::var_os("CORTIQ_ROUTING_TRACE").and_then(
                |p| match std::fs::File::create(&p) {
                    Ok(f) => Some(Mutex::new(std::io::BufWriter::new(f))),
                    Err(e) => {
                        tracing::warn!("routing trace {}: {e}", p.to_string_lossy());
                        None
                    }
                },
            ),
            clock: (partial
                && dev.ctx.caps.timestamps
                && std::env::var("CORTIQ_OFFLOAD_PROFILE").is_ok_and(|v| v == "1"))
            .then(|| Mutex::new(SpanClock::new(&dev.ctx, 2 * c.num_hidden_layers as u32 + 1))),
            gpu_ns: AtomicU64::new(0),
            gpu_routing_ns: AtomicU64::new(0),
            submit_ns: AtomicU64::new(0),
            route_submit_ns: AtomicU64::new(0),
            queue_submit_ns: AtomicU64::new(0),
            submissions: AtomicU64::new(0),
            wait_ns: AtomicU64::new(0),
            join_ns: AtomicU64::new(0),
        }
    }

    /// Appends a layer's routed experts of one frame to the routing trace, if one is kept.
    fn record(&self, layer: usize, routed: &[u32]) {
        use std::io::Write;
        let Some(t) = &self.trace else { return };
        let mut w = t.lock().unwrap_or_else(|p| p.into_inner());
        let mut line = format!("{layer}:");
        for x in routed {
            line.push_str(&format!(" {x}"));
        }
        line.push('\n');
        if let Err(e) = w.write_all(line.as_bytes()).and_then(|_| w.flush()) {
            tracing::warn!("routing trace: {e}");
        }
    }
}

/// The main thread's side of the stager: the staging jobs handed over (a layer and its
/// admissions) and the staged uploads coming back, counted per layer so that a layer can wait
/// for its own before it decides again.
struct Handoff<'a> {
    jobs: Option<mpsc::Sender<(usize, Vec<Admission>)>>,
    done: &'a mpsc::Receiver<(usize, Vec<Upload>)>,
    /// Jobs handed over and not back yet, per layer.
    out: Vec<usize>,
}

impl Handoff<'_> {
    /// Hands `admitted` to the stager; back when there is none (it is staged in line then).
    fn send(&mut self, il: usize, admitted: Vec<Admission>) -> Result<(), (usize, Vec<Admission>)> {
        let Some(jobs) = &self.jobs else {
            return Err((il, admitted));
        };
        jobs.send((il, admitted))
            .map_err(|mpsc::SendError(job)| job)?;
        self.out[il] += 1;
        Ok(())
    }

    fn take(&mut self, (il, ups): (usize, Vec<Upload>), pending: &mut Vec<(usize, Vec<Upload>)>) {
        self.out[il] = self.out[il].saturating_sub(1);
        pending.push((il, ups));
    }

    /// What the stager has staged so far, without waiting.
    fn ready(&mut self, pending: &mut Vec<(usize, Vec<Upload>)>) {
        while let Ok(r) = self.done.try_recv() {
            self.take(r, pending);
        }
    }

    /// Waits for layer `il`'s jobs; whether there were any.
    fn layer(&mut self, il: usize, pending: &mut Vec<(usize, Vec<Upload>)>) -> bool {
        let waited = self.out[il] > 0;
        while self.out[il] > 0 {
            match self.done.recv() {
                Ok(r) => self.take(r, pending),
                Err(_) => break,
            }
        }
        waited
    }

    /// Closes the hand-over and waits for everything the stager still holds.
    fn finish(&mut self, pending: &mut Vec<(usize, Vec<Upload>)>) {
        self.jobs = None;
        for r in self.done.iter() {
            self.take(r, pending);
        }
    }
}

/// Adds the time since its start to a counter when dropped (on every way out of a scope).
struct Elapsed<'a>(&'a AtomicU64, std::time::Instant);

impl Drop for Elapsed<'_> {
    fn drop(&mut self) {
        let ns = self.1.elapsed().as_nanos() as u64;
        self.0.fetch_add(ns, Ordering::Relaxed);
    }
}

/// Keeps the CPU thread pool awake while the host waits for the GPU: all workers but two
/// spin on a flag until the guard drops (or 5 ms pass), so the cold experts that follow start
/// on threads that are running rather than asleep (waking them measured 50-150 us per layer
/// on the H200's host, docs/perf.md).
struct WarmPool(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl WarmPool {
    fn hold() -> WarmPool {
        let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        // Two cores stay free: this thread polls the readback and the encoder records the
        // next spans meanwhile (a pool spinning on every core made both wait).
        for _ in 0..rayon::current_num_threads().saturating_sub(2).max(1) {
            let f = flag.clone();
            rayon::spawn(move || {
                let t0 = std::time::Instant::now();
                while f.load(Ordering::Relaxed)
                    && t0.elapsed() < std::time::Duration::from_millis(5)
                {
                    std::hint::spin_loop();
                }
            });
        }
        WarmPool(flag)
    }
}

impl Drop for WarmPool {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Relaxed);
    }
}

impl GpuModel<'_> {
    /// Submits a graph with breaks (some routed experts on the CPU) span by span: at a
    /// layer's [`Break::Read`] the span so far goes to the GPU with a copy of the layer's cold
    /// slots, routed experts and MoE input; the next span (the resident experts and the
    /// shared expert) is submitted behind it, and while the GPU runs it the host reads the
    /// copy back, computes the cold experts from the mapped file and, at [`Break::Write`],
    /// writes their outputs into the cold slots' rows for the sum that starts the next span.
    /// The experts the policy admits are staged on another core meanwhile, and their copies
    /// go up in the next submission, ahead of its span. `tail` records what the frame copies
    /// out after its last dispatch.
    pub(crate) fn run_breaks(
        &self,
        g: &Graph,
        nt: usize,
        mut taps: Option<&mut Vec<(Tap, wgpu::Buffer)>>,
        tail: &(dyn Fn(&mut wgpu::CommandEncoder) + Sync),
    ) -> Result<(), ForwardError> {
        let c = &self.model.config;
        let ctx = &self.res.dev.ctx;
        let s = &self.res.scratch;
        let cp = &self.res.cold;
        let (k, d) = (c.num_experts_per_tok, c.hidden_size);
        let stage_buf = cp.stage.lock().unwrap_or_else(|p| p.into_inner());
        let encoder = || {
            ctx.device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("frame (span)"),
                })
        };
        // Submits `cb` behind the copies of the uploads staged so far (admissions, and the
        // next layer's prefetches, which must land before it routes), except layer `hold`'s:
        // its routing is on the device and its resident experts, about to run, read the slots
        // that routing chose, so its uploads wait for a later submission.
        // `outs`: the copies of the last layer's cold outputs, which `cb` reads.
        let submit = |cb: wgpu::CommandBuffer,
                      pending: &mut Vec<(usize, Vec<Upload>)>,
                      hold: Option<usize>,
                      outs: Option<(wgpu::CommandBuffer, Staged)>| {
            let _timed = Elapsed(&cp.submit_ns, std::time::Instant::now());
            let (now, later): (Vec<_>, Vec<_>) =
                pending.drain(..).partition(|(il, _)| Some(*il) != hold);
            *pending = later;
            let queue_submit = |cbs: Vec<wgpu::CommandBuffer>| {
                let _timed = Elapsed(&cp.queue_submit_ns, std::time::Instant::now());
                cp.submissions.fetch_add(1, Ordering::Relaxed);
                ctx.queue.submit(cbs)
            };
            if now.is_empty() && outs.is_none() {
                return queue_submit(vec![cb]);
            }
            let ring = &cp.ring;
            let mut cbs = Vec::new();
            let mut release = Vec::new();
            for (il, uploads) in now {
                let moe = &self.res.layers[il].moe;
                let (r, ok, failed) =
                    moe.commit(&self.res.dev, ring, uploads, &cp.faults, &mut cbs);
                release.extend(r);
                cp.admitted.fetch_add(ok as u64, Ordering::Relaxed);
                cp.failed.fetch_add(failed as u64, Ordering::Relaxed);
            }
            let outs = outs.map(|(copies, staged)| {
                cbs.push(copies);
                staged
            });
            cbs.push(cb);
            let index = queue_submit(cbs);
            for staged in release {
                ring.release(staged);
            }
            if let Some(staged) = outs {
                cp.outs.release(staged);
            }
            index
        };
        let spans = &g.spans();
        let clock = cp
            .clock
            .as_ref()
            .map(|c| c.lock().unwrap_or_else(|p| p.into_inner()));
        let timed = clock
            .as_ref()
            .map_or(0, |c| (spans.len() as u32).min(c.spans));
        // Span `i` as a command buffer: its dispatches, then the layer's copies for the host
        // (a read) or what the frame copies out (the last).
        let encode = |i: usize, taps: &mut Option<&mut Vec<(Tap, wgpu::Buffer)>>| {
            let span = &spans[i];
            let mut enc = encoder();
            let stamps = clock
                .as_ref()
                .filter(|_| (i as u32) < timed)
                .map(|c| (&c.set, 2 * i as u32));
            g.record_span_stamped(
                ctx,
                &mut enc,
                span.items.clone(),
                taps.as_deref_mut(),
                stamps,
            );
            match span.end {
                Some(Break::Read(_)) => {
                    let slots = (nt * k * 4) as u64;
                    enc.copy_buffer_to_buffer(&s.cold, 0, &stage_buf, 0, slots);
                    let at = (MAX_BATCH * k * 4) as u64;
                    enc.copy_buffer_to_buffer(&s.slot_ids, 0, &stage_buf, at, slots);
                    enc.copy_buffer_to_buffer(&s.u, 0, &stage_buf, 2 * at, (nt * d * 4) as u64);
                }
                Some(Break::Write(_)) => {}
                None => {
                    tail(&mut enc);
                    if let Some(c) = clock.as_ref().filter(|_| timed > 0) {
                        enc.resolve_query_set(&c.set, 0..2 * timed, &c.resolve, 0);
                        let bytes = u64::from(timed) * 16;
                        enc.copy_buffer_to_buffer(&c.resolve, 0, &c.read, 0, bytes);
                    }
                }
            }
            enc.finish()
        };
        // The stager copies the admitted and prefetched experts into the staging ring on its
        // own thread, beside the cold experts and the GPU (a layer's copies took longer than
        // its cold experts, and every layer waited for them); what it has staged goes up
        // with the next submission, the rest at the end of the frame, so every admission of
        // a frame lands before the next frame decides again.
        let (job_tx, job_rx) = mpsc::channel::<(usize, Vec<Admission>)>();
        let (done_tx, done_rx) = mpsc::channel::<(usize, Vec<Upload>)>();
        let stage_now = |il: usize, admitted: Vec<Admission>| {
            let w = &self.model.weights.layers[il].moe;
            (il, self.res.layers[il].moe.stage(w, &cp.ring, admitted))
        };
        std::thread::scope(|scope| -> Result<(), ForwardError> {
            let stager = std::thread::Builder::new()
                .name("cortiq-stager".into())
                .spawn_scoped(scope, move || {
                    for (il, admitted) in job_rx {
                        if done_tx.send(stage_now(il, admitted)).is_err() {
                            break;
                        }
                    }
                });
            if let Err(e) = stager {
                tracing::warn!("no stager thread ({e}): admissions are staged in line");
            }
            // Recording a layer's spans costs the host about as long as the GPU takes to run
            // the span before its routing: the encoder records them on its own thread, in
            // order, while this one submits, waits and computes (a traced frame, whose taps
            // are collected in order, records them here). It runs free: held two spans ahead
            // (to record while this thread waits rather than beside the cold experts), in a
            // build that also staged admissions after the cold experts, it measured slower on
            // the H200 (docs/perf.md, fourth pass).
            let (cb_tx, cb_rx) = mpsc::channel::<wgpu::CommandBuffer>();
            let encoder_thread = taps.is_none()
                && std::thread::Builder::new()
                    .name("cortiq-encoder".into())
                    .spawn_scoped(scope, move || {
                        let mut none = None;
                        for i in 0..spans.len() {
                            if cb_tx.send(encode(i, &mut none)).is_err() {
                                break;
                            }
                        }
                    })
                    .map_err(|e| tracing::warn!("no encoder thread ({e}): spans recorded in line"))
                    .is_ok();
            let mut span = |i: usize| -> Result<wgpu::CommandBuffer, ForwardError> {
                if encoder_thread {
                    cb_rx.recv().map_err(|_| {
                        unsupported(format!("the span encoder stopped before span {i}")).into()
                    })
                } else {
                    Ok(encode(i, &mut taps))
                }
            };
            let mut pending: Vec<(usize, Vec<Upload>)> = Vec::new();
            let mut handoff = Handoff {
                jobs: Some(job_tx),
                done: &done_rx,
                out: vec![0; c.num_hidden_layers],
            };
            // Hands `admitted` to the stager, or stages it here when there is none.
            let stage = |il: usize,
                         admitted: Vec<Admission>,
                         handoff: &mut Handoff<'_>,
                         pending: &mut Vec<_>| {
                if let Err((il, admitted)) = handoff.send(il, admitted) {
                    pending.push(stage_now(il, admitted));
                }
            };
            let mut frame = || -> Result<(), ForwardError> {
                // The last layer whose routing came back this frame, and that routing.
                let mut last: Option<(usize, Vec<u32>)> = None;
                let mut i = 0;
                let mut cb = span(0)?;
                // The copies of the last layer's cold outputs, for the next span's submission.
                let mut outs = None;
                loop {
                    handoff.ready(&mut pending);
                    let il = match spans[i].end {
                        None => {
                            submit(cb, &mut pending, None, outs.take());
                            return Ok(());
                        }
                        Some(Break::Write(_)) => unreachable!("a layer's write follows its read"),
                        Some(Break::Read(il)) => il,
                    };
                    let index = {
                        let _timed = Elapsed(&cp.route_submit_ns, std::time::Instant::now());
                        submit(cb, &mut pending, None, outs.take())
                    };
                    // The resident experts and the shared expert go right behind it (they read
                    // only the device's data); the span after the write is encoded while the GPU
                    // runs these (the cold outputs it reads go up by queued writes, which land
                    // before its submission).
                    debug_assert_eq!(spans[i + 1].end, Some(Break::Write(il)));
                    // What the stager has finished goes up with them (off the critical path:
                    // the GPU is busy with the span before), but this layer's.
                    let resident = span(i + 1)?;
                    handoff.ready(&mut pending);
                    submit(resident, &mut pending, Some(il), None);
                    let next = span(i + 2)?;
                    let words = 2 * MAX_BATCH * k + nt * d;
                    let warm = cp.warm_pool.then(WarmPool::hold);
                    let t_wait = std::time::Instant::now();
                    let back = readback::read_mapped_after(ctx, &stage_buf, words, Some(index))?;
                    cp.wait_ns
                        .fetch_add(t_wait.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    drop(warm);
                    let bits = |v: &[f32]| -> Vec<u32> { v.iter().map(|v| v.to_bits()).collect() };
                    let cold = bits(&back[..nt * k]);
                    let routed = bits(&back[MAX_BATCH * k..MAX_BATCH * k + nt * k]);
                    let moe = &self.res.layers[il].moe;
                    cp.record(il, &routed);
                    // The next layer's likeliest experts go to the stager first (they help this
                    // frame only if they land before that layer routes), then what this layer
                    // admits; both before the cold experts start. (A build that handed the
                    // admissions over after them, with the encoder held two spans ahead, measured
                    // slower on the H200: docs/perf.md, fourth pass.)
                    let after = spans[i + 2..].iter().find_map(|s| match s.end {
                        Some(Break::Read(l)) => Some(l),
                        _ => None,
                    });
                    if let Some(nl) = after.filter(|&l| l == il + 1 && cp.prefetch > 0) {
                        let likely = {
                            let mut co = cp.corouting.lock().unwrap_or_else(|p| p.into_inner());
                            if let Some((pl, pr)) = last.as_ref().filter(|(pl, _)| pl + 1 == il) {
                                co.observe(*pl, pr, &routed);
                            }
                            co.likely(il, &routed)
                        };
                        let ahead = self.res.layers[nl].moe.prefetch(&likely, cp.prefetch);
                        if !ahead.is_empty() {
                            cp.prefetched
                                .fetch_add(ahead.len() as u64, Ordering::Relaxed);
                            stage(nl, ahead, &mut handoff, &mut pending);
                        }
                    } else if cp.prefetch > 0 {
                        // No next layer to prefetch into: the counts still learn.
                        let mut co = cp.corouting.lock().unwrap_or_else(|p| p.into_inner());
                        if let Some((pl, pr)) = last.as_ref().filter(|(pl, _)| pl + 1 == il) {
                            co.observe(*pl, pr, &routed);
                        }
                    }
                    // The admissions are decided from the cold winners the device read back,
                    // whatever the policy says next, so they need not wait for the cold experts.
                    // A prefetch into this layer still with the stager is committed first: its
                    // slot must not be chosen again while it might yet be taken back.
                    if handoff.layer(il, &mut pending) || pending.iter().any(|(l, _)| *l == il) {
                        submit(encoder().finish(), &mut pending, None, None);
                    }
                    let admitted = moe.decide(&routed, &cold, cp.policy, cp.max_admissions);
                    if !admitted.is_empty() {
                        stage(il, admitted, &mut handoff, &mut pending);
                    }
                    let t_join = std::time::Instant::now();
                    let done = self.cold_experts(il, &cold, &back[2 * MAX_BATCH * k..]);
                    cp.join_ns
                        .fetch_add(t_join.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    outs = done?;
                    last = Some((il, routed));
                    cb = next;
                    i += 2;
                }
            };
            let ran = frame();
            // What the stager still holds is committed (or taken back) whether the frame ran
            // to its end or not: an admission in the host's map must reach the device's, and
            // its staging slot must come back.
            handoff.finish(&mut pending);
            if !pending.is_empty() {
                submit(encoder().finish(), &mut pending, None, None);
            }
            ran?;
            if let Some(c) = clock.as_ref().filter(|_| timed > 0) {
                let ns = c.busy_ns(ctx, timed)?;
                cp.gpu_ns.fetch_add(ns.iter().sum(), Ordering::Relaxed);
                let routing = ns
                    .iter()
                    .zip(spans.iter())
                    .filter(|(_, s)| matches!(s.end, Some(Break::Read(_))))
                    .map(|(ns, _)| ns)
                    .sum();
                cp.gpu_routing_ns.fetch_add(routing, Ordering::Relaxed);
            }
            Ok(())
        })
    }

    /// Computes layer `il`'s cold slots (`cold[slot]`: the expert, or `NONE_SLOT`) on the CPU
    /// from the MoE input rows `u` (`[nt, D]`, slot `i` reading row `i / k`), each expert once
    /// over all of its rows, and stages the outputs for the slots' rows of the expert outputs:
    /// the copies that the next submission must carry ahead of the span that reads them (or,
    /// with no staging slot ready, queued writes, which need no carrying).
    fn cold_experts(
        &self,
        il: usize,
        cold: &[u32],
        u: &[f32],
    ) -> Result<Option<(wgpu::CommandBuffer, Staged)>, ForwardError> {
        use rayon::prelude::*;
        let c = &self.model.config;
        let (k, d, ne) = (c.num_experts_per_tok, c.hidden_size, c.num_experts);
        let routed = &self.model.weights.layers[il].moe.routed;
        let mut by_expert: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
        for (slot, &x) in cold.iter().enumerate() {
            if x == NONE_SLOT {
                continue;
            }
            if x as usize >= ne {
                return Err(unsupported(format!(
                    "layer {il}: the device routed slot {slot} to expert {x} of {ne}"
                ))
                .into());
            }
            by_expert.entry(x as usize).or_default().push(slot);
        }
        let n_cold: usize = by_expert.values().map(Vec::len).sum();
        self.res
            .cold
            .cold
            .fetch_add(n_cold as u64, Ordering::Relaxed);
        let bytes: usize = by_expert
            .keys()
            .map(|&x| {
                let e = &routed.experts[x];
                e.gate_up.bytes().len() + e.down.bytes().len()
            })
            .sum();
        self.res
            .cold
            .cold_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        let t0 = std::time::Instant::now();
        // An expert on one row reads that row of `u` in place: experts on the same row then
        // share one quantisation of it (a decoded token's cold experts all do).
        let inputs: Vec<(usize, Vec<usize>, Cow<'_, [f32]>)> = by_expert
            .into_iter()
            .map(|(x, slots)| {
                let row = |slot: usize| &u[slot / k * d..][..d];
                let xs = match slots.as_slice() {
                    &[slot] => Cow::Borrowed(row(slot)),
                    many => Cow::Owned(many.iter().flat_map(|&s| row(s)).copied().collect()),
                };
                (x, slots, xs)
            })
            .collect();
        let jobs = || -> Vec<(usize, &[f32])> {
            inputs.iter().map(|(x, _, xs)| (*x, xs.as_ref())).collect()
        };
        let ys: Vec<Vec<f32>> = match &self.res.cold.schedule {
            ColdSchedule::Team(team) => routed.experts_rows_on(team, &jobs()),
            ColdSchedule::Each => inputs
                .par_iter()
                .map(|(x, slots, xs)| routed.expert_rows(*x, xs, slots.len()))
                .collect(),
            ColdSchedule::Together => routed.experts_rows(&jobs()),
        };
        let outs: Vec<(Vec<usize>, Vec<f32>)> = inputs
            .into_iter()
            .zip(ys)
            .map(|((_, slots, _), y)| (slots, y))
            .collect();
        let ns = t0.elapsed().as_nanos() as u64;
        self.res.cold.cold_ns.fetch_add(ns, Ordering::Relaxed);
        let rows: Vec<(usize, &[f32])> = outs
            .iter()
            .flat_map(|(slots, y)| slots.iter().copied().zip(y.chunks(d)))
            .collect();
        if rows.is_empty() {
            return Ok(None);
        }
        let ctx = &self.res.dev.ctx;
        let dst = &self.res.scratch.expert_out;
        let parts: Vec<&[u8]> = rows.iter().map(|(_, r)| bytemuck::cast_slice(r)).collect();
        if let Some(staged) = self.res.cold.outs.try_stage(&parts) {
            let mut enc = ctx
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("cold outputs"),
                });
            for (part, &(slot, _)) in rows.iter().enumerate() {
                self.res
                    .cold
                    .outs
                    .record(&mut enc, &staged, part, dst, (slot * d * 4) as u64);
            }
            return Ok(Some((enc.finish(), staged)));
        }
        for (slot, row) in rows {
            ctx.queue
                .write_buffer(dst, (slot * d * 4) as u64, bytemuck::cast_slice(row));
        }
        Ok(None)
    }

    pub(crate) fn count_routed(&self, nt: usize) {
        let c = &self.model.config;
        let n = nt * c.num_experts_per_tok * c.num_hidden_layers;
        self.res.cold.routed.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// The share of routed (token row, expert) slots computed in VRAM so far, when some
    /// experts are on the CPU (`None` when every expert is resident).
    pub fn expert_share(&self) -> Option<f64> {
        let partial = self.res.layers.iter().any(|l| l.moe.cache().is_some());
        if !partial {
            return None;
        }
        let all = self.res.cold.routed.load(Ordering::Relaxed);
        let cold = self.res.cold.cold.load(Ordering::Relaxed);
        Some(if all == 0 {
            0.0
        } else {
            1.0 - cold as f64 / all as f64
        })
    }

    /// What the cold path has done so far: routed slots, slots computed on the CPU, the bytes
    /// of the experts it read (each expert once per frame), the CPU's seconds on them, and
    /// the experts admitted into banks (and refused).
    pub fn offload_stats(&self) -> OffloadStats {
        let r = &self.res.cold;
        OffloadStats {
            routed: r.routed.load(Ordering::Relaxed),
            cold: r.cold.load(Ordering::Relaxed),
            cold_bytes: r.cold_bytes.load(Ordering::Relaxed),
            cold_seconds: r.cold_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            admitted: r.admitted.load(Ordering::Relaxed),
            failed: r.failed.load(Ordering::Relaxed),
            prefetched: r.prefetched.load(Ordering::Relaxed),
            gpu_seconds: r.gpu_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            gpu_routing_seconds: r.gpu_routing_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            submit_seconds: r.submit_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            route_submit_seconds: r.route_submit_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            queue_submit_seconds: r.queue_submit_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            submissions: r.submissions.load(Ordering::Relaxed),
            wait_seconds: r.wait_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            join_seconds: r.join_ns.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }

    /// Routed experts in VRAM and in all, over the layers (admissions move experts in and
    /// out, never their number, unless one fails and retires its slot).
    pub fn resident_experts(&self) -> (usize, usize) {
        let c = &self.model.config;
        let all = c.num_experts * c.num_hidden_layers;
        let cold: usize = self
            .res
            .layers
            .iter()
            .filter_map(|l| l.moe.cache().map(|c| c.slots().len() - c.resident()))
            .sum();
        (all - cold, all)
    }

    /// Per layer with a bank and experts on the CPU, the device's expert -> slot map
    /// (`u32::MAX`: computed on the CPU) beside the host's, read back: after every frame they
    /// agree, or an admission did not reach the device (a check for tests and `doctor`-style
    /// diagnostics, not for the token path).
    pub fn slot_maps(&self) -> Result<Vec<crate::moe::SlotMaps>, ForwardError> {
        let ctx = &self.res.dev.ctx;
        let mut out = Vec::new();
        for l in &self.res.layers {
            if let Some(maps) = l.moe.slot_maps(ctx) {
                out.push(maps.map_err(|e| unsupported(format!("reading a slot map: {e}")))?);
            }
        }
        Ok(out)
    }

    /// Per layer, each routed expert's learned score (empty rows for layers whose experts are
    /// all resident): what [`Offload::warm`] takes in a later run.
    pub fn expert_scores(&self) -> Vec<Vec<f32>> {
        self.res
            .layers
            .iter()
            .map(|l| l.moe.cache().map_or_else(Vec::new, |c| c.scores()))
            .collect()
    }

    /// Makes the device refuse the next `n` admissions (their copies aimed past their bank:
    /// a validation error, caught like any other refusal). For testing the fault path: each
    /// refused slot is retired and its experts computed on the CPU.
    #[doc(hidden)]
    pub fn inject_upload_faults(&self, n: usize) {
        self.res.cold.faults.store(n, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(expert: u32) -> Admission {
        Admission {
            expert,
            slot: 0,
            evicted: 1,
        }
    }

    /// A stager that hands each job back after a pause, so that the main thread's side
    /// sees jobs in flight.
    fn slow_stager(
        jobs: mpsc::Receiver<(usize, Vec<Admission>)>,
        done: mpsc::Sender<(usize, Vec<Upload>)>,
    ) {
        for (il, admitted) in jobs {
            std::thread::sleep(std::time::Duration::from_millis(20));
            let ups = admitted.into_iter().map(|a| (a, None)).collect();
            if done.send((il, ups)).is_err() {
                break;
            }
        }
    }

    #[test]
    fn a_layer_waits_for_its_own_jobs_and_the_frame_for_all() {
        let (job_tx, job_rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel();
        std::thread::scope(|s| {
            s.spawn(move || slow_stager(job_rx, done_tx));
            let mut h = Handoff {
                jobs: Some(job_tx),
                done: &done_rx,
                out: vec![0; 4],
            };
            let mut pending = Vec::new();
            // Layer 1's prefetch, then layer 0's admissions, then layer 2's.
            assert!(h.send(1, vec![admission(7)]).is_ok());
            assert!(h.send(0, vec![admission(8), admission(9)]).is_ok());
            assert!(h.send(2, vec![admission(10)]).is_ok());
            assert_eq!(h.out, [1, 1, 1, 0]);
            // Nothing in flight for layer 3: no wait.
            assert!(!h.layer(3, &mut pending));
            // Layer 1 waits for its job (the first sent) and no further.
            assert!(h.layer(1, &mut pending));
            assert_eq!(h.out[1], 0);
            assert!(
                pending
                    .iter()
                    .any(|(il, ups)| *il == 1 && ups[0].0.expert == 7)
            );
            assert!(!h.layer(1, &mut pending));
            // The end of the frame collects the rest, in the order handed over.
            h.finish(&mut pending);
            assert_eq!(h.out, [0, 0, 0, 0]);
            let layers: Vec<usize> = pending.iter().map(|(il, _)| *il).collect();
            assert_eq!(layers, [1, 0, 2]);
            assert_eq!(pending[1].1.len(), 2);
            // With the hand-over closed, a job comes back to be staged in line.
            assert_eq!(
                h.send(3, vec![admission(11)]),
                Err((3, vec![admission(11)]))
            );
            assert_eq!(h.out[3], 0);
        });
    }
}
