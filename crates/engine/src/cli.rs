//! The command line, parsed by clap into a plain description of what was asked.
//!
//! These types stay as close to the flags as possible; each subcommand resolves them into its
//! library options (e.g. [`engine::inspect::InspectOptions`]) in `main.rs`. Conventions shared
//! by every command: the model is a positional argument or `-m`, and optional wherever the
//! embedded demo model can serve; the short flags are llama.cpp's (`-m`, `-p`, `-f`, `-n`, `-c`,
//! `-t`, `-o`); every number is checked here, with the flag and the accepted range in the
//! message, and negative numbers are read as values (and then refused where they make no
//! sense), never as unknown flags.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// cortiq: run, chat with, convert and measure mixture-of-experts models stored as CMF files.
///
/// With no model given, `run`, `chat`, `logits`, `perplexity` and `inspect` use the demo model
/// built into the binary (a 12.6 M-parameter qwen4_exp trained on Shakespeare).
#[derive(Debug, Parser)]
#[command(name = "cortiq", version, about, long_about, propagate_version = true)]
pub struct Cli {
    /// The subcommand.
    #[command(subcommand)]
    pub command: Command,
}

/// Every subcommand.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate text from a prompt, streamed to stdout (CPU today).
    Run(RunArgs),
    /// Talk with a model through its chat template, one line per message (/help lists commands).
    Chat(ChatArgs),
    /// Convert a Hugging Face checkpoint directory (qwen4_exp, deepseek_v4, deepseek_v41) to one CMF file.
    Convert(ConvertArgs),
    /// Perplexity of a model on a text file; with --kl-base, KL and top-1 agreement vs a base.
    Perplexity(PerplexityArgs),
    /// Show what a CMF file holds: metadata, generation defaults, tensors; optionally verify checksums.
    Inspect(InspectArgs),
    /// Report the GPU (adapter, driver, features, limits, VRAM budget) and whether every kernel builds.
    Doctor(DoctorArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Write float32 logits [T, vocab] of every prompt position as .npy (CPU).
    Logits(LogitsArgs),
    /// Serve the model over HTTP: OpenAI-compatible chat and text completions, streaming.
    Serve(ServeArgs),
}

/// `cortiq serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The model (default: the built-in demo).
    #[command(flatten)]
    pub model: ModelArg,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port, printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require this key with every request (`Authorization: Bearer KEY` or `x-api-key`).
    /// Default: $CORTIQ_API_KEY, else none.
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// The name `/v1/models` reports (default: the file's stem, or `cortiq-demo`).
    #[arg(long, value_name = "NAME")]
    pub alias: Option<String>,
    /// Requests decoded together, their tokens batched into one forward step; more queue.
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub parallel: u16,
    /// Memory the prompt cache may keep in sequence states (host memory on the CPU, device
    /// memory on the GPU); 0 turns it off.
    #[arg(long, value_name = "MIB", default_value_t = 2048)]
    pub cache_mb: u64,
    /// Drafting with the model's MTP head while one request decodes alone (with others
    /// active, their tokens are batched instead): up to N tokens a step (1..=7), `auto`, or
    /// `off`. Replies are the same either way.
    #[arg(long, value_name = "N|auto|off", default_value = "off")]
    pub mtp: engine::speculative::MtpMode,
    /// Prompt-lookup drafting instead: up to N tokens a step (1..=7; 0: off) copied from where
    /// the last 2-4 tokens occurred before in the context (the conversation so far, the
    /// prompt, the reply), checked like MTP drafts (the same tokens either way; no head needed).
    /// Pays on text that repeats its context.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub lookup: usize,
    /// Sampling defaults for requests that leave a field out, and the context (-c).
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Threads, activations, backend, VRAM.
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// The model: positional, or `-m` as llama.cpp spells it.
#[derive(Debug, Args)]
pub struct ModelArg {
    /// The CMF model file (default: the demo model built into the binary).
    #[arg(value_name = "MODEL")]
    pub model_pos: Option<PathBuf>,
    /// The CMF model file (the same as the positional MODEL).
    #[arg(
        short = 'm',
        long = "model",
        value_name = "MODEL",
        conflicts_with = "model_pos"
    )]
    pub model_flag: Option<PathBuf>,
}

