//! A random-weight qwen4_exp made in memory, without a file: the released geometry of
//! Qwen3.8-Flash-Next (48 layers, 36 GDN + 12 QSA, hidden 2560, 4 HC streams, 512 experts top-10
//! of width 640, gated shared expert, vocab 248,320, PLE at release width) for
//! `cortiq bench model --synthetic qwen3.8-flash-next`, quantised per profile.
//!
//! One payload per (dtype, shape) is quantised from random values and shared on the host by
//! every tensor of that shape; each tensor still goes up to its own device memory, so the
//! device reads exactly the bytes the real model's would. For the CPU, [`Synthetic::distinct`]
//! gives every tensor its own copy in RAM (the shared payloads would be read from the cache). The PLE n-gram table is short (its
//! prime vocabularies start at `ngram_vocab_size_base = 1000` instead of 20M): a decoded token
//! reads one row per head of it either way.

use std::collections::HashMap;

use model_core::{Mat, Vector};
use quant_codecs::{DType, MatRef};
use serde_json::json;

use crate::config::{LayerType, Qwen4ExpTextConfig};
use crate::ple::PleHash;
use crate::weights::{Source, WeightError, Weights};

/// The released config (`layers` and `experts` overridable for smaller runs), with a short
/// PLE table.
pub fn release_config(layers: usize, experts: usize) -> serde_json::Value {
    let layer_types: Vec<&str> = (0..layers)
        .map(|il| {
            if il % 4 == 3 {
                "indexed_attention"
            } else {
                "linear_attention"
            }
        })
        .collect();
    let mut c = json!({
        "model_type": "qwen4_exp_text",
        "vocab_size": 248320, "hidden_size": 2560, "num_hidden_layers": layers,
        "num_attention_heads": 24, "num_key_value_heads": 2, "head_dim": 256,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "moe_intermediate_size": 640, "shared_expert_intermediate_size": 640,
        "num_experts": experts, "num_experts_per_tok": 10, "norm_topk_prob": true,
        "hc_count": 4, "hc_lowrank": 320
    });
    let more = json!({
        "ple_layer_ids": [2], "ngram_size": 3, "heads_per_ngram": 8, "ple_embed_dim": 2560,
        "ngram_vocab_size_base": 1000, "make_ngram_vocab_size_divisible_by": 128,
        "split_ngram_parts": 1, "seed": 1234, "eos_token_id": 248044, "bos_token_id": 248044,
        "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 128,
        "indexer_budget": 2048, "indexer_compress_ratio": 4, "output_gate_type": "sigmoid"
    });
    let obj = c.as_object_mut().expect("an object");
    for (k, v) in more.as_object().expect("an object") {
        obj.insert(k.clone(), v.clone());
    }
    obj.insert("layer_types".into(), json!(layer_types));
    obj.insert(
        "rope_parameters".into(),
        json!({"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}),
    );
    c
}

/// The dtype of the matrix `name` `[rows, cols]` (a conversion profile's choice).
pub type DtypeOf = dyn Fn(&str, usize, usize) -> DType + Send + Sync;

/// The payloads of a synthetic model, and its config.
pub struct Synthetic {
    /// The config.
    pub config: Qwen4ExpTextConfig,
    blobs: HashMap<(DType, usize, usize), Vec<u8>>,
    /// With [`Synthetic::distinct`]: one copy of its shape's payload per tensor, handed out in
    /// binding order.
    copies: HashMap<(DType, usize, usize), Vec<Vec<u8>>>,
    dtype_of: Box<DtypeOf>,
}

type Key = (DType, usize, usize);

impl Synthetic {
    /// Quantises one random payload per (dtype, shape) the model needs; `dtype_of` decides
    /// each matrix's dtype from its canonical name.
    pub fn new(
        config: &serde_json::Value,
        dtype_of: Box<DtypeOf>,
    ) -> Result<Synthetic, WeightError> {
        Self::with_skew(config, dtype_of, 0.0)
    }

    /// [`Synthetic::new`] with skewed expert popularity: the router's row for the expert of
    /// popularity rank `r` (ranks a fixed shuffle of the ids) scaled by `(r + 1)^-skew`, so
    /// its logits spread wider the higher it ranks and it lands in a token's top-k more often (random weights otherwise route uniformly, which no trained
    /// model does). Every layer shares the router payload, so every layer has the same
    /// popular experts. With top-10 of 512 and Gaussian logits, skew 0.1 sends 46% of the
    /// routed pairs to the most popular quarter of the experts, 0.15 about 56%, 0.2 66%.
    pub fn with_skew(
        config: &serde_json::Value,
        dtype_of: Box<DtypeOf>,
        skew: f64,
    ) -> Result<Synthetic, WeightError> {
        let c = Qwen4ExpTextConfig::from_json(config)?;
        c.validate()?;
        let (d, h) = (c.hidden_size, c.hc_count);
        let hd = h * d;
        let (hk, hv) = (c.linear_num_key_heads, c.linear_num_value_heads);
        let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
        let (hq, hkv, ad) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let q = c.qsa();
        let (e, i, is) = (
            c.num_experts,
            c.moe_intermediate_size,
            c.shared_expert_intermediate_size,
        );
        let pdim = c.ple_embed_dim();
        let shard_rows = PleHash::new(&c, 0)
            .padded_rows
            .div_ceil(c.split_ngram_parts.max(1));
        let l = "model.layers.0";
        let mut shapes: Vec<(String, usize, usize)> = vec![
            ("model.embed_tokens.weight".into(), c.vocab_size, d),
            ("lm_head.weight".into(), c.vocab_size, d),
            (
                format!("{l}.attn_hyper_connection.input_mix_weight_down.weight"),
                c.hc_lowrank,
                hd,
            ),
            (
                format!("{l}.attn_hyper_connection.input_mix_weight_up.weight"),
                hd,
                c.hc_lowrank,
            ),
            (
                format!("{l}.attn_hyper_connection.block_inject_weight.weight"),
                h,
                hd,
            ),
            (
                format!("{l}.linear_attn.in_proj_qkv.weight"),
                2 * hk * dk + hv * dv,
                d,
            ),
            (format!("{l}.linear_attn.in_proj_z.weight"), hv * dv, d),
            (format!("{l}.linear_attn.in_proj_b.weight"), hv, d),
            (format!("{l}.linear_attn.out_proj.weight"), d, hv * dv),
            (format!("{l}.self_attn.q_proj.weight"), hq * 2 * ad, d),
            (format!("{l}.self_attn.k_proj.weight"), hkv * ad, d),
            (format!("{l}.self_attn.o_proj.weight"), d, hq * ad),
            (
                format!("{l}.ple.ple_embedding.ngram_embedding.shard_0.weight"),
                shard_rows,
                pdim / c.ngram_heads(),
            ),
            (format!("{l}.ple.key_proj.weight"), hd, pdim),
            (format!("{l}.ple.value_proj.weight"), d, pdim),
            (format!("{l}.mlp.gate.weight"), e, d),
            (format!("{l}.mlp.experts.0.gate_up_proj.weight"), 2 * i, d),
            (format!("{l}.mlp.experts.0.down_proj.weight"), d, i),
            (format!("{l}.mlp.shared_expert.gate_proj.weight"), is, d),
            (format!("{l}.mlp.shared_expert.down_proj.weight"), d, is),
        ];
        if let Some(q) = q {
            shapes.push((
                format!("{l}.self_attn.indexer.index_qk_proj.weight"),
                (q.n_heads + 1) * q.head_dim,
                d,
            ));
        }
        let mut blobs = HashMap::new();
        for (k, (name, rows, cols)) in shapes.into_iter().enumerate() {
            let dtype = dtype_of(&name, rows, cols);
            if blobs.contains_key(&(dtype, rows, cols)) {
                continue;
            }
            let codec_err = |source| {
                WeightError::Bind(model_core::BindError::Codec {
                    name: name.clone(),
                    source,
                })
            };
            let skewed = skew != 0.0 && name.ends_with(".mlp.gate.weight");
            // Popularity by a fixed shuffle of the ids (389 is odd: a permutation of any
            // power-of-two count), so the first ids are not the popular ones.
            let scale = |x: usize| {
                if skewed {
                    (((x * 389) % rows + 1) as f64).powf(-skew) as f32
                } else {
                    1.0
                }
            };
            let bytes =
                model_core::synthetic::payload(dtype, rows, cols, 0x5eed + k as u64, &scale)
                    .map_err(codec_err)?;
            blobs.insert((dtype, rows, cols), bytes);
        }
        Ok(Synthetic {
            config: c,
            blobs,
            copies: HashMap::new(),
            dtype_of,
        })
    }

    /// Gives every tensor its own copy of its payload in host memory (as a file's mapping
    /// would), so a CPU forward reads the model's bytes from memory, not one shared payload
    /// per shape from the cache. Costs the model's size in RAM.
    pub fn distinct(&mut self) -> Result<(), WeightError> {
        use rayon::prelude::*;
        let counting = SyntheticSource {
            s: self,
            next: Default::default(),
            taken: Default::default(),
        };
        Weights::bind_from(&counting, &self.config)?;
        let counts = counting.taken.into_inner();
        let blobs = &self.blobs;
        self.copies = counts
            .into_par_iter()
            .map(|(key, n)| {
                let copies = (0..n)
                    .into_par_iter()
                    .map(|_| blobs[&key].clone())
                    .collect();
                (key, copies)
            })
            .collect();
        Ok(())
    }

    /// The weights, every tensor named as a file's would be.
    pub fn weights(&self) -> Result<Weights<'_>, WeightError> {
        Weights::bind_from(
            &SyntheticSource {
                s: self,
                next: Default::default(),
                taken: Default::default(),
            },
            &self.config,
        )
    }

    /// Host bytes of the payloads (the shared ones, and the copies).
    pub fn host_bytes(&self) -> usize {
        let copies: usize = self.copies.values().flatten().map(Vec::len).sum();
        self.blobs.values().map(Vec::len).sum::<usize>() + copies
    }

    /// Whether layer `il` is a GDN layer.
    pub fn is_gdn(&self, il: usize) -> bool {
        self.config.layer_type(il) == LayerType::LinearAttention
    }
}

struct SyntheticSource<'s> {
    s: &'s Synthetic,
    next: std::cell::Cell<usize>,
    /// Tensors bound so far per shape (which copy the next one gets).
    taken: std::cell::RefCell<HashMap<Key, usize>>,
}

