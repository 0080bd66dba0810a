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

use cmf_format::Cmf;
use model_dsv4::{Model, Weights};
use serde_json::json;
use test_support::bench::{self, SyntheticWriter};

fn main() {
    let (dtype, experts, prompt) = bench::args(16, 256);
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
    let mut w = SyntheticWriter::create(&path, "deepseek_v4", config, dtype);
    w.mat("model.embed_tokens.weight", vocab, d);
    w.mat("lm_head.weight", vocab, d);
    w.mat("model.hc_head.hc_fn", n, n * d);
    w.vec("model.hc_head.hc_base", &[n], 0.0);
    w.vec("model.hc_head.hc_scale", &[1], 1.0);
    w.vec("model.norm.weight", &[d], 1.0);
    let m = (2 + n) * n;
    for il in 0..3 {
        let p = format!("model.layers.{il}");
        for site in ["attn_hc", "ffn_hc"] {
            w.mat(&format!("{p}.{site}.fn"), m, n * d);
            w.vec(&format!("{p}.{site}.base"), &[m], 0.0);
            w.vec(&format!("{p}.{site}.scale"), &[3], 1.0);
        }
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            w.vec(&format!("{p}.{norm}.weight"), &[d], 1.0);
        }
        let a = format!("{p}.self_attn");
        w.mat(&format!("{a}.q_a_proj.weight"), qr, d);
        w.vec(&format!("{a}.q_a_norm.weight"), &[qr], 1.0);
        w.mat(&format!("{a}.q_b_proj.weight"), h * dh, qr);
        w.mat(&format!("{a}.kv_proj.weight"), dh, d);
        w.vec(&format!("{a}.kv_norm.weight"), &[dh], 1.0);
        w.mat(&format!("{a}.o_a_proj.weight"), g * r, h * dh / g);
        w.mat(&format!("{a}.o_b_proj.weight"), d, g * r);
        w.vec(&format!("{a}.sinks"), &[h], 0.0);
        let comp = |w: &mut SyntheticWriter, p: &str, width: usize, head: usize, rate: usize| {
            w.mat(&format!("{p}.kv_proj.weight"), width, d);
            w.mat(&format!("{p}.gate_proj.weight"), width, d);
            w.vec(&format!("{p}.position_bias"), &[rate, width], 0.0);
            w.vec(&format!("{p}.kv_norm.weight"), &[head], 1.0);
        };
        if il == 1 {
            comp(&mut w, &format!("{a}.compressor"), 2 * dh, dh, 4);
            let x = format!("{a}.compressor.indexer");
            comp(&mut w, &x, 2 * di, di, 4);
            w.mat(&format!("{x}.q_b_proj.weight"), ni * di, qr);
            w.mat(&format!("{x}.scorer.weights_proj.weight"), ni, d);
        } else if il == 2 {
            comp(&mut w, &format!("{a}.compressor"), dh, dh, 128);
        }
        let f = format!("{p}.mlp");
        w.mat(&format!("{f}.gate.weight"), experts, d);
        if il == 0 {
            let ids: Vec<f32> = (0..vocab * topk)
                .map(|i| (((i / topk) * 5 + i % topk) % experts) as f32)
                .collect();
            w.f32s(&format!("{f}.gate.tid2eid"), &[vocab, topk], &ids);
        } else {
            w.vec(
                &format!("{f}.gate.e_score_correction_bias"),
                &[experts],
                0.0,
            );
        }
        for e in 0..experts {
            w.mat(
                &format!("{f}.experts.{e}.gate_up_proj.weight"),
                2 * inter,
                d,
            );
            w.mat(&format!("{f}.experts.{e}.down_proj.weight"), d, inter);
        }
        w.mat(&format!("{f}.shared_experts.gate_proj.weight"), inter, d);
        w.mat(&format!("{f}.shared_experts.up_proj.weight"), inter, d);
        w.mat(&format!("{f}.shared_experts.down_proj.weight"), d, inter);
    }
    w.finish();

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

    bench::report(&model, dtype, experts, prompt, per_token);
}
