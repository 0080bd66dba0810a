//! The `cortiq` binary: parses arguments, runs one subcommand, maps the outcome to an exit code.
//!
//! Exit status: 0 success, 1 a check failed (`inspect --verify` found corrupt tensors), 2 an
//! error (bad arguments, unreadable or invalid file). A closed stdout (`| head`) exits 0.

mod cli;

use std::io::{self, Write};
use std::process::ExitCode;

use anyhow::Context;
use cli::{
    BenchCommand, BenchKernelsArgs, Cli, Command, ConvertArgs, DeviceArgs, DoctorArgs, InspectArgs,
    LogitsArgs,
};
use engine::inspect::{self, InspectOptions};
use engine::{gpu_runtime, quant_codecs};

fn main() -> ExitCode {
    let xdg = quiet_mesa();
    let parsed = cli::parse();
    init_logging(matches!(&parsed, Ok(c) if matches!(c.command, Command::Serve(_))));
    let code = match parsed {
        Ok(cli) => run(cli),
        Err(e) => {
            // Usage errors exit 2, --help and --version 0, as clap's own exit would.
            let _ = e.print();
            ExitCode::from(e.exit_code().clamp(0, 255) as u8)
        }
    };
    if let Some(dir) = xdg {
        // Ours and empty (Mesa only checks that it exists); a leftover would pile up per run.
        let _ = std::fs::remove_dir(dir);
    }
    code
}

/// Mesa's Vulkan loader prints `XDG_RUNTIME_DIR is invalid or not set` on stderr when the
/// variable is missing (containers, cron, CI); that line is not ours and alarms users. Point it
/// at a private directory before any library can read it; returns it, for removal at exit.
fn quiet_mesa() -> Option<std::path::PathBuf> {
    let ok = std::env::var_os("XDG_RUNTIME_DIR")
        .map(std::path::PathBuf::from)
        .is_some_and(|d| d.is_dir());
    if ok {
        return None;
    }
    let dir = std::env::temp_dir().join(format!("cortiq-xdg-{}", std::process::id()));
    // Created fresh (not an existing directory someone else made), mode 0700.
    #[cfg(unix)]
    let made = {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new().mode(0o700).create(&dir).is_ok()
    };
    #[cfg(not(unix))]
    let made = std::fs::create_dir(&dir).is_ok();
    if !made {
        return None;
    }
    // SAFETY: called first thing in `main`, before any other thread exists, so nothing can read
    // the environment concurrently.
    unsafe { std::env::set_var("XDG_RUNTIME_DIR", &dir) };
    Some(dir)
}

/// Sizes rayon's global pool (`-t`; the default is every core) and sets the projections'
/// activation path (`--act`).
fn set_compute(args: &cli::ComputeArgs) -> anyhow::Result<()> {
    quant_codecs::ops::set_act_choice(match args.act {
        cli::Act::F32 => quant_codecs::ops::ActChoice::F32,
        cli::Act::Int8 => quant_codecs::ops::ActChoice::Int8,
        cli::Act::Auto => quant_codecs::ops::ActChoice::Auto,
    });
    if let Some(n) = args.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("-t: setting up the thread pool")?;
    }
    Ok(())
}

fn init_logging(serving: bool) {
    // A server logs one line per request by default.
    let default = if serving {
        "warn,engine::serve=info"
    } else {
        "warn"
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(io::stderr)
        // Colour codes only for a person at a terminal, never in a log file or a pipe.
        .with_ansi(io::stderr().is_terminal())
        .init();
}

fn run(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::Inspect(args) => run_inspect(args),
        Command::Doctor(args) => run_doctor(args),
        Command::Bench(BenchCommand::Kernels(args)) => run_bench_kernels(args),
        Command::Bench(BenchCommand::Model(args)) => run_bench_model(args),
        Command::Bench(BenchCommand::Cache(args)) => run_bench_cache(args),
        Command::Convert(args) => run_convert(args),
        Command::Logits(args) => run_logits(args),
        Command::Run(args) => run_generate(args),
        Command::Chat(args) => run_chat(args),
        Command::Perplexity(args) => run_perplexity(args),
        Command::Serve(args) => run_serve(args),
    };
    match result {
        Ok(code) => code,
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cortiq: {}", one_line(&e));
            ExitCode::from(2)
        }
    }
}

/// The error and its causes on one line, skipping causes the message already quotes (the
/// library errors include their source's text in their own message).
fn one_line(e: &anyhow::Error) -> String {
    let mut msg = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !msg.contains(&text) {
            if !msg.is_empty() {
                msg.push_str(": ");
            }
            msg.push_str(&text);
        }
    }
    msg.replace('\n', " ")
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain()
        .filter_map(|c| c.downcast_ref::<io::Error>())
        .any(|io| io.kind() == io::ErrorKind::BrokenPipe)
}

