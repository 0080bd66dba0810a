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
    /// Report the GPU (adapter, driver, features, limits, VRAM budget) and whether every kernel builds.
    Doctor(DoctorArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Convert a Hugging Face checkpoint directory (qwen4_exp, deepseek_v4) to one CMF file.
    Convert(ConvertArgs),
    /// Write float32 logits [T, vocab] of every prompt position as .npy (qwen4_exp, deepseek_v4; CPU).
    Logits(LogitsArgs),
    /// Generate text from a prompt, streamed to stdout (qwen4_exp, deepseek_v4; CPU).
    Run(RunArgs),
    /// Talk with a model through its chat template, one line per message (/reset, /quit).
    Chat(ChatArgs),
    /// Perplexity of a model on a text file; with --kl-base, KL and top-1 agreement vs a base.
    Perplexity(PerplexityArgs),
}

/// `cortiq logits`.
#[derive(Debug, Args)]
pub struct LogitsArgs {
    /// The CMF model.
    pub model: PathBuf,
    /// Token ids, comma-separated, used exactly as given (no BOS added).
    #[arg(long, value_delimiter = ',', required = true)]
    pub tokens: Vec<u32>,
    /// The .npy file to write.
    #[arg(long, value_name = "FILE.npy")]
    pub out: PathBuf,
    /// Prefill K tokens, then decode the rest one at a time (same output shape).
    #[arg(long, value_name = "K")]
    pub decode_from: Option<usize>,
}

/// `cortiq convert`.
#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// The checkpoint directory (config.json, *.safetensors, tokenizer files).
    pub input: PathBuf,
    /// The CMF file to write.
    #[arg(short, long, value_name = "OUT.cmf")]
    pub output: PathBuf,
    /// Quantisation profile: f32, f16, bf16, q8, q4, q2 or fp4 (docs/convert.md).
    #[arg(long, value_name = "PROFILE", default_value = "q4")]
    pub quant: String,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// Options every command that may use the GPU takes.
#[derive(Debug, Args)]
pub struct DeviceArgs {
    /// auto (GPU if present, else CPU), wgpu, or cpu. Default: $CORTIQ_GPU, else auto.
    #[arg(long, value_name = "BACKEND")]
    pub backend: Option<String>,
    /// VRAM the weight arena may use, e.g. 16G. Default: $CORTIQ_VRAM, else by adapter type.
    #[arg(long, value_name = "SIZE")]
    pub vram: Option<String>,
}

/// `cortiq doctor`.
#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Device selection.
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `cortiq bench ...`.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Matvec/matmat throughput of every format, against the same device's read bandwidth.
    Kernels(BenchKernelsArgs),
}

/// `cortiq bench kernels`.
#[derive(Debug, Args)]
pub struct BenchKernelsArgs {
    /// Device selection.
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Size of the large matrix, e.g. 1G (it must exceed every cache to measure memory).
    #[arg(long, value_name = "SIZE", default_value = "1G")]
    pub large: String,
    /// Seconds of measurement per record.
    #[arg(long, default_value_t = 0.5)]
    pub seconds: f64,
    /// Only these formats (comma-separated dtype names, e.g. q4tp,mxfp4).
    #[arg(long, value_delimiter = ',')]
    pub formats: Vec<String>,
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

/// Sampling flags shared by `run` and `chat`.
#[derive(Debug, Args)]
pub struct SamplingArgs {
    /// Most tokens to generate.
    #[arg(short = 'n', long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long = "temp", default_value_t = 0.8)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0 = all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches P.
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// `cortiq run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The CMF model, with an embedded tokenizer (default: the Shakespeare demo model embedded in
    /// the binary).
    pub model: Option<PathBuf>,
    /// The prompt.
    #[arg(short = 'p', long)]
    pub prompt: String,
    /// Sampling.
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// `cortiq chat`.
#[derive(Debug, Args)]
pub struct ChatArgs {
    /// The CMF model, with an embedded tokenizer and chat template (default: the embedded demo).
    pub model: Option<PathBuf>,
    /// A system message to start the conversation with.
    #[arg(long)]
    pub system: Option<String>,
    /// Sampling (-n is per reply).
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// `cortiq perplexity`.
#[derive(Debug, Args)]
pub struct PerplexityArgs {
    /// The CMF model.
    pub model: PathBuf,
    /// The text file to score (tokenised with the model's tokenizer, no special tokens added).
    pub file: PathBuf,
    /// Tokens per window.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Tokens between window starts (default: ctx / 2).
    #[arg(long)]
    pub stride: Option<usize>,
    /// Score only the first N tokens of the file.
    #[arg(long, value_name = "N")]
    pub max_tokens: Option<usize>,
    /// Also run this model on the same windows: mean KL divergence and top-1 agreement of MODEL
    /// against it.
    #[arg(long, value_name = "BASE.cmf")]
    pub kl_base: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}
