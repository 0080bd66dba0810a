//! `cortiq bench model`: llama-bench-like prefill (`ppN`) and decode (`tgN`) throughput of a
//! whole model (a file, or the synthetic release geometry of `model_qwen4::synthetic` or
//! `model_dsv4::synthetic`) on the GPU or the CPU, with the weight bytes one decoded token
//! reads and the decode bound those imply at the read bandwidth of the same device measured
//! in the same run.

use std::time::Instant;

use serde::Serialize;

use gpu_runtime::ops::graph::Granularity;

use crate::model::{AnyModel, ForwardError};

/// What to run.
#[derive(Debug, Clone)]
pub struct ModelBenchOptions {
    /// Prompt tokens of the prefill test.
    pub prompt: usize,
    /// Tokens of the decode test.
    pub decode: usize,
    /// Timed repetitions (after one untimed warm-up).
    pub reps: usize,
    /// Also time every dispatch of a decoded token (GPU): which kernels the stages are made of.
    pub dispatches: bool,
    /// Above 1: also decode this many sequences together (`tgNxB`: each step one token of
    /// each, fed as one batch as the server does), reporting their total tokens per second.
    pub batch: usize,
    /// Also time the check step of MTP drafting: one forward of K rows with every row's
    /// logits (`verifyK`, K = 2..=8: the sampled token and K-1 drafts), in steps per second,
    /// beside `tgN`'s one-row steps (what decides when drafting pays).
    pub verify: bool,
    /// Feed the decode test a fixed pseudo-random token sequence instead of each step's greedy
    /// token: random weights decode into loops of a few tokens, which route to the same experts
    /// over and over and make any expert cache look better than it would on text.
    pub scripted: bool,
}

/// One test's result.
#[derive(Debug, Clone, Serialize)]
pub struct ModelRecord {
    /// `pp512`, `tg128`.
    pub test: String,
    /// Mean tokens per second.
    pub tok_s: f64,
    /// Standard deviation over the repetitions.
    pub stdev: f64,
    /// Repetitions.
    pub reps: usize,
}

/// The table.
#[derive(Debug, Clone, Serialize)]
pub struct ModelReport {
    /// What ran (file or synthetic geometry).
    pub model: String,
    /// Conversion profile.
    pub profile: String,
    /// `gpu` or `cpu`.
    pub backend: String,
    /// Adapter or CPU.
    pub device: String,
    /// Weight bytes one decoded token reads.
    pub token_bytes: u64,
    /// Read bandwidth of the same device, this run (bytes/s).
    pub read_bandwidth: f64,
    /// `read_bandwidth / token_bytes`: decode tokens/s if weights were all that was read.
    pub bound_tok_s: f64,
    /// The tests.
    pub records: Vec<ModelRecord>,
    /// Where a decoded token's GPU time goes: milliseconds per token by stage (summed over
    /// layers), each stage a timed compute pass of its own (empty on the CPU, or without
    /// timestamp queries).
    pub stages: Vec<StageTime>,
    /// With `dispatches`: per stage and kernel shape (`stage: kernel shape`), slowest first,
    /// each dispatch a timed pass of its own.
    pub dispatches: Vec<StageTime>,
    /// With `dispatches`: what a decoded token's one-pass GPU time loses when each kernel's
    /// steps are left out of it (milliseconds per token, largest first; `calls` its steps a
    /// token): each kernel's share of the chain without the per-dispatch passes' overhead.
    pub marginal: Vec<StageTime>,
    /// With a prompt test of at least one full frame: [`ModelReport::stages`] and
    /// [`ModelReport::dispatches`] for a prefill frame of that many rows (milliseconds per frame).
    pub frame_rows: usize,
    /// A prefill frame's GPU time by stage.
    pub frame_stages: Vec<StageTime>,
    /// With `dispatches`: a prefill frame's GPU time by kernel.
    pub frame_dispatches: Vec<StageTime>,
    /// A decoded token's (and a prefill frame's) GPU time in one timed pass, as it runs
    /// unprofiled: the GPU's busy time without the stage passes' boundaries, to set beside the
    /// wall clock of `tgN` (milliseconds; absent without timestamp queries).
    pub whole_ms: Option<f64>,
    /// The same for a prefill frame of [`ModelReport::frame_rows`] rows.
    pub frame_whole_ms: Option<f64>,
    /// Where the host's time per decoded token goes (qwen4_exp on the GPU, every routed
    /// expert resident).
    pub host: Option<HostRecord>,
    /// With routed experts on the CPU: the decode test's cold path, per decoded token of the
    /// timed repetitions.
    pub offload: Option<OffloadRecord>,
}

