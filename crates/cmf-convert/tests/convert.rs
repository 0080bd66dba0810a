//! The converter on the committed reference fixtures (fixtures/<case>/hf).
//!
//! Expected values come from the source safetensors read here independently (the `safetensors`
//! crate, bf16 -> f32 by shifting bits, FP8/FP4 decoded by this file's own tables, the FP8 block
//! read from each fixture's config) and from this file's own copy of the name mappings
//! (tools/reference/make_fixtures.py's `_DS_LEAF` and make_dsv41_fixtures.py's `_LEAF` /
//! `released_name`, applied in the HF -> DeepSeek direction, as the fixture generators applied
//! them), never from the converter.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use cmf_convert::{ConvertError, ConvertOptions, Profile, convert};
use cmf_format::Cmf;
use quant_codecs::{self, DType};
use safetensors::{Dtype, SafeTensors};

const CASES: [&str; 7] = [
    "qwen4_exp_a",
    "qwen4_exp_b",
    "qwen4_exp_c",
    "deepseek_v4_a",
    "deepseek_v4_b",
    "deepseek_v41_a",
    "deepseek_v41_b",
];

/// The DeepSeek-V4.1 fixtures.
const V41: [&str; 2] = ["deepseek_v41_a", "deepseek_v41_b"];

/// The `model_type` a case's fixture declares.
fn architecture(case: &str) -> &'static str {
    if case.starts_with("qwen") {
        "qwen4_exp"
    } else if case.starts_with("deepseek_v41") {
        "deepseek_v41"
    } else {
        "deepseek_v4"
    }
}

/// `quantization_config.weight_block_size` of a fixture's config.json (128 x 128 if absent).
fn fp8_block(case: &str) -> [usize; 2] {
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture(case).join("config.json")).unwrap()).unwrap();
    match cfg["quantization_config"]["weight_block_size"].as_array() {
        Some(b) => [
            b[0].as_u64().unwrap() as usize,
            b[1].as_u64().unwrap() as usize,
        ],
        None => [128, 128],
    }
}

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(case)
        .join("hf")
}

fn run(input: &Path, output: &Path, profile: Profile) -> Result<(), ConvertError> {
    let opts = ConvertOptions::new(input.to_path_buf(), output.to_path_buf(), profile);
    let mut calls = 0;
    let r = convert(&opts, &mut |p| {
        calls += 1;
        assert!(p.tensors_done <= p.tensors_total && p.bytes_done <= p.bytes_total);
    })?;
    assert_eq!(calls, r.tensors, "one progress call per tensor");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The source, read independently
// ---------------------------------------------------------------------------------------------

struct Raw {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

fn read_source(dir: &Path) -> HashMap<String, Raw> {
    let mut out = HashMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            let buf = std::fs::read(&p).unwrap();
            let st = SafeTensors::deserialize(&buf).unwrap();
            for (name, t) in st.tensors() {
                out.insert(
                    name,
                    Raw {
                        dtype: t.dtype(),
                        shape: t.shape().to_vec(),
                        bytes: t.data().to_vec(),
                    },
                );
            }
        }
    }
    out
}

const FP4: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

fn pow2(k: i32) -> f32 {
    (k as f64).exp2() as f32
}

fn fp8(b: u8) -> f32 {
    let (s, e, m) = ((b >> 7) as i32, ((b >> 3) & 15) as i32, (b & 7) as f32);
    let mag = if e == 0 {
        m * pow2(-9)
    } else {
        (8.0 + m) * pow2(e - 10)
    };
    if s == 1 { -mag } else { mag }
}

/// f32 values of a source float tensor (bf16 by shifting bits).
fn floats(t: &Raw) -> Vec<f32> {
    match t.dtype {
        Dtype::BF16 => t
            .bytes
            .chunks(2)
            .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
            .collect(),
        Dtype::F32 => t
            .bytes
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        Dtype::I64 => t
            .bytes
            .chunks(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f32)
            .collect(),
        d => panic!("unexpected source dtype {d:?}"),
    }
}

/// Dequantised f32 of a DeepSeek weight (FP8 block-scaled in blocks of `block`, FP8 Engram
/// rows with a scale per 32 values, FP4, or plain).
fn ds_values(src: &HashMap<String, Raw>, name: &str, block: [usize; 2]) -> Vec<f32> {
    let t = &src[name];
    let scale = || &src[&name.replace(".weight", ".scale")];
    match t.dtype {
        Dtype::F8_E4M3 if name.ends_with(".engram.embed.weight") => {
            let s = scale();
            let cols = t.shape[1];
            t.bytes
                .iter()
                .enumerate()
                .map(|(i, &b)| {
                    let (r, c) = (i / cols, i % cols);
                    fp8(b) * pow2(s.bytes[r * (cols / 32) + c / 32] as i32 - 127)
                })
                .collect()
        }
        Dtype::F8_E4M3 => {
            let s = scale();
            let cols = t.shape[1];
            t.bytes
                .iter()
                .enumerate()
                .map(|(i, &b)| {
                    let (r, c) = (i / cols, i % cols);
                    let k = s.bytes[(r / block[0]) * s.shape[1] + c / block[1]];
                    fp8(b) * pow2(k as i32 - 127)
                })
                .collect()
        }
        Dtype::I8 => {
            let s = scale();
            let cols = t.shape[1] * 2;
            let mut out = Vec::new();
            for (i, &b) in t.bytes.iter().enumerate() {
                for (k, nib) in [b & 15, b >> 4].into_iter().enumerate() {
                    let e = 2 * i + k;
                    let (r, c) = (e / cols, e % cols);
                    out.push(
                        FP4[nib as usize] * pow2(s.bytes[r * (cols / 32) + c / 32] as i32 - 127),
                    );
                }
            }
            out
        }
        _ => floats(t),
    }
}

