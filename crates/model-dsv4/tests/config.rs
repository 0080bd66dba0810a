//! The config's `__post_init__` and validation, against values transformers 5.24 computes for
//! the same JSON (`DeepseekV4Config(...)` and `DeepseekV4RotaryEmbedding`, printed once and
//! written here as the witness).

use model_dsv4::config::RopeKind;
use model_dsv4::ops::Rope;
use model_dsv4::{AttnKind, ConfigError, DeepseekV4Config};
use serde_json::json;

/// The released V4-Flash `config.json` keys that drive the schedule and RoPE (legacy form).
fn flash() -> serde_json::Value {
    let mut ratios = vec![0, 0];
    for _ in 0..20 {
        ratios.extend([4, 128]);
    }
    ratios.extend([4, 0]);
    json!({
        "num_hidden_layers": 43, "compress_ratios": ratios, "qk_rope_head_dim": 64,
        "num_hash_layers": 3,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                          "beta_fast": 32, "beta_slow": 1}
    })
}

#[test]
fn released_flash_config_resolves_like_transformers() {
    let c = DeepseekV4Config::from_json(&flash()).unwrap();
    // 44 ratios (43 layers + MTP) are truncated to 43 layers.
    assert_eq!(c.layer_types.as_ref().unwrap().len(), 43);
    assert_eq!(c.attn_kind(0), AttnKind::Sliding);
    assert_eq!(c.attn_kind(1), AttnKind::Sliding);
    assert_eq!(c.attn_kind(2), AttnKind::Csa);
    assert_eq!(c.attn_kind(3), AttnKind::Hca);
    assert_eq!(c.attn_kind(42), AttnKind::Csa);
    assert!((0..3).all(|il| c.is_hash_layer(il)) && !c.is_hash_layer(3));
    assert_eq!(c.rate(AttnKind::Csa), Some(4));
    assert_eq!(c.rate(AttnKind::Hca), Some(128));
    assert_eq!(c.rope_main().kind, RopeKind::Default);
    assert!(matches!(c.rope_compress().kind, RopeKind::Yarn { factor, .. } if factor == 16.0));
    assert_eq!(c.rope_compress().attention_factor, 1.0);
    assert_eq!(c.rotary_dim(c.rope_compress()), 64);

    // DeepseekV4RotaryEmbedding(cfg).compress_inv_freq, transformers 5.24.
    let want: [f64; 32] = [
        1.0,
        0.687656045,
        0.472870797,
        0.325172454,
        0.223606795,
        0.153764561,
        0.105737120,
        0.0727107748,
        0.0500000007,
        0.0343828015,
        0.0236435402,
        0.0162586235,
        0.0111803403,
        0.00768822804,
        0.00528685655,
        0.00363553851,
        0.00226562493,
        0.00139680132,
        0.000849689706,
        0.000508081983,
        0.000296977785,
        0.000168179977,
        9.08678412e-05,
        4.54442306e-05,
        1.95312532e-05,
        5.37231244e-06,
        3.69430336e-06,
        2.54040970e-06,
        1.74692821e-06,
        1.20128561e-06,
        8.26071300e-07,
        5.68052940e-07,
    ];
    let got = Rope::new(c.rope_compress(), c.head_dim);
    for (i, (&g, &w)) in got.inv_freq().iter().zip(&want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= 1e-6 * w.abs(),
            "inv_freq[{i}]: {g} vs {w}"
        );
    }
    let main = Rope::new(c.rope_main(), c.head_dim);
    let want_main: [f64; 4] = [1.0, 0.749894202, 0.562341332, 0.421696514];
    for (&g, &w) in main.inv_freq().iter().zip(&want_main) {
        assert!((g as f64 - w).abs() <= 1e-6, "{g} vs {w}");
    }
}

#[test]
fn bad_configs_name_the_field() {
    let field = |v: serde_json::Value| match DeepseekV4Config::from_json(&v) {
        Err(ConfigError::Invalid { field, .. }) => field,
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("accepted {v}"),
    };
    let mut v = flash();
    v["compress_ratios"][2] = json!(5);
    assert_eq!(field(v), "compress_ratios");
    assert_eq!(
        field(json!({"num_hidden_layers": 2, "layer_types": ["sliding_attention"]})),
        "layer_types"
    );
    assert_eq!(
        field(json!({"num_hidden_layers": 1, "layer_types": ["full_attention"]})),
        "layer_types"
    );
    assert_eq!(field(json!({"scoring_func": "relu"})), "scoring_func");
    assert_eq!(
        field(json!({"num_hidden_layers": 1, "mlp_layer_types": ["dense"]})),
        "mlp_layer_types"
    );
    assert_eq!(field(json!({"hidden_act": "gelu"})), "hidden_act");
    // The message lists what is accepted.
    let e = DeepseekV4Config::from_json(&json!({"scoring_func": "relu"})).unwrap_err();
    assert!(
        e.to_string().contains("sqrtsoftplus, softmax, sigmoid"),
        "{e}"
    );
    assert_eq!(field(json!({"o_groups": 7})), "o_groups");
    assert_eq!(
        field(json!({"num_experts_per_tok": 9, "n_routed_experts": 8})),
        "num_experts_per_tok"
    );
    assert_eq!(
        field(json!({"rope_scaling": {"type": "longrope", "factor": 2}})),
        "rope_parameters.compress"
    );
    assert_eq!(
        field(json!({"index_head_dim": 32})),
        "rope_parameters.compress"
    );
    assert_eq!(field(json!({"swiglu_limit": -1.0})), "swiglu_limit");
    assert!(DeepseekV4Config::from_json(&json!({"swiglu_limit": 0.0})).is_ok());
    assert!(matches!(
        DeepseekV4Config::from_json(&json!({"hidden_size": "wide"})),
        Err(ConfigError::Json(_))
    ));
}

/// Sizes that do not fit in memory (or in `usize`) are config errors naming the field, found
/// before any per-layer vector or tensor is built.
#[test]
fn oversized_configs_are_errors_not_overflows() {
    let field = |v: serde_json::Value| match DeepseekV4Config::from_json(&v) {
        Err(ConfigError::Invalid { field, rule }) => {
            eprintln!("{field}: {rule}");
            field
        }
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("accepted {v}"),
    };
    assert_eq!(
        field(json!({"num_hidden_layers": 1_000_000_000_000u64})),
        "num_hidden_layers"
    );
    assert_eq!(
        field(json!({"num_hidden_layers": model_dsv4::config::MAX_LAYERS + 1})),
        "num_hidden_layers"
    );
    let big = 1u64 << 40;
    assert_eq!(
        field(json!({"num_attention_heads": big, "head_dim": big})),
        "num_attention_heads"
    );
    assert_eq!(field(json!({"hc_mult": 1u64 << 33})), "hc_mult");
    // (2 + N) * N fits, N * hidden_size does not.
    assert_eq!(
        field(json!({"hc_mult": 1u64 << 20, "hidden_size": 1u64 << 50})),
        "hc_mult"
    );
    assert_eq!(field(json!({"vocab_size": 1u64 << 62})), "vocab_size");
    assert_eq!(field(json!({"o_lora_rank": 1u64 << 62})), "o_lora_rank");
    assert_eq!(
        field(json!({"moe_intermediate_size": 1u64 << 63})),
        "moe_intermediate_size"
    );
    assert_eq!(
        field(
            json!({"compress_rates": {"compressed_sparse_attention": 1u64 << 62,
                                        "heavily_compressed_attention": 128}})
        ),
        "compress_rates"
    );
    // The released geometry is far from every bound.
    assert!(DeepseekV4Config::from_json(&flash()).is_ok());
}