/// The host's side of the decode test's tokens (qwen4_exp on the GPU, every routed expert
/// resident), milliseconds per decoded token (`model_qwen4::host_clock`).
#[derive(Debug, Clone, Serialize)]
pub struct HostRecord {
    /// The next token's inputs: its embedding row, its n-gram rows, their uploads.
    pub inputs_ms: f64,
    /// Inside `queue.submit`.
    pub submit_ms: f64,
    /// Encoding the next token's command buffer, after the submission, while the GPU runs.
    pub ahead_ms: f64,
    /// From then to the token read back (the rest of the GPU's time included).
    pub read_ms: f64,
}

/// The cold path of the decode test (routed experts on the CPU), per decoded token.
#[derive(Debug, Clone, Serialize)]
pub struct OffloadRecord {
    /// Routed experts resident in VRAM, and in all.
    pub resident: (usize, usize),
    /// The share of routed (token, expert) pairs computed in VRAM.
    pub hit_rate: f64,
    /// Bytes of the experts the CPU read per token.
    pub cold_bytes: f64,
    /// The CPU's milliseconds on cold experts per token.
    pub cpu_ms: f64,
    /// Wall milliseconds per token.
    pub token_ms: f64,
    /// Experts uploaded into banks per token.
    pub admitted: f64,
    /// Of those, prefetched (the next layer's likeliest experts) per token.
    pub prefetched: f64,
    /// The GPU's busy milliseconds per token (`CORTIQ_OFFLOAD_PROFILE=1`; else 0).
    pub gpu_ms: f64,
    /// Of those, the spans that end at a layer's routing (what the cold experts wait for).
    pub gpu_routing_ms: f64,
    /// The host's milliseconds per token in submissions (with the admissions' commits).
    pub submit_ms: f64,
    /// Of those, the submissions of spans ending at a routing (the critical path).
    pub route_submit_ms: f64,
    /// Of all, the time inside `queue.submit`.
    pub queue_submit_ms: f64,
    /// Submissions per token.
    pub submissions: f64,
    /// The host's milliseconds per token waiting for layers' readbacks.
    pub wait_ms: f64,
    /// The host's milliseconds per token from each readback to the cold outputs' writes.
    pub join_ms: f64,
}

/// One stage's (or one kernel shape's) share of a decoded token.
#[derive(Debug, Clone, Serialize)]
pub struct StageTime {
    /// `hc`, `ple`, `gdn`, `qsa`, `moe`, `head` (or `stage: kernel shape`).
    pub stage: String,
    /// Timed passes per token.
    pub calls: usize,
    /// Milliseconds per token.
    pub ms: f64,
}

fn stats(v: &[f64]) -> (f64, f64) {
    let n = v.len().max(1) as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (mean, var.sqrt())
}

/// Prompt ids spread over the vocabulary (any valid ids do: the weights are what is read).
fn ids(n: usize, vocab: usize, salt: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 7919 + salt * 104729 + 13) % vocab) as u32)
        .collect()
}

