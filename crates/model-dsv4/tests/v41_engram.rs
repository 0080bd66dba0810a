//! The Engram hashing against the witnesses the V4.1 fixture generator wrote from the
//! transformers reference and numpy (tools/reference/README.md §7), for both cases: numpy's
//! seed state and raw PCG64 outputs, the multiplier draws, the primes / offsets / table sizes,
//! the compressed token map derived from `hf/tokenizer.json`, and the table rows of every
//! position of every prompt, hashed whole, token by token, and split at every point.

mod common;

use std::num::NonZeroU64;
use std::path::Path;

use common::{fixture, read_npy};
use model_dsv4::config_v41::DeepseekV41Config;
use model_dsv4::engram::numpy_rng::{Pcg64, seed_sequence_state};
use model_dsv4::engram::{
    CompressedTokenMap, EngramError, EngramHasher, EngramLayout, hash_multipliers,
};
use serde_json::Value;

const CASES: [&str; 2] = ["deepseek_v41_a", "deepseek_v41_b"];

fn config(case: &str) -> DeepseekV41Config {
    let path = fixture(case).join("hf/config.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    DeepseekV41Config::from_json(&v).unwrap_or_else(|e| panic!("{case}: {e}"))
}

fn cases_json(case: &str) -> Value {
    let path = fixture(case).join("expected/cases.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn expected(case: &str, name: &str) -> std::path::PathBuf {
    fixture(case).join("expected").join(name)
}

fn i64s(case: &str, name: &str) -> (Vec<usize>, Vec<i64>) {
    let npy = read_npy(&expected(case, name));
    (npy.shape, npy.i64)
}

fn as_u64(v: &[i64]) -> Vec<u64> {
    v.iter().map(|&x| u64::try_from(x).unwrap()).collect()
}

/// A little-endian C-order `<u8` (uint64) `.npy`, which cmf-format's reader does not cover:
/// `(shape, data)`.
fn read_u64_npy(path: &Path) -> (Vec<usize>, Vec<u64>) {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&b[..6], b"\x93NUMPY", "{}", path.display());
    let (hlen, start) = match b[6] {
        1 => (u16::from_le_bytes([b[8], b[9]]) as usize, 10),
        _ => (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12),
    };
    let header = std::str::from_utf8(&b[start..start + hlen]).unwrap();
    assert!(header.contains("'descr': '<u8'"), "{header}");
    assert!(header.contains("'fortran_order': False"), "{header}");
    let shape: Vec<usize> = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .unwrap()
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    let data: Vec<u64> = b[start + hlen..]
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(data.len(), shape.iter().product::<usize>());
    (shape, data)
}

/// The token map the fixture ships (`engram_token_map.npy`).
fn stored_map(case: &str) -> CompressedTokenMap {
    CompressedTokenMap::from_i64(&i64s(case, "engram_token_map.npy").1).unwrap()
}

fn hasher(case: &str) -> EngramHasher {
    EngramHasher::new(&config(case), stored_map(case)).unwrap()
}

/// The prompts `pN_ids.npy` with their `pN_engram_hash_ids.npy`.
fn prompts(case: &str) -> Vec<(Vec<u32>, Vec<usize>, Vec<u64>)> {
    (0..)
        .map(|p| expected(case, &format!("p{p}_ids.npy")))
        .take_while(|p| p.exists())
        .enumerate()
        .map(|(p, path)| {
            let ids = read_npy(&path)
                .i64
                .iter()
                .map(|&i| u32::try_from(i).unwrap())
                .collect();
            let (shape, rows) = i64s(case, &format!("p{p}_engram_hash_ids.npy"));
            (ids, shape, as_u64(&rows))
        })
        .collect()
}

/// numpy's `default_rng(10007 * layer_id)`: `SeedSequence` state and the first raw PCG64
/// outputs (`engram_rng_seed_state.npy`, `engram_rng_raw.npy`), and the bounded draws
/// (`cases.json` `engram.rng_draws` with `rng_bound_exclusive` and `rng_seeds`).
#[test]
fn numpy_rng_reproduces_the_witnesses() {
    for case in CASES {
        let c = config(case);
        let e = &cases_json(case)["engram"];
        let (shape, states) = read_u64_npy(&expected(case, "engram_rng_seed_state.npy"));
        assert_eq!(shape, [c.engram_layer_ids.len(), 4], "{case}");
        let (raw_shape, raws) = read_u64_npy(&expected(case, "engram_rng_raw.npy"));
        let n_raw = raw_shape[1];
        let bound = e["rng_bound_exclusive"].as_i64().unwrap();
        let cvs = c.engram_compressed_vocab_size;
        assert_eq!(bound, (i64::MAX / cvs as i64 / 2).max(1), "{case}");
        for (k, &layer) in c.engram_layer_ids.iter().enumerate() {
            let seed = 10007 * layer as u128;
            assert_eq!(e["rng_seeds"][k].as_u64().unwrap() as u128, seed, "{case}");
            assert_eq!(
                seed_sequence_state(seed),
                states[4 * k..4 * k + 4],
                "{case} layer {layer}"
            );
            let mut rng = Pcg64::from_seed(seed);
            let got: Vec<u64> = (0..n_raw).map(|_| rng.next_u64()).collect();
            assert_eq!(
                got,
                raws[n_raw * k..n_raw * (k + 1)],
                "{case} layer {layer}"
            );
            let mut rng = Pcg64::from_seed(seed);
            let draws: Vec<i64> = e["rng_draws"][k]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_i64().unwrap())
                .collect();
            let got: Vec<i64> = draws
                .iter()
                .map(|_| rng.integers_i64(0, bound).unwrap())
                .collect();
            assert_eq!(got, draws, "{case} layer {layer}");
        }
    }
}