impl ModelArg {
    /// The model given, if any.
    pub fn path(&self) -> Option<&std::path::Path> {
        self.model_flag.as_deref().or(self.model_pos.as_deref())
    }
}

/// How the CPU computes: threads and the activation path of the quantised projections.
#[derive(Debug, Args)]
pub struct ComputeArgs {
    /// CPU threads for the forward pass (default: every core).
    #[arg(short = 't', long, value_name = "N", value_parser = threads, allow_negative_numbers = true)]
    pub threads: Option<usize>,
    /// Activations of the quantised projections: auto (int8 for q4tp, q2tp and mxfp4, f32 for
    /// q8_2f: the faster path of each; f32 for all on a CPU without AVX2, whose int8 path is
    /// the slow portable reference), int8 (quantised per 32-block, integer dot products) or
    /// f32 (the exact reference path). Float matrices always take f32.
    #[arg(long, value_enum, default_value_t = Act::Auto)]
    pub act: Act,
    /// auto (a hardware GPU when there is one and the model fits its budget, else the CPU),
    /// wgpu (the GPU, a software one too), or cpu. Default: $CORTIQ_GPU, else auto. Runs on
    /// the GPU: qwen4_exp.
    #[arg(long, value_name = "BACKEND")]
    pub backend: Option<String>,
    /// VRAM the model's weights may use on the GPU, e.g. 16G (K, M, G, T; binary units).
    /// Default: $CORTIQ_VRAM, else by adapter type. Routed experts that do not fit are
    /// computed on the CPU.
    #[arg(long, value_name = "SIZE", value_parser = positive_size)]
    pub vram: Option<u64>,
    /// Keep the routed experts of the first N layers on the CPU and the rest in VRAM
    /// (llama.cpp's static policy; default: as many experts in every layer as --vram holds).
    #[arg(long, value_name = "N")]
    pub n_cpu_moe: Option<usize>,
    /// How the resident routed experts change while running, when not all fit: learned
    /// (routing frequency with recency; scores kept beside the model file in MODEL.experts so
    /// the next run starts warm), lru, or static.
    #[arg(long, value_name = "POLICY", default_value = "learned")]
    pub expert_cache: String,
}

/// The activation path (`--act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Act {
    /// Exact f32 activations.
    F32,
    /// int8 activations per 32-element block.
    Int8,
    /// The faster of the two per format.
    Auto,
}

/// `cortiq logits`.
#[derive(Debug, Args)]
pub struct LogitsArgs {
    /// The model.
    #[command(flatten)]
    pub model: ModelArg,
    /// Token ids, comma-separated, used exactly as given (no BOS added).
    #[arg(
        long,
        value_delimiter = ',',
        required = true,
        allow_negative_numbers = true
    )]
    pub tokens: Vec<u32>,
    /// The .npy file to write.
    #[arg(short = 'o', long, value_name = "FILE.npy")]
    pub out: PathBuf,
    /// Prefill K tokens, then decode the rest one at a time (same output shape).
    #[arg(long, value_name = "K", allow_negative_numbers = true)]
    pub decode_from: Option<usize>,
    /// Threads.
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// `cortiq convert`.
#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// The checkpoint directory (config.json, *.safetensors, tokenizer files).
    pub input: PathBuf,
    /// The CMF file to write (written to a temporary file beside it, renamed when complete).
    #[arg(short, long, value_name = "OUT.cmf")]
    pub output: PathBuf,
    /// Quantisation profile: f32, f16, bf16, q8, q4, q2, fp4, or source (every tensor in its
    /// checkpoint precision) (docs/convert.md).
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
    /// VRAM the weight arena may use, e.g. 16G or 1.5T (K, M, G, T; binary units). Default:
    /// $CORTIQ_VRAM, else by adapter type.
    #[arg(long, value_name = "SIZE", value_parser = positive_size)]
    pub vram: Option<u64>,
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
    /// Prefill and decode tokens/s of a whole model (a file, or the synthetic release
    /// geometry), with the bound the device's read bandwidth puts on decode.
    Model(BenchModelArgs),
    /// Hit rates of the expert cache's policies replayed over recorded routing
    /// (CORTIQ_ROUTING_TRACE=FILE on a run with experts on the CPU), at any bank size.
    Cache(BenchCacheArgs),
}