/// make_fixtures.py `_DS_LEAF` (HF -> DeepSeek) and `_DS_TOP`.
const DS_LEAF: [(&str, &str); 31] = [
    (
        ".self_attn.compressor.indexer.scorer.weights_proj.",
        ".attn.indexer.weights_proj.",
    ),
    (
        ".self_attn.compressor.indexer.q_b_proj.",
        ".attn.indexer.wq_b.",
    ),
    (
        ".self_attn.compressor.indexer.kv_proj.",
        ".attn.indexer.compressor.wkv.",
    ),
    (
        ".self_attn.compressor.indexer.gate_proj.",
        ".attn.indexer.compressor.wgate.",
    ),
    (
        ".self_attn.compressor.indexer.kv_norm.",
        ".attn.indexer.compressor.norm.",
    ),
    (
        ".self_attn.compressor.indexer.position_bias",
        ".attn.indexer.compressor.ape",
    ),
    (".self_attn.compressor.kv_proj.", ".attn.compressor.wkv."),
    (
        ".self_attn.compressor.gate_proj.",
        ".attn.compressor.wgate.",
    ),
    (".self_attn.compressor.kv_norm.", ".attn.compressor.norm."),
    (
        ".self_attn.compressor.position_bias",
        ".attn.compressor.ape",
    ),
    (".self_attn.q_a_proj.", ".attn.wq_a."),
    (".self_attn.q_a_norm.", ".attn.q_norm."),
    (".self_attn.q_b_proj.", ".attn.wq_b."),
    (".self_attn.kv_proj.", ".attn.wkv."),
    (".self_attn.kv_norm.", ".attn.kv_norm."),
    (".self_attn.o_a_proj.", ".attn.wo_a."),
    (".self_attn.o_b_proj.", ".attn.wo_b."),
    (".self_attn.sinks", ".attn.attn_sink"),
    (".input_layernorm.", ".attn_norm."),
    (".post_attention_layernorm.", ".ffn_norm."),
    (".attn_hc.fn", ".hc_attn_fn"),
    (".attn_hc.base", ".hc_attn_base"),
    (".attn_hc.scale", ".hc_attn_scale"),
    (".ffn_hc.fn", ".hc_ffn_fn"),
    (".ffn_hc.base", ".hc_ffn_base"),
    (".ffn_hc.scale", ".hc_ffn_scale"),
    (".mlp.gate.e_score_correction_bias", ".ffn.gate.bias"),
    (".mlp.gate.", ".ffn.gate."),
    (".mlp.shared_experts.gate_proj.", ".ffn.shared_experts.w1."),
    (".mlp.shared_experts.down_proj.", ".ffn.shared_experts.w2."),
    (".mlp.shared_experts.up_proj.", ".ffn.shared_experts.w3."),
];
const DS_TOP: [(&str, &str); 6] = [
    ("model.embed_tokens.weight", "embed.weight"),
    ("lm_head.weight", "head.weight"),
    ("model.norm.weight", "norm.weight"),
    ("model.hc_head.hc_fn", "hc_head_fn"),
    ("model.hc_head.hc_base", "hc_head_base"),
    ("model.hc_head.hc_scale", "hc_head_scale"),
];

/// make_dsv41_fixtures.py `_LEAF` (HF piece after `model.layers.L.` -> released piece), its
/// regex groups written out; `true` marks a pattern anchored at both ends (`...$`).
const V41_LEAF: [(&str, &str, bool); 32] = [
    (
        "self_attn.compressor.kv_proj.",
        "attn.compressor.wkv.",
        false,
    ),
    (
        "self_attn.compressor.gate_proj.",
        "attn.compressor.wgate.",
        false,
    ),
    (
        "self_attn.compressor.kv_norm.",
        "attn.compressor.norm.",
        false,
    ),
    ("self_attn.indexer.q_b_proj.", "attn.indexer.wq_b.", false),
    ("self_attn.indexer.k_proj.", "attn.indexer.wk.", false),
    (
        "self_attn.indexer.weights_proj.",
        "attn.indexer.weights_proj.",
        false,
    ),
    ("self_attn.indexer.k_norm.", "attn.indexer.k_norm.", false),
    ("self_attn.q_a_proj.", "attn.wq_a.", false),
    ("self_attn.q_a_norm.", "attn.q_norm.", false),
    ("self_attn.q_b_proj.", "attn.wq_b.", false),
    ("self_attn.kv_proj.", "attn.wkv.", false),
    ("self_attn.kv_norm.", "attn.kv_norm.", false),
    ("self_attn.o_a_proj.", "attn.wo_a.", false),
    ("self_attn.o_b_proj.", "attn.wo_b.", false),
    ("self_attn.sinks", "attn.attn_sink", true),
    ("input_layernorm.", "attn_norm.", false),
    ("post_attention_layernorm.", "ffn_norm.", false),
    ("attn_hc.fn", "hc_attn_fn", true),
    ("attn_hc.base", "hc_attn_base", true),
    ("attn_hc.scale", "hc_attn_scale", true),
    ("ffn_hc.fn", "hc_ffn_fn", true),
    ("ffn_hc.base", "hc_ffn_base", true),
    ("ffn_hc.scale", "hc_ffn_scale", true),
    (
        "mlp.gate.e_score_correction_bias_vl",
        "ffn.gate.bias_vl",
        true,
    ),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias", true),
    ("mlp.gate.weight", "ffn.gate.weight", true),
    (
        "mlp.shared_experts.gate_proj.",
        "ffn.shared_experts.w1.",
        false,
    ),
    (
        "mlp.shared_experts.down_proj.",
        "ffn.shared_experts.w2.",
        false,
    ),
    (
        "mlp.shared_experts.up_proj.",
        "ffn.shared_experts.w3.",
        false,
    ),
    ("engram.wkv.weight", "engram.wkv.weight", true),
    ("engram.q_weight", "engram.q_weight", true),
    ("engram.k_weight", "engram.k_weight", true),
];

/// make_dsv41_fixtures.py `released_name`: a transformers V4.1 name (not a routed expert) to
/// the released checkpoint's name.
fn released_v41(hf: &str) -> String {
    for (h, r) in [
        ("model.embed_tokens.weight", "embed.weight"),
        ("lm_head.weight", "head.weight"),
        ("model.norm.weight", "norm.weight"),
    ] {
        if hf == h {
            return r.to_string();
        }
    }
    if let Some(l) = hf
        .strip_prefix("model.engram_tables.")
        .and_then(|r| r.strip_suffix(".weight"))
    {
        return format!("layers.{l}.engram.embed.weight");
    }
    let rest = hf
        .strip_prefix("model.layers.")
        .unwrap_or_else(|| panic!("no released name for {hf}"));
    let (l, tail) = rest.split_once('.').unwrap();
    let (h, r, _) = V41_LEAF
        .iter()
        .find(|(h, _, whole)| {
            if *whole {
                tail == *h
            } else {
                tail.starts_with(h)
            }
        })
        .unwrap_or_else(|| panic!("no released name for {hf}"));
    format!("layers.{l}.{r}{}", &tail[h.len()..])
}

