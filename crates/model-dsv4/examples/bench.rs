//! CPU speed of the deepseek_v4 reference forward on a synthetic model (random weights, written
//! to a temporary CMF, never committed), with the weight bytes one decoded token touches against
//! the machine's measured read bandwidth.
//!
//!     cargo run --release -p model-dsv4 --example bench [-- DTYPE [EXPERTS [PROMPT]]]
//!
//! Geometry: V4-Flash widths (hidden 4096, 4 mHC streams, 64 heads x 512 with q_lora_rank 1024,
//! 8 output groups of rank 1024, indexer 64 x 128 top-512, sliding window 128, compress rates
//! 4 / 128, expert FFN 2048, top-6 + one shared expert) but 3 layers (sliding + hash MoE, CSA,
//! HCA), EXPERTS routed experts (default 16, release 256) and vocab 32768. Matrices in DTYPE
//! (default q8_2f), vectors f32.

use cmf_format::{Cmf, CmfWriter, Header};
use model_dsv4::{Model, SeqState, Weights};
use quant_codecs::{DType, synthetic_payload};
use rayon::prelude::*;
use serde_json::json;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dtype = args
        .first()
        .map_or(DType::Q8_2f, |s| DType::from_name(s).expect("dtype name"));
    let experts: usize = args.get(1).map_or(16, |s| s.parse().expect("experts"));
    let prompt: usize = args.get(2).map_or(256, |s| s.parse().expect("prompt"));
    let (vocab, d, n, h, dh, qr, g, r) = (32768, 4096, 4, 64, 512, 1024, 8, 1024);
    let (ni, di, inter, topk) = (64, 128, 2048, 6);
    let config = json!({
        "model_type": "deepseek_v4",
        "vocab_size": vocab, "hidden_size": d, "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        "mlp_layer_types": ["hash_moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "num_attention_heads": h, "head_dim": dh, "q_lora_rank": qr, "qk_rope_head_dim": 64,
        "o_groups": g, "o_lora_rank": r, "index_n_heads": ni, "index_head_dim": di,
        "index_topk": 512, "sliding_window": 128, "moe_intermediate_size": inter,
        "n_routed_experts": experts, "num_experts_per_tok": topk, "hc_mult": n,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1}
    });
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("synthetic.cmf");
    let mut header = Header::new("deepseek_v4");
    header.config = config;
    let mut w = CmfWriter::create(&path, header).unwrap();
    let mut seed = 1u64;
    let mut mat = |w: &mut CmfWriter, name: &str, rows: usize, cols: usize| {
        seed += 1;
        let b = synthetic_payload(dtype, rows, cols, seed).unwrap();
        w.add_tensor(name, dtype, &[rows, cols], &b).unwrap();
    };
    let vec = |w: &mut CmfWriter, name: &str, shape: &[usize], value: f32| {
        let len: usize = shape.iter().product();
        let b: Vec<u8> = (0..len).flat_map(|_| value.to_le_bytes()).collect();
        w.add_tensor(name, DType::F32, shape, &b).unwrap();
    };
    mat(&mut w, "model.embed_tokens.weight", vocab, d);
    mat(&mut w, "lm_head.weight", vocab, d);
    mat(&mut w, "model.hc_head.hc_fn", n, n * d);
    vec(&mut w, "model.hc_head.hc_base", &[n], 0.0);
    vec(&mut w, "model.hc_head.hc_scale", &[1], 1.0);
    vec(&mut w, "model.norm.weight", &[d], 1.0);
    let m = (2 + n) * n;
    for il in 0..3 {
        let p = format!("model.layers.{il}");
        for site in ["attn_hc", "ffn_hc"] {
            mat(&mut w, &format!("{p}.{site}.fn"), m, n * d);
            vec(&mut w, &format!("{p}.{site}.base"), &[m], 0.0);
            vec(&mut w, &format!("{p}.{site}.scale"), &[3], 1.0);
        }
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            vec(&mut w, &format!("{p}.{norm}.weight"), &[d], 1.0);
        }
        let a = format!("{p}.self_attn");
        mat(&mut w, &format!("{a}.q_a_proj.weight"), qr, d);
        vec(&mut w, &format!("{a}.q_a_norm.weight"), &[qr], 1.0);
        mat(&mut w, &format!("{a}.q_b_proj.weight"), h * dh, qr);
        mat(&mut w, &format!("{a}.kv_proj.weight"), dh, d);
        vec(&mut w, &format!("{a}.kv_norm.weight"), &[dh], 1.0);
        mat(&mut w, &format!("{a}.o_a_proj.weight"), g * r, h * dh / g);
        mat(&mut w, &format!("{a}.o_b_proj.weight"), d, g * r);
        vec(&mut w, &format!("{a}.sinks"), &[h], 0.0);
        let mut comp = |w: &mut CmfWriter, p: &str, width: usize, head: usize, rate: usize| {
            mat(w, &format!("{p}.kv_proj.weight"), width, d);
            mat(w, &format!("{p}.gate_proj.weight"), width, d);
            vec(w, &format!("{p}.position_bias"), &[rate, width], 0.0);
            vec(w, &format!("{p}.kv_norm.weight"), &[head], 1.0);
        };
        if il == 1 {
            comp(&mut w, &format!("{a}.compressor"), 2 * dh, dh, 4);
            let x = format!("{a}.compressor.indexer");
            comp(&mut w, &x, 2 * di, di, 4);
            mat(&mut w, &format!("{x}.q_b_proj.weight"), ni * di, qr);
            mat(&mut w, &format!("{x}.scorer.weights_proj.weight"), ni, d);
        } else if il == 2 {
            comp(&mut w, &format!("{a}.compressor"), dh, dh, 128);
        }
        let f = format!("{p}.mlp");
        mat(&mut w, &format!("{f}.gate.weight"), experts, d);
        if il == 0 {
            let ids: Vec<u8> = (0..vocab * topk)
                .map(|i| (((i / topk) * 5 + i % topk) % experts) as f32)
                .flat_map(f32::to_le_bytes)
                .collect();
            w.add_tensor(
                &format!("{f}.gate.tid2eid"),
                DType::F32,
                &[vocab, topk],
                &ids,
            )
            .unwrap();
        } else {
            vec(
                &mut w,
                &format!("{f}.gate.e_score_correction_bias"),
                &[experts],
                0.0,
            );
        }
        for e in 0..experts {
            mat(
                &mut w,
                &format!("{f}.experts.{e}.gate_up_proj.weight"),
                2 * inter,
                d,
            );
            mat(
                &mut w,
                &format!("{f}.experts.{e}.down_proj.weight"),
                d,
                inter,
            );
        }
        mat(
            &mut w,
            &format!("{f}.shared_experts.gate_proj.weight"),
            inter,
            d,
        );
        mat(
            &mut w,
            &format!("{f}.shared_experts.up_proj.weight"),
            inter,
            d,
        );
        mat(
            &mut w,
            &format!("{f}.shared_experts.down_proj.weight"),
            d,
            inter,
        );
    }
    w.finish().unwrap();

    let cmf = Cmf::open(&path).unwrap();
    let (config, weights) = Weights::bind(&cmf).unwrap();
    // Bytes one decoded token reads: every matrix except the embedding table (one row) and the
    // routed experts, of which top-k per layer are read.
    let expert_bytes: usize = weights.layers[0].moe.routed.experts[0]
        .gate_up
        .bytes()
        .len()
        + weights.layers[0].moe.routed.experts[0].down.bytes().len();
    let total: usize = cmf.tensors().iter().map(|t| t.nbytes as usize).sum();
    let embed = weights.embed_tokens.bytes().len();
    let per_token = total - embed - 3 * experts * expert_bytes + 3 * topk * expert_bytes;
    let model = Model::new(config, weights);

    let tokens: Vec<u32> = (0..prompt as u32)
        .map(|i| (i * 7919 + 13) % vocab as u32)
        .collect();
    let mut st = SeqState::new(&model.config);
    let t0 = Instant::now();
    model.forward(&tokens, &mut st).unwrap();
    let prefill = prompt as f64 / t0.elapsed().as_secs_f64();
    let n_dec = 16;
    let t0 = Instant::now();
    for i in 0..n_dec {
        model
            .forward(&[(i * 31 + 5) % vocab as u32], &mut st)
            .unwrap();
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
