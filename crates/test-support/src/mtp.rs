//! A qwen4_exp fixture with an MTP head (`mtp.*`) added: transformers ignores the head, so the
//! fixtures have none. The head's decoder layer and mixer are copies of the fixture's last
//! indexed-attention layer and head mixer; its projections and norms are pseudo-random. Its
//! drafts are mostly wrong, which is what exactness tests want: every rejection path runs,
//! and the output must still be the trunk's.

use std::path::{Path, PathBuf};

use cmf_format::Cmf;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::Value;

use crate::{Profile, fixture};

/// Converts fixture `case` with an MTP head made from `seed` under `profile`, opens it, and
/// runs `f` on it.
pub fn with_mtp_head<R>(case: &str, profile: Profile, seed: u64, f: impl FnOnce(&Cmf) -> R) -> R {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("temporary directory: {e}"));
    let out = convert_with_mtp_head(case, dir.path(), profile, seed);
    let cmf = Cmf::open(&out).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
    f(&cmf)
}

/// Converts fixture `case` with an MTP head made from `seed` to `<dir>/<case>-mtp.cmf`.
pub fn convert_with_mtp_head(case: &str, dir: &Path, profile: Profile, seed: u64) -> PathBuf {
    let hf = dir.join(format!("{case}-mtp-hf"));
    add_head(&fixture(case).join("hf"), &hf, seed);
    let out = dir.join(format!("{case}-mtp.cmf"));
    cmf_convert::convert(
        &cmf_convert::ConvertOptions::new(hf, out.clone(), profile),
        &mut |_| {},
    )
    .unwrap_or_else(|e| panic!("converting {case} with an MTP head: {e}"));
    out
}

/// Copies the checkpoint `src` to `dst` with `mtp.*` tensors in a shard of their own.
fn add_head(src: &Path, dst: &Path, seed: u64) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    let read = |name: &str| -> Value {
        serde_json::from_slice(&std::fs::read(dst.join(name)).unwrap()).unwrap()
    };
    let config = read("config.json");
    let text = &config["text_config"];
    let d = text["hidden_size"].as_u64().unwrap() as usize;
    let h = text["hc_count"].as_u64().unwrap() as usize;
    let types = text["layer_types"].as_array().unwrap();
    let last_attn = types
        .iter()
        .rposition(|t| t == "indexed_attention")
        .expect("the fixture has an indexed-attention layer");
    // A single-file checkpoint gets an index, so the head can go in a shard of its own.
    if !dst.join("model.safetensors.index.json").is_file() {
        let bytes = std::fs::read(dst.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let map: serde_json::Map<String, Value> = st
            .names()
            .into_iter()
            .map(|n| (n.to_string(), Value::String("model.safetensors".into())))
            .collect();
        let index = serde_json::json!({ "metadata": {}, "weight_map": map });
        std::fs::write(
            dst.join("model.safetensors.index.json"),
            serde_json::to_vec(&index).unwrap(),
        )
        .unwrap();
    }
    let mut index = read("model.safetensors.index.json");
    let map = index["weight_map"].as_object().unwrap().clone();
    let layer = format!("model.language_model.layers.{last_attn}.");
    let mixer = "model.language_model.hyper_connection_mixer.";
    // (new name, dtype, shape, bytes)
    let mut out: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut shards: Vec<&str> = map.values().filter_map(Value::as_str).collect();
    shards.sort_unstable();
    shards.dedup();
    for shard in shards {
        let bytes = std::fs::read(dst.join(shard)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, t) in st.tensors() {
            let new = if let Some(rest) = name.strip_prefix(&layer) {
                if rest.starts_with("ple.") {
                    continue;
                }
                format!("mtp.layers.0.{rest}")
            } else if let Some(rest) = name.strip_prefix(mixer) {
                format!("mtp.hyper_connection_mixer.{rest}")
            } else {
                continue;
            };
            out.push((new, t.dtype(), t.shape().to_vec(), t.data().to_vec()));
        }
    }
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut random = |n: usize, scale: f32| -> Vec<u8> {
        (0..n)
            .flat_map(|_| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let u = (rng >> 40) as f32 / (1u64 << 24) as f32;
                ((2.0 * u - 1.0) * scale).to_le_bytes()
            })
            .collect()
    };
    let s = 1.0 / (d as f32).sqrt();
    out.push((
        "mtp.fc_embedding.weight".into(),
        Dtype::F32,
        vec![d, d],
        random(d * d, s),
    ));
    out.push((
        "mtp.fc_hidden.weight".into(),
        Dtype::F32,
        vec![d, d],
        random(d * d, s),
    ));
    out.push((
        "mtp.pre_fc_norm_embedding.weight".into(),
        Dtype::F32,
        vec![d],
        random(d, 0.1),
    ));
    let hd = h * d;
    out.push((
        "mtp.pre_fc_norm_hidden.weight".into(),
        Dtype::F32,
        vec![hd],
        random(hd, 0.1),
    ));
    let views: Vec<(String, TensorView<'_>)> = out
        .iter()
        .map(|(n, dt, shape, b)| (n.clone(), TensorView::new(*dt, shape.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dst.join("mtp.safetensors")).unwrap();
    let wm = index["weight_map"].as_object_mut().unwrap();
    for (n, ..) in &out {
        wm.insert(n.clone(), Value::String("mtp.safetensors".into()));
    }
    std::fs::write(
        dst.join("model.safetensors.index.json"),
        serde_json::to_vec_pretty(&index).unwrap(),
    )
    .unwrap();
}