/// The exact f32 values a CMF tensor must hold, from the source.
fn expected(case: &str, src: &HashMap<String, Raw>, cmf_name: &str) -> Vec<f32> {
    let block = fp8_block(case);
    let parts: Vec<&str> = cmf_name.split('.').collect();
    let expert = cmf_name.contains(".mlp.experts.").then(|| {
        let layer: usize = parts[2].parse().unwrap();
        let e: usize = parts[5].parse().unwrap();
        (layer, e, parts[6])
    });
    if case.starts_with("qwen") {
        if let Some((l, e, which)) = expert {
            let fused = &src[&format!("model.language_model.layers.{l}.mlp.experts.{which}")];
            let all = floats(fused);
            let per = all.len() / fused.shape[0];
            return all[e * per..(e + 1) * per].to_vec();
        }
        let name = match cmf_name.strip_prefix("model.") {
            Some(rest) => format!("model.language_model.{rest}"),
            None => cmf_name.to_string(),
        };
        return floats(&src[&name]);
    }
    if let Some((l, e, which)) = expert {
        let stem = format!("layers.{l}.ffn.experts.{e}");
        return if which == "gate_up_proj" {
            let mut v = ds_values(src, &format!("{stem}.w1.weight"), block);
            v.extend(ds_values(src, &format!("{stem}.w3.weight"), block));
            v
        } else {
            ds_values(src, &format!("{stem}.w2.weight"), block)
        };
    }
    if case.starts_with("deepseek_v41") {
        return ds_values(src, &released_v41(cmf_name), block);
    }
    if let Some((_, ds)) = DS_TOP.iter().find(|(hf, _)| *hf == cmf_name) {
        return ds_values(src, ds, block);
    }
    let name = &cmf_name["model.".len()..];
    let (hf, ds) = DS_LEAF
        .iter()
        .find(|(hf, _)| name.contains(hf))
        .unwrap_or_else(|| panic!("no mapping for {cmf_name}"));
    ds_values(src, &name.replacen(hf, ds, 1), block)
}

/// Source tensors the CMF file must account for (scales and w3 travel with their weight;
/// fused qwen experts become one CMF tensor per expert).
fn expected_count(src: &HashMap<String, Raw>) -> usize {
    src.iter()
        .map(|(n, t)| {
            if n.ends_with(".scale") || (n.contains(".ffn.experts.") && n.ends_with(".w3.weight")) {
                0
            } else if n.ends_with("experts.gate_up_proj") || n.ends_with("experts.down_proj") {
                t.shape[0]
            } else {
                1
            }
        })
        .sum()
}

/// Values of a CMF tensor, or of an integer tensor kept in the header.
fn cmf_values(cmf: &Cmf, name: &str) -> Vec<f32> {
    let t = cmf.tensor(name).unwrap();
    quant_codecs::dequantize(t.dtype(), t.shape(), t.bytes).unwrap()
}

fn cmf_names(cmf: &Cmf) -> Vec<String> {
    let mut names: Vec<String> = cmf.tensors().iter().map(|t| t.name.clone()).collect();
    if let Some(serde_json::Value::Object(m)) = cmf.header().extra.get("integer_tensors") {
        names.extend(m.keys().cloned());
    }
    names
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[test]
fn every_fixture_converts_under_every_profile_and_verifies() {
    let tmp = tempfile::tempdir().unwrap();
    for case in CASES {
        let src = read_source(&fixture(case));
        for profile in Profile::ALL {
            let out = tmp.path().join(format!("{case}-{profile}.cmf"));
            run(&fixture(case), &out, profile).unwrap_or_else(|e| panic!("{case} {profile}: {e}"));
            let cmf = Cmf::open(&out).unwrap();
            cmf.verify().unwrap();
            let h = cmf.header();
            assert_eq!(h.quantization.profile, profile.name());
            assert_eq!(h.architecture, architecture(case));
            assert!(h.provenance.converter.starts_with("cortiq "));
            assert!(
                h.provenance
                    .sources
                    .iter()
                    .any(|s| s.file == "config.json" && s.bytes > 0)
            );
            assert!(h.tokenizer.is_some() && h.chat_template.is_some() && h.generation.is_some());
            assert!(h.dims.hidden_size.is_some() && h.dims.vocab_size.is_some());
            assert_eq!(
                cmf_names(&cmf).len(),
                expected_count(&src),
                "{case} {profile}"
            );
        }
    }
}

#[test]
fn qwen_header_keeps_the_text_config_and_the_original() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("a.cmf");
    run(&fixture("qwen4_exp_a"), &out, Profile::Q8).unwrap();
    let cmf = Cmf::open(&out).unwrap();
    let h = cmf.header();
    assert_eq!(h.config["model_type"], "qwen4_exp_text");
    assert_eq!(
        h.provenance.extra["source_config"]["model_type"],
        "qwen4_exp"
    );
    let tc: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixture("qwen4_exp_a").join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(h.chat_template.as_deref(), tc["chat_template"].as_str());
}

#[test]
fn f32_profile_reproduces_every_source_value_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    for case in CASES {
        let src = read_source(&fixture(case));
        let out = tmp.path().join(format!("{case}.cmf"));
        run(&fixture(case), &out, Profile::F32).unwrap();
        let cmf = Cmf::open(&out).unwrap();
        for t in cmf.tensors() {
            // Engram tables stay mxfp8 in every profile (exact: their stored values).
            let want_dtype = if t.name.starts_with("model.engram_tables.") {
                DType::Mxfp8
            } else {
                DType::F32
            };
            assert_eq!(t.dtype, want_dtype, "{case} {}", t.name);
            let got = cmf_values(&cmf, &t.name);
            let want = expected(case, &src, &t.name);
            assert_eq!(got.len(), want.len(), "{case} {}", t.name);
            for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g.to_bits() == w.to_bits(),
                    "{case} {} [{k}]: {g} != {w}",
                    t.name
                );
            }
        }
        // Integers that f32 cannot hold are exact in the header.
        if let Some(serde_json::Value::Object(m)) = cmf.header().extra.get("integer_tensors") {
            for (name, v) in m {
                let raw = &src[&format!("model.language_model.{}", &name["model.".len()..])];
                let want: Vec<i64> = raw
                    .bytes
                    .chunks(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                let got: Vec<i64> = v["data"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_i64().unwrap())
                    .collect();
                assert_eq!(got, want, "{name}");
            }
        }
    }
}

