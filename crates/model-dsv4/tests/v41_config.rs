//! `DeepseekV41Config`: the released composite `config.json` of both V4.1 fixtures resolves to
//! the schedule and layer roles that fixtures/README.md states for each case (written out
//! here by hand, not read from the generator's output), to the `layer_types` /
//! `rope_parameters` transformers derived (`cases.json`), and to the released geometry when
//! fields are left to their defaults; bad configs are errors naming the field.

mod common;

use common::fixture;
use model_dsv4::config::RopeKind;
use model_dsv4::config_v41::{
    CandidateRole, DeepseekV41Config, IndexRole, KvRole, LayerRole, RopeSet, V41ConfigError,
};
use serde_json::{Value, json};

fn read_json(path: &std::path::Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn hf_config(case: &str) -> Value {
    read_json(&fixture(case).join("hf/config.json"))
}

fn load(case: &str) -> DeepseekV41Config {
    DeepseekV41Config::from_json(&hf_config(case)).unwrap_or_else(|e| panic!("{case}: {e}"))
}

const SLIDING: LayerRole = LayerRole {
    compress_ratio: 0,
    rope: RopeSet::Main,
    kv: KvRole::SlidingOnly,
    index: IndexRole::None,
    candidate: CandidateRole::None,
    engram: None,
};

fn compressed(ratio: usize, kv: KvRole, index: IndexRole) -> LayerRole {
    LayerRole {
        compress_ratio: ratio,
        rope: RopeSet::Compress,
        kv,
        index,
        candidate: CandidateRole::None,
        engram: None,
    }
}

/// fixtures/README.md, `deepseek_v41_a`: "2 sliding-only layers, one ratio-2 group (KV source
/// 2 ...), one ratio-1 group (KV source 4 = candidate source, then a Reuse layer and a Reindex
/// layer 6 whose top-k is restricted to the candidate blocks); Engram on a sliding-only layer
/// (1) and on a KV source (4)"; "KV reuse (layers 3, 5 read sources 2, 4)"; compress_ratios
/// [0, 0, 2, 2, 1, 1, 1]; KV sources [2, 4]; index sources [2, 4, 6]; candidate source 4.
#[test]
fn fixture_a_roles_are_as_the_readme_states() {
    let c = load("deepseek_v41_a");
    assert_eq!(c.num_hidden_layers, 7);
    assert_eq!(c.compress_ratios, [0, 0, 2, 2, 1, 1, 1]);
    assert_eq!(c.kv_source_layer_ids, [2, 4]);
    assert_eq!(c.index_source_layer_ids, [2, 4, 6]);
    assert_eq!(c.candidate_source_layer_id, Some(4));
    let mut want = vec![
        SLIDING,
        SLIDING,
        compressed(2, KvRole::Source, IndexRole::Source),
        compressed(2, KvRole::Reuse { source: 2 }, IndexRole::Reuse { from: 2 }),
        compressed(1, KvRole::Source, IndexRole::Source),
        compressed(1, KvRole::Reuse { source: 4 }, IndexRole::Reuse { from: 4 }),
        compressed(
            1,
            KvRole::Reuse { source: 4 },
            IndexRole::Reindex { keys_from: 4 },
        ),
    ];
    want[4].candidate = CandidateRole::Source;
    want[6].candidate = CandidateRole::Restricted { by: 4 };
    want[1].engram = Some(0);
    want[4].engram = Some(1);
    assert_eq!(c.roles(), want.as_slice());
    // "engram layers [1, 4], tables [630, 834] rows x 64, compressed vocab 427 (pad 2 -> 2)",
    // "ngram 2..4, 2 heads".
    assert_eq!(c.engram_layer_ids, [1, 4]);
    assert_eq!(c.engram_num_embeddings, [630, 834]);
    assert_eq!(c.engram_layout().unwrap().table_rows(), &[630, 834]);
    assert_eq!(
        (c.engram_head_dim, c.engram_max_ngram_size, c.engram_n_heads),
        (64, 4, 2)
    );
    assert_eq!(c.engram_compressed_vocab_size, 427);
    assert_eq!(c.engram_pad_token_id, 2);
    // "4 mHC streams; 8 experts top-2; YaRN (factor 4, original 1024) on the compressed rope",
    // "rms_norm_eps 1e-20", "fp8 32x32 block + fp4 experts".
    assert_eq!(
        (c.hc_mult, c.n_routed_experts, c.num_experts_per_tok),
        (4, 8, 2)
    );
    assert_eq!(c.rms_norm_eps, 1e-20);
    assert_eq!(
        (
            c.candidate_block_size,
            c.candidate_topk_blocks,
            c.index_topk
        ),
        (4, 3, 6)
    );
    let rc = c.rope_compress().unwrap();
    assert!(
        matches!(rc.kind, RopeKind::Yarn { factor, original_max_position_embeddings, .. }
        if factor == 4.0 && original_max_position_embeddings == 1024.0)
    );
    let q = c.quantization_config.as_ref().unwrap();
    assert_eq!(q.weight_block_size.as_deref(), Some(&[32, 32][..]));
    assert_eq!(q.expert_dtype.as_deref(), Some("fp4"));
}

/// fixtures/README.md, `deepseek_v41_b`: "two ratio-2 groups (sources 1 and 3; layer 2 reuses
/// source 1) and a ratio-1 group (source 4 = candidate source with block 2 / top 5 blocks,
/// Reindex layer 5); Engram on layers 0 and 3 with 3-grams x 3 heads and rows of 96";
/// compress_ratios [0, 2, 2, 2, 1, 1]; KV sources [1, 3, 4]; index sources [1, 3, 4, 5];
/// candidate source 4.
#[test]
fn fixture_b_roles_are_as_the_readme_states() {
    let c = load("deepseek_v41_b");
    assert_eq!(c.num_hidden_layers, 6);
    assert_eq!(c.compress_ratios, [0, 2, 2, 2, 1, 1]);
    assert_eq!(c.kv_source_layer_ids, [1, 3, 4]);
    assert_eq!(c.index_source_layer_ids, [1, 3, 4, 5]);
    assert_eq!(c.candidate_source_layer_id, Some(4));
    let mut want = vec![
        SLIDING,
        compressed(2, KvRole::Source, IndexRole::Source),
        compressed(2, KvRole::Reuse { source: 1 }, IndexRole::Reuse { from: 1 }),
        compressed(2, KvRole::Source, IndexRole::Source),
        compressed(1, KvRole::Source, IndexRole::Source),
        compressed(
            1,
            KvRole::Reuse { source: 4 },
            IndexRole::Reindex { keys_from: 4 },
        ),
    ];
    want[4].candidate = CandidateRole::Source;
    want[5].candidate = CandidateRole::Restricted { by: 4 };
    want[0].engram = Some(0);
    want[3].engram = Some(1);
    assert_eq!(c.roles(), want.as_slice());
    assert_eq!(c.engram_layer_ids, [0, 3]);
    assert_eq!(c.engram_num_embeddings, [434, 606]);
    assert_eq!(
        (c.engram_head_dim, c.engram_max_ngram_size, c.engram_n_heads),
        (96, 3, 3)
    );
    assert_eq!((c.candidate_block_size, c.candidate_topk_blocks), (2, 5));
    assert_eq!((c.hc_mult, c.swiglu_limit, c.o_groups), (2, 0.5, 4));
    let rc = c.rope_compress().unwrap();
    assert!(
        matches!(rc.kind, RopeKind::Yarn { factor, original_max_position_embeddings, .. }
        if factor == 8.0 && original_max_position_embeddings == 512.0)
    );
    // 8 heads of 32, rope 8.
    assert_eq!(c.rotary_dim(rc), 8);
}

/// The `layer_types` and `rope_parameters` transformers derived from the same `config.json`
/// (recorded in `cases.json` by the fixture generator).
#[test]
fn layer_types_and_rope_sets_match_transformers() {
    for case in ["deepseek_v41_a", "deepseek_v41_b"] {
        let c = load(case);
        let cases = read_json(&fixture(case).join("expected/cases.json"));
        let want: Vec<&str> = cases["layer_types"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(c.layer_types(), want, "{case}");
        // The nested sets transformers resolved, fed back in, give the same parameters.
        let mut nested = hf_config(case);
        nested["text_config"]["rope_parameters"] = cases["rope_parameters"].clone();
        let n = DeepseekV41Config::from_json(&nested).unwrap();
        assert_eq!(n.rope_main(), c.rope_main(), "{case}");
        assert_eq!(n.rope_compress(), c.rope_compress(), "{case}");
        let rc = c.rope_compress().unwrap();
        assert_eq!(rc.attention_factor, 1.0, "{case}");
        assert_eq!(rc.partial_rotary_factor, 0.25, "{case}");
        assert_eq!(c.rope_main().unwrap().kind, RopeKind::Default, "{case}");
    }
}

/// The flat `deepseek_v41_text` form (text fields at the top level) reads the same.
#[test]
fn flat_config_reads_like_the_composite() {
    let composite = load("deepseek_v41_a");
    let mut flat = hf_config("deepseek_v41_a")["text_config"].clone();
    flat["quantization_config"] = hf_config("deepseek_v41_a")["quantization_config"].clone();
    let c = DeepseekV41Config::from_json(&flat).unwrap();
    assert_eq!(c.roles(), composite.roles());
    assert_eq!(c.engram_layout(), composite.engram_layout());
    assert_eq!(c.quantization_config, composite.quantization_config);
}

/// Everything left to its default is the released V4.1-Flash (reference-arch.md §2.1): the
/// 40-layer schedule with 3 DSpark entries, its sources, and with the released Engram fields
/// the prime layout gives exactly the released table sizes.
#[test]
fn defaults_are_the_released_geometry() {
    let c = DeepseekV41Config::from_json(&json!({
        "engram_layer_ids": [1, 14],
        "engram_num_embeddings": [384006168u64, 384016682u64],
        "engram_pad_token_id": 2,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536}
    }))
    .unwrap();
    assert_eq!(c.num_hidden_layers, 40);
    assert_eq!(c.compress_ratios.len(), 43);
    assert_eq!(&c.compress_ratios[..3], &[0, 0, 2]);
    assert_eq!(&c.compress_ratios[19..21], &[2, 1]);
    assert_eq!(&c.compress_ratios[39..], &[1, 0, 0, 0]);
    assert_eq!(c.kv_source_layer_ids, [2, 8, 14, 20]);
    assert_eq!(c.index_source_layer_ids, [2, 8, 14, 20, 24, 28, 32, 36]);
    assert_eq!(c.candidate_source_layer_id, Some(20));
    assert_eq!(c.dspark_target_layer_ids, [37, 38, 39]);
    let r = c.roles();
    assert_eq!(r[1].engram, Some(0));
    assert_eq!(r[14].engram, Some(1));
    assert_eq!(r[14].kv, KvRole::Source);
    assert_eq!(r[19].kv, KvRole::Reuse { source: 14 });
    assert_eq!(r[19].index, IndexRole::Reuse { from: 14 });
    assert_eq!(r[20].candidate, CandidateRole::Source);
    assert_eq!(r[23].index, IndexRole::Reuse { from: 20 });
    assert_eq!(r[24].index, IndexRole::Reindex { keys_from: 20 });
    assert_eq!(r[36].candidate, CandidateRole::Restricted { by: 20 });
    assert_eq!(r[39].index, IndexRole::Reuse { from: 36 });
    assert_eq!(c.engram_layout().unwrap().n_cols(), 24);
    assert_eq!(c.rotary_dim(c.rope_compress().unwrap()), 64);
    // The transformers field name for the pad is read too.
    let c = DeepseekV41Config::from_json(&json!({"engram_pad_id": 7})).unwrap();
    assert_eq!(c.engram_pad_token_id, 7);
    // A negative candidate source disables the two-level top-k.
    let c = DeepseekV41Config::from_json(&json!({"candidate_source_layer_id": -1})).unwrap();
    assert_eq!(c.candidate_source_layer_id, None);
    assert!(c.roles().iter().all(|r| r.candidate == CandidateRole::None));
    // With no index source, compressed layers attend no compressed entry.
    let c = DeepseekV41Config::from_json(&json!({"index_source_layer_ids": [],
        "candidate_source_layer_id": -1}))
    .unwrap();
    assert_eq!(c.roles()[2].kv, KvRole::Source);
    assert!(c.roles().iter().all(|r| r.index == IndexRole::None));
    // Without explicit sources a custom schedule gets the first layer of each same-ratio run.
    let c = DeepseekV41Config::from_json(&json!({"num_hidden_layers": 7,
        "num_nextn_predict_layers": 0}))
    .unwrap();
    assert_eq!(c.compress_ratios, [0, 0, 2, 2, 2, 1, 1]);
    assert_eq!(c.kv_source_layer_ids, [2, 5]);
    assert_eq!(c.index_source_layer_ids, [2, 5]);
}

/// The release's legacy `"type": "yarn"` spelling counts as `rope_type` (deliberately unlike
/// the reference, which then silently falls back to plain RoPE).
#[test]
fn legacy_rope_type_key_means_yarn() {
    let mut v = hf_config("deepseek_v41_a");
    let rs = v["text_config"]["rope_scaling"].as_object_mut().unwrap();
    let t = rs.remove("rope_type").unwrap();
    rs.insert("type".into(), t);
    let c = DeepseekV41Config::from_json(&v).unwrap();
    assert_eq!(c.rope_compress(), load("deepseek_v41_a").rope_compress());
}

fn field(v: Value) -> &'static str {
    match DeepseekV41Config::from_json(&v) {
        Err(V41ConfigError::Invalid { field, rule }) => {
            eprintln!("{field}: {rule}");
            field
        }
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("accepted {v}"),
    }
}

