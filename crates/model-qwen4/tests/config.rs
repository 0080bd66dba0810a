//! The fixtures' text configs parse and validate; broken configs name the field at fault.

use model_qwen4::{ConfigError, LayerType, Qwen4ExpTextConfig};
use serde_json::{Value, json};
use std::path::PathBuf;

fn fixture_text_config(case: &str) -> Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(case)
        .join("hf/config.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    v["text_config"].clone()
}

fn field_of(r: Result<Qwen4ExpTextConfig, ConfigError>) -> &'static str {
    match r {
        Err(ConfigError::Invalid { field, .. }) => field,
        other => panic!("expected an Invalid error, got {other:?}"),
    }
}

#[test]
fn fixture_configs_parse_and_validate() {
    let a = Qwen4ExpTextConfig::from_json(&fixture_text_config("qwen4_exp_a")).unwrap();
    assert_eq!(a.hc_count, 4);
    assert_eq!(a.layer_type(3), LayerType::IndexedAttention);
    assert_eq!(a.layer_type(0), LayerType::LinearAttention);
    // ple_layer_ids [2] is one-indexed: layer index 1.
    assert_eq!(a.ple_layer_index(1), Some(0));
    assert_eq!(a.ple_layer_index(0), None);
    assert_eq!(a.eos_id(), Some(503));
    assert_eq!(a.qsa().unwrap().block_topk(), 2);
    let b = Qwen4ExpTextConfig::from_json(&fixture_text_config("qwen4_exp_b")).unwrap();
    assert_eq!(b.ple_layer_index(0), Some(0));
    assert!(!b.norm_topk_prob);
    assert_eq!(b.rotary_dim(), 8);
    let c = Qwen4ExpTextConfig::from_json(&fixture_text_config("qwen4_exp_c")).unwrap();
    assert_eq!(c.ngram_size, 2);
    assert_eq!(c.qsa().unwrap().block_topk(), 3);
}

#[test]
fn defaults_follow_the_reference() {
    let c = Qwen4ExpTextConfig::from_json(&json!({
        "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 128,
        "indexer_budget": 2048, "indexer_compress_ratio": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    }))
    .unwrap();
    assert_eq!(c.hidden_size, 2048);
    assert_eq!(c.num_hidden_layers, 40);
    assert_eq!(c.linear_num_value_heads, 32);
    assert_eq!(c.hc_lowrank, 320);
    assert_eq!(c.ngram_vocab_size_base, 20_000_000);
    // Derived pattern: every 4th layer is attention.
    assert_eq!(c.layer_type(3), LayerType::IndexedAttention);
    assert_eq!(c.layer_type(4), LayerType::LinearAttention);
    assert_eq!(c.rotary_dim(), 64);
}

#[test]
fn broken_configs_name_the_field() {
    let base = fixture_text_config("qwen4_exp_a");
    let with = |k: &str, v: Value| {
        let mut c = base.clone();
        c[k] = v;
        Qwen4ExpTextConfig::from_json(&c)
    };
    assert_eq!(field_of(with("hc_count", json!(1))), "hc_count");
    assert_eq!(field_of(with("eos_token_id", Value::Null)), "eos_token_id");
    // 0 is not a one-indexed id.
    assert_eq!(field_of(with("ple_layer_ids", json!([0]))), "ple_layer_ids");
    // Layer id 4 is the indexed-attention layer: PLE must sit on a linear layer.
    assert_eq!(field_of(with("ple_layer_ids", json!([4]))), "ple_layer_ids");
    assert_eq!(
        field_of(with("indexer_budget", Value::Null)),
        "indexer_budget"
    );
    assert_eq!(
        field_of(with("indexer_kv_heads", json!(2))),
        "indexer_kv_heads"
    );
    assert_eq!(field_of(with("indexer_budget", json!(9))), "indexer_budget");
    assert_eq!(
        field_of(with("output_gate_type", json!("relu"))),
        "output_gate_type"
    );
    assert_eq!(
        field_of(with("num_experts_per_tok", json!(9))),
        "num_experts_per_tok"
    );
    assert_eq!(
        field_of(with("layer_types", json!(["linear_attention"]))),
        "layer_types"
    );
    assert!(matches!(
        with("hc_count", json!("four")),
        Err(ConfigError::Json(_))
    ));
}

/// Every config value that selects math is an enum: an unknown value names the field and the
/// values it accepts; the reference's alias `full_attention` reads as indexed attention.
#[test]
fn unknown_enum_values_name_the_field_and_the_accepted_values() {
    let base = fixture_text_config("qwen4_exp_a");
    let with = |path: &[&str], v: Value| {
        let mut c = base.clone();
        let mut at = &mut c;
        for p in &path[..path.len() - 1] {
            at = &mut at[*p];
        }
        at[path[path.len() - 1]] = v;
        Qwen4ExpTextConfig::from_json(&c)
    };
    let n = base["num_hidden_layers"].as_u64().unwrap() as usize;
    let mut types = vec![json!("linear_attention"); n];
    types[1] = json!("mamba");
    for (path, value, field, accepted) in [
        (vec!["hidden_act"], json!("gelu"), "hidden_act", "silu"),
        (
            vec!["output_gate_type"],
            json!("tanh"),
            "output_gate_type",
            "sigmoid, silu",
        ),
        (
            vec!["layer_types"],
            Value::Array(types),
            "layer_types",
            "linear_attention, indexed_attention, full_attention",
        ),
        (
            vec!["rope_parameters", "rope_type"],
            json!("yarn"),
            "rope_parameters",
            "default",
        ),
    ] {
        match with(&path, value) {
            Err(e @ ConfigError::Invalid { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains(&format!("`{field}`")), "{msg}");
                assert!(msg.contains(accepted), "{msg}");
            }
            other => panic!("{path:?}: expected an Invalid error, got {other:?}"),
        }
    }
    let mut types = vec![json!("linear_attention"); n];
    types[n - 1] = json!("full_attention");
    let c = with(&["layer_types"], Value::Array(types)).unwrap();
    assert_eq!(c.layer_type(n - 1), LayerType::IndexedAttention);
}
