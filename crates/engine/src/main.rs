//! The `cortiq` binary: parses arguments, runs one subcommand, maps the outcome to an exit code.
//!
//! Exit status: 0 success, 1 a check failed (`inspect --verify` found corrupt tensors), 2 an
//! error (bad arguments, unreadable or invalid file). A closed stdout (`| head`) exits 0.

mod cli;

use std::io::{self, Write};
use std::process::ExitCode;

use anyhow::Context;
use cli::{Cli, Command, InspectArgs};
use engine::inspect::{self, InspectOptions};

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
    let mut out = io::BufWriter::new(io::stdout().lock());
    if args.json {
        serde_json::to_writer_pretty(&mut out, &report).context("writing JSON to stdout")?;
        writeln!(out)?;
    } else {
        report.write_text(&mut out)?;
    }
    out.flush()?;
    let corrupt = report.verify.as_ref().is_some_and(|v| !v.bad.is_empty());
    Ok(if corrupt {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}