/// `cortiq bench cache`.
#[derive(Debug, Args)]
pub struct BenchCacheArgs {
    /// The routing trace (one line per layer and frame: `layer: id id ...`).
    #[arg(value_name = "TRACE")]
    pub trace: PathBuf,
    /// Bank sizes to replay, in experts per layer, comma-separated.
    #[arg(long, value_name = "N,...", value_delimiter = ',', required = true, value_parser = count)]
    pub slots: Vec<usize>,
    /// Experts per layer (default: one more than the largest id in the trace).
    #[arg(long, value_name = "N", value_parser = count)]
    pub experts: Option<usize>,
    /// Admissions per layer and frame (what a run allows: 1).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub max_admissions: usize,
    /// Frames not counted while the cache warms up (default: the first third).
    #[arg(long, value_name = "N")]
    pub warm: Option<usize>,
    /// The learned policy's prefetch: the next layer's likeliest experts uploaded per layer
    /// and frame (what a run does with CORTIQ_PREFETCH=N; default: a run's default).
    #[arg(long, value_name = "N")]
    pub prefetch: Option<usize>,
}

/// `cortiq bench model`.
#[derive(Debug, Args)]
pub struct BenchModelArgs {
    /// The model file (default: the built-in demo; see --synthetic).
    #[arg(value_name = "MODEL.cmf", conflicts_with = "synthetic")]
    pub model: Option<PathBuf>,
    /// A random-weight model of a released geometry, made in memory without a file:
    /// qwen3.8-flash-next or deepseek-v4-flash.
    #[arg(long, value_name = "NAME")]
    pub synthetic: Option<String>,
    /// The synthetic model's profile: q8, q4, q2 or fp4 (docs/convert.md).
    #[arg(long, value_name = "PROFILE", default_value = "q4")]
    pub quant: String,
    /// The synthetic model's layers (default: the release's, 48 or 43).
    #[arg(long, value_name = "N", value_parser = count)]
    pub layers: Option<usize>,
    /// The synthetic model's routed experts per layer (default: the release's, 512 or 256).
    #[arg(long, value_name = "N", value_parser = count)]
    pub experts: Option<usize>,
    /// With --synthetic deepseek-v4-flash: distinct host copies of a routed expert that the
    /// cold experts read (expert (layer, x) takes copy (layer * experts + x) mod N; the
    /// release's 147 GB of experts do not fit a host's RAM). Default: 1024 (13.7 GB of FP4),
    /// far past any CPU cache, when experts run on the CPU; else 0.
    #[arg(long, value_name = "N")]
    pub host_experts: Option<usize>,
    /// Prompt tokens of the prefill test (0 skips it).
    #[arg(short = 'p', long, default_value_t = 512)]
    pub prompt: usize,
    /// Tokens of the decode test (0 skips it).
    #[arg(short = 'n', long, default_value_t = 128)]
    pub decode: usize,
    /// Timed repetitions of each test (after one warm-up).
    #[arg(short = 'r', long, default_value_t = 3, value_parser = count)]
    pub reps: usize,
    /// Also time every dispatch of a decoded token (GPU) and list the kernels by time.
    #[arg(long)]
    pub dispatches: bool,
    /// Also decode this many sequences together (tgNxB), one batched forward per step as the
    /// server's parallel requests run; their total tok/s.
    #[arg(long, value_name = "B", default_value_t = 1, value_parser = count)]
    pub batch: usize,
    /// Also time MTP's check step: one forward of K = 2..=8 rows with every row's logits
    /// (`verifyK`, steps per second, beside `tgN`'s one-row steps).
    #[arg(long)]
    pub verify: bool,
    /// With --synthetic: skewed expert popularity (the router row of the expert of popularity
    /// rank r, a fixed shuffle of the ids, scaled by (r+1)^-SKEW; 0 routes uniformly, 0.15
    /// sends ~56% of the routed pairs to a quarter of the experts).
    #[arg(long, value_name = "SKEW", default_value_t = 0.0)]
    pub skew: f64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Threads, activations, backend, VRAM.
    #[command(flatten)]
    pub compute: ComputeArgs,
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
    #[arg(long, value_name = "SIZE", default_value = "1G", value_parser = positive_size)]
    pub large: u64,
    /// Seconds of measurement per record (setup, such as making the test matrices, comes on top).
    #[arg(long, default_value_t = 0.5, value_parser = positive_seconds, allow_negative_numbers = true)]
    pub seconds: f64,
    /// Only these formats (comma-separated dtype names, e.g. q4tp,mxfp4).
    #[arg(long, value_delimiter = ',')]
    pub formats: Vec<String>,
}