/// Runs the prefill and decode tests on `model`; `read_bandwidth` is the device's, measured by
/// the caller in the same run.
pub fn bench(
    model: &AnyModel<'_>,
    name: &str,
    profile: &str,
    read_bandwidth: f64,
    opts: &ModelBenchOptions,
    progress: &mut dyn FnMut(&ModelRecord),
) -> Result<ModelReport, ForwardError> {
    let vocab = model.vocab_size();
    let mut st = model.new_state();
    let mut records = Vec::new();
    if opts.prompt > 0 {
        let mut rates = Vec::new();
        for rep in 0..=opts.reps {
            model.reset(&mut st);
            let p = ids(opts.prompt, vocab, rep);
            let t0 = Instant::now();
            model.greedy(&p, &mut st)?;
            let s = t0.elapsed().as_secs_f64();
            if rep > 0 {
                rates.push(opts.prompt as f64 / s);
            }
        }
        let (tok_s, stdev) = stats(&rates);
        let r = ModelRecord {
            test: format!("pp{}", opts.prompt),
            tok_s,
            stdev,
            reps: opts.reps,
        };
        progress(&r);
        records.push(r);
    }
    // The cold path's counters over the timed repetitions (after the untimed one, in which an
    // expert cache warms up).
    let mut before = None;
    let mut host_before = None;
    let mut t_decode = Instant::now();
    if opts.decode > 0 {
        let mut rates = Vec::new();
        for rep in 0..=opts.reps {
            if rep == 1 {
                before = offload_stats(model);
                host_before = host_stats(model);
                t_decode = Instant::now();
                // The chained regions' profile counts the timed repetitions only.
                let _ = quant_codecs::chain_profile::report();
            }
            model.reset(&mut st);
            let script = ids(opts.decode + 1, vocab, 1000 + rep);
            let mut tok = script[0];
            let t0 = Instant::now();
            for i in 0..opts.decode {
                tok = model.greedy(&[tok], &mut st)?;
                if opts.scripted {
                    tok = script[i + 1];
                }
            }
            let s = t0.elapsed().as_secs_f64();
            if rep > 0 {
                rates.push(opts.decode as f64 / s);
            }
        }
        if let Some(line) = quant_codecs::chain_profile::report() {
            eprintln!("tg{}: {line}", opts.decode);
        }
        let (tok_s, stdev) = stats(&rates);
        let r = ModelRecord {
            test: format!("tg{}", opts.decode),
            tok_s,
            stdev,
            reps: opts.reps,
        };
        progress(&r);
        records.push(r);
    }
    let offload = match (model, before, offload_stats(model)) {
        (AnyModel::Qwen4Gpu(_) | AnyModel::Dsv4Gpu(_), Some(a), Some(b)) if opts.decode > 0 => {
            let tokens = (opts.decode * opts.reps) as f64;
            let routed = (b.routed - a.routed).max(1) as f64;
            Some(OffloadRecord {
                resident: match model {
                    AnyModel::Qwen4Gpu(g) => g.resident_experts(),
                    AnyModel::Dsv4Gpu(g) => g.resident_experts(),
                    _ => unreachable!("matched above"),
                },
                hit_rate: 1.0 - (b.cold - a.cold) as f64 / routed,
                cold_bytes: (b.cold_bytes - a.cold_bytes) as f64 / tokens,
                cpu_ms: 1e3 * (b.cold_seconds - a.cold_seconds) / tokens,
                token_ms: 1e3 * t_decode.elapsed().as_secs_f64() / tokens,
                admitted: (b.admitted - a.admitted) as f64 / tokens,
                prefetched: (b.prefetched - a.prefetched) as f64 / tokens,
                gpu_ms: 1e3 * (b.gpu_seconds - a.gpu_seconds) / tokens,
                gpu_routing_ms: 1e3 * (b.gpu_routing_seconds - a.gpu_routing_seconds) / tokens,
                submit_ms: 1e3 * (b.submit_seconds - a.submit_seconds) / tokens,
                route_submit_ms: 1e3 * (b.route_submit_seconds - a.route_submit_seconds) / tokens,
                queue_submit_ms: 1e3 * (b.queue_submit_seconds - a.queue_submit_seconds) / tokens,
                submissions: (b.submissions - a.submissions) as f64 / tokens,
                wait_ms: 1e3 * (b.wait_seconds - a.wait_seconds) / tokens,
                join_ms: 1e3 * (b.join_seconds - a.join_seconds) / tokens,
            })
        }
        _ => None,
    };
    let host = match (host_before, host_stats(model)) {
        (Some(a), Some(b)) if opts.decode > 0 && offload.is_none() => {
            let d = b.since(&a);
            let per = |sec: f64| 1e3 * sec / d.frames.max(1) as f64;
            (d.frames > 0).then(|| HostRecord {
                inputs_ms: per(d.inputs_seconds),
                submit_ms: per(d.submit_seconds),
                read_ms: per(d.read_seconds),
                ahead_ms: per(d.ahead_seconds),
            })
        }
        _ => None,
    };
    if opts.batch > 1 && opts.decode > 0 {
        let r = batched_decode(model, opts)?;
        progress(&r);
        records.push(r);
    }
    if opts.verify && opts.decode > 0 {
        for k in 2..=quant_codecs::MAX_BATCH {
            let r = verify_steps(model, opts, k)?;
            progress(&r);
            records.push(r);
        }
    }
    let mut stages = Vec::new();
    let mut dispatches = Vec::new();
    let mut frame_stages = Vec::new();
    let mut frame_dispatches = Vec::new();
    let mut whole = Vec::new();
    let mut without = Vec::new();
    let mut frame_whole = Vec::new();
    // The longest frame the `-p` prompt is fed in (qwen4_exp all-resident: up to 512 rows
    // by default).
    let batch = quant_codecs::MAX_BATCH;
    let frame_rows = match model {
        AnyModel::Qwen4Gpu(g) if offload.is_none() => {
            g.frame_rows().min(opts.prompt / batch * batch).max(batch)
        }
        _ => batch,
    };
    // A stage profile times one submission: a model with experts on the CPU has many.
    type Profiled = Vec<(String, usize, f64)>;
    type ProfileFrames<'m> =
        Box<dyn FnMut(usize, usize, Granularity) -> Result<Profiled, ForwardError> + 'm>;
    let mut profile_frames: Option<ProfileFrames<'_>> = match (model, &mut st, &offload) {
        (AnyModel::Qwen4Gpu(g), crate::model::AnyState::Qwen4Gpu(s), None) => {
            Some(Box::new(move |rows, n, gran| {
                model_reset(model, s);
                Ok(g.profile_frames(&ids(rows, vocab, 0), n, s, gran)?)
            }))
        }
        (AnyModel::Dsv4Gpu(g), _, None) => Some(Box::new(move |rows, n, gran| {
            Ok(g.profile_frames(&ids(rows, vocab, 0), n, gran)?)
        })),
        _ => None,
    };
    if let Some(profile_frames) = profile_frames.as_mut() {
        let mut runs = Vec::new();
        if opts.decode > 0 || opts.prompt < frame_rows {
            let n = opts.decode.clamp(1, 16);
            runs.push((1, n, Granularity::Stage, &mut stages));
            runs.push((1, n, Granularity::Whole, &mut whole));
            if opts.dispatches {
                runs.push((1, n, Granularity::Dispatch, &mut dispatches));
                runs.push((1, n, Granularity::Without, &mut without));
            }
        }
        if opts.prompt >= frame_rows {
            let n = (opts.prompt / frame_rows).clamp(1, 8);
            runs.push((frame_rows, n, Granularity::Stage, &mut frame_stages));
            runs.push((frame_rows, n, Granularity::Whole, &mut frame_whole));
            if opts.dispatches {
                runs.push((frame_rows, n, Granularity::Dispatch, &mut frame_dispatches));
            }
        }
        for (rows, n, gran, out) in runs {
            for (stage, calls, sec) in profile_frames(rows, n, gran)? {
                out.push(StageTime {
                    stage,
                    calls,
                    ms: sec * 1e3,
                });
            }
        }
        dispatches.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        frame_dispatches.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    }
    let marginal = marginal_times(&without, &dispatches);
    let token_bytes = model.bytes_per_token().unwrap_or(0);
    Ok(ModelReport {
        model: name.to_string(),
        profile: profile.to_string(),
        backend: model.backend_name().to_string(),
        device: model.device(),
        token_bytes,
        read_bandwidth,
        bound_tok_s: if token_bytes > 0 {
            read_bandwidth / token_bytes as f64
        } else {
            0.0
        },
        records,
        stages,
        dispatches,
        marginal,
        frame_rows,
        frame_stages,
        frame_dispatches,
        whole_ms: total_ms(&whole),
        frame_whole_ms: total_ms(&frame_whole),
        host,
        offload,
    })
}

