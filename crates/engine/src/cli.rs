//! The command line, parsed by clap into a plain description of what was asked.
//!
//! These types stay as close to the flags as possible; each subcommand resolves them into its
//! library options (e.g. [`engine::inspect::InspectOptions`]) in `main.rs`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// cortiq: run and inspect CMF model files.
#[derive(Debug, Parser)]
#[command(name = "cortiq", version, about, propagate_version = true)]
pub struct Cli {
    /// The subcommand.
    #[command(subcommand)]
    pub command: Command,
}

/// Every subcommand.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show what a CMF file holds: metadata, tensors, totals; optionally verify checksums.
    Inspect(InspectArgs),
}

/// `cortiq inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The CMF file (default: the example model embedded in the binary).
    pub file: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Check every tensor's checksum; exit with status 1 if any is corrupt.
    #[arg(long)]
    pub verify: bool,
    /// Show one tensor in detail.
    #[arg(long, value_name = "NAME")]
    pub tensor: Option<String>,
    /// With --tensor: print its first N values, dequantised to f32.
    #[arg(long, value_name = "N", requires = "tensor")]
    pub values: Option<usize>,
}

/// Parses `std::env::args`, exiting with clap's usage message on error.
pub fn parse() -> Cli {
    Cli::parse()
}