/// Multipliers, primes, offsets and table sizes equal the reference's.
#[test]
fn hashing_constants_match_the_reference() {
    for case in CASES {
        let c = config(case);
        let (shape, mult) = i64s(case, "engram_multipliers.npy");
        assert_eq!(shape, [c.engram_layer_ids.len(), c.engram_max_ngram_size]);
        let cvs = NonZeroU64::new(c.engram_compressed_vocab_size).unwrap();
        let got = hash_multipliers(&c.engram_layer_ids, c.engram_max_ngram_size, cvs);
        assert_eq!(got, as_u64(&mult), "{case}: multipliers");
        assert!(got.iter().all(|m| m % 2 == 1));

        let layout = EngramLayout::from_config(&c).unwrap();
        let (pshape, primes) = i64s(case, "engram_primes.npy");
        assert_eq!(
            pshape,
            [
                c.engram_layer_ids.len(),
                c.engram_max_ngram_size - 1,
                c.engram_n_heads
            ]
        );
        assert_eq!(
            layout.primes(),
            as_u64(&primes).as_slice(),
            "{case}: primes"
        );
        let (oshape, offsets) = i64s(case, "engram_offsets.npy");
        assert_eq!(oshape, [c.engram_layer_ids.len(), layout.n_cols()]);
        assert_eq!(
            layout.offsets(),
            as_u64(&offsets).as_slice(),
            "{case}: offsets"
        );
        let num = cases_json(case)["engram"]["num_embeddings"].clone();
        let want: Vec<u64> = serde_json::from_value(num).unwrap();
        assert_eq!(layout.table_rows(), want.as_slice(), "{case}: table rows");
        assert_eq!(c.engram_layout(), Some(&layout));
    }
}

/// The released multipliers (`engram_layer_ids [1, 14]`, compressed vocabulary 99092), printed
/// once with numpy 2.4.6 (`compute_hash_multipliers` of the reference).
#[test]
fn released_multipliers_match_numpy() {
    let got = hash_multipliers(&[1, 14], 4, NonZeroU64::new(99092).unwrap());
    assert_eq!(
        got,
        [
            76632096046245,
            4839876093313,
            35959672319349,
            73987337458391,
            67716810739261,
            51510806800915,
            30921347202721,
            82619226485591
        ]
    );
}

