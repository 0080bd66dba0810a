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
    init_logging();
    run(cli::parse())
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(io::stderr)
        .init();
}

fn run(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::Inspect(args) => run_inspect(args),
        Command::Doctor(args) => run_doctor(args),
        Command::Bench(BenchCommand::Kernels(args)) => run_bench_kernels(args),
        Command::Convert(args) => run_convert(args),
        Command::Logits(args) => run_logits(args),
        Command::Run(args) => run_generate(args),
        Command::Chat(args) => run_chat(args),
        Command::Perplexity(args) => run_perplexity(args),
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
    tracing::debug!(file = ?args.file, ?opts, "inspect");
    let report = match &args.file {
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
    if let Some(v) = &args.vram {
        o.vram_budget = Some(
            gpu_runtime::parse_size(v)
                .with_context(|| format!("--vram {v:?}: expected a size like 16G or 512M"))?,
        );
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
        large_bytes: gpu_runtime::parse_size(&args.large)
            .with_context(|| format!("--large {:?}: expected a size like 1G", args.large))?,
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

fn run_convert(args: ConvertArgs) -> anyhow::Result<ExitCode> {
    let profile: engine::convert::Profile = args
        .quant
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--quant: {e}"))?;
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
        "cortiq: wrote {} ({} {}, {} tensors, {:.1} MB from {:.1} MB of source in {:.1} s, {:.0} MB/s{}{})",
        report.output.display(),
        report.architecture,
        profile,
        report.tensors,
        report.output_bytes as f64 / 1e6,
        report.source_bytes as f64 / 1e6,
        secs,
        report.source_bytes as f64 / 1e6 / secs.max(1e-9),
        if report.verbatim > 0 {
            format!(", {} FP4 tensors copied verbatim", report.verbatim)
        } else {
            String::new()
        },
        if report.fallbacks > 0 {
            format!(", {} narrow matrices fell back to q8_2f", report.fallbacks)
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
    };
    let l = engine::logits::logits(&args.model, &opts)?;
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
fn open_runner(path: Option<&std::path::Path>) -> anyhow::Result<engine::run::Runner> {
    Ok(match path {
        Some(p) => engine::run::Runner::open(p)?,
        None => engine::run::Runner::from_cmf(engine::embedded_model()?)?,
    })
}

fn sampling(args: &cli::SamplingArgs) -> engine::sampling::Sampling {
    engine::sampling::Sampling {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    }
}

fn rate(n: usize, s: f64) -> f64 {
    if s > 0.0 { n as f64 / s } else { 0.0 }
}

fn run_generate(args: cli::RunArgs) -> anyhow::Result<ExitCode> {
    use engine::generate::{Event, Finish, GenerateOptions};

    let runner = open_runner(args.model.as_deref())?;
    let prompt = runner.encode(&args.prompt)?;
    let mut sampler = engine::sampling::Sampler::new(sampling(&args.sampling));
    let mut state = runner.model.model().new_state();
    let mut out = io::stdout().lock();
    let mut write_err = None;
    let g = runner.complete(
        &mut state,
        &prompt,
        &mut sampler,
        &GenerateOptions::new(args.sampling.max_tokens),
        &mut |e| {
            if let Event::Text(piece) = e
                && write_err.is_none()
                && let Err(e) = out.write_all(piece.as_bytes()).and_then(|_| out.flush())
            {
                write_err = Some(e);
            }
        },
    )?;
    if let Some(e) = write_err {
        return Err(e.into());
    }
    writeln!(out)?;
    eprintln!(
        "cortiq: prompt {} tokens in {:.2} s ({:.1} tok/s); generated {} tokens in {:.2} s ({:.1} tok/s){}",
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
    Ok(ExitCode::SUCCESS)
}

fn run_chat(args: cli::ChatArgs) -> anyhow::Result<ExitCode> {
    use std::io::{BufRead, IsTerminal};

    let runner = open_runner(args.model.as_deref())?;
    let mut chat =
        engine::chat::Chat::new(&runner, args.system.as_deref(), sampling(&args.sampling))?;
    let interactive = io::stdin().is_terminal();
    if interactive {
        eprintln!("cortiq chat: one line per message; /reset starts over, /quit (or Ctrl-D) ends.");
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
            _ => {}
        }
        let mut write_err = None;
        let r = chat.reply(line, args.sampling.max_tokens, &mut |piece| {
            if write_err.is_none()
                && let Err(e) = out.write_all(piece.as_bytes()).and_then(|_| out.flush())
            {
                write_err = Some(e);
            }
        })?;
        if let Some(e) = write_err {
            return Err(e.into());
        }
        writeln!(out)?;
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
    Ok(ExitCode::SUCCESS)
}

fn run_perplexity(args: cli::PerplexityArgs) -> anyhow::Result<ExitCode> {
    let runner = engine::run::Runner::open(&args.model)?;
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let mut ids = runner
        .tokenizer
        .encode(text.as_str(), false)
        .map_err(|e| anyhow::anyhow!("{}: tokenizing: {e}", args.file.display()))?
        .get_ids()
        .to_vec();
    if let Some(n) = args.max_tokens {
        ids.truncate(n);
    }
    let base_cmf = args
        .kl_base
        .as_ref()
        .map(engine::cmf_format::Cmf::open)
        .transpose()?;
    let base = base_cmf
        .as_ref()
        .map(engine::model::AnyModel::bind)
        .transpose()?;
    let opts = engine::perplexity::PerplexityOptions {
        ctx: args.ctx,
        stride: args.stride.unwrap_or(args.ctx.div_ceil(2)),
    };
    // llama.cpp's running estimate: `[window]ppl` after each window, on stderr.
    let mut err = io::stderr().lock();
    let report = engine::perplexity::perplexity(
        runner.model.model(),
        base.as_ref(),
        &ids,
        opts,
        &mut |p| {
            let _ = write!(err, "[{}/{}]{:.4},", p.done, p.total, p.ppl);
            let _ = err.flush();
        },
    )?;
    let _ = writeln!(err);
    print_report(args.json, &report, |w| report.write_text(w))?;
    Ok(ExitCode::SUCCESS)
}