/// The host's frame counters of a qwen4_exp model on the GPU.
fn host_stats(model: &AnyModel<'_>) -> Option<model_qwen4::host_clock::HostStats> {
    match model {
        AnyModel::Qwen4Gpu(g) => Some(g.host_stats()),
        _ => None,
    }
}

/// The cold path's counters of a model with routed experts on the CPU.
fn offload_stats(model: &AnyModel<'_>) -> Option<model_qwen4::OffloadStats> {
    match model {
        AnyModel::Qwen4Gpu(g) if g.expert_share().is_some() => Some(g.offload_stats()),
        // deepseek_v4's cold path counts what the CPU did and the admissions (it has no
        // prefetch and no GPU-side timing).
        AnyModel::Dsv4Gpu(g) if model.expert_share().is_some() => {
            let s = g.cold_stats();
            Some(model_qwen4::OffloadStats {
                routed: s.routed,
                cold: s.cold,
                cold_bytes: s.cold_bytes,
                cold_seconds: s.cold_seconds,
                admitted: s.admitted,
                ..Default::default()
            })
        }
        _ => None,
    }
}

/// `opts.batch` sequences decoding `opts.decode` tokens each in lockstep, one batched forward
/// per step; their total tokens per second.
fn batched_decode(
    model: &AnyModel<'_>,
    opts: &ModelBenchOptions,
) -> Result<ModelRecord, ForwardError> {
    let (vocab, batch) = (model.vocab_size(), opts.batch);
    let mut states: Vec<_> = (0..batch).map(|_| model.new_state()).collect();
    let mut rates = Vec::new();
    for rep in 0..=opts.reps {
        for s in &mut states {
            model.reset(s);
        }
        let mut toks = ids(batch, vocab, rep);
        let t0 = Instant::now();
        for _ in 0..opts.decode {
            let feeds: Vec<[u32; 1]> = toks.iter().map(|&t| [t]).collect();
            let mut seqs: Vec<(&[u32], _)> = feeds
                .iter()
                .map(|f| &f[..])
                .zip(states.iter_mut())
                .collect();
            let logits = model.forward_batch(&mut seqs)?;
            toks = logits.iter().map(|l| crate::sampling::argmax(l)).collect();
        }
        let s = t0.elapsed().as_secs_f64();
        if rep > 0 {
            rates.push((batch * opts.decode) as f64 / s);
        }
    }
    let (tok_s, stdev) = stats(&rates);
    Ok(ModelRecord {
        test: format!("tg{}x{batch}", opts.decode),
        tok_s,
        stdev,
        reps: opts.reps,
    })
}