/// `fixtures/deepseek_v41_a`'s config with `edit` applied to its `text_config`.
fn edited(edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> Value {
    let mut v = hf_config("deepseek_v41_a");
    edit(v["text_config"].as_object_mut().unwrap());
    v
}

#[test]
fn bad_configs_name_the_field() {
    // A KV source must have a compressed branch.
    assert_eq!(
        field(edited(|t| {
            t.insert("kv_source_layer_ids".into(), json!([1, 4]));
        })),
        "kv_source_layer_ids"
    );
    assert_eq!(
        field(edited(|t| {
            t.insert("kv_source_layer_ids".into(), json!([2, 9]));
        })),
        "kv_source_layer_ids"
    );
    // Index sources: compressed, and after a KV source.
    assert_eq!(
        field(edited(|t| {
            t.insert("index_source_layer_ids".into(), json!([0, 2]));
        })),
        "index_source_layer_ids"
    );
    assert_eq!(
        field(edited(|t| {
            t.insert("compress_ratios".into(), json!([0, 2, 2, 2, 1, 1, 1]));
            t.insert("index_source_layer_ids".into(), json!([1, 2, 4]));
        })),
        "index_source_layer_ids"
    );
    // A compressed layer before every KV source.
    assert_eq!(
        field(edited(|t| {
            t.insert("compress_ratios".into(), json!([0, 2, 2, 2, 1, 1, 1]));
        })),
        "compress_ratios"
    );
    assert_eq!(
        field(edited(|t| {
            t.insert("compress_ratios".into(), json!([0, 0, 2, 2, 1, 1]));
        })),
        "compress_ratios"
    );
    assert_eq!(
        field(edited(|t| {
            t.insert("compress_ratios".into(), json!([0, 0, 2, -2, 1, 1, 1]));
        })),
        "compress_ratios"
    );
    assert_eq!(
        field(edited(|t| {
            t.insert("candidate_source_layer_id".into(), json!(5));
        })),
        "candidate_source_layer_id"
    );
    // Schedules that would read another KV group's state.
    assert_eq!(
        field(edited(|t| {
            t.insert("index_source_layer_ids".into(), json!([2]));
            t.insert("candidate_source_layer_id".into(), json!(2));
        })),
        "index_source_layer_ids"
    );
    assert_eq!(
        field(edited(|t| {
            t.insert("index_source_layer_ids".into(), json!([6]));
            t.insert("candidate_source_layer_id".into(), json!(6));
        })),
        "index_source_layer_ids"
    );
    assert_eq!(
        field(edited(|t| {
            t.insert("candidate_source_layer_id".into(), json!(2));
        })),
        "candidate_source_layer_id"
    );
    // Engram.
    assert_eq!(
        field(edited(|t| {
            t.insert("engram_layer_ids".into(), json!([1, 7]));
        })),
        "engram_layer_ids"
    );
    assert_eq!(
        field(edited(|t| {
            t.insert("engram_layer_ids".into(), json!([4, 4]));
        })),
        "engram_layer_ids"
    );
    assert_eq!(
        field(edited(|t| {
            t.insert("engram_head_dim".into(), json!(48));
        })),
        "engram_head_dim"
    );
    assert_eq!(
        field(edited(|t| {
            t.insert("engram_max_ngram_size".into(), json!(1));
        })),
        "engram_max_ngram_size"
    );
    assert_eq!(
        field(edited(|t| {
            t.insert("engram_n_heads".into(), json!(1u64 << 40));
        })),
        "engram_n_heads"
    );
    assert_eq!(
        field(edited(|t| {
            t.insert("engram_num_embeddings".into(), json!([630, 835]));
        })),
        "engram_num_embeddings"
    );
    assert_eq!(
        field(edited(|t| {
            t.insert("engram_num_embeddings".into(), json!([630]));
        })),
        "engram_num_embeddings"
    );
    assert_eq!(
        field(edited(|t| {
            t.insert("engram_pad_id".into(), json!(3));
        })),
        "engram_pad_token_id"
    );
    assert_eq!(
        field(edited(|t| {
            t.insert("engram_pad_token_id".into(), json!(512));
            t.insert("engram_pad_id".into(), json!(512));
        })),
        "engram_pad_token_id"
    );
    assert_eq!(
        field(edited(|t| {
            t.insert("engram_compressed_vocab_size".into(), json!(0));
        })),
        "engram_compressed_vocab_size"
    );
    // The rest.
    assert_eq!(
        field(edited(|t| {
            t.insert("scoring_func".into(), json!("relu"));
        })),
        "scoring_func"
    );
    assert_eq!(
        field(edited(|t| {
            t.insert("rms_norm_eps".into(), json!(0.0));
        })),
        "rms_norm_eps"
    );
    // 48 rotating channels fit the 64-wide heads but not the 32-wide indexer heads.
    assert_eq!(
        field(edited(|t| {
            t.insert("qk_rope_head_dim".into(), json!(48));
        })),
        "rope_parameters.compress"
    );
    assert_eq!(
        field(json!({"tie_word_embeddings": true})),
        "tie_word_embeddings"
    );
    assert_eq!(field(json!({"model_type": "deepseek_v4"})), "model_type");
    assert_eq!(field(json!({"num_hidden_layers": 0})), "num_hidden_layers");
    assert_eq!(
        field(json!({"quantization_config": {"weight_block_size": [32]}})),
        "quantization_config.weight_block_size"
    );
    assert_eq!(
        field(
            json!({"engram_layer_ids": [1], "engram_num_embeddings": [1],
                     "engram_vocab_size": i64::MAX as u64})
        ),
        "engram_vocab_size"
    );
    assert!(matches!(
        DeepseekV41Config::from_json(&json!({"hidden_size": "wide"})),
        Err(V41ConfigError::Json(_))
    ));
}