/// The token map derived from `hf/tokenizer.json` (decode and raw token of every id, through
/// the `tokenizers` crate) equals the one the reference derived (`engram_token_map.npy`), and
/// its size and pad entry are those `cases.json` records.
#[test]
fn token_map_derived_from_the_tokenizer_matches() {
    for case in CASES {
        let path = fixture(case).join("hf/tokenizer.json");
        let tok = tokenizers::Tokenizer::from_file(&path).unwrap();
        let n = tok.get_vocab_size(true) as u32;
        let derived = CompressedTokenMap::from_token_strings((0..n).map(|id| {
            let text = tok.decode(&[id], false).unwrap();
            (text, tok.id_to_token(id))
        }));
        let stored = stored_map(case);
        assert_eq!(derived.ids(), stored.ids(), "{case}");
        let e = &cases_json(case)["engram"];
        assert_eq!(
            derived.compressed_vocab_size(),
            e["compressed_vocab_size"].as_u64().unwrap()
        );
        let pad = e["pad_token_id"].as_u64().unwrap() as usize;
        assert_eq!(
            derived.get(pad),
            Some(e["pad_compressed_id"].as_u64().unwrap() as u32)
        );
        // The map really merges tokens (else the test would not exercise the normaliser).
        assert!(derived.compressed_vocab_size() < u64::from(n));
    }
}

/// Every position of every prompt: whole prompt, one token at a time, and split in two at
/// every point (prefill then cached continuation), equal exactly.
#[test]
fn hash_ids_match_every_prompt_whole_and_incremental() {
    for case in CASES {
        let h = hasher(case);
        let per = h.ids_per_token();
        let prompts = prompts(case);
        assert_eq!(prompts.len(), 3, "{case}");
        for (p, (ids, shape, want)) in prompts.iter().enumerate() {
            assert_eq!(
                shape,
                &[ids.len(), h.layout().n_layers(), h.layout().n_cols()]
            );
            let whole = h.hash_prompt(ids).unwrap();
            assert_eq!(&whole, want, "{case} p{p}: whole prompt");

            let mut ctx = h.new_context();
            let mut one_by_one = Vec::new();
            for &t in ids {
                h.hash_into(&mut ctx, &[t], &mut one_by_one).unwrap();
            }
            assert_eq!(&one_by_one, want, "{case} p{p}: token by token");

            for k in 0..=ids.len() {
                let mut ctx = h.new_context();
                let mut out = Vec::new();
                h.hash_into(&mut ctx, &ids[..k], &mut out).unwrap();
                // A snapshot of the look-back restores the continuation exactly.
                let mut resumed = ctx.clone();
                h.hash_into(&mut resumed, &ids[k..], &mut out).unwrap();
                assert_eq!(&out, want, "{case} p{p}: split at {k}");
            }
            assert_eq!(want.len(), ids.len() * per);
        }
    }
}

/// Rows stay inside their table; a token past the map is an error that leaves the output and
/// the look-back untouched; a map of the wrong size is refused.
#[test]
fn bad_input_is_an_error() {
    let case = "deepseek_v41_a";
    let h = hasher(case);
    let (ids, _, _) = &prompts(case)[0];
    let rows = h.hash_prompt(ids).unwrap();
    let cols = h.layout().n_cols();
    for (i, &r) in rows.iter().enumerate() {
        let layer = (i / cols) % h.layout().n_layers();
        assert!(r < h.layout().table_rows()[layer]);
    }

    let mut ctx = h.new_context();
    let mut out = Vec::new();
    h.hash_into(&mut ctx, &ids[..3], &mut out).unwrap();
    let (before, len) = (ctx.clone(), out.len());
    let err = h.hash_into(&mut ctx, &[ids[3], 512], &mut out).unwrap_err();
    assert_eq!(
        err,
        EngramError::TokenOutOfRange {
            token: 512,
            position: 1,
            len: 512
        }
    );
    assert_eq!((ctx, out.len()), (before, len));

    let other = hasher("deepseek_v41_b");
    let mut wrong = other.new_context();
    assert!(matches!(
        h.hash_into(&mut wrong, &[1], &mut Vec::new()),
        Err(EngramError::ContextMismatch { .. })
    ));

    let c = config(case);
    let small = CompressedTokenMap::from_ids((0..10).collect()).unwrap();
    assert!(matches!(
        EngramHasher::new(&c, small),
        Err(EngramError::CompressedVocabMismatch {
            expected: 427,
            found: 10
        })
    ));
    let v41_b_without_engram = {
        let path = fixture("deepseek_v41_b").join("hf/config.json");
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        v["text_config"]["engram_layer_ids"] = serde_json::json!([]);
        v["text_config"]["engram_num_embeddings"] = serde_json::json!([]);
        DeepseekV41Config::from_json(&v).unwrap()
    };
    assert!(matches!(
        EngramHasher::new(&v41_b_without_engram, stored_map(case)),
        Err(EngramError::NoEngramLayers)
    ));
}
