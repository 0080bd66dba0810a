//! CPU speed of the qwen4_exp reference forward on a synthetic model (random weights, written to
//! a temporary CMF, never committed), with the weight bytes one decoded token touches against
//! the machine's measured read bandwidth.
//!
//!     cargo run --release -p model-qwen4 --example bench [-- DTYPE [EXPERTS [PROMPT]]]
//!
//! Geometry: release widths (hidden 2560, 4 HC streams of low rank 320, 24x256 attention heads
//! with 2 KV heads, GDN 16 key / 48 value heads of 128, QSA 4x128 budget 2048 ratio 4, expert
//! FFN 640, top-10, gated shared expert 640, PLE on the 2nd layer) but 4 layers (3 GDN + 1
//! attention), EXPERTS routed experts (default 64, release 512), vocab 32768 and a small PLE
//! n-gram table. Matrices in DTYPE (default q8_2f), vectors f32.

use cmf_format::{Cmf, CmfWriter, Header};
use model_qwen4::{Model, SeqState, Weights};
use quant_codecs::{DType, synthetic_payload};
use rayon::prelude::*;
use serde_json::json;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dtype = args
        .first()
        .map_or(DType::Q8_2f, |s| DType::from_name(s).expect("dtype name"));
    let experts: usize = args.get(1).map_or(64, |s| s.parse().expect("experts"));
    let prompt: usize = args.get(2).map_or(128, |s| s.parse().expect("prompt"));
    let config = json!({
        "model_type": "qwen4_exp_text",
        "vocab_size": 32768, "hidden_size": 2560, "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
        "num_attention_heads": 24, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "moe_intermediate_size": 640, "shared_expert_intermediate_size": 640,
        "num_experts": experts, "num_experts_per_tok": 10, "norm_topk_prob": true,
        "hc_count": 4, "hc_lowrank": 320,
        "ple_layer_ids": [2], "ngram_size": 3, "heads_per_ngram": 8,
        "ngram_vocab_size_base": 1000, "split_ngram_parts": 1, "eos_token_id": 2,
        "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 128,
        "indexer_budget": 2048, "indexer_compress_ratio": 4, "output_gate_type": "sigmoid",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    });
    let cfg = model_qwen4::Qwen4ExpTextConfig::from_json(&config).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("synthetic.cmf");
    let mut header = Header::new("qwen4_exp");
    header.config = config;
    let mut w = CmfWriter::create(&path, header).unwrap();
    let mut seed = 1u64;
    let mut mat = |w: &mut CmfWriter, name: &str, rows: usize, cols: usize| {
        seed += 1;
        let b = synthetic_payload(dtype, rows, cols, seed).unwrap();
        w.add_tensor(name, dtype, &[rows, cols], &b).unwrap();
    };
    let vec = |w: &mut CmfWriter, name: &str, shape: &[usize], value: f32| {
        let n: usize = shape.iter().product();
        let b: Vec<u8> = (0..n).flat_map(|_| value.to_le_bytes()).collect();
        w.add_tensor(name, DType::F32, shape, &b).unwrap();
    };
    let (d, hd, r) = (2560, 4 * 2560, 320);
    let hc = |w: &mut CmfWriter,
              mat: &mut dyn FnMut(&mut CmfWriter, &str, usize, usize),
              p: &str,
              inject: bool| {
        vec(w, &format!("{p}.hc_norm.weight"), &[hd], 0.0);
        mat(w, &format!("{p}.input_mix_weight_down.weight"), r, hd);
        mat(w, &format!("{p}.input_mix_weight_up.weight"), hd, r);
        if inject {
            mat(w, &format!("{p}.block_inject_weight.weight"), 4, hd);
        }
    };
    mat(&mut w, "model.embed_tokens.weight", 32768, d);
    mat(&mut w, "lm_head.weight", 32768, d);
    hc(&mut w, &mut mat, "model.hyper_connection_mixer", false);
    for il in 0..4 {
        let p = format!("model.layers.{il}");
        hc(
            &mut w,
            &mut mat,
            &format!("{p}.attn_hyper_connection"),
            true,
        );
        hc(&mut w, &mut mat, &format!("{p}.mlp_hyper_connection"), true);
        if il < 3 {
            let q = format!("{p}.linear_attn");
            mat(&mut w, &format!("{q}.in_proj_qkv.weight"), 10240, d);
            mat(&mut w, &format!("{q}.in_proj_z.weight"), 6144, d);
            mat(&mut w, &format!("{q}.in_proj_b.weight"), 48, d);
            mat(&mut w, &format!("{q}.in_proj_a.weight"), 48, d);
            mat(&mut w, &format!("{q}.out_proj.weight"), d, 6144);
            vec(&mut w, &format!("{q}.conv1d.weight"), &[10240, 1, 4], 0.25);
            vec(&mut w, &format!("{q}.dt_bias"), &[48], 0.0);
            vec(&mut w, &format!("{q}.A_log"), &[48], 0.0);
            vec(&mut w, &format!("{q}.norm.weight"), &[128], 1.0);
        } else {
            let q = format!("{p}.self_attn");
            mat(&mut w, &format!("{q}.q_proj.weight"), 24 * 512, d);
            mat(&mut w, &format!("{q}.k_proj.weight"), 512, d);
            mat(&mut w, &format!("{q}.v_proj.weight"), 512, d);
            mat(&mut w, &format!("{q}.o_proj.weight"), d, 6144);
            mat(&mut w, &format!("{q}.indexer.index_qk_proj.weight"), 640, d);
            for n in ["q_norm", "k_norm"] {
                vec(&mut w, &format!("{q}.{n}.weight"), &[256], 0.0);
            }
            for n in ["q_layernorm", "k_layernorm"] {
                vec(&mut w, &format!("{q}.indexer.{n}.weight"), &[128], 0.0);
            }
        }
        if il == 1 {
            let q = format!("{p}.ple");
            let rows = model_qwen4::ple::PleHash::new(&cfg, 0).padded_rows;
            mat(
                &mut w,
                &format!("{q}.ple_embedding.ngram_embedding.shard_0.weight"),
                rows,
                160,
            );
            mat(&mut w, &format!("{q}.key_proj.weight"), hd, d);
            mat(&mut w, &format!("{q}.value_proj.weight"), d, d);
            for n in ["norm_key", "norm_query", "norm_conv"] {
                vec(&mut w, &format!("{q}.{n}.weight"), &[hd], 0.0);
            }
            vec(&mut w, &format!("{q}.conv1d.weight"), &[hd, 1, 4], 0.25);
        }
        let m = format!("{p}.mlp");
        mat(&mut w, &format!("{m}.gate.weight"), experts, d);
        for e in 0..experts {
            mat(
                &mut w,
                &format!("{m}.experts.{e}.gate_up_proj.weight"),
                1280,
                d,
            );
            mat(&mut w, &format!("{m}.experts.{e}.down_proj.weight"), d, 640);
        }
        mat(
            &mut w,
            &format!("{m}.shared_expert.gate_proj.weight"),
            640,
            d,
        );
        mat(&mut w, &format!("{m}.shared_expert.up_proj.weight"), 640, d);
        mat(
            &mut w,
            &format!("{m}.shared_expert.down_proj.weight"),
            d,
            640,
        );
        vec(
            &mut w,
            &format!("{m}.shared_expert_gate.weight"),
            &[1, d],
            0.001,
        );
    }
    w.finish().unwrap();

    let cmf = Cmf::open(&path).unwrap();
    let (config, weights) = Weights::bind(&cmf).unwrap();
    // Bytes one decoded token reads: every matrix except the embedding table and the n-gram
    // table (one row each) and the routed experts, of which top-k are read.
    let expert_bytes: usize = weights.layers[0].moe.routed.experts[0]
        .gate_up
        .bytes()
        .len()
        + weights.layers[0].moe.routed.experts[0].down.bytes().len();
    let total: usize = cmf.tensors().iter().map(|t| t.nbytes as usize).sum();
    let embed = weights.embed.bytes().len();
    let ple_table: usize = weights.layers[1]
        .ple
        .as_ref()
        .unwrap()
        .shards
        .iter()
        .map(|s| s.bytes().len())
        .sum();
    let routed = 4 * experts * expert_bytes;
    let per_token = total - embed - ple_table - routed + 4 * 10 * expert_bytes;
    let model = Model::new(config, weights);

    let tokens: Vec<u32> = (0..prompt as u32)
        .map(|i| (i * 7919 + 13) % 32768)
        .collect();
    let mut st = SeqState::new(&model.config);
    let t0 = Instant::now();
    model.forward(&tokens, &mut st).unwrap();
    let prefill = prompt as f64 / t0.elapsed().as_secs_f64();
    let n_dec = 16;
    let t0 = Instant::now();
    for i in 0..n_dec {
        model.forward(&[(i * 31 + 5) % 32768], &mut st).unwrap();
    }
    let dec_s = t0.elapsed().as_secs_f64() / n_dec as f64;

    // Read bandwidth: sum a 1 GiB buffer with all cores (best of 3).
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
    let bound = per_token as f64 / bw;
    println!(
        "dtype {} experts {experts} threads {}: prefill {prompt} tokens {prefill:.1} tok/s; decode {:.2} tok/s \
         ({:.1} ms/token); {:.1} MB of weights per decoded token, read bandwidth {:.1} GB/s -> bound {:.1} ms/token \
         ({:.0}% of the bandwidth bound)",
        dtype.name(),
        rayon::current_num_threads(),
        1.0 / dec_s,
        dec_s * 1e3,
        per_token as f64 / 1e6,
        bw / 1e9,
        bound * 1e3,
        100.0 * bound / dec_s
    );
}
