//! cortiq developer tasks, run as `cargo xtask TASK`.
//!
//! Tasks:
//! - `tiny-cmf [OUT]`: write the deterministic example model file (default `assets/tiny.cmf`).
//! - `shaders`: parse and validate every WGSL module and specialisation with naga, for the
//!   lavapipe, full and minimal capability sets, printing naga's rendered errors.
//! - `synth-checkpoint DIR [--gb N] [--vocab N]`: write a deterministic synthetic `qwen4_exp` checkpoint of
//!   at least N GB (default 4) for measuring `cortiq convert` (docs/perf.md); never committed.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use cmf_format::{Cmf, CmfWriter, Header};
use quant_codecs::DType;

fn main() -> ExitCode {
    match run(std::env::args().skip(1).collect()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Vec<String>) -> Result<()> {
    match args.first().map(String::as_str) {
        Some("tiny-cmf") => {
            let out = match args.get(1) {
                Some(p) => PathBuf::from(p),
                None => workspace_root().join("assets/tiny.cmf"),
            };
            tiny_cmf(&out)
        }
        Some("shaders") => shaders(),
        Some("synth-checkpoint") => {
            let dir = args
                .get(1)
                .context("usage: cargo xtask synth-checkpoint DIR [--gb N] [--vocab N]")?;
            let (mut gb, mut vocab) = (4.0, None);
            let mut rest = args[2..].iter();
            while let Some(flag) = rest.next() {
                let value = rest
                    .next()
                    .with_context(|| format!("{flag} needs a number"))?;
                match flag.as_str() {
                    "--gb" => gb = value.parse::<f64>().context("--gb")?,
                    "--vocab" => vocab = Some(value.parse::<usize>().context("--vocab")?),
                    other => bail!("unexpected argument {other:?}"),
                }
            }
            synth_checkpoint(Path::new(dir), gb, vocab)
        }
        Some(other) => bail!(
            "unknown task {other:?}; tasks: tiny-cmf [OUT], shaders, synth-checkpoint DIR [--gb N] [--vocab N]"
        ),
        None => bail!("usage: cargo xtask TASK; tasks: tiny-cmf [OUT], shaders"),
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// splitmix64: a tiny deterministic generator, so the example file never changes.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-scale, scale).
    fn weight(&mut self, scale: f32) -> f32 {
        let unit = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        (2.0 * unit - 1.0) * scale
    }
}

/// The example model: a one-layer "tiny-example" with a tensor in every dtype.
fn tiny_cmf(out: &Path) -> Result<()> {
    const HIDDEN: usize = 64;
    const VOCAB: usize = 128;
    const INTER: usize = 96;
    let mut h = Header::new("tiny-example");
    h.config = serde_json::json!({
        "architectures": ["TinyExample"],
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "num_experts": 2
    });
    h.dims.hidden_size = Some(HIDDEN as u64);
    h.dims.num_hidden_layers = Some(1);
    h.dims.vocab_size = Some(VOCAB as u64);
    h.dims.max_position_embeddings = Some(256);
    h.quantization.profile = "tiny-mixed".into();
    h.provenance.converter = "cortiq xtask tiny-cmf".into();
    h.generation = Some(serde_json::json!({"temperature": 0.0}));

    // (name, dtype, shape); quantised matrices take their last two dims as [rows, cols].
    let tensors: [(&str, DType, &[usize]); 11] = [
        ("model.embed_tokens.weight", DType::Q8_2f, &[VOCAB, HIDDEN]),
        (
            "model.layers.0.input_layernorm.weight",
            DType::F32,
            &[HIDDEN],
        ),
        (
            "model.layers.0.self_attn.q_proj.weight",
            DType::F16,
            &[HIDDEN, HIDDEN],
        ),
        (
            "model.layers.0.self_attn.k_proj.weight",
            DType::BF16,
            &[32, HIDDEN],
        ),
        (
            "model.layers.0.self_attn.v_proj.weight",
            DType::Q8_2f,
            &[32, HIDDEN],
        ),
        (
            "model.layers.0.self_attn.o_proj.weight",
            DType::Q4tp,
            &[HIDDEN, HIDDEN],
        ),
        (
            "model.layers.0.post_attention_layernorm.weight",
            DType::BF16,
            &[HIDDEN],
        ),
        (
            "model.layers.0.mlp.experts.gate_up_proj",
            DType::Mxfp4,
            &[2, 2 * INTER, HIDDEN],
        ),
        (
            "model.layers.0.mlp.experts.down_proj",
            DType::Q2tp,
            &[2, HIDDEN, INTER],
        ),
        ("model.norm.weight", DType::F16, &[HIDDEN]),
        ("lm_head.weight", DType::Q4tp, &[VOCAB, HIDDEN]),
    ];
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut rng = SplitMix(0x00c0_ffee);
    let mut w = CmfWriter::create(out, h)?;
    for (name, dtype, shape) in tensors {
        let n: usize = shape.iter().product();
        let is_norm = shape.len() == 1;
        let values: Vec<f32> = (0..n)
            .map(|_| {
                if is_norm {
                    1.0 + rng.weight(0.1)
                } else {
                    rng.weight(0.5)
                }
            })
            .collect();
        // A stacked quantised tensor is `E` independent matrices, each with its own sections.
        let (rows, cols) = match shape {
            [.., r, c] => (*r, *c),
            [c] => (1, *c),
            [] => (1, 1),
        };
        let mut bytes = Vec::new();
        for m in values.chunks((rows * cols).max(1)) {
            let q = quant_codecs::quantize(dtype, rows, cols, m)
                .with_context(|| format!("quantising {name}"))?;
            bytes.extend_from_slice(&q);
        }
        w.add_tensor(name, dtype, shape, &bytes)?;
    }
    let path = w.finish()?;
    let cmf = Cmf::open(&path)?;
    cmf.verify()?;
    println!(
        "wrote {} ({} bytes, {} tensors, uid {:016x})",
        path.display(),
        cmf.file_len(),
        cmf.tensors().len(),
        cmf.uid()
    );
    Ok(())
}

/// Validates every kernel module under every capability set the runtime targets.
fn shaders() -> Result<()> {
    use kernels_wgsl::{Caps, registry, validate_all};
    let modules = registry();
    let specs: usize = modules.iter().map(|m| m.specializations.len()).sum();
    let mut failed = 0;
    for (name, caps) in [
        ("lavapipe", Caps::LAVAPIPE),
        ("full", Caps::FULL),
        ("minimal", Caps::MINIMAL),
    ] {
        let errors = validate_all(caps);
        println!(
            "{name:<9} {} module(s), {specs} specialisation(s): {} error(s)",
            modules.len(),
            errors.len()
        );
        for e in &errors {
            println!("{e}");
        }
        failed += errors.len();
    }
    if failed > 0 {
        bail!("{failed} shader validation error(s)");
    }
    Ok(())
}

/// Reads a safetensors file's header and data section (small files only: the fixture).
fn read_safetensors(path: &Path) -> Result<(serde_json::Map<String, serde_json::Value>, Vec<u8>)> {
    let buf = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let n = u64::from_le_bytes(buf[..8].try_into()?) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&buf[8..8 + n])?;
    Ok((header, buf[8 + n..].to_vec()))
}

/// One tensor of a shard being written: name, dtype, shape, and how to produce its bytes.
enum SynthData {
    Copy(Vec<u8>),
    Random { seed: u64, bytes: u64 },
}

fn write_shard(path: &Path, tensors: &[(String, String, Vec<usize>, SynthData)]) -> Result<u64> {
    use std::io::Write;
    let mut header = serde_json::Map::new();
    let mut off = 0u64;
    for (name, dtype, shape, data) in tensors {
        let len = match data {
            SynthData::Copy(b) => b.len() as u64,
            SynthData::Random { bytes, .. } => *bytes,
        };
        header.insert(
            name.clone(),
            serde_json::json!({ "dtype": dtype, "shape": shape, "data_offsets": [off, off + len] }),
        );
        off += len;
    }
    let mut h = serde_json::to_vec(&header)?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut f = std::io::BufWriter::with_capacity(1 << 22, std::fs::File::create(path)?);
    f.write_all(&(h.len() as u64).to_le_bytes())?;
    f.write_all(&h)?;
    let mut chunk = vec![0u8; 1 << 22];
    for (_, _, _, data) in tensors {
        match data {
            SynthData::Copy(b) => f.write_all(b)?,
            SynthData::Random { seed, bytes } => {
                let mut rng = SplitMix(*seed);
                let mut left = *bytes as usize;
                while left > 0 {
                    let n = left.min(chunk.len());
                    for w in chunk[..n].chunks_exact_mut(8) {
                        // Four bf16 values in [-1/16, 1/16): sign, exponent 0x3b-0x3d, any mantissa.
                        let r = rng.next();
                        for k in 0..4 {
                            let m = (r >> (16 * k)) as u16;
                            let v = (m & 0x807f) | (0x3d00 - ((m >> 7) & 0x3) * 0x80);
                            w[2 * k..2 * k + 2].copy_from_slice(&v.to_le_bytes());
                        }
                    }
                    f.write_all(&chunk[..n])?;
                    left -= n;
                }
            }
        }
    }
    f.flush()?;
    Ok(8 + h.len() as u64 + off)
}

/// A `qwen4_exp` checkpoint shaped like fixtures/qwen4_exp_a but with many wide experts: every
/// small tensor is the fixture's own, the routed experts (and router) are deterministic random
/// bf16, one shard per layer of experts, with an index.
fn synth_checkpoint(dir: &Path, gb: f64, vocab: Option<usize>) -> Result<()> {
    let src = workspace_root().join("fixtures/qwen4_exp_a/hf");
    std::fs::create_dir_all(dir)?;
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json"))?)?;
    let text = &config["text_config"];
    let d = text["hidden_size"].as_u64().context("hidden_size")? as usize;
    let layers = text["num_hidden_layers"]
        .as_u64()
        .context("num_hidden_layers")? as usize;
    let inter = 4096usize;
    let per_expert = 3 * inter * d * 2; // gate, up, down in bf16
    let experts = ((gb * 1e9) / (layers * per_expert) as f64).ceil() as usize;
    config["text_config"]["num_experts"] = experts.into();
    // A large vocabulary makes the embedding and lm_head single tensors of gigabytes, the case
    // the converter quantises a block of rows at a time.
    if let Some(v) = vocab {
        config["text_config"]["vocab_size"] = v.into();
    }
    config["text_config"]["moe_intermediate_size"] = inter.into();
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(&config)?)?;
    for f in [
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(src.join(f), dir.join(f))?;
    }

    // Every fixture tensor except experts and routers goes to shard 0.
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("model.safetensors.index.json"))?)?;
    let mut files: Vec<String> = index["weight_map"]
        .as_object()
        .context("weight_map")?
        .values()
        .filter_map(|v| v.as_str().map(String::from))
        .collect();
    files.sort();
    files.dedup();
    let mut small = Vec::new();
    for f in &files {
        let (header, data) = read_safetensors(&src.join(f))?;
        for (name, info) in header {
            if name == "__metadata__"
                || name.contains(".mlp.experts.")
                || name.ends_with(".mlp.gate.weight")
            {
                continue;
            }
            if let Some(v) = vocab
                && (name.ends_with("embed_tokens.weight") || name == "lm_head.weight")
            {
                let seed = 7 + small.len() as u64;
                let data = SynthData::Random {
                    seed,
                    bytes: (v * d * 2) as u64,
                };
                small.push((name, "BF16".to_string(), vec![v, d], data));
                continue;
            }
            let off = info["data_offsets"].as_array().context("offsets")?;
            let (a, b) = (
                off[0].as_u64().unwrap_or(0) as usize,
                off[1].as_u64().unwrap_or(0) as usize,
            );
            let shape: Vec<usize> = serde_json::from_value(info["shape"].clone())?;
            let dtype = info["dtype"].as_str().unwrap_or("BF16").to_string();
            small.push((name, dtype, shape, SynthData::Copy(data[a..b].to_vec())));
        }
    }
    let n_shards = layers + 1;
    let shard_name = |i: usize| format!("model-{:05}-of-{n_shards:05}.safetensors", i + 1);
    let mut weight_map = serde_json::Map::new();
    let mut total = 0u64;
    for (name, ..) in &small {
        weight_map.insert(name.clone(), shard_name(0).into());
    }
    total += write_shard(&dir.join(shard_name(0)), &small)?;
    for l in 0..layers {
        let stem = format!("model.language_model.layers.{l}.mlp.");
        let tensors = vec![
            (
                format!("{stem}gate.weight"),
                "BF16".to_string(),
                vec![experts, d],
                SynthData::Random {
                    seed: 3 * l as u64,
                    bytes: (experts * d * 2) as u64,
                },
            ),
            (
                format!("{stem}experts.gate_up_proj"),
                "BF16".to_string(),
                vec![experts, 2 * inter, d],
                SynthData::Random {
                    seed: 3 * l as u64 + 1,
                    bytes: (experts * 2 * inter * d * 2) as u64,
                },
            ),
            (
                format!("{stem}experts.down_proj"),
                "BF16".to_string(),
                vec![experts, d, inter],
                SynthData::Random {
                    seed: 3 * l as u64 + 2,
                    bytes: (experts * inter * d * 2) as u64,
                },
            ),
        ];
        for (name, ..) in &tensors {
            weight_map.insert(name.clone(), shard_name(l + 1).into());
        }
        total += write_shard(&dir.join(shard_name(l + 1)), &tensors)?;
        eprintln!("xtask: wrote {} ({l}/{layers})", shard_name(l + 1));
    }
    let index =
        serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_vec_pretty(&index)?,
    )?;
    eprintln!(
        "xtask: {} ({experts} experts x {layers} layers, intermediate {inter}, hidden {d}): {:.2} GB",
        dir.display(),
        total as f64 / 1e9
    );
    Ok(())
}
