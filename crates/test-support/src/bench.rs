//! What the models' CPU bench examples share: a synthetic CMF writer (seeded random matrices in
//! one dtype, constant f32 vectors), the timing of a prefill and of cached decode through any
//! [`CausalLm`], the machine's read bandwidth, and the one-line report that sets decode speed
//! against the bandwidth bound.

use std::path::Path;
use std::time::Instant;

use cmf_format::{CmfWriter, Header};
use model_core::CausalLm;
use quant_codecs::{DType, synthetic_payload};
use rayon::prelude::*;

/// Writes a synthetic model: every matrix `dtype` with seeded random values, vectors f32.
pub struct SyntheticWriter {
    writer: CmfWriter,
    dtype: DType,
    seed: u64,
}

impl SyntheticWriter {
    /// A new file at `path` for `architecture` with `config` as its header config.
    pub fn create(
        path: &Path,
        architecture: &str,
        config: serde_json::Value,
        dtype: DType,
    ) -> Self {
        let mut header = Header::new(architecture);
        header.config = config;
        Self::with_header(path, header, dtype)
    }

    /// A new file at `path` with `header` (e.g. one carrying a tokenizer, so `cortiq run` can
    /// drive the synthetic model).
    pub fn with_header(path: &Path, header: Header, dtype: DType) -> Self {
        SyntheticWriter {
            writer: CmfWriter::create(path, header).unwrap_or_else(|e| panic!("{e}")),
            dtype,
            seed: 1,
        }
    }

    /// A `[rows, cols]` matrix of seeded random values.
    pub fn mat(&mut self, name: &str, rows: usize, cols: usize) {
        self.seed += 1;
        let b = synthetic_payload(self.dtype, rows, cols, self.seed).unwrap();
        self.writer
            .add_tensor(name, self.dtype, &[rows, cols], &b)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }

    /// An f32 tensor of `shape` holding `value` everywhere.
    pub fn vec(&mut self, name: &str, shape: &[usize], value: f32) {
        let n: usize = shape.iter().product();
        let b: Vec<u8> = (0..n).flat_map(|_| value.to_le_bytes()).collect();
        self.writer
            .add_tensor(name, DType::F32, shape, &b)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }

    /// An f32 tensor of `shape` holding `values`.
    pub fn f32s(&mut self, name: &str, shape: &[usize], values: &[f32]) {
        let b: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.writer
            .add_tensor(name, DType::F32, shape, &b)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }

    /// Finishes the file.
    pub fn finish(self) {
        self.writer.finish().unwrap_or_else(|e| panic!("{e}"));
    }
}

/// Prefill speed and cached-decode time of `model`.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// Prompt tokens per second.
    pub prefill_tok_s: f64,
    /// Seconds per decoded token.
    pub decode_s: f64,
}

/// Prefills `prompt` pseudo-random tokens below `vocab`, then decodes `n_dec` more one at a time.
pub fn time_forward<M: CausalLm>(model: &M, prompt: usize, n_dec: u32) -> Timing {
    let vocab = model.vocab_size() as u32;
    let tokens: Vec<u32> = (0..prompt as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let mut st = model.new_state();
    let t0 = Instant::now();
    model.forward(&tokens, &mut st).unwrap();
    let prefill_tok_s = prompt as f64 / t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    for i in 0..n_dec {
        model.forward(&[(i * 31 + 5) % vocab], &mut st).unwrap();
    }
    Timing {
        prefill_tok_s,
        decode_s: t0.elapsed().as_secs_f64() / n_dec as f64,
    }
}

/// Read bandwidth in bytes/s: a 1 GiB buffer summed with all cores, best of 3.
pub fn read_bandwidth() -> f64 {
    let buf = vec![1u64; 1 << 27];
    let mut bw: f64 = 0.0;
    for _ in 0..3 {
        let t0 = Instant::now();
        let s: u64 = buf
            .par_chunks(1 << 16)
            .map(|c| c.iter().copied().fold(0u64, u64::wrapping_add))
            .sum();
        std::hint::black_box(s);
        bw = bw.max((buf.len() * 8) as f64 / t0.elapsed().as_secs_f64());
    }
    bw
}

/// Times `model` and prints one line: prefill and decode speed, and decode against the bound
/// that reading `per_token_bytes` at the measured bandwidth sets.
pub fn report<M: CausalLm>(
    model: &M,
    dtype: DType,
    experts: usize,
    prompt: usize,
    per_token_bytes: usize,
) {
    let t = time_forward(model, prompt, 16);
    let bw = read_bandwidth();
    let bound = per_token_bytes as f64 / bw;
    println!(
        "dtype {} experts {experts} threads {}: prefill {prompt} tokens {:.1} tok/s; decode {:.2} tok/s \
         ({:.1} ms/token); {:.1} MB of weights per decoded token, read bandwidth {:.1} GB/s -> bound {:.1} ms/token \
         ({:.0}% of the bandwidth bound)",
        dtype.name(),
        rayon::current_num_threads(),
        t.prefill_tok_s,
        1.0 / t.decode_s,
        t.decode_s * 1e3,
        per_token_bytes as f64 / 1e6,
        bw / 1e9,
        bound * 1e3,
        100.0 * bound / t.decode_s
    );
}

/// The bench arguments `[DTYPE [EXPERTS [PROMPT]]]` with their defaults; sets the activation
/// path from `CORTIQ_ACT` (`f32`, the default, `int8` or `auto`).
pub fn args(default_experts: usize, default_prompt: usize) -> (DType, usize, usize) {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dtype = args
        .first()
        .map_or(DType::Q8_2f, |s| DType::from_name(s).expect("dtype name"));
    let experts = args
        .get(1)
        .map_or(default_experts, |s| s.parse().expect("experts"));
    let prompt = args
        .get(2)
        .map_or(default_prompt, |s| s.parse().expect("prompt"));
    // CORTIQ_ACT=int8 runs the projections on int8 activations (the f32 path otherwise).
    use quant_codecs::ops::ActChoice;
    let act = match std::env::var("CORTIQ_ACT").as_deref() {
        Ok("int8") => ActChoice::Int8,
        Ok("auto") => ActChoice::Auto,
        Ok("f32") | Err(_) => ActChoice::F32,
        Ok(other) => panic!("CORTIQ_ACT={other}: expected f32, int8 or auto"),
    };
    quant_codecs::ops::set_act_choice(act);
    eprintln!("activation path: {act:?}");
    (dtype, experts, prompt)
}