/// Steps of `k` rows with every row's logits (as a check of `k - 1` drafts), as many steps as
/// make `opts.decode` rows; steps per second.
fn verify_steps(
    model: &AnyModel<'_>,
    opts: &ModelBenchOptions,
    k: usize,
) -> Result<ModelRecord, ForwardError> {
    let vocab = model.vocab_size();
    let steps = opts.decode.div_ceil(k).max(1);
    let mut st = model.new_state();
    let mut rates = Vec::new();
    for rep in 0..=opts.reps {
        model.reset(&mut st);
        let rows = ids(steps * k, vocab, rep);
        let t0 = Instant::now();
        for step in rows.chunks(k) {
            let logits = model.forward(step, &mut st)?;
            std::hint::black_box(logits);
        }
        let s = t0.elapsed().as_secs_f64();
        if rep > 0 {
            rates.push(steps as f64 / s);
        }
    }
    let (tok_s, stdev) = stats(&rates);
    Ok(ModelRecord {
        test: format!("verify{k}"),
        tok_s,
        stdev,
        reps: opts.reps,
    })
}

fn model_reset(model: &AnyModel<'_>, s: &mut model_qwen4::GpuState) {
    if let AnyModel::Qwen4Gpu(g) = model {
        g.reset(s);
    }
}