impl SyntheticSource<'_> {
    fn id(&self) -> usize {
        let id = self.next.get();
        self.next.set(id + 1);
        id
    }
}

impl<'s> Source<'s> for SyntheticSource<'s> {
    fn mat(&self, name: &str, rows: usize, cols: usize) -> Result<Mat<'s>, WeightError> {
        let dtype = (self.s.dtype_of)(name, rows, cols);
        let key = (dtype, rows, cols);
        let shared = self.s.blobs.get(&key).ok_or_else(|| {
            WeightError::Bind(model_core::BindError::Missing(format!(
                "{name} ({dtype:?} {rows}x{cols}: no synthetic payload of that shape)"
            )))
        })?;
        let n = {
            let mut taken = self.taken.borrow_mut();
            let n = taken.entry(key).or_insert(0);
            *n += 1;
            *n - 1
        };
        let bytes = self
            .s
            .copies
            .get(&key)
            .and_then(|c| c.get(n))
            .unwrap_or(shared);
        let m = MatRef::new(dtype, rows, cols, bytes).map_err(|source| {
            WeightError::Bind(model_core::BindError::Codec {
                name: name.to_string(),
                source,
            })
        })?;
        Ok(Mat::new(name, self.id(), m))
    }

    fn vector(&self, name: &str, shape: &[usize]) -> Result<Vector, WeightError> {
        let n = shape.iter().product();
        // Norm weights 0 (the (1+w) norms then scale by 1), a GDN norm weight of 1, a small
        // conv kernel and shared-expert gate.
        let v = if name.ends_with("conv1d.weight") {
            0.25
        } else if name.ends_with("linear_attn.norm.weight") {
            1.0
        } else if name.ends_with("shared_expert_gate.weight") {
            0.001
        } else {
            0.0
        };
        Ok(Vector::new(name, self.id(), vec![v; n]))
    }

    fn stored_integers(
        &self,
        _name: &str,
        _len: usize,
        _header: bool,
    ) -> Result<Option<Vec<i64>>, WeightError> {
        Ok(None)
    }
}
