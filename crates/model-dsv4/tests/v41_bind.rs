//! Bad deepseek_v41 files and inputs are typed errors naming what is wrong: a missing Engram
//! table or projection, a wrong shape, a missing or mismatched token map, a token the Engram
//! hash cannot take, a state of another model; a refused forward leaves the state as it was.

use cmf_format::{Cmf, CmfWriter};
use model_core::BindError;
use model_dsv4::CausalLm;
use model_dsv4::engram::{CompressedTokenMap, EngramError, EngramTableError};
use model_dsv4::v41::{ForwardError, Model, V41WeightError, Weights};
use quant_codecs::DType;
use std::path::Path;
use test_support::{Profile, convert_fixture, fixture, read_npy};

/// The reference's token map of `case` (`engram_token_map.npy`).
fn stored_map(case: &str) -> CompressedTokenMap {
    let npy = read_npy(&fixture(case).join("expected/engram_token_map.npy"));
    CompressedTokenMap::from_i64(&npy.i64).unwrap()
}

/// A copy of `src` at `dst` without `drop`, and with `replace` `(name, dtype, shape, bytes)`
/// written in place of the tensor of that name.
fn rewrite(
    src: &Cmf,
    dst: &Path,
    drop: &str,
    replace: Option<(&str, DType, Vec<usize>, Vec<u8>)>,
) -> Cmf {
    let mut w = CmfWriter::create(dst, src.header().clone()).unwrap();
    for t in src.tensors() {
        if t.name == drop {
            continue;
        }
        match &replace {
            Some((name, dtype, shape, bytes)) if *name == t.name => {
                w.add_tensor(name, *dtype, shape, bytes).unwrap()
            }
            _ => {
                let v = src.tensor(&t.name).unwrap();
                w.add_tensor(&t.name, v.dtype(), v.shape(), v.bytes)
                    .unwrap()
            }
        }
    }
    w.finish().unwrap();
    Cmf::open(dst).unwrap()
}

fn bind_err(cmf: &Cmf, map: Option<CompressedTokenMap>) -> V41WeightError {
    match Weights::bind(cmf, map) {
        Err(e) => e,
        Ok(_) => panic!("bound a broken model"),
    }
}

#[test]
fn broken_files_are_errors_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = convert_fixture("deepseek_v41_a", dir.path(), Profile::F32);
    let cmf = Cmf::open(&path).unwrap();
    let map = || Some(stored_map("deepseek_v41_a"));

    // A missing Engram table.
    let table = "model.engram_tables.4.weight";
    let no_table = rewrite(&cmf, &dir.path().join("a.cmf"), table, None);
    let err = bind_err(&no_table, map());
    assert!(
        matches!(&err, V41WeightError::Table(EngramTableError::Bind(BindError::Missing(n))) if n == table),
        "{err:?}"
    );
    assert!(err.to_string().contains(table), "{err}");

    // A table with fewer rows than the config's prime layout addresses.
    let t = cmf.tensor(table).unwrap();
    let (rows, cols) = (t.shape()[0], t.shape()[1]);
    let short_rows = rows - 1;
    let mut bytes = t.bytes[..short_rows * cols].to_vec();
    bytes.extend_from_slice(&t.bytes[rows * cols..rows * cols + short_rows * cols / 32]);
    let short = rewrite(
        &cmf,
        &dir.path().join("b.cmf"),
        "",
        Some((table, DType::Mxfp8, vec![short_rows, cols], bytes)),
    );
    let err = bind_err(&short, map());
    assert!(
        matches!(&err, V41WeightError::Table(EngramTableError::Bind(BindError::Shape { name, .. })) if name == table),
        "{err:?}"
    );

    // A missing KV-source compressor projection and a wrong-shaped indexer key projection.
    let kv = "model.layers.2.self_attn.compressor.kv_proj.weight";
    let err = bind_err(&rewrite(&cmf, &dir.path().join("c.cmf"), kv, None), map());
    assert!(
        matches!(&err, V41WeightError::Bind(BindError::Missing(n)) if n == kv),
        "{err:?}"
    );
    let wk = "model.layers.4.self_attn.indexer.k_proj.weight";
    let v = cmf.tensor(wk).unwrap();
    let (r, c) = (v.shape()[0], v.shape()[1]);
    let wrong = rewrite(
        &cmf,
        &dir.path().join("d.cmf"),
        "",
        Some((wk, DType::F32, vec![c, r], v.bytes.to_vec())),
    );
    let err = bind_err(&wrong, map());
    assert!(
        matches!(&err, V41WeightError::Bind(BindError::Shape { name, .. }) if name == wk),
        "{err:?}"
    );

    // No token map, or one of another tokenizer (its compressed vocabulary differs).
    let err = bind_err(&cmf, None);
    assert!(
        matches!(&err, V41WeightError::NoTokenMap(l) if l == &[1, 4]),
        "{err:?}"
    );
    let other = CompressedTokenMap::from_ids((0..512).collect()).unwrap();
    let err = bind_err(&cmf, Some(other));
    assert!(
        matches!(
            &err,
            V41WeightError::Engram(EngramError::CompressedVocabMismatch {
                expected: 427,
                found: 512
            })
        ),
        "{err:?}"
    );
}

#[test]
fn bad_inputs_are_errors_and_leave_the_state_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = convert_fixture("deepseek_v41_a", dir.path(), Profile::F32);
    let cmf = Cmf::open(&path).unwrap();
    // A map that covers only the first 400 token ids (the config's compressed size kept by
    // appending the missing compressed ids at the end, so binding succeeds).
    let full = stored_map("deepseek_v41_a");
    let mut ids: Vec<u32> = full.ids()[..400].to_vec();
    let seen: std::collections::HashSet<u32> = ids.iter().copied().collect();
    let missing: Vec<u32> = (0..427).filter(|c| !seen.contains(c)).collect();
    ids.extend(missing);
    let n_map = ids.len();
    assert!(
        n_map < 512,
        "the truncated map must leave some token ids out"
    );
    let (config, weights) =
        Weights::bind(&cmf, Some(CompressedTokenMap::from_ids(ids).unwrap())).unwrap();
    let model = Model::new(config, weights);
    let mut st = model.new_state();
    model.forward(&[5, 6, 7], &mut st).unwrap();
    let before = st.clone();
    let err = model.forward(&[8, 511], &mut st).unwrap_err();
    assert!(
        matches!(
            &err,
            ForwardError::Engram(EngramError::TokenOutOfRange {
                token: 511,
                position: 1,
                ..
            })
        ),
        "{err:?}"
    );
    assert_eq!(st.pos, before.pos);
    assert_eq!(st.ngram, before.ngram);
    // The state continues as if the refused call never happened.
    let mut fresh = model.new_state();
    let want = model.forward(&[5, 6, 7, 8], &mut fresh).unwrap();
    let got = model.forward(&[8], &mut st).unwrap();
    let want = &want[3 * model.vocab_size()..];
    let tol = 1e-5 * test_support::max_abs(want);
    assert!(test_support::max_abs_diff(want, &got) <= tol);

    // A token past the vocabulary, and a state of another geometry.
    assert!(matches!(
        model.forward(&[512], &mut st),
        Err(ForwardError::Input(_))
    ));
    let mut other = model.new_state();
    other.layers.pop();
    assert!(matches!(
        model.forward(&[1], &mut other),
        Err(ForwardError::StateMismatch(_))
    ));
}