impl ModelReport {
    /// The llama-bench-like table and the bound.
    pub fn write_text(&self, w: &mut dyn std::io::Write) -> std::io::Result<()> {
        writeln!(w, "| model | profile | backend | test | t/s |")?;
        writeln!(w, "| --- | --- | --- | --- | ---: |")?;
        for r in &self.records {
            writeln!(
                w,
                "| {} | {} | {} ({}) | {} | {:.2} ± {:.2} |",
                self.model, self.profile, self.backend, self.device, r.test, r.tok_s, r.stdev
            )?;
        }
        if self.token_bytes > 0 {
            writeln!(
                w,
                "\na decoded token reads {:.3} GB of weights; read bandwidth {:.1} GB/s (same \
                 run) -> bound {:.1} tok/s",
                self.token_bytes as f64 / 1e9,
                self.read_bandwidth / 1e9,
                self.bound_tok_s
            )?;
            // One sequence's decode against the bound (a batch's total is not bounded by it:
            // its weights are read once for all its rows).
            for r in self
                .records
                .iter()
                .filter(|r| r.test.starts_with("tg") && !r.test.contains('x'))
            {
                writeln!(
                    w,
                    "{}: {:.1}% of the bound",
                    r.test,
                    100.0 * r.tok_s / self.bound_tok_s
                )?;
            }
        }
        if let Some(o) = &self.offload {
            writeln!(
                w,
                "\nrouted experts on the CPU ({} of {} resident): decode {:.1}% in VRAM; per \
                 token {:.1} MB of cold experts read by the CPU in {:.2} ms (of {:.2} ms), {:.2} \
                 experts admitted ({:.2} prefetched)",
                o.resident.0,
                o.resident.1,
                100.0 * o.hit_rate,
                o.cold_bytes / 1e6,
                o.cpu_ms,
                o.token_ms,
                o.admitted,
                o.prefetched
            )?;
            // (Counted by the qwen4_exp cold path; deepseek_v4's counts the CPU's work only.)
            if o.submissions > 0.0 {
                writeln!(
                    w,
                    "host per token: {:.2} ms waiting for readbacks, {:.2} ms in the cold experts \
                 (from readbacks to their outputs), {:.2} ms submitting ({:.1} submissions; \
                 {:.2} ms in queue.submit; {:.2} ms submitting the spans up to a routing), \
                 {:.2} ms the rest",
                    o.wait_ms,
                    o.join_ms,
                    o.submit_ms,
                    o.submissions,
                    o.queue_submit_ms,
                    o.route_submit_ms,
                    o.token_ms - o.wait_ms - o.join_ms - o.submit_ms
                )?;
            }
            if o.gpu_ms > 0.0 {
                writeln!(
                    w,
                    "GPU busy {:.2} ms per token (timed spans; {:.2} ms of them up to the \
                     routers of layers with cold experts); the token takes {:.2}x the longer of \
                     the GPU's and the CPU's time",
                    o.gpu_ms,
                    o.gpu_routing_ms,
                    o.token_ms / o.gpu_ms.max(o.cpu_ms)
                )?;
            }
        }
        if let Some(ms) = self.whole_ms {
            // The decode test's wall clock per token against the GPU's busy time: what is
            // left is the host's turn between tokens (the token's readback, the next token's
            // inputs, the submission) and any gaps the GPU leaves.
            let wall = self
                .records
                .iter()
                .find(|r| r.test.starts_with("tg") && !r.test.contains('x') && r.tok_s > 0.0)
                .map(|r| 1e3 / r.tok_s);
            write!(
                w,
                "\nGPU time of a decoded token in one timed pass: {ms:.3} ms"
            )?;
            match wall {
                Some(wall) => writeln!(
                    w,
                    "; the decode test's wall clock {wall:.3} ms a token ({:.3} ms besides the \
                     GPU's)",
                    wall - ms
                )?,
                None => writeln!(w)?,
            }
            if let Some(h) = &self.host {
                writeln!(
                    w,
                    "host per decoded token: {:.3} ms the inputs (embedding and n-gram rows, \
                     uploads), {:.3} ms in queue.submit, then {:.3} ms encoding the next \
                     token's commands and {:.3} ms until the token is read back (together \
                     {:.3} ms past the GPU's time)",
                    h.inputs_ms,
                    h.submit_ms,
                    h.ahead_ms,
                    h.read_ms,
                    h.ahead_ms + h.read_ms - ms
                )?;
            }
        }
        if let Some(ms) = self.frame_whole_ms {
            writeln!(
                w,
                "GPU time of a prefill frame of {} rows in one timed pass: {ms:.3} ms ({:.1} \
                 tok/s)",
                self.frame_rows,
                1e3 * self.frame_rows as f64 / ms
            )?;
        }
        print_profile(
            w,
            &self.stages,
            &self.dispatches,
            "a decoded token",
            "token",
        )?;
        if !self.marginal.is_empty() {
            let total: f64 = self.marginal.iter().map(|s| s.ms).sum();
            writeln!(
                w,
                "\nWhat a decoded token's one-pass GPU time loses without each kernel (a timed \
                 pass of the token with that kernel's steps left out, its outputs wrong), largest \
                 first; together {total:.3} ms"
            )?;
            print_kernels(w, &self.marginal, "token")?;
        }
        if !self.frame_stages.is_empty() {
            let what = format!("a prefill frame of {} rows", self.frame_rows);
            print_profile(
                w,
                &self.frame_stages,
                &self.frame_dispatches,
                &what,
                "frame",
            )?;
        }
        Ok(())
    }
}

