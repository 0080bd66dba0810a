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
//!
//! With `CORTIQ_BENCH_KEEP=FILE.cmf` it only writes the model there, with the demo model's
//! tokenizer embedded, for measuring the `cortiq` binary on a multi-GB file (e.g. 256 experts
//! make about 5 GB at q8_2f).

use cmf_format::Cmf;
use model_qwen4::{Model, Weights};
use serde_json::json;
use test_support::bench::{self, SyntheticWriter};

fn main() {
    let (dtype, experts, prompt) = bench::args(64, 128);
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
    let keep = std::env::var_os("CORTIQ_BENCH_KEEP").map(std::path::PathBuf::from);
    let path = keep
        .clone()
        .unwrap_or_else(|| dir.path().join("synthetic.cmf"));
    let mut header = cmf_format::Header::new("qwen4_exp");
    header.config = config;
    if keep.is_some() {
        let demo = test_support::workspace().join("assets/shakespeare.cmf");
        header.tokenizer = Cmf::open(&demo).unwrap().header().tokenizer.clone();
    }
    let mut w = SyntheticWriter::with_header(&path, header, dtype);
    let (d, hd, r) = (2560, 4 * 2560, 320);
    let hc = |w: &mut SyntheticWriter, p: &str, inject: bool| {
        w.vec(&format!("{p}.hc_norm.weight"), &[hd], 0.0);
        w.mat(&format!("{p}.input_mix_weight_down.weight"), r, hd);
        w.mat(&format!("{p}.input_mix_weight_up.weight"), hd, r);
        if inject {
            w.mat(&format!("{p}.block_inject_weight.weight"), 4, hd);
        }
    };
    w.mat("model.embed_tokens.weight", 32768, d);
    w.mat("lm_head.weight", 32768, d);
    hc(&mut w, "model.hyper_connection_mixer", false);
    for il in 0..4 {
        let p = format!("model.layers.{il}");
        hc(&mut w, &format!("{p}.attn_hyper_connection"), true);
        hc(&mut w, &format!("{p}.mlp_hyper_connection"), true);
        if il < 3 {
            let q = format!("{p}.linear_attn");
            w.mat(&format!("{q}.in_proj_qkv.weight"), 10240, d);
            w.mat(&format!("{q}.in_proj_z.weight"), 6144, d);
            w.mat(&format!("{q}.in_proj_b.weight"), 48, d);
            w.mat(&format!("{q}.in_proj_a.weight"), 48, d);
            w.mat(&format!("{q}.out_proj.weight"), d, 6144);
            w.vec(&format!("{q}.conv1d.weight"), &[10240, 1, 4], 0.25);
            w.vec(&format!("{q}.dt_bias"), &[48], 0.0);
            w.vec(&format!("{q}.A_log"), &[48], 0.0);
            w.vec(&format!("{q}.norm.weight"), &[128], 1.0);
        } else {
            let q = format!("{p}.self_attn");
            w.mat(&format!("{q}.q_proj.weight"), 24 * 512, d);
            w.mat(&format!("{q}.k_proj.weight"), 512, d);
            w.mat(&format!("{q}.v_proj.weight"), 512, d);
            w.mat(&format!("{q}.o_proj.weight"), d, 6144);
            w.mat(&format!("{q}.indexer.index_qk_proj.weight"), 640, d);
            for n in ["q_norm", "k_norm"] {
                w.vec(&format!("{q}.{n}.weight"), &[256], 0.0);
            }
            for n in ["q_layernorm", "k_layernorm"] {
                w.vec(&format!("{q}.indexer.{n}.weight"), &[128], 0.0);
            }
        }
        if il == 1 {
            let q = format!("{p}.ple");
            let rows = model_qwen4::ple::PleHash::new(&cfg, 0).padded_rows;
            w.mat(
                &format!("{q}.ple_embedding.ngram_embedding.shard_0.weight"),
                rows,
                160,
            );
            w.mat(&format!("{q}.key_proj.weight"), hd, d);
            w.mat(&format!("{q}.value_proj.weight"), d, d);
            for n in ["norm_key", "norm_query", "norm_conv"] {
                w.vec(&format!("{q}.{n}.weight"), &[hd], 0.0);
            }
            w.vec(&format!("{q}.conv1d.weight"), &[hd, 1, 4], 0.25);
        }
        let m = format!("{p}.mlp");
        w.mat(&format!("{m}.gate.weight"), experts, d);
        for e in 0..experts {
            w.mat(&format!("{m}.experts.{e}.gate_up_proj.weight"), 1280, d);
            w.mat(&format!("{m}.experts.{e}.down_proj.weight"), d, 640);
        }
        w.mat(&format!("{m}.shared_expert.gate_proj.weight"), 640, d);
        w.mat(&format!("{m}.shared_expert.up_proj.weight"), 640, d);
        w.mat(&format!("{m}.shared_expert.down_proj.weight"), d, 640);
        w.vec(&format!("{m}.shared_expert_gate.weight"), &[1, d], 0.001);
    }
    w.finish();
    if keep.is_some() {
        let bytes = std::fs::metadata(&path).unwrap().len();
        println!("wrote {} ({:.2} GB)", path.display(), bytes as f64 / 1e9);
        return;
    }

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

    bench::report(&model, dtype, experts, prompt, per_token);
}