fn run_inspect(args: InspectArgs) -> anyhow::Result<ExitCode> {
    let opts = InspectOptions {
        verify: args.verify,
        tensor: args.tensor,
        values: args.values,
    };
    tracing::debug!(file = ?args.model.path(), ?opts, "inspect");
    let report = match args.model.path() {
        Some(file) => inspect::inspect(file, &opts)?,
        None => inspect::inspect_cmf(&engine::embedded_model()?, &opts)?,
    };
    print_report(args.json, &report, |w| report.write_text(w))?;
    let corrupt = report.verify.as_ref().is_some_and(|v| !v.bad.is_empty());
    Ok(if corrupt {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// Resolves `--backend` / `--vram` over the environment's settings.
fn gpu_options(args: &DeviceArgs) -> anyhow::Result<gpu_runtime::GpuOptions> {
    let mut o = gpu_runtime::GpuOptions::from_env()?;
    if let Some(b) = &args.backend {
        o.backend = b.parse()?;
    }
    if let Some(v) = args.vram {
        o.vram_budget = Some(v);
    }
    Ok(o)
}

fn run_doctor(args: DoctorArgs) -> anyhow::Result<ExitCode> {
    let report = engine::doctor::run(&gpu_options(&args.device)?)?;
    print_report(args.json, &report, |w| report.write_text(w))?;
    Ok(ExitCode::SUCCESS)
}

fn run_bench_kernels(args: BenchKernelsArgs) -> anyhow::Result<ExitCode> {
    let formats = args
        .formats
        .iter()
        .map(|f| {
            quant_codecs::DType::from_name(f).with_context(|| {
                format!(
                    "--formats: {f:?} is not a dtype (f32, f16, bf16, q8_2f, q4tp, q2tp, mxfp4)"
                )
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let opts = engine::bench::KernelBenchOptions {
        gpu: gpu_options(&args.device)?,
        large_bytes: args.large,
        seconds: args.seconds,
        formats,
    };
    let bar = indicatif::ProgressBar::new_spinner();
    bar.set_message("measuring the read ceiling");
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    let report = engine::bench::kernels(&opts, &mut |r| {
        bar.set_message(format!(
            "{} {} {} T={}: {:.1} GB/s",
            r.test, r.format, r.shape, r.rows_per_call, r.gbps
        ))
    })?;
    bar.finish_and_clear();
    print_report(args.json, &report, |w| report.write_text(w))?;
    Ok(ExitCode::SUCCESS)
}

/// Whether process `pid` runs (Linux: its `/proc` entry); `None` where that cannot be told.
fn process_alive(pid: u32) -> Option<bool> {
    let proc = std::path::Path::new("/proc");
    proc.join("self")
        .exists()
        .then(|| proc.join(pid.to_string()).exists())
}

/// Checks `-o` before any work, clears what dead conversions of the same target left, and
/// makes Ctrl-C / SIGTERM remove this conversion's temporary file before exiting.
fn prepare_output(target: &std::path::Path) -> anyhow::Result<()> {
    anyhow::ensure!(
        !target.is_dir(),
        "-o {}: is a directory; give the CMF file's path",
        target.display()
    );
    let parent = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    anyhow::ensure!(
        parent.is_dir(),
        "-o {}: the directory {} does not exist",
        target.display(),
        parent.display()
    );
    let own = std::process::id();
    for (path, pid) in engine::cmf_format::temp_files(target) {
        // A live writer (perhaps in another PID namespace sharing this directory) touches its
        // file continuously: only one idle for a minute and of a process not running here is
        // stale.
        let idle = std::fs::metadata(&path)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|d| d > std::time::Duration::from_secs(60));
        match process_alive(pid) {
            Some(false) if pid != own && idle => match std::fs::remove_file(&path) {
                Ok(()) => eprintln!(
                    "cortiq: removed {}, left by an interrupted conversion (process {pid})",
                    path.display()
                ),
                Err(e) => eprintln!("cortiq: could not remove stale {}: {e}", path.display()),
            },
            _ if pid != own => eprintln!(
                "cortiq: note: {} belongs to process {pid}, which may still be converting",
                path.display()
            ),
            _ => {}
        }
    }
    let target = target.to_path_buf();
    ctrlc::set_handler(move || {
        for (path, pid) in engine::cmf_format::temp_files(&target) {
            if pid == own {
                let _ = std::fs::remove_file(path);
            }
        }
        eprintln!("\ncortiq: interrupted; the partial output was removed");
        if let Some(dir) = std::env::var_os("XDG_RUNTIME_DIR").map(std::path::PathBuf::from)
            && dir
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("cortiq-xdg-"))
        {
            let _ = std::fs::remove_dir(dir);
        }
        std::process::exit(130);
    })
    .context("installing the Ctrl-C handler")?;
    Ok(())
}

fn run_convert(args: ConvertArgs) -> anyhow::Result<ExitCode> {
    let profile: engine::convert::Profile = args
        .quant
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--quant: {e}"))?;
    prepare_output(&args.output)?;
    let opts = engine::convert::ConvertOptions::new(args.input, args.output, profile);
    let bar = if args.quiet {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(0)
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{wide_bar}] {binary_bytes}/{binary_total_bytes} \
             {binary_bytes_per_sec} ETA {eta} {msg}",
        )
        .context("progress bar template")?,
    );
    let start = std::time::Instant::now();
    let report = engine::convert::convert(&opts, &mut |p| {
        bar.set_length(p.bytes_total);
        bar.set_position(p.bytes_done);
        bar.set_message(format!("{}/{} tensors", p.tensors_done, p.tensors_total));
    })?;
    bar.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "cortiq: wrote {} ({} {}, {} tensors, {:.1} MB from {:.1} MB of source in {:.1} s, {:.0} MB/s{}{}{})",
        report.output.display(),
        report.architecture,
        profile,
        report.tensors,
        report.output_bytes as f64 / 1e6,
        report.source_bytes as f64 / 1e6,
        secs,
        report.source_bytes as f64 / 1e6 / secs.max(1e-9),
        if report.verbatim > 0 {
            format!(", {} tensors copied verbatim", report.verbatim)
        } else {
            String::new()
        },
        if report.fallbacks > 0 {
            format!(", {} narrow matrices fell back to q8_2f", report.fallbacks)
        } else {
            String::new()
        },
        if report.skipped > 0 {
            format!(", {} vision tensors skipped", report.skipped)
        } else {
            String::new()
        },
    );
    Ok(ExitCode::SUCCESS)
}

fn run_logits(args: LogitsArgs) -> anyhow::Result<ExitCode> {
    let opts = engine::logits::LogitsOptions {
        tokens: args.tokens,
        decode_from: args.decode_from,
        placement: placement(&args.compute, None)?,
    };
    set_compute(&args.compute)?;
    let l = match args.model.path() {
        Some(p) => engine::logits::logits(p, &opts)?,
        None => engine::logits::logits_cmf(&engine::embedded_model()?, &opts)?,
    };
    let file = std::fs::File::create(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let mut w = io::BufWriter::new(file);
    engine::logits::write_npy(&mut w, l.rows, l.vocab, &l.data)
        .and_then(|_| w.flush())
        .with_context(|| format!("writing {}", args.out.display()))?;
    Ok(ExitCode::SUCCESS)
}

/// Prints a report to stdout: pretty JSON with `--json`, else its text form.
fn print_report(
    json: bool,
    report: &impl serde::Serialize,
    text: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> anyhow::Result<()> {
    let mut out = io::BufWriter::new(io::stdout().lock());
    if json {
        serde_json::to_writer_pretty(&mut out, report).context("writing JSON to stdout")?;
        writeln!(out)?;
    } else {
        text(&mut out)?;
    }
    out.flush()?;
    Ok(())
}

/// The runner of the model at `path`, else of the embedded demo model.
fn open_runner(
    path: Option<&std::path::Path>,
    place: &engine::model::Placement,
) -> anyhow::Result<engine::run::Runner> {
    Ok(match path {
        Some(p) => {
            let place = engine::model::Placement {
                expert_state: Some(expert_state(p)),
                ..place.clone()
            };
            engine::run::Runner::open_on(p, &place)?
        }
        None => engine::run::Runner::from_cmf_on(engine::embedded_model()?, place)?,
    })
}

/// Where a model file's learned expert scores are kept: beside it, `MODEL.cmf.experts`.
fn expert_state(model: &std::path::Path) -> std::path::PathBuf {
    let mut p = model.as_os_str().to_owned();
    p.push(".experts");
    p.into()
}

/// Keeps the learned expert scores beside the model file for the next run (a model with
/// experts on the CPU); a failure to write is a warning, the run's output stands.
fn save_expert_scores(runner: &engine::run::Runner, path: Option<&std::path::Path>) {
    let Some(p) = path else { return };
    let at = expert_state(p);
    match runner.model.model().save_expert_scores(&at) {
        Ok(true) => tracing::info!("expert scores kept in {}", at.display()),
        Ok(false) => {}
        Err(e) => tracing::warn!("{}: expert scores not kept: {e}", at.display()),
    }
}

/// Where the model runs: `--backend`, else `$CORTIQ_GPU`, else auto; `--vram`; the context a
/// device state holds.
fn placement(c: &cli::ComputeArgs, ctx: Option<usize>) -> anyhow::Result<engine::model::Placement> {
    let backend = match &c.backend {
        Some(b) => b.parse()?,
        None => match std::env::var("CORTIQ_GPU") {
            Ok(v) if !v.is_empty() => v.parse()?,
            _ => engine::gpu_runtime::BackendChoice::Auto,
        },
    };
    Ok(engine::model::Placement {
        backend,
        vram: c.vram,
        ctx,
        cpu_moe: c.n_cpu_moe,
        policy: Some(c.expert_cache.parse().map_err(anyhow::Error::msg)?),
        expert_state: None,
    })
}

/// A generating command's device context: `--ctx`, else the model's context length, capped
/// (a release model's 256K would preallocate gigabytes of cache nobody asked for).
fn generation_ctx(ctx: Option<usize>, path: Option<&std::path::Path>) -> Option<usize> {
    const CAP: usize = 32768;
    ctx.or_else(|| {
        let len = match path {
            Some(p) => cmf_format::Cmf::open(p)
                .ok()
                .and_then(|c| engine::run::context_length_of(&c)),
            None => engine::embedded_model()
                .ok()
                .and_then(|c| engine::run::context_length_of(&c)),
        };
        len.map(|n| n.min(CAP))
    })
}

/// The sampling settings: each flag given, else the model's generation default, else
/// llama.cpp's default; a fresh seed when none is given (printed when it matters, so the run
/// can be repeated).
fn sampling(
    args: &cli::SamplingArgs,
    model: engine::sampling::GenerationDefaults,
) -> engine::sampling::Sampling {
    let model = model.checked();
    let greedy_model = model.do_sample == Some(false);
    let temperature = args.temperature.unwrap_or(if greedy_model {
        0.0
    } else {
        model.temperature.unwrap_or(0.8)
    });
    let seed = args.seed.unwrap_or_else(engine::sampling::fresh_seed);
    if temperature > 0.0 && args.seed.is_none() {
        eprintln!("cortiq: seed {seed} (--seed {seed} repeats this run)");
    }
    engine::sampling::Sampling {
        temperature,
        top_k: args.top_k.or(model.top_k).unwrap_or(40),
        top_p: args.top_p.or(model.top_p).unwrap_or(0.95),
        min_p: args.min_p.or(model.min_p).unwrap_or(0.05),
        repeat_penalty: args
            .repeat_penalty
            .or(model.repetition_penalty)
            .unwrap_or(1.0),
        repeat_last_n: args.repeat_last_n,
        seed,
        ..engine::sampling::Sampling::default()
    }
}

/// Prompts longer than this are prefilled in chunks with a progress line on a terminal.
const PREFILL_CHUNK: usize = 512;

/// A progress bar on stderr when it is a terminal, hidden otherwise.
fn progress_bar(len: u64, what: &str) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template(&format!(
        "{what} {{pos}}/{{len}} tokens [{{wide_bar}}] {{per_sec}} ETA {{eta}}"
    )) {
        bar.set_style(style);
    }
    bar
}

fn rate(n: usize, s: f64) -> f64 {
    if s > 0.0 { n as f64 / s } else { 0.0 }
}

fn run_generate(args: cli::RunArgs) -> anyhow::Result<ExitCode> {
    use engine::generate::{Event, Finish, GenerateOptions};

    set_compute(&args.compute)?;
    let place = placement(
        &args.compute,
        generation_ctx(args.sampling.ctx, args.model.path()),
    )?;
    let runner = open_runner(args.model.path(), &place)?;
    let text = match (&args.prompt, &args.file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => engine::files::read_text(f, engine::files::MAX_TEXT_BYTES)?,
        (None, None) => anyhow::bail!("no prompt: give -p TEXT or -f FILE"),
    };
    let prompt = runner.encode(&text)?;
    let mut max_new = args.sampling.max_tokens;
    if let Some(ctx) = args.sampling.ctx {
        anyhow::ensure!(
            prompt.len() < ctx,
            "the prompt is {} tokens: --ctx {ctx} leaves no room to generate",
            prompt.len()
        );
        if prompt.len().saturating_add(max_new) > ctx {
            max_new = ctx - prompt.len();
            eprintln!(
                "cortiq: generating at most {max_new} tokens: the prompt is {} of --ctx {ctx}",
                prompt.len()
            );
        }
    }
    if let Some(model_ctx) = runner.context_length()
        && prompt.len().saturating_add(max_new) > model_ctx
    {
        eprintln!(
            "cortiq: warning: the prompt ({} tokens) plus -n {max_new} exceeds the model's context \
             length of {model_ctx} tokens; past it the output is not what the model was trained for",
            prompt.len()
        );
    }
    let mut sampler =
        engine::sampling::Sampler::new(sampling(&args.sampling, runner.generation_defaults()));
    let mut state = runner.model.model().new_state();
    let bar = if prompt.len() > PREFILL_CHUNK {
        progress_bar(prompt.len() as u64, "prefill")
    } else {
        indicatif::ProgressBar::hidden()
    };
    let opts = GenerateOptions {
        max_new,
        prefill_chunk: if prompt.len() > PREFILL_CHUNK {
            PREFILL_CHUNK
        } else {
            0
        },
        mtp: args.mtp,
        lookup: args.lookup,
        ..GenerateOptions::default()
    };
    let mut out = io::stdout().lock();
    let mut write_err = None;
    let g = runner.complete(&mut state, &prompt, &mut sampler, &opts, &mut |e| match e {
        Event::Prefill { done, total } => {
            bar.set_position(done as u64);
            if done == total {
                bar.finish_and_clear();
            }
        }
        Event::Text(piece) => {
            if write_err.is_none()
                && let Err(e) = out.write_all(piece.as_bytes()).and_then(|_| out.flush())
            {
                write_err = Some(e);
            }
        }
        Event::Token(_) => {}
    })?;
    if let Some(e) = write_err {
        return Err(e.into());
    }
    writeln!(out)?;
    // The checksum check runs beside generation; a short run waits for its verdict here, after
    // the text, so a damaged file never passes unnoticed.
    runner.model.integrity().wait()?;
    let experts = match runner.model.model().expert_share() {
        Some(share) => format!("; experts {:.1}% in VRAM", 100.0 * share),
        None => String::new(),
    };
    save_expert_scores(&runner, args.model.path());
    eprintln!(
        "cortiq: prompt {} tokens in {:.2} s ({:.1} tok/s); generated {} tokens in {:.2} s ({:.1} tok/s){experts}{}",
        g.prompt.len(),
        g.prompt_seconds,
        rate(g.prompt.len(), g.prompt_seconds),
        g.tokens.len(),
        g.gen_seconds,
        rate(g.tokens.len().saturating_sub(1), g.gen_seconds),
        if g.finish == Finish::Eos {
            ", stopped at EOS"
        } else {
            ""
        }
    );

    if let Some(d) = g.drafts {
        eprintln!(
            "cortiq: drafts: {} checked in {} steps, {} kept ({:.1}%); {:.2} tokens per check",
            d.drafted,
            d.checks,
            d.accepted,
            100.0 * d.accepted as f64 / d.drafted.max(1) as f64,
            d.mean_accepted_length()
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn run_chat(args: cli::ChatArgs) -> anyhow::Result<ExitCode> {
    use std::io::{BufRead, IsTerminal};

    set_compute(&args.compute)?;
    let place = placement(
        &args.compute,
        generation_ctx(args.sampling.ctx, args.model.path()),
    )?;
    let runner = open_runner(args.model.path(), &place)?;
    let settings = sampling(&args.sampling, runner.generation_defaults());
    let mut chat = engine::chat::Chat::new(&runner, args.system.as_deref(), settings)?;
    chat.ctx_limit = args.sampling.ctx.or(runner.context_length());
    chat.mtp = args.mtp;
    chat.lookup = args.lookup;
    const HELP: &str = "commands: /reset starts over, /quit or /exit (or Ctrl-D) ends, /help";
    let interactive = io::stdin().is_terminal();
    if interactive {
        eprintln!("cortiq chat: one line per message; {HELP}.");
    }
    let mut out = io::stdout().lock();
    let mut lines = io::stdin().lock().lines();
    loop {
        if interactive {
            eprint!("> ");
        }
        let Some(line) = lines.next().transpose()? else {
            break;
        };
        let line = line.trim();
        match line {
            "" => continue,
            "/quit" | "/exit" => break,
            "/reset" => {
                chat.reset();
                continue;
            }
            "/help" => {
                eprintln!("{HELP}");
                continue;
            }
            // A slash and a word is a command; an unknown one is answered, not sent to the model.
            c if c.starts_with('/') && c.len() > 1 && !c.contains(char::is_whitespace) => {
                eprintln!("cortiq chat: unknown command {c}; {HELP}");
                continue;
            }
            _ => {}
        }
        if !interactive {
            // Piped input is not echoed by a terminal: write the transcript.
            writeln!(out, "> {line}")?;
        }
        let mut write_err = None;
        let reply = chat.reply(line, args.sampling.max_tokens, &mut |piece| {
            if write_err.is_none()
                && let Err(e) = out.write_all(piece.as_bytes()).and_then(|_| out.flush())
            {
                write_err = Some(e);
            }
        });
        if let Some(e) = write_err {
            return Err(e.into());
        }
        let r = match reply {
            Ok(r) => r,
            // What the user can fix in the conversation ends the turn, not the session (the
            // conversation is as it was before the message).
            Err(
                e @ (engine::chat::ChatError::Context { .. }
                | engine::chat::ChatError::Template(_)
                | engine::chat::ChatError::Run(engine::run::RunError::EmptyPrompt)),
            ) => {
                eprintln!("cortiq chat: {e}");
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        writeln!(out)?;
        if !interactive {
            writeln!(out)?;
        }
        tracing::info!(
            prefilled = r.prefilled,
            reused = r.reused,
            tokens = r.tokens,
            "reply"
        );
        if interactive {
            eprintln!(
                "[{} prompt tokens ({} reused) at {:.1} tok/s; {} tokens at {:.1} tok/s]",
                r.prefilled + r.reused,
                r.reused,
                rate(r.prefilled, r.prompt_seconds),
                r.tokens,
                rate(r.tokens.saturating_sub(1), r.gen_seconds)
            );
        }
    }
    save_expert_scores(&runner, args.model.path());
    Ok(ExitCode::SUCCESS)
}

fn run_serve(args: cli::ServeArgs) -> anyhow::Result<ExitCode> {
    set_compute(&args.compute)?;
    let ctx = generation_ctx(args.sampling.ctx, args.model.path()).unwrap_or(4096);
    let place = placement(&args.compute, Some(ctx))?;
    let runner = open_runner(args.model.path(), &place)?;
    // Each request draws its own seed unless it gives one (a fixed default would make every
    // request with the same prompt answer the same).
    let mut args = args;
    args.sampling.seed = Some(0);
    let defaults = sampling(&args.sampling, runner.generation_defaults());
    let name = args.alias.clone().unwrap_or_else(|| {
        args.model
            .path()
            .and_then(|p| p.file_stem())
            .map_or("cortiq-demo".to_string(), |s| {
                s.to_string_lossy().into_owned()
            })
    });
    let api_key = args
        .api_key
        .clone()
        .or_else(|| std::env::var("CORTIQ_API_KEY").ok())
        .filter(|k| !k.is_empty());
    let backend = runner.model.model().backend_name().to_string();
    let mut wopts = engine::serve::worker::WorkerOptions::new(ctx);
    wopts.parallel = usize::from(args.parallel);
    wopts.cache_bytes = args.cache_mb << 20;
    // An explicit depth on a model without a head is refused before the server starts.
    engine::speculative::drafter(&runner, args.mtp, args.lookup)?;
    wopts.mtp = args.mtp;
    wopts.lookup = args.lookup;
    let worker = engine::serve::worker::Worker::spawn(runner, wopts)?;
    let state = engine::serve::ServerState::new(worker, &name, api_key, defaults);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))?;
        let local = listener.local_addr()?;
        eprintln!(
            "cortiq serve: {name} on {backend}, context {ctx} tokens, {} parallel, listening on \
             http://{local} (POST /v1/chat/completions, /v1/completions, /v1/messages; GET \
             /v1/models, /health)",
            args.parallel
        );
        engine::serve::serve_until(listener, state, shutdown_signal()).await?;
        eprintln!("cortiq serve: stopped");
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Resolves at SIGINT (Ctrl-C) or, on Unix, SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    eprintln!("cortiq serve: shutting down (the requests in flight end now)");
}

fn run_bench_cache(args: cli::BenchCacheArgs) -> anyhow::Result<ExitCode> {
    use model_qwen4::CachePolicy;
    use model_qwen4::cache_replay::{RoutingTrace, replay};
    let text = std::fs::read_to_string(&args.trace)
        .with_context(|| format!("reading {}", args.trace.display()))?;
    let trace =
        RoutingTrace::parse(&text).with_context(|| format!("in {}", args.trace.display()))?;
    let seen = trace.experts();
    let experts = args.experts.unwrap_or(seen);
    if seen > experts {
        anyhow::bail!(
            "{}: expert id {} routed, but --experts is {experts}",
            args.trace.display(),
            seen - 1
        );
    }
    let frames = trace.frames();
    let warm = args.warm.unwrap_or(frames / 3);
    if warm >= frames {
        anyhow::bail!(
            "{}: {frames} frames, none left after a warm-up of {warm}",
            args.trace.display()
        );
    }
    let prefetch = args
        .prefetch
        .unwrap_or(model_qwen4::Offload::default().prefetch);
    println!(
        "{}: {} layers, {frames} frames, {experts} experts; counted after {warm} frames, at most {} admission(s) a layer and frame, learned prefetching {prefetch}",
        args.trace.display(),
        trace.layers.len(),
        args.max_admissions
    );
    println!("| slots / layer | policy | routed pairs in VRAM | uploads / layer / frame |");
    println!("|---:|---|---:|---:|");
    for &slots in &args.slots {
        for policy in [CachePolicy::Learned, CachePolicy::Lru, CachePolicy::Static] {
            let r = replay(
                &trace,
                experts,
                slots.min(experts),
                policy,
                args.max_admissions,
                prefetch,
                warm,
            );
            let per = (frames - warm) * trace.layers.len();
            println!(
                "| {slots} | {} | {:.1}% | {:.3} |",
                format!("{policy:?}").to_lowercase(),
                100.0 * r.hit_rate(),
                r.admitted as f64 / per.max(1) as f64
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn run_bench_model(args: cli::BenchModelArgs) -> anyhow::Result<ExitCode> {
    use engine::bench_model::{ModelBenchOptions, bench};
    set_compute(&args.compute)?;
    let place = placement(&args.compute, Some(args.prompt.max(1) + args.decode + 8))?;
    let opts = ModelBenchOptions {
        prompt: args.prompt,
        decode: args.decode,
        reps: args.reps,
        dispatches: args.dispatches,
        batch: args.batch,
        verify: args.verify,
        scripted: args.synthetic.is_some(),
    };
    let mut err = io::stderr().lock();
    let mut progress = |r: &engine::bench_model::ModelRecord| {
        let _ = writeln!(err, "{}: {:.2} ± {:.2} tok/s", r.test, r.tok_s, r.stdev);
    };
    let report = match &args.synthetic {
        Some(name) if name == "qwen3.8-flash-next" => {
            let (layers, experts) = (args.layers.unwrap_or(48), args.experts.unwrap_or(512));
            let profile: engine::convert::Profile =
                args.quant.parse().map_err(anyhow::Error::msg)?;
            let config = model_qwen4::synthetic::release_config(layers, experts);
            let t0 = std::time::Instant::now();
            let mut synth = model_qwen4::synthetic::Synthetic::with_skew(
                &config,
                Box::new(move |n: &str, r: usize, c: usize| {
                    profile.dtype_for(engine::convert::qwen4_role(n, false), &[r, c])
                }),
                args.skew,
            )?;
            let offload = place.vram.is_some() || place.cpu_moe.is_some();
            if place.backend == engine::gpu_runtime::BackendChoice::Cpu || offload {
                // The CPU reads the host copies (the whole model, or the cold experts): each
                // tensor gets its own, as a file's mapping would.
                synth.distinct()?;
            }
            let weights = synth.weights()?;
            let model = model_qwen4::Model::new(synth.config.clone(), weights);
            let model = engine::model::AnyModel::place_qwen4(model, &place)?;
            let (mib, grouped) = match &model {
                engine::model::AnyModel::Qwen4Gpu(g) => {
                    (g.resident_bytes() >> 20, g.grouped_layers())
                }
                _ => (0, 0),
            };
            eprintln!(
                "synthetic model ready in {:.1} s ({} host MiB, {mib} device MiB; routed experts \
                 grouped in {grouped} of {layers} layers)",
                t0.elapsed().as_secs_f64(),
                synth.host_bytes() >> 20,
            );
            let bw = read_bandwidth(&model)?;
            let what = format!("{name} (synthetic: {layers} layers, {experts} experts)");
            bench(&model, &what, profile.name(), bw, &opts, &mut progress)?
        }
        Some(name) if name == "deepseek-v4-flash" => {
            let (layers, experts) = (args.layers.unwrap_or(43), args.experts.unwrap_or(256));
            let profile: engine::convert::Profile =
                args.quant.parse().map_err(anyhow::Error::msg)?;
            let config = model_dsv4::synthetic::release_config(layers, experts);
            // Cold experts read distinct host copies; with every expert resident the host
            // copies are only uploaded, and one shared payload does.
            let cold_possible = place.backend == engine::gpu_runtime::BackendChoice::Cpu
                || place.vram.is_some()
                || place.cpu_moe.is_some();
            let pool = args
                .host_experts
                .unwrap_or(if cold_possible { 1024 } else { 0 });
            let t0 = std::time::Instant::now();
            let synth = model_dsv4::synthetic::Synthetic::new(
                &config,
                Box::new(move |n: &str, r: usize, c: usize| {
                    profile.dtype_for(engine::convert::dsv4_role(n, false), &[r, c])
                }),
                args.skew,
                pool,
            )?;
            let weights = synth.weights()?;
            let model = model_dsv4::Model::new(synth.config.clone(), weights);
            let model = engine::model::AnyModel::place_dsv4(model, &place)?;
            let (mib, resident) = match &model {
                engine::model::AnyModel::Dsv4Gpu(g) => {
                    (g.resident_bytes() >> 20, g.resident_experts())
                }
                _ => (0, (0, layers * experts)),
            };
            eprintln!(
                "synthetic model ready in {:.1} s ({} host MiB, {} distinct host experts; {mib} \
                 device MiB, {} of {} routed experts resident)",
                t0.elapsed().as_secs_f64(),
                synth.host_bytes() >> 20,
                synth.pool(),
                resident.0,
                resident.1,
            );
            let bw = read_bandwidth(&model)?;
            let what = format!("{name} (synthetic: {layers} layers, {experts} experts)");
            bench(&model, &what, profile.name(), bw, &opts, &mut progress)?
        }
        Some(name) => anyhow::bail!(
            "--synthetic {name}: the synthetic geometries are: qwen3.8-flash-next, deepseek-v4-flash"
        ),
        None => {
            let runner = open_runner(args.model.as_deref(), &place)?;
            let model = runner.model.model();
            let bw = read_bandwidth(model)?;
            let what = args
                .model
                .as_ref()
                .map_or("built-in demo".to_string(), |p| p.display().to_string());
            bench(model, &what, "-", bw, &opts, &mut progress)?
        }
    };
    print_report(args.json, &report, |w| report.write_text(w))?;
    Ok(ExitCode::SUCCESS)
}

/// The read bandwidth of the device `model` runs on, measured now (bytes/s).
fn read_bandwidth(model: &engine::model::AnyModel<'_>) -> anyhow::Result<f64> {
    let ctx = match model {
        engine::model::AnyModel::Qwen4Gpu(g) => g.ctx(),
        engine::model::AnyModel::Dsv4Gpu(g) => g.ctx(),
        engine::model::AnyModel::Dsv41Gpu(g) => g.ctx(),
        _ => return Ok(engine::bench::cpu_read_bandwidth(1 << 30, 0.5)),
    };
    // As `bench kernels` does: a probe, then about half a second of reads (a short burst
    // measures the clocks ramping up, not the memory).
    let probe = engine::gpu_runtime::bench::read_ceiling(ctx, 1 << 30, 1)?;
    let reps = (0.5 / probe.1.seconds.max(1e-6)).clamp(5.0, 4000.0) as usize;
    Ok(engine::gpu_runtime::bench::read_ceiling(ctx, 1 << 30, reps)?.0)
}

fn run_perplexity(args: cli::PerplexityArgs) -> anyhow::Result<ExitCode> {
    set_compute(&args.compute)?;
    let (model, file) = args.resolve().map_err(anyhow::Error::msg)?;
    let place = placement(&args.compute, Some(args.ctx))?;
    let runner = open_runner(model.as_deref(), &place)?;
    let text = engine::files::read_text(&file, engine::files::MAX_TEXT_BYTES)?;
    let mut ids = runner
        .tokenizer
        .encode(text.as_str(), false)
        .map_err(|e| anyhow::anyhow!("{}: tokenizing: {e}", file.display()))?
        .get_ids()
        .to_vec();
    if let Some(n) = args.limit {
        ids.truncate(n);
    }
    let base = args
        .kl_base
        .as_deref()
        .map(|p| engine::model::LoadedModel::open_on(p, &place).map(std::sync::Arc::new))
        .transpose()?;
    if let Some(b) = &base {
        engine::integrity::Integrity::start(b);
    }
    let opts = engine::perplexity::PerplexityOptions {
        ctx: args.ctx,
        stride: args.stride.unwrap_or(args.ctx.div_ceil(2)),
    };
    // llama.cpp's running estimate: `[window]ppl` after each window, on stderr.
    let mut err = io::stderr().lock();
    let report = engine::perplexity::perplexity(
        runner.model.model(),
        base.as_ref().map(|b| b.model()),
        &ids,
        opts,
        &mut |p| {
            let _ = write!(err, "[{}/{}]{:.4},", p.done, p.total, p.ppl);
            let _ = err.flush();
        },
    )?;
    let _ = writeln!(err);
    runner.model.integrity().wait()?;
    if let Some(b) = &base {
        b.integrity().wait()?;
    }
    print_report(args.json, &report, |w| report.write_text(w))?;
    Ok(ExitCode::SUCCESS)
}
