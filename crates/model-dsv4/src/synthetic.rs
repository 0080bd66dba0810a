//! A random-weight deepseek_v4 made in memory, without a file: the released geometry of
//! DeepSeek-V4-Flash (43 layers: 2 sliding, 21 CSA at rate 4, 20 HCA at rate 128; hidden 4096,
//! 4 mHC streams, 64 heads of 512 with one latent KV head, grouped output projection 8 x 1024,
//! 256 experts top-6 of width 2048 + one shared, the first 3 layers hash-routed, vocab 129,280)
//! for `cortiq bench model --synthetic deepseek-v4-flash`, quantised per profile.
//!
//! One payload per (dtype, shape) is quantised from random values and shared on the host by
//! every tensor of that shape; each tensor still goes up to its own device memory, so the
//! device reads exactly the bytes the real model's would. The routed experts, which the CPU
//! reads when they are cold, come from a pool of distinct host copies, expert `(layer, x)`
//! taking copy `(layer * experts + x) mod pool`: the real model's 147 GB of FP4 experts do not
//! fit a host's RAM, and a pool many times the CPU's last-level cache makes every cold expert a
//! read from memory, as a file's mapping would.

use std::collections::HashMap;

use model_core::{BindError, Mat, Vector};
use quant_codecs::{DType, MatRef};
use serde_json::json;

use crate::config::{AttnKind, DeepseekV4Config};
use crate::weights::{Source, WeightError, Weights};

/// The released config (`layers` and `experts` overridable for smaller runs).
pub fn release_config(layers: usize, experts: usize) -> serde_json::Value {
    // config.json's `compress_ratios`: [0, 0] + [4, 128] * 20 + [4] (+ the MTP layer's 0).
    let ratios: Vec<i64> = (0..layers)
        .map(|il| match il {
            0 | 1 => 0,
            _ if il % 2 == 0 => 4,
            _ => 128,
        })
        .collect();
    json!({
        "model_type": "deepseek_v4",
        "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
        "num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": 1,
        "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024,
        "o_groups": 8, "o_lora_rank": 1024,
        "n_routed_experts": experts, "n_shared_experts": 1, "num_experts_per_tok": 6.min(experts),
        "num_hash_layers": 3.min(layers), "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5, "norm_topk_prob": true,
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
        "sliding_window": 128, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6, "swiglu_limit": 10.0, "max_position_embeddings": 1048576,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "compress_ratios": ratios,
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": false
    })
}

/// The dtype of the matrix `name` `[rows, cols]` (a conversion profile's choice).
pub type DtypeOf = dyn Fn(&str, usize, usize) -> DType + Send + Sync;

type Key = (DType, usize, usize);

/// The payloads of a synthetic model, and its config.
pub struct Synthetic {
    /// The config.
    pub config: DeepseekV4Config,
    blobs: HashMap<Key, Vec<u8>>,
    /// Distinct copies of one routed expert's `(gate_up, down)` payloads.
    pool: Vec<(Vec<u8>, Vec<u8>)>,
    dtype_of: Box<DtypeOf>,
}

impl Synthetic {
    /// Quantises one random payload per (dtype, shape) the model needs (`dtype_of` decides
    /// each matrix's dtype from its canonical name) and `pool` distinct copies of a routed
    /// expert (0: every expert reads the one shared payload).
    ///
    /// `skew` makes expert popularity uneven, as a trained router's is: the router row of the
    /// expert of popularity rank `r` (ranks a fixed shuffle of the ids, the same in every
    /// layer) is scaled by `(r + 1)^-skew`, so its logits spread wider and it lands in a
    /// token's top-k more often. The hash-routed layers' `tid2eid` is uniform.
    pub fn new(
        config: &serde_json::Value,
        dtype_of: Box<DtypeOf>,
        skew: f64,
        pool: usize,
    ) -> Result<Synthetic, WeightError> {
        use rayon::prelude::*;
        let c = DeepseekV4Config::from_json(config)?;
        c.validate()?;
        let (d, n) = (c.hidden_size, c.hc_mult);
        let (h, dh, qr) = (c.num_attention_heads, c.head_dim, c.q_lora_rank);
        let (g, r) = (c.o_groups, c.o_lora_rank);
        let (e, i) = (c.n_routed_experts, c.moe_intermediate_size);
        let (ni, di) = (c.index_n_heads, c.index_head_dim);
        let l = "model.layers.0";
        let a = format!("{l}.self_attn");
        let m = format!("{l}.mlp");
        let mut shapes: Vec<(String, usize, usize)> = vec![
            ("model.embed_tokens.weight".into(), c.vocab_size, d),
            ("lm_head.weight".into(), c.vocab_size, d),
            ("model.hc_head.hc_fn".into(), n, n * d),
            (format!("{l}.attn_hc.fn"), (2 + n) * n, n * d),
            (format!("{a}.q_a_proj.weight"), qr, d),
            (format!("{a}.q_b_proj.weight"), h * dh, qr),
            (format!("{a}.kv_proj.weight"), dh, d),
            (format!("{a}.o_a_proj.weight"), g * r, h * dh / g),
            (format!("{a}.o_b_proj.weight"), d, g * r),
            (format!("{m}.gate.weight"), e, d),
            (format!("{m}.experts.0.gate_up_proj.weight"), 2 * i, d),
            (format!("{m}.experts.0.down_proj.weight"), d, i),
            (format!("{m}.shared_experts.gate_proj.weight"), i, d),
            (format!("{m}.shared_experts.down_proj.weight"), d, i),
        ];
        let kinds: Vec<AttnKind> = (0..c.num_hidden_layers).map(|il| c.attn_kind(il)).collect();
        if kinds.contains(&AttnKind::Hca) {
            shapes.push((format!("{a}.compressor.kv_proj.weight"), dh, d));
        }
        if kinds.contains(&AttnKind::Csa) {
            let x = format!("{a}.compressor.indexer");
            shapes.extend([
                (format!("{a}.compressor.kv_proj.weight"), 2 * dh, d),
                (format!("{x}.kv_proj.weight"), 2 * di, d),
                (format!("{x}.q_b_proj.weight"), ni * di, qr),
                (format!("{x}.scorer.weights_proj.weight"), ni, d),
            ]);
        }
        let mut blobs = HashMap::new();
        for (k, (name, rows, cols)) in shapes.into_iter().enumerate() {
            let dtype = dtype_of(&name, rows, cols);
            if blobs.contains_key(&(dtype, rows, cols)) {
                continue;
            }
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
            let bytes = model_core::synthetic::payload(dtype, rows, cols, 0xd5e + k as u64, &scale)
                .map_err(|source| BindError::Codec { name, source })?;
            blobs.insert((dtype, rows, cols), bytes);
        }
        let expert = |what: &str, rows, cols| {
            let name = format!("{m}.experts.0.{what}.weight");
            &blobs[&(dtype_of(&name, rows, cols), rows, cols)]
        };
        let (gu, dn) = (expert("gate_up_proj", 2 * i, d), expert("down_proj", d, i));
        let pool = (0..pool.min(c.num_hidden_layers * e))
            .into_par_iter()
            .map(|_| (gu.clone(), dn.clone()))
            .collect();
        Ok(Synthetic {
            config: c,
            blobs,
            pool,
            dtype_of,
        })
    }