/// Each kernel's time out of a [`Granularity::Without`] profile: the mean of the `all` passes
/// less the pass without it, largest first, with its steps a token from the per-dispatch
/// profile.
fn marginal_times(without: &[StageTime], dispatches: &[StageTime]) -> Vec<StageTime> {
    let Some(all) = without.iter().find(|s| s.stage == "all") else {
        return Vec::new();
    };
    // Same-named passes come summed, `calls` of them a token.
    let all_ms = all.ms / all.calls.max(1) as f64;
    let mut out: Vec<StageTime> = without
        .iter()
        .filter(|s| s.stage != "all" && s.stage != "warm-up")
        .map(|s| StageTime {
            stage: s.stage.clone(),
            calls: dispatches
                .iter()
                .find(|d| d.stage == s.stage)
                .map_or(0, |d| d.calls),
            ms: all_ms - s.ms,
        })
        .collect();
    out.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    out
}

/// The milliseconds of a profile's passes together (`None` when nothing was timed).
fn total_ms(passes: &[StageTime]) -> Option<f64> {
    (!passes.is_empty()).then(|| passes.iter().map(|s| s.ms).sum())
}

/// Writes a stage profile and, when there is one, the per-kernel profile under it, as
/// milliseconds per `unit` (`what` names the unit in the headings).
fn print_profile(
    w: &mut dyn std::io::Write,
    stages: &[StageTime],
    dispatches: &[StageTime],
    what: &str,
    unit: &str,
) -> std::io::Result<()> {
    if !stages.is_empty() {
        let total: f64 = stages.iter().map(|s| s.ms).sum();
        writeln!(
            w,
            "\nGPU time of {what} by stage (a timed pass per stage): {total:.3} ms"
        )?;
        for s in stages {
            writeln!(
                w,
                "  {:<5} {:>8.3} ms  {:>5.1}%",
                s.stage,
                s.ms,
                100.0 * s.ms / total
            )?;
        }
    }
    if !dispatches.is_empty() {
        let total: f64 = dispatches.iter().map(|s| s.ms).sum();
        let calls: usize = dispatches.iter().map(|s| s.calls).sum();
        writeln!(
            w,
            "\nGPU time of {what} by kernel (a timed pass per dispatch step, slowest first): \
             {calls} steps, {total:.3} ms"
        )?;
        print_kernels(w, dispatches, unit)?;
    }
    Ok(())
}