/// `cortiq inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The model.
    #[command(flatten)]
    pub model: ModelArg,
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
    #[arg(
        long,
        value_name = "N",
        requires = "tensor",
        allow_negative_numbers = true
    )]
    pub values: Option<usize>,
}

/// Parses `std::env::args`; `Err` carries clap's usage message (or `--help` / `--version`).
pub fn parse() -> Result<Cli, clap::Error> {
    Cli::try_parse()
}

/// Sampling flags shared by `run` and `chat`. Unset flags take the model's own generation
/// defaults (`cortiq inspect` shows them), else llama.cpp's defaults.
#[derive(Debug, Args)]
pub struct SamplingArgs {
    /// Most tokens to generate (per reply in chat).
    #[arg(short = 'n', long = "max-tokens", value_name = "N", default_value_t = 128,
          value_parser = count, allow_negative_numbers = true)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy. Default: the model's, else 0.8.
    #[arg(long = "temp", value_name = "T", value_parser = temperature, allow_negative_numbers = true)]
    pub temperature: Option<f32>,
    /// Keep only the K most likely tokens (0 = all). Default: the model's, else 40.
    #[arg(long, value_name = "K", allow_negative_numbers = true)]
    pub top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches P, in (0, 1]. Default: the
    /// model's, else 0.95.
    #[arg(long, value_name = "P", value_parser = top_p, allow_negative_numbers = true)]
    pub top_p: Option<f32>,
    /// Drop tokens less likely than P times the most likely one, in [0, 1]. Default: the
    /// model's, else 0.05.
    #[arg(long, value_name = "P", value_parser = unit_interval, allow_negative_numbers = true)]
    pub min_p: Option<f32>,
    /// Penalise tokens seen in the last --repeat-last-n tokens (1 = off, > 1 discourages
    /// repeats). Default: the model's, else 1.
    #[arg(long, value_name = "X", value_parser = penalty, allow_negative_numbers = true)]
    pub repeat_penalty: Option<f32>,
    /// How many recent tokens the repeat penalty looks at.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 64,
        allow_negative_numbers = true
    )]
    pub repeat_last_n: usize,
    /// Random seed (default: a fresh one, printed so the run can be repeated).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub seed: Option<u64>,
    /// Context limit in tokens, prompt included. Default: none for run (it warns past the
    /// model's context length), the model's context length for chat.
    #[arg(short = 'c', long = "ctx", value_name = "N", value_parser = count,
          allow_negative_numbers = true)]
    pub ctx: Option<usize>,
}