    /// The weights, every tensor named as a file's would be.
    pub fn weights(&self) -> Result<Weights<'_>, WeightError> {
        Weights::bind_from(
            &SyntheticSource {
                s: self,
                next: Default::default(),
            },
            &self.config,
        )
    }

    /// Host bytes of the payloads (the shared ones and the expert pool).
    pub fn host_bytes(&self) -> usize {
        let pool: usize = self.pool.iter().map(|(a, b)| a.len() + b.len()).sum();
        self.blobs.values().map(Vec::len).sum::<usize>() + pool
    }

    /// Distinct expert copies on the host.
    pub fn pool(&self) -> usize {
        self.pool.len()
    }
}

struct SyntheticSource<'s> {
    s: &'s Synthetic,
    next: std::cell::Cell<usize>,
}

/// `(layer, expert, gate_up?)` of a routed expert's matrix name.
fn expert_of(name: &str) -> Option<(usize, usize, bool)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (il, rest) = rest.split_once('.')?;
    let rest = rest.strip_prefix("mlp.experts.")?;
    let (x, what) = rest.split_once('.')?;
    Some((
        il.parse().ok()?,
        x.parse().ok()?,
        what.starts_with("gate_up"),
    ))
}

impl<'s> Source<'s> for SyntheticSource<'s> {
    fn mat(&self, name: &str, rows: usize, cols: usize) -> Result<Mat<'s>, BindError> {
        let dtype = (self.s.dtype_of)(name, rows, cols);
        let mut bytes = self.s.blobs.get(&(dtype, rows, cols)).ok_or_else(|| {
            BindError::Missing(format!(
                "{name} ({dtype:?} {rows}x{cols}: no synthetic payload of that shape)"
            ))
        })?;
        if let Some((il, x, gate_up)) = expert_of(name)
            && !self.s.pool.is_empty()
        {
            let (gu, dn) =
                &self.s.pool[(il * self.s.config.n_routed_experts + x) % self.s.pool.len()];
            bytes = if gate_up { gu } else { dn };
        }
        let m = MatRef::new(dtype, rows, cols, bytes).map_err(|source| BindError::Codec {
            name: name.to_string(),
            source,
        })?;
        let id = self.next.get();
        self.next.set(id + 1);
        Ok(Mat::new(name, id, m))
    }

    fn vector(&self, name: &str, shape: &[usize]) -> Result<Vector, BindError> {
        // Norm weights 1 (these norms scale by w, not 1 + w); mHC bases and scales, sinks,
        // position biases and router biases 0.
        let v = if name.ends_with("norm.weight") {
            1.0
        } else {
            0.0
        };
        let id = self.next.get();
        self.next.set(id + 1);
        Ok(Vector::new(name, id, vec![v; shape.iter().product()]))
    }

    fn integers(&self, _name: &str, shape: &[usize]) -> Result<Vec<i64>, BindError> {
        // `tid2eid` `[V, k]`: k distinct experts per token, spread by a multiplicative hash.
        let (v, k) = (shape[0], shape.get(1).copied().unwrap_or(1));
        let e = self.s.config.n_routed_experts as u64;
        Ok((0..v as u64)
            .flat_map(|t| {
                let h = t.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32;
                (0..k as u64).map(move |j| ((h + j) % e) as i64)
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_names_parse() {
        assert_eq!(
            expert_of("model.layers.12.mlp.experts.255.gate_up_proj.weight"),
            Some((12, 255, true))
        );
        assert_eq!(
            expert_of("model.layers.0.mlp.experts.3.down_proj.weight"),
            Some((0, 3, false))
        );
        assert_eq!(
            expert_of("model.layers.0.mlp.shared_experts.down_proj.weight"),
            None
        );
    }
}