#[test]
fn bf16_profile_is_exact_for_bf16_sources() {
    let tmp = tempfile::tempdir().unwrap();
    let case = "qwen4_exp_b";
    let src = read_source(&fixture(case));
    let out = tmp.path().join("b.cmf");
    run(&fixture(case), &out, Profile::Bf16).unwrap();
    let cmf = Cmf::open(&out).unwrap();
    for t in cmf.tensors() {
        assert_eq!(
            cmf_values(&cmf, &t.name),
            expected(case, &src, &t.name),
            "{}",
            t.name
        );
    }
}

#[test]
fn fused_expert_split_puts_row_r_of_expert_e_where_the_source_has_it() {
    let tmp = tempfile::tempdir().unwrap();
    let case = "qwen4_exp_a";
    let src = read_source(&fixture(case));
    let out = tmp.path().join("a.cmf");
    run(&fixture(case), &out, Profile::F32).unwrap();
    let cmf = Cmf::open(&out).unwrap();
    for which in ["gate_up_proj", "down_proj"] {
        let fused = &src[&format!("model.language_model.layers.2.mlp.experts.{which}")];
        let (e_n, rows, cols) = (fused.shape[0], fused.shape[1], fused.shape[2]);
        let all = floats(fused);
        for e in 0..e_n {
            let t = cmf
                .tensor(&format!("model.layers.2.mlp.experts.{e}.{which}.weight"))
                .unwrap();
            assert_eq!(t.shape(), &[rows, cols]);
            let got = cmf_values(&cmf, t.name());
            for r in 0..rows {
                let want = &all[(e * rows + r) * cols..][..cols];
                assert_eq!(&got[r * cols..][..cols], want, "{which} expert {e} row {r}");
            }
        }
    }
}

#[test]
fn deepseek_fp4_experts_are_copied_verbatim_under_fp4() {
    let tmp = tempfile::tempdir().unwrap();
    for case in [
        "deepseek_v4_a",
        "deepseek_v4_b",
        "deepseek_v41_a",
        "deepseek_v41_b",
    ] {
        let src = read_source(&fixture(case));
        let out = tmp.path().join(format!("{case}.cmf"));
        run(&fixture(case), &out, Profile::Fp4).unwrap();
        let cmf = Cmf::open(&out).unwrap();
        let mut n = 0;
        for t in cmf
            .tensors()
            .iter()
            .filter(|t| t.name.contains(".mlp.experts."))
        {
            assert_eq!(t.dtype, DType::Mxfp4, "{}", t.name);
            assert_eq!(
                cmf_values(&cmf, &t.name),
                expected(case, &src, &t.name),
                "{}",
                t.name
            );
            // Code plane = the source's packed bytes (w1 then w3), scale plane = its E8M0 bytes.
            let parts = t.name.split('.').collect::<Vec<_>>();
            let stem = format!("layers.{}.ffn.experts.{}", parts[2], parts[5]);
            let ws: &[&str] = if parts[6] == "gate_up_proj" {
                &["w1", "w3"]
            } else {
                &["w2"]
            };
            let mut bytes: Vec<u8> = Vec::new();
            for w in ws {
                bytes.extend_from_slice(&src[&format!("{stem}.{w}.weight")].bytes);
            }
            for w in ws {
                bytes.extend_from_slice(&src[&format!("{stem}.{w}.scale")].bytes);
            }
            assert_eq!(cmf.tensor(&t.name).unwrap().bytes, &bytes[..], "{}", t.name);
            n += 1;
        }
        assert!(n > 0);
    }
}

fn sse(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum()
}

fn f16_at(b: &[u8], o: usize) -> f32 {
    quant_codecs::float::f16_bits_to_f32(u16::from_le_bytes([b[o], b[o + 1]]))
}

const SLACK: f64 = 1.0 + 1e-5;