/// `cortiq run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The model.
    #[command(flatten)]
    pub model: ModelArg,
    /// The prompt.
    #[arg(
        short = 'p',
        long,
        required_unless_present = "file",
        conflicts_with = "file"
    )]
    pub prompt: Option<String>,
    /// Read the prompt from this text file (UTF-8, at most 256 MiB).
    #[arg(short = 'f', long, value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// Sampling.
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Drafting with the model's MTP head: up to N tokens a step (1..=7), `auto` (up to 3
    /// where the model has a head and the backend runs it), or `off`. The generated tokens are
    /// the same either way; a monitor drafts less, or not at all, while drafting does not pay.
    #[arg(long, value_name = "N|auto|off", default_value = "off")]
    pub mtp: engine::speculative::MtpMode,
    /// Prompt-lookup drafting instead: up to N tokens a step (1..=7; 0: off) copied from where
    /// the last 2-4 tokens occurred before in the context (the conversation so far, the
    /// prompt, the reply), checked like MTP drafts (the same tokens either way; no head needed).
    /// Pays on text that repeats its context.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub lookup: usize,
    /// Threads.
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// `cortiq chat`.
#[derive(Debug, Args)]
pub struct ChatArgs {
    /// The model (it needs an embedded chat template).
    #[command(flatten)]
    pub model: ModelArg,
    /// A system message to start the conversation with.
    #[arg(long)]
    pub system: Option<String>,
    /// Sampling.
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Drafting with the model's MTP head: up to N tokens a step (1..=7), `auto` (up to 3
    /// where the model has a head and the backend runs it), or `off`. The generated tokens are
    /// the same either way; a monitor drafts less, or not at all, while drafting does not pay.
    #[arg(long, value_name = "N|auto|off", default_value = "off")]
    pub mtp: engine::speculative::MtpMode,
    /// Prompt-lookup drafting instead: up to N tokens a step (1..=7; 0: off) copied from where
    /// the last 2-4 tokens occurred before in the context (the conversation so far, the
    /// prompt, the reply), checked like MTP drafts (the same tokens either way; no head needed).
    /// Pays on text that repeats its context.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub lookup: usize,
    /// Threads.
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// `cortiq perplexity`.
#[derive(Debug, Args)]
pub struct PerplexityArgs {
    /// `[MODEL] FILE`: the CMF model (default: the built-in demo) and the UTF-8 text file to
    /// score (tokenised with the model's tokenizer, no special tokens added; at most 256 MiB).
    #[arg(value_name = "PATHS", num_args = 0..=2)]
    pub paths: Vec<PathBuf>,
    /// The CMF model (instead of the first positional path).
    #[arg(short = 'm', long = "model", value_name = "MODEL")]
    pub model: Option<PathBuf>,
    /// The text file to score (instead of the last positional path).
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// Tokens per window (at least 2).
    #[arg(short = 'c', long, default_value_t = 512, value_parser = window, allow_negative_numbers = true)]
    pub ctx: usize,
    /// Tokens between window starts (default: ctx / 2).
    #[arg(long, value_parser = count, allow_negative_numbers = true)]
    pub stride: Option<usize>,
    /// Score only the first N tokens of the text.
    #[arg(long, value_name = "N", value_parser = count, allow_negative_numbers = true)]
    pub limit: Option<usize>,
    /// Also run this model on the same windows: mean KL divergence and top-1 agreement of MODEL
    /// against it.
    #[arg(long, value_name = "BASE.cmf")]
    pub kl_base: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Threads.
    #[command(flatten)]
    pub compute: ComputeArgs,
}

impl PerplexityArgs {
    /// `(model, text)` from the positional paths and the flags.
    pub fn resolve(&self) -> Result<(Option<PathBuf>, PathBuf), String> {
        let mut pos = self.paths.iter().cloned();
        let (model, file) = match (self.model.clone(), self.file.clone(), self.paths.len()) {
            (m, Some(f), n) if n + usize::from(m.is_some()) <= 1 => (m.or(pos.next()), f),
            (Some(m), None, 1) => (Some(m), pos.next().expect("one path")),
            (None, None, 1) => (None, pos.next().expect("one path")),
            (None, None, 2) => (pos.next(), pos.next().expect("two paths")),
            (_, None, 0) => return Err("no text file to score (perplexity [MODEL] FILE)".into()),
            _ => {
                return Err(
                    "too many paths: give perplexity [MODEL] FILE, or -m MODEL and -f FILE".into(),
                );
            }
        };
        Ok((model, file))
    }
}

// ---- value checks: each names the accepted range (clap adds the flag and the value) ----

fn number<T: std::str::FromStr>(s: &str) -> Result<T, String> {
    s.trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number"))
}

fn finite(s: &str) -> Result<f64, String> {
    let v: f64 = number(s)?;
    if v.is_finite() {
        Ok(v)
    } else {
        Err("must be a finite number".into())
    }
}

fn temperature(s: &str) -> Result<f32, String> {
    match finite(s)? {
        v if v >= 0.0 => Ok(v as f32),
        _ => Err("must be >= 0 (0 is greedy)".into()),
    }
}

fn top_p(s: &str) -> Result<f32, String> {
    match finite(s)? {
        v if v > 0.0 && v <= 1.0 => Ok(v as f32),
        _ => Err("must be in (0, 1]".into()),
    }
}

fn unit_interval(s: &str) -> Result<f32, String> {
    match finite(s)? {
        v if (0.0..=1.0).contains(&v) => Ok(v as f32),
        _ => Err("must be in [0, 1]".into()),
    }
}

fn penalty(s: &str) -> Result<f32, String> {
    match finite(s)? {
        v if v > 0.0 => Ok(v as f32),
        _ => Err("must be > 0 (1 is off)".into()),
    }
}

fn positive_seconds(s: &str) -> Result<f64, String> {
    match finite(s)? {
        v if v > 0.0 && v <= 3600.0 => Ok(v),
        _ => Err("must be in (0, 3600] seconds".into()),
    }
}

fn count(s: &str) -> Result<usize, String> {
    match number::<i128>(s)? {
        v if v >= 1 && v <= usize::MAX as i128 => Ok(v as usize),
        _ => Err("must be a whole number >= 1".into()),
    }
}

fn window(s: &str) -> Result<usize, String> {
    match count(s)? {
        v if v >= 2 => Ok(v),
        _ => Err("must be at least 2 (a window predicts its tokens from the ones before)".into()),
    }
}

fn threads(s: &str) -> Result<usize, String> {
    match number::<i128>(s)? {
        v if (1..=4096).contains(&v) => Ok(v as usize),
        _ => Err("must be between 1 and 4096".into()),
    }
}

fn positive_size(s: &str) -> Result<u64, String> {
    match engine::gpu_runtime::parse_size(s) {
        Some(v) if v > 0 => Ok(v),
        Some(_) => Err("must be larger than 0".into()),
        None => Err("expected a size like 512M, 16G or 1.5T (K, M, G, T; binary units)".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_checked_with_their_range() {
        assert_eq!(temperature("0"), Ok(0.0));
        assert!(temperature("-1").unwrap_err().contains(">= 0"));
        assert!(temperature("nan").unwrap_err().contains("finite"));
        assert!(temperature("inf").is_err());
        assert!(top_p("2").unwrap_err().contains("(0, 1]"));
        assert!(top_p("-0.5").is_err());
        assert!(top_p("0").is_err());
        assert_eq!(top_p("1"), Ok(1.0));
        assert!(penalty("0").is_err());
        assert!(count("0").is_err());
        assert!(count("-3").is_err());
        assert!(window("1").unwrap_err().contains("at least 2"));
        assert!(positive_seconds("-1").is_err());
        assert!(positive_size("0").unwrap_err().contains("larger than 0"));
        assert_eq!(positive_size("1T"), Ok(1 << 40));
        assert_eq!(positive_size("1.5G"), Ok(3 << 29));
        assert!(threads("0").is_err());
    }

    #[test]
    fn perplexity_paths_resolve_every_spelling() {
        let args = |v: &[&str]| {
            let cli = Cli::try_parse_from([&["cortiq", "perplexity"], v].concat()).unwrap();
            let Command::Perplexity(p) = cli.command else {
                unreachable!()
            };
            p.resolve()
        };
        let p = PathBuf::from;
        assert_eq!(
            args(&["m.cmf", "t.txt"]),
            Ok((Some(p("m.cmf")), p("t.txt")))
        );
        assert_eq!(args(&["t.txt"]), Ok((None, p("t.txt"))));
        assert_eq!(
            args(&["-m", "m.cmf", "t.txt"]),
            Ok((Some(p("m.cmf")), p("t.txt")))
        );
        assert_eq!(args(&["-f", "t.txt"]), Ok((None, p("t.txt"))));
        assert_eq!(
            args(&["m.cmf", "-f", "t.txt"]),
            Ok((Some(p("m.cmf")), p("t.txt")))
        );
        assert!(args(&[]).is_err());
        assert!(args(&["-m", "m.cmf", "a", "b"]).is_err());
    }

    #[test]
    fn negative_numbers_are_values_and_refused_by_range() {
        let e = Cli::try_parse_from(["cortiq", "run", "-p", "x", "--temp", "-1"]).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("--temp") && msg.contains(">= 0"), "{msg}");
        let e = Cli::try_parse_from(["cortiq", "run", "-p", "x", "-n", "-5"]).unwrap_err();
        assert!(e.to_string().contains("whole number >= 1"), "{e}");
        // Every numeric flag reads a negative number as its value, then refuses it.
        for flag in ["--top-k", "--repeat-last-n", "--seed"] {
            let e = Cli::try_parse_from(["cortiq", "run", "-p", "x", flag, "-1"]).unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains("invalid value '-1'") && msg.contains(flag),
                "{msg}"
            );
        }
    }
}
