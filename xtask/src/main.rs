//! cortiq developer tasks, run as `cargo xtask TASK`.
//!
//! Tasks:
//! - `tiny-cmf [OUT]`: write the deterministic example model file (default `assets/tiny.cmf`).
//! - `shaders`: parse and validate every WGSL module and specialisation with naga, for the
//!   lavapipe, full and minimal capability sets, printing naga's rendered errors.

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
        Some(other) => bail!("unknown task {other:?}; tasks: tiny-cmf [OUT], shaders"),
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