/// Checks `got` (decoded `p`) against `w` within docs/codecs.md's bound for `dtype`.
fn within_bound(
    dtype: DType,
    rows: usize,
    cols: usize,
    p: &[u8],
    w: &[f32],
    got: &[f32],
) -> Result<(), String> {
    let same_bits = || got.iter().zip(w).all(|(g, v)| g.to_bits() == v.to_bits());
    match dtype {
        DType::F32 => (got == w).then_some(()).ok_or("f32 not exact".into()),
        // Only Engram tables are mxfp8, copied from the source: exact.
        DType::Mxfp8 => same_bits()
            .then_some(())
            .ok_or("mxfp8 not bit-exact".into()),
        DType::F16 | DType::BF16 => {
            let ulp = if dtype == DType::F16 {
                pow2(-11)
            } else {
                pow2(-8)
            };
            for (k, (g, v)) in got.iter().zip(w).enumerate() {
                // Round to nearest: half an ulp relative, or half the smallest f16 subnormal step.
                if (g - v).abs() > v.abs() * ulp + pow2(-25) {
                    return Err(format!("[{k}] {g} vs {v}"));
                }
            }
            Ok(())
        }
        DType::Q8_2f => {
            let n = rows * cols;
            let cs: Vec<f32> = (0..cols).map(|i| f16_at(p, n + 2 * rows + 2 * i)).collect();
            for r in 0..rows {
                let row = &w[r * cols..][..cols];
                let m = row
                    .iter()
                    .zip(&cs)
                    .fold(0.0f32, |m, (v, c)| m.max(v.abs() / c));
                let mut s1 = half_up(m / 127.0);
                if s1 < m / 127.0 {
                    s1 = next_f16(s1);
                }
                let bound: f64 = cs
                    .iter()
                    .map(|c| (s1 as f64 * *c as f64 / 2.0).powi(2))
                    .sum();
                let e = sse(row, &got[r * cols..][..cols]);
                if e > bound * SLACK + 1e-40 {
                    return Err(format!("row {r}: sse {e} > {bound}"));
                }
            }
            Ok(())
        }
        DType::Q4tp | DType::Q2tp => {
            let q2 = dtype == DType::Q2tp;
            let (qmax, plane) = if q2 {
                (1.5f32, rows * cols / 4)
            } else {
                (7.0, rows * cols / 2)
            };
            for r in 0..rows {
                let lo = f16_at(p, plane + 4 * r);
                let step = f16_at(p, plane + 4 * r + 2);
                let rungs: Vec<f32> = (0..32)
                    .filter(|&c| !q2 || c > 0)
                    .map(|c| {
                        quant_codecs::tiered::exp2q(lo + (if q2 { c - 1 } else { c }) as f32 * step)
                    })
                    .collect();
                for g in 0..cols / 32 {
                    let o = r * cols + g * 32;
                    let amax = w[o..o + 32].iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let up = rungs
                        .iter()
                        .copied()
                        .find(|&s| s >= amax / qmax)
                        .ok_or("no rung")?;
                    let bound = 32.0 * (up as f64 / 2.0).powi(2);
                    let e = sse(&w[o..o + 32], &got[o..o + 32]);
                    if e > bound * SLACK + 1e-40 {
                        return Err(format!("row {r} group {g}: sse {e} > {bound}"));
                    }
                }
            }
            Ok(())
        }
        DType::Mxfp4 => {
            for (gi, (gw, gd)) in w.chunks(32).zip(got.chunks(32)).enumerate() {
                let amax = gw.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
                if amax == 0.0 {
                    continue;
                }
                let mut e = -130i32;
                while 6.0 * 2f64.powi(e) < amax {
                    e += 1;
                }
                let s = 2f64.powi(e);
                let bound: f64 = gw
                    .iter()
                    .map(|v| {
                        let a = v.abs() as f64 / s;
                        let h = if a < 2.0 {
                            0.25
                        } else if a < 4.0 {
                            0.5
                        } else {
                            1.0
                        };
                        (h * s).powi(2)
                    })
                    .sum();
                let err = sse(gw, gd);
                if err > bound * SLACK {
                    return Err(format!("group {gi}: sse {err} > {bound}"));
                }
            }
            Ok(())
        }
        d => Err(format!("unexpected dtype {d}")),
    }
}

fn half_up(x: f32) -> f32 {
    quant_codecs::float::f16_bits_to_f32(quant_codecs::float::f32_to_f16_bits(x))
}

fn next_f16(x: f32) -> f32 {
    quant_codecs::float::f16_bits_to_f32(quant_codecs::float::f32_to_f16_bits(x) + 1)
}