/// The first 40 rows of a per-kernel table: milliseconds per `unit`, steps, microseconds a step.
fn print_kernels(
    w: &mut dyn std::io::Write,
    rows: &[StageTime],
    unit: &str,
) -> std::io::Result<()> {
    writeln!(
        w,
        "  {:>9} {:>6} {:>8}  stage: kernel shape",
        format!("ms/{unit}"),
        "calls",
        "us/call"
    )?;
    for s in rows.iter().take(40) {
        writeln!(
            w,
            "  {:>9.3} {:>6} {:>8.2}  {}",
            s.ms,
            s.calls,
            1e3 * s.ms / s.calls.max(1) as f64,
            s.stage
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LoadedModel;

    #[test]
    fn a_batched_decode_runs_beside_the_plain_tests() {
        let loaded = LoadedModel::new(crate::embedded_model().unwrap()).unwrap();
        let opts = ModelBenchOptions {
            prompt: 8,
            decode: 4,
            reps: 1,
            dispatches: false,
            batch: 3,
            verify: false,
            scripted: false,
        };
        let r = bench(loaded.model(), "demo", "q8", 1e9, &opts, &mut |_| {}).unwrap();
        let tests: Vec<&str> = r.records.iter().map(|r| r.test.as_str()).collect();
        assert_eq!(tests, ["pp8", "tg4", "tg4x3"]);
        assert!(r.records.iter().all(|r| r.tok_s > 0.0));
        let mut text = Vec::new();
        r.write_text(&mut text).unwrap();
        let text = String::from_utf8(text).unwrap();
        assert!(
            text.contains("tg4: ") && !text.contains("tg4x3: "),
            "{text}"
        );
    }

    /// On the GPU (lavapipe in CI) the report times a decoded token and a prefill frame in one
    /// pass beside the stage profile, and sets the token's against the decode test's wall clock.
    /// The demo model on the GPU (`None`, after `test_support::no_gpu`, without one), and the
    /// options of a one-sequence GPU bench.
    fn gpu_demo(
        prompt: usize,
        decode: usize,
        dispatches: bool,
    ) -> Option<(LoadedModel, ModelBenchOptions)> {
        let place = crate::model::Placement {
            backend: gpu_runtime::BackendChoice::Wgpu,
            ..Default::default()
        };
        let loaded = match LoadedModel::new_on(crate::embedded_model().unwrap(), &place) {
            Ok(l) if l.model().backend_name() == "gpu" => l,
            Ok(_) => {
                test_support::no_gpu(&"the demo model went to the CPU");
                return None;
            }
            Err(e) => {
                test_support::no_gpu(&e);
                return None;
            }
        };
        let opts = ModelBenchOptions {
            prompt,
            decode,
            reps: 1,
            dispatches,
            batch: 1,
            verify: false,
            scripted: false,
        };
        Some((loaded, opts))
    }

    #[test]
    fn the_gpu_report_times_a_token_in_one_pass() {
        let Some((loaded, opts)) = gpu_demo(64, 2, false) else {
            return;
        };
        let r = bench(loaded.model(), "demo", "q8", 1e9, &opts, &mut |_| {}).unwrap();
        if r.stages.is_empty() {
            // No timestamp queries on this adapter: no profile of either kind.
            assert!(r.whole_ms.is_none() && r.frame_whole_ms.is_none());
            return;
        }
        assert!(r.whole_ms.is_some_and(|ms| ms > 0.0), "{:?}", r.whole_ms);
        assert!(
            r.frame_whole_ms.is_some_and(|ms| ms > 0.0),
            "{:?}",
            r.frame_whole_ms
        );
        let mut text = Vec::new();
        r.write_text(&mut text).unwrap();
        let text = String::from_utf8(text).unwrap();
        assert!(
            text.contains("GPU time of a decoded token in one timed pass: ")
                && text.contains("the decode test's wall clock")
                && text.contains(&format!(
                    "prefill frame of {} rows in one timed pass",
                    r.frame_rows
                ))
                && text.contains("host per decoded token: "),
            "{text}"
        );
        // The host's phases are disjoint stretches of each decoded token's wall clock (which
        // the mean of the repetitions' rates gives to within their spread: 10% allowed).
        let h = r.host.as_ref().expect("the host's phases on the GPU");
        let wall = r
            .records
            .iter()
            .find(|t| t.test.starts_with("tg"))
            .map(|t| 1e3 / t.tok_s)
            .expect("a decode test");
        let parts = [h.inputs_ms, h.submit_ms, h.ahead_ms, h.read_ms];
        assert!(parts.iter().all(|&p| p >= 0.0), "{h:?}");
        let sum: f64 = parts.iter().sum();
        assert!(
            sum > 0.0 && sum <= wall * 1.1,
            "{h:?} against {wall} ms a token"
        );
    }

    /// With `--dispatches` every kernel of the per-dispatch profile is also left out of one
    /// pass of the token: the same kernels, each step left out once.
    #[test]
    fn every_kernel_is_left_out_of_one_pass() {
        let Some((loaded, opts)) = gpu_demo(0, 1, true) else {
            return;
        };
        let r = bench(loaded.model(), "demo", "q8", 1e9, &opts, &mut |_| {}).unwrap();
        if r.stages.is_empty() {
            assert!(r.marginal.is_empty());
            return;
        }
        let mut left_out: Vec<(&str, usize)> = r
            .marginal
            .iter()
            .map(|s| (s.stage.as_str(), s.calls))
            .collect();
        let mut profiled: Vec<(&str, usize)> = r
            .dispatches
            .iter()
            .map(|s| (s.stage.as_str(), s.calls))
            .collect();
        left_out.sort();
        profiled.sort();
        assert_eq!(left_out, profiled);
        assert!(profiled.iter().map(|p| p.1).sum::<usize>() > profiled.len());
    }
}