#[test]
fn quantised_profiles_stay_within_each_codec_bound() {
    let tmp = tempfile::tempdir().unwrap();
    for case in CASES {
        let src = read_source(&fixture(case));
        for profile in [
            Profile::Q8,
            Profile::Q4,
            Profile::Q2,
            Profile::Fp4,
            Profile::F16,
        ] {
            let out = tmp.path().join(format!("{case}-{profile}.cmf"));
            run(&fixture(case), &out, profile).unwrap();
            let cmf = Cmf::open(&out).unwrap();
            let mut seen: BTreeMap<DType, usize> = BTreeMap::new();
            for t in cmf.tensors() {
                let view = cmf.tensor(&t.name).unwrap();
                let want = expected(case, &src, &t.name);
                let got = cmf_values(&cmf, &t.name);
                let (rows, cols) = match t.shape.as_slice() {
                    [r, c] => (*r, *c),
                    _ => (1, want.len()),
                };
                within_bound(t.dtype, rows, cols, view.bytes, &want, &got)
                    .unwrap_or_else(|e| panic!("{case} {profile} {} ({}): {e}", t.name, t.dtype));
                *seen.entry(t.dtype).or_default() += 1;
            }
            let wants: &[DType] = match profile {
                Profile::Q8 => &[DType::Q8_2f, DType::F32],
                Profile::Q4 => &[DType::Q8_2f, DType::F16, DType::F32],
                Profile::Q2 | Profile::Fp4 => &[DType::Q8_2f, DType::F16, DType::F32],
                _ => &[DType::F16],
            };
            for d in wants {
                assert!(
                    seen.contains_key(d),
                    "{case} {profile}: no {d} tensor ({seen:?})"
                );
            }
            // Experts wide enough for groups of 32 get the profile's expert format.
            let deepseek = case.starts_with("deepseek");
            match profile {
                Profile::Q4 => assert!(!deepseek || seen.contains_key(&DType::Q4tp)),
                Profile::Q2 => assert!(!deepseek || seen.contains_key(&DType::Q2tp)),
                Profile::Fp4 => assert!(!deepseek || seen.contains_key(&DType::Mxfp4)),
                _ => {}
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------------------------

fn copy_fixture(case: &str, to: &Path) -> PathBuf {
    let dir = to.join(case);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(fixture(case)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    dir
}

/// Converts a broken copy; the error must mention every string in `needles`, and nothing may be
/// left in the output directory.
fn expect_failure(dir: &Path, needles: &[&str]) -> String {
    let out_dir = dir.parent().unwrap().join("out");
    std::fs::create_dir_all(&out_dir).unwrap();
    let out = out_dir.join("x.cmf");
    let err = run(dir, &out, Profile::Q4)
        .expect_err("conversion should fail")
        .to_string();
    for n in needles {
        assert!(err.contains(n), "error {err:?} does not mention {n:?}");
    }
    let left: Vec<_> = std::fs::read_dir(&out_dir).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    err
}

fn edit_json(path: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

#[test]
fn missing_shard_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("qwen4_exp_a", tmp.path());
    std::fs::remove_file(dir.join("model-00002-of-00003.safetensors")).unwrap();
    expect_failure(&dir, &["model-00002-of-00003.safetensors", "not found"]);
}

#[test]
fn truncated_safetensors_names_file_and_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("qwen4_exp_b", tmp.path());
    let p = dir.join("model.safetensors");
    let len = std::fs::metadata(&p).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(len - 100).unwrap();
    expect_failure(
        &dir,
        &["model.safetensors", "truncated", "model.language_model."],
    );
}

#[test]
fn unknown_model_type_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("deepseek_v4_a", tmp.path());
    edit_json(&dir.join("config.json"), |c| {
        c["model_type"] = "llama".into()
    });
    expect_failure(&dir, &["config.json", "unknown model_type", "llama"]);
}

#[test]
fn index_naming_a_missing_tensor_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("deepseek_v4_b", tmp.path());
    edit_json(&dir.join("model.safetensors.index.json"), |i| {
        i["weight_map"]["layers.0.attn.ghost.weight"] = "model-00001-of-00002.safetensors".into();
    });
    expect_failure(
        &dir,
        &[
            "layers.0.attn.ghost.weight",
            "model-00001-of-00002.safetensors",
        ],
    );
}

#[test]
fn shape_contradicting_config_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("qwen4_exp_c", tmp.path());
    edit_json(&dir.join("config.json"), |c| {
        c["text_config"]["num_experts"] = 7.into()
    });
    expect_failure(
        &dir,
        &["model.safetensors", "experts.", "expected shape", "[7,"],
    );

    let dir = copy_fixture("deepseek_v4_a", tmp.path().join("2").as_path());
    edit_json(&dir.join("config.json"), |c| c["vocab_size"] = 500.into());
    expect_failure(
        &dir,
        &["model.safetensors", "\"embed.weight\"", "[500, 64]"],
    );
}

#[test]
fn streaming_row_blocks_writes_the_same_tensors() {
    // With a threshold of 0 every plain-float matrix goes through the block-by-block path
    // (column maxima first for q8_2f); the tensors must equal the one-shot conversion's.
    let dir = tempfile::tempdir().unwrap();
    for case in ["qwen4_exp_a", "deepseek_v4_a", "deepseek_v41_b"] {
        for profile in [Profile::Q8, Profile::Q4, Profile::Bf16] {
            let whole = dir.path().join(format!("{case}-whole.cmf"));
            let streamed = dir.path().join(format!("{case}-streamed.cmf"));
            run(&fixture(case), &whole, profile).unwrap();
            let mut opts = ConvertOptions::new(fixture(case), streamed.clone(), profile);
            opts.stream_above = 0;
            let report = convert(&opts, &mut |_| {}).unwrap();
            assert!(
                report.streamed > 0,
                "{case} {profile:?}: nothing took the streaming path"
            );
            let (a, b) = (Cmf::open(&whole).unwrap(), Cmf::open(&streamed).unwrap());
            b.verify().unwrap();
            assert_eq!(a.tensors().len(), b.tensors().len());
            for t in a.tensors() {
                let (x, y) = (a.tensor(&t.name).unwrap(), b.tensor(&t.name).unwrap());
                assert_eq!(x.dtype(), y.dtype(), "{case} {profile:?} {}", t.name);
                assert!(
                    x.bytes == y.bytes,
                    "{case} {profile:?} {}: payloads differ",
                    t.name
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// DeepSeek-V4.1
// ---------------------------------------------------------------------------------------------

/// The source tensors a CMF tensor of a V4.1 file consumes (weights with their `.scale`).
fn v41_sources(src: &HashMap<String, Raw>, cmf_name: &str) -> Vec<String> {
    let parts: Vec<&str> = cmf_name.split('.').collect();
    let weights = if cmf_name.starts_with("model.layers.") && cmf_name.contains(".mlp.experts.") {
        let stem = format!("layers.{}.ffn.experts.{}", parts[2], parts[5]);
        if parts[6] == "gate_up_proj" {
            vec![format!("{stem}.w1.weight"), format!("{stem}.w3.weight")]
        } else {
            vec![format!("{stem}.w2.weight")]
        }
    } else if cmf_name.starts_with("mtp.") {
        vec![cmf_name.to_string()]
    } else {
        vec![released_v41(cmf_name)]
    };
    let mut out = Vec::new();
    for w in weights {
        let scale = w.replace(".weight", ".scale");
        if w.ends_with(".weight") && src.contains_key(&scale) {
            out.push(scale);
        }
        out.push(w);
    }
    out
}

#[test]
fn deepseek_v41_every_source_tensor_lands_under_its_transformers_name() {
    // Each CMF tensor maps back (make_dsv41_fixtures.py's released_name) to source tensors
    // that exist, and together they consume every source tensor exactly once.
    let tmp = tempfile::tempdir().unwrap();
    for case in V41 {
        let src = read_source(&fixture(case));
        let out = tmp.path().join(format!("{case}.cmf"));
        run(&fixture(case), &out, Profile::Q4).unwrap();
        let cmf = Cmf::open(&out).unwrap();
        let mut consumed: BTreeMap<String, String> = BTreeMap::new();
        for t in cmf.tensors() {
            for s in v41_sources(&src, &t.name) {
                assert!(src.contains_key(&s), "{case}: {} needs {s}", t.name);
                if let Some(prev) = consumed.insert(s.clone(), t.name.clone()) {
                    panic!("{case}: {s} consumed by {prev} and {}", t.name);
                }
            }
        }
        let missing: Vec<_> = src.keys().filter(|k| !consumed.contains_key(*k)).collect();
        assert!(missing.is_empty(), "{case}: not converted: {missing:?}");
        // The names the model crates will look for, spot-checked by hand.
        for name in [
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.norm.weight",
            "model.layers.4.self_attn.indexer.q_b_proj.weight",
            "model.layers.4.self_attn.indexer.k_proj.weight",
            "model.layers.4.self_attn.compressor.kv_proj.weight",
            "model.layers.4.mlp.gate.e_score_correction_bias_vl",
            "model.layers.4.attn_hc.fn",
            "model.layers.3.mlp.experts.0.gate_up_proj.weight",
        ] {
            assert!(cmf.tensor(name).is_some(), "{case}: no {name}");
        }
        let engram: Vec<String> = cmf
            .tensors()
            .iter()
            .filter(|t| t.name.contains("engram"))
            .map(|t| t.name.clone())
            .collect();
        let layers: &[usize] = if case.ends_with('a') {
            &[1, 4]
        } else {
            &[0, 3]
        };
        for l in layers {
            for n in [
                format!("model.engram_tables.{l}.weight"),
                format!("model.layers.{l}.engram.wkv.weight"),
                format!("model.layers.{l}.engram.q_weight"),
                format!("model.layers.{l}.engram.k_weight"),
            ] {
                assert!(engram.contains(&n), "{case}: no {n} in {engram:?}");
            }
        }
        assert_eq!(engram.len(), 4 * layers.len(), "{case}: {engram:?}");
    }
}

#[test]
fn deepseek_v41_engram_tables_are_mxfp8_copies_gatherable_by_row() {
    let tmp = tempfile::tempdir().unwrap();
    for case in V41 {
        let src = read_source(&fixture(case));
        for profile in Profile::ALL {
            let out = tmp.path().join(format!("{case}-{profile}.cmf"));
            let opts = ConvertOptions::new(fixture(case), out.clone(), profile);
            let report = convert(&opts, &mut |_| {}).unwrap();
            let cmf = Cmf::open(&out).unwrap();
            let mut tables = 0;
            for t in cmf
                .tensors()
                .iter()
                .filter(|t| t.name.starts_with("model.engram_tables."))
            {
                let released = released_v41(&t.name);
                let (codes, scales) = (
                    &src[&released],
                    &src[&released.replace(".weight", ".scale")],
                );
                assert_eq!(t.dtype, DType::Mxfp8, "{case} {profile} {}", t.name);
                assert_eq!(t.shape, codes.shape, "{case} {profile} {}", t.name);
                let view = cmf.tensor(&t.name).unwrap();
                // The payload is the source's code bytes, then its scale bytes.
                assert!(
                    view.bytes == [&codes.bytes[..], &scales.bytes[..]].concat().as_slice(),
                    "{case} {profile} {}: not a verbatim copy",
                    t.name
                );
                // Row r is `cols` code bytes at r * cols and `cols / 32` scale bytes after
                // the plane: read straight from the mapped file, and decoded the same.
                let (rows, cols) = (codes.shape[0], codes.shape[1]);
                let m = quant_codecs::MatRef::new(DType::Mxfp8, rows, cols, view.bytes).unwrap();
                let want = ds_values(&src, &released, [32, 32]);
                for r in [0, 1, rows / 2, rows - 1] {
                    assert_eq!(
                        &view.bytes[r * cols..][..cols],
                        &codes.bytes[r * cols..][..cols]
                    );
                    assert_eq!(
                        &view.bytes[rows * cols + r * cols / 32..][..cols / 32],
                        &scales.bytes[r * cols / 32..][..cols / 32]
                    );
                    let mut row = vec![0.0f32; cols];
                    m.dequantize_row(r, &mut row).unwrap();
                    let w = &want[r * cols..][..cols];
                    assert!(
                        row.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{case} {profile} {} row {r}",
                        t.name
                    );
                }
                tables += 1;
            }
            assert_eq!(tables, 2, "{case} {profile}");
            // The tables (and under fp4 and source the experts) are the verbatim copies.
            let experts = if matches!(profile, Profile::Fp4 | Profile::Source) {
                cmf.tensors()
                    .iter()
                    .filter(|t| t.name.contains(".mlp.experts."))
                    .count()
            } else {
                0
            };
            assert_eq!(report.verbatim, tables + experts, "{case} {profile}");
            assert_eq!(report.skipped, 0);
        }
    }
}

#[test]
fn deepseek_v41_header_keeps_the_text_config_and_the_original() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("a.cmf");
    run(&fixture("deepseek_v41_a"), &out, Profile::Q8).unwrap();
    let cmf = Cmf::open(&out).unwrap();
    let h = cmf.header();
    assert_eq!(h.architecture, "deepseek_v41");
    assert_eq!(h.config["model_type"], "deepseek_v41_text");
    assert_eq!(h.config["engram_layer_ids"], serde_json::json!([1, 4]));
    assert_eq!(h.dims.hidden_size, Some(64));
    assert_eq!(h.dims.num_hidden_layers, Some(7));
    let orig = &h.provenance.extra["source_config"];
    assert_eq!(orig["model_type"], "deepseek_v41");
    assert_eq!(
        orig["quantization_config"]["weight_block_size"],
        serde_json::json!([32, 32])
    );
    assert!(orig["vision_config"].is_object());
}

// ---------------------------------------------------------------------------------------------
// Rewriting a fixture's tensors (DeepSeek-V4.1 cases with one shard)
// ---------------------------------------------------------------------------------------------

type Tensors = BTreeMap<String, Raw>;

/// Rewrites `dir/model.safetensors` after `f` edits its tensors.
fn rewrite_tensors(dir: &Path, f: impl FnOnce(&mut Tensors)) {
    let p = dir.join("model.safetensors");
    let mut all: Tensors = read_source(dir).into_iter().collect();
    f(&mut all);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = all
        .iter()
        .map(|(k, t)| {
            let v = safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.bytes);
            (k.clone(), v.unwrap())
        })
        .collect();
    safetensors::tensor::serialize_to_file(views, None, &p).unwrap();
}

fn raw(dtype: Dtype, shape: &[usize], bytes: Vec<u8>) -> Raw {
    Raw {
        dtype,
        shape: shape.to_vec(),
        bytes,
    }
}

#[test]
fn deepseek_v41_vision_tensors_are_skipped_and_mtp_is_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("deepseek_v41_a", tmp.path());
    // FP8 32x32 blocks with scale byte 126 (0.5): e4m3 0x38 (1.0) decodes to 0.5.
    let fp8 = raw(Dtype::F8_E4M3, &[32, 64], vec![0x38; 32 * 64]);
    let fp8_scale = raw(Dtype::F8_E8M0, &[1, 2], vec![126; 2]);
    rewrite_tensors(&dir, |t| {
        let bf16 = |n: usize| raw(Dtype::BF16, &[n], [0x80, 0x3f].repeat(n));
        t.insert(
            "vision.blocks.0.attn.qkv.weight".into(),
            raw(Dtype::BF16, &[96, 32], vec![0; 96 * 64]),
        );
        t.insert("vision.patch_embed.proj.bias".into(), bf16(32));
        t.insert(
            "aligner.linear.weight".into(),
            raw(Dtype::BF16, &[64, 32], vec![0; 64 * 64]),
        );
        for d in ["image_start", "image_end", "image_newline"] {
            t.insert(d.into(), bf16(64));
        }
        t.insert("mtp.0.attn_norm.weight".into(), bf16(64));
        t.insert("mtp.0.attn.wq_a.weight".into(), fp8);
        t.insert("mtp.0.attn.wq_a.scale".into(), fp8_scale);
    });
    let out = tmp.path().join("x.cmf");
    let opts = ConvertOptions::new(dir.clone(), out.clone(), Profile::F32);
    let report = convert(&opts, &mut |_| {}).unwrap();
    assert_eq!(report.skipped, 6);
    let cmf = Cmf::open(&out).unwrap();
    assert!(cmf.tensors().iter().all(|t| !t.name.contains("vision")
        && !t.name.contains("aligner")
        && !t.name.contains("image_")));
    assert_eq!(cmf_values(&cmf, "mtp.0.attn_norm.weight"), vec![1.0; 64]);
    assert_eq!(
        cmf_values(&cmf, "mtp.0.attn.wq_a.weight"),
        vec![0.5; 32 * 64]
    );
    assert!(
        cmf.tensor("mtp.0.attn.wq_a.scale").is_none(),
        "scales travel with their weight"
    );
}

#[test]
fn deepseek_v41_engram_scale_of_the_wrong_shape_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("deepseek_v41_a", tmp.path());
    rewrite_tensors(&dir, |t| {
        t.insert(
            "layers.4.engram.embed.scale".into(),
            raw(Dtype::F8_E8M0, &[834, 1], vec![127; 834]),
        );
    });
    expect_failure(
        &dir,
        &[
            "model.safetensors",
            "\"layers.4.engram.embed.scale\"",
            "[834, 2]",
            "[834, 1]",
        ],
    );
}

#[test]
fn deepseek_v41_engram_scale_of_the_wrong_dtype_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("deepseek_v41_a", tmp.path());
    rewrite_tensors(&dir, |t| {
        t.insert(
            "layers.1.engram.embed.scale".into(),
            raw(Dtype::F32, &[630, 2], vec![0; 630 * 2 * 4]),
        );
    });
    expect_failure(&dir, &["\"layers.1.engram.embed.scale\"", "F32", "F8_E8M0"]);
}

#[test]
fn deepseek_v41_fp8_grid_must_fit_weight_block_size() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("deepseek_v41_a", tmp.path());
    // The stored grids are 32x32 blocks; a config claiming 64x64 blocks does not fit them.
    edit_json(&dir.join("config.json"), |c| {
        c["quantization_config"]["weight_block_size"] = serde_json::json!([64, 64])
    });
    let err = expect_failure(
        &dir,
        &[
            "model.safetensors",
            ".scale",
            "[64, 64]",
            "weight_block_size",
        ],
    );
    assert!(err.contains("layers."), "{err}");

    // A malformed block size is a config error.
    let dir = copy_fixture("deepseek_v41_a", tmp.path().join("2").as_path());
    edit_json(&dir.join("config.json"), |c| {
        c["quantization_config"]["weight_block_size"] = serde_json::json!([32])
    });
    expect_failure(
        &dir,
        &["config.json", "weight_block_size", "two positive integers"],
    );

    // One weight with a grid of the wrong size under the right block.
    let dir = copy_fixture("deepseek_v41_a", tmp.path().join("3").as_path());
    rewrite_tensors(&dir, |t| {
        t.insert(
            "layers.0.attn.wkv.scale".into(),
            raw(Dtype::F8_E8M0, &[1, 1], vec![127]),
        );
    });
    expect_failure(
        &dir,
        &[
            "\"layers.0.attn.wkv.weight\"",
            "layers.0.attn.wkv.scale",
            "[2, 2]",
            "[1, 1]",
            "[32, 32]",
        ],
    );
}

#[test]
fn deepseek_v41_unknown_tensor_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("deepseek_v41_a", tmp.path());
    rewrite_tensors(&dir, |t| {
        t.insert(
            "layers.0.attn.ghost.weight".into(),
            raw(Dtype::BF16, &[4], vec![0; 8]),
        );
    });
    expect_failure(
        &dir,
        &[
            "model.safetensors",
            "layers.0.attn.ghost.weight",
            "deepseek_v41 mapping",
        ],
    );
    // V4's names that V4.1 does not have are unknown too.
    let dir = copy_fixture("deepseek_v41_a", tmp.path().join("2").as_path());
    rewrite_tensors(&dir, |t| {
        t.insert("hc_head_fn".into(), raw(Dtype::F32, &[4], vec![0; 16]));
    });
    expect_failure(&dir, &["hc_head_fn", "deepseek_v41 mapping"]);
}

#[test]
fn deepseek_v41_engram_tables_must_match_the_config() {
    let tmp = tempfile::tempdir().unwrap();
    // A table the config does not list.
    let dir = copy_fixture("deepseek_v41_a", tmp.path());
    edit_json(&dir.join("config.json"), |c| {
        c["text_config"]["engram_layer_ids"] = serde_json::json!([1, 5])
    });
    expect_failure(
        &dir,
        &[
            "\"layers.4.engram.embed.weight\"",
            "engram_layer_ids",
            "[1, 5]",
        ],
    );

    // A listed table that is missing.
    let dir = copy_fixture("deepseek_v41_a", tmp.path().join("2").as_path());
    rewrite_tensors(&dir, |t| {
        t.remove("layers.1.engram.embed.weight");
        t.remove("layers.1.engram.embed.scale");
    });
    expect_failure(
        &dir,
        &[
            "layers.1.engram.embed.weight",
            "not found",
            "model.engram_tables.1.weight",
        ],
    );

    // Rows that contradict engram_num_embeddings.
    let dir = copy_fixture("deepseek_v41_a", tmp.path().join("3").as_path());
    edit_json(&dir.join("config.json"), |c| {
        c["text_config"]["engram_num_embeddings"] = serde_json::json!([630, 835])
    });
    expect_failure(
        &dir,
        &[
            "\"layers.4.engram.embed.weight\"",
            "[835, 64]",
            "engram_num_embeddings",
            "[834, 64]",
        ],
    );
}
