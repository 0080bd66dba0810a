//! DeepSeek-V4.1-Flash (`deepseek_v41`), the exact CPU forward (transformers main's
//! `DeepseekV41ForCausalLM`, text only), as a variant of V4 where the math is shared.
//!
//! Top to bottom (`DeepseekV41TextModel.forward` + `lm_head`): embed into `hc_mult` identical
//! streams; hash the tokens' n-grams once for all Engram layers and gather their table rows;
//! per layer: the Engram module (on its layers), the attention site's mHC maps, collapse with
//! the PREVIOUS site's `pre` (single-pass mHC: stream 0 alone before the first layer),
//! `input_layernorm`, attention ([`attention`]), expand; the MoE site's maps, collapse with the
//! attention site's `pre`, `post_attention_layernorm`, MoE (V4's block with a logit
//! temperature, no hash routing), expand; then the collapse with the last site's `pre` (no
//! `hc_head`), `norm`, `lm_head`.
//!
//! ```
//! use model_dsv4::v41::{Model, Weights};
//! use model_dsv4::CausalLm;
//! # let dir = tempfile::tempdir()?;
//! # let path = test_support::convert_fixture("deepseek_v41_a", dir.path(), test_support::Profile::F32);
//! # let token_map = Some(model_dsv4::engram::CompressedTokenMap::from_i64(
//! #     &test_support::read_npy(&test_support::fixture("deepseek_v41_a")
//! #         .join("expected/engram_token_map.npy")).i64)?);
//! // `path`: a deepseek_v41 CMF; `token_map`: its tokenizer's compressed token map.
//! let cmf = cmf_format::Cmf::open(&path)?;
//! let (config, weights) = Weights::bind(&cmf, token_map)?;
//! let model = Model::new(config, weights);
//! let mut state = model.new_state();
//! let logits = model.forward(&[5, 17, 42], &mut state)?; // [3, vocab]
//! let next = model.forward(&[7], &mut state)?; // cached: [1, vocab]
//! assert_eq!(logits.len(), 3 * model.vocab_size());
//! assert_eq!(next.len(), model.vocab_size());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod attention;
pub mod compressor;
pub mod gpu;
pub mod indexer;
pub mod qat;
pub mod state;
pub mod weights;

use crate::attention::Ropes;
use crate::config_v41::DeepseekV41Config;
use crate::engram::{EngramError, EngramTableError, block};
use crate::hc::{self, HcDims};
use crate::moe::{self, Router};
use crate::ops::{Rope, rms_norm};
use model_core::trace::{
    ATTN_INPUT, ATTN_OUT, ATTN_STREAMS, HEAD_OUT, LAYER_OUT, LOGITS, MLP_INPUT, MOE_OUT,
};
use model_core::{CausalLm, InputError, Trace, check_tokens};
use quant_codecs::ops::linear;

pub use state::SeqState;
pub use weights::{V41WeightError, Weights};

/// Bad input to a forward.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// No tokens, or a token id outside the vocabulary.
    #[error(transparent)]
    Input(#[from] InputError),
    /// The sequence state was made for a different model (or its caches were altered).
    #[error("the sequence state does not belong to this model: {0}")]
    StateMismatch(String),
    /// A token the Engram hash cannot take (outside the tokenizer's token map).
    #[error(transparent)]
    Engram(#[from] EngramError),
    /// An Engram table row could not be read.
    #[error(transparent)]
    Table(#[from] EngramTableError),
    /// The device forward failed (or was refused: a foreign state, the context exceeded).
    #[error(transparent)]
    Device(#[from] crate::forward::ForwardError),
}

/// A bound model: config + weights.
pub struct Model<'a> {
    /// The config.
    pub config: DeepseekV41Config,
    /// The weights.
    pub weights: Weights<'a>,
    ropes: Ropes,
    router: Router,
}

impl<'a> Model<'a> {
    /// Wraps a config and its weights (bound by [`Weights::bind`], which validated the config).
    pub fn new(config: DeepseekV41Config, weights: Weights<'a>) -> Model<'a> {
        let rope = |rp: Option<&crate::config::RopeParams>| {
            Rope::new(
                rp.expect("resolved by from_json, checked by validate"),
                config.head_dim,
            )
        };
        let ropes = Ropes {
            main: rope(config.rope_main()),
            compress: rope(config.rope_compress()),
        };
        let router = Router {
            n_experts: config.n_routed_experts,
            top_k: config.num_experts_per_tok,
            scoring: config.scoring_func,
            scale: config.routed_scaling_factor as f32,
            temp: config.gate_temp as f32,
            swiglu_limit: config.swiglu_limit as f32,
        };
        Model {
            config,
            weights,
            ropes,
            router,
        }
    }

    /// The Engram rows of `tokens` for every Engram layer, `[layer][t, n_cols * hd]`, advancing
    /// the look-back `ngram` (untouched on error).
    pub(crate) fn engram_rows(
        &self,
        tokens: &[u32],
        ngram: &mut Option<crate::engram::NgramContext>,
    ) -> Result<Vec<Option<Vec<f32>>>, ForwardError> {
        let w = &self.weights;
        let mut per_layer: Vec<Option<Vec<f32>>> = vec![None; w.layers.len()];
        let (Some(hasher), Some(ctx)) = (&w.hasher, ngram.as_mut()) else {
            return Ok(per_layer);
        };
        let mut ctx_next = ctx.clone();
        let mut ids = Vec::new();
        hasher.hash_into(&mut ctx_next, tokens, &mut ids)?;
        let n_cols = hasher.layout().n_cols();
        let per_token = hasher.ids_per_token();
        for (il, lw) in w.layers.iter().enumerate() {
            let (Some(ew), Some(k)) = (&lw.engram, self.config.roles()[il].engram) else {
                continue;
            };
            let wanted: Vec<u64> = (0..tokens.len())
                .flat_map(|r| ids[r * per_token + k * n_cols..][..n_cols].iter().copied())
                .collect();
            let mut rows = vec![0f32; wanted.len() * ew.table.cols()];
            ew.table.gather(&wanted, &mut rows)?;
            per_layer[il] = Some(rows);
        }
        *ctx = ctx_next;
        Ok(per_layer)
    }
}

impl CausalLm for Model<'_> {
    type State = SeqState;
    type Error = ForwardError;

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn new_state(&self) -> SeqState {
        SeqState::new(&self.config, self.weights.hasher.as_ref())
    }

    fn run(
        &self,
        tokens: &[u32],
        st: &mut SeqState,
        trace: &mut Trace<'_>,
        last_only: bool,
    ) -> Result<Vec<f32>, ForwardError> {
        let c = &self.config;
        let w = &self.weights;
        let t = tokens.len();
        check_tokens(tokens, c.vocab_size)?;
        if let Some(why) = st.mismatch(c, w.hasher.is_some()) {
            return Err(ForwardError::StateMismatch(why));
        }
        let (n, d) = (c.hc_mult, c.hidden_size);
        let eps = c.rms_norm_eps as f32;
        let dims = HcDims {
            n,
            d,
            norm_eps: eps,
            hc_eps: c.hc_eps as f32,
            iters: c.hc_sinkhorn_iters,
        };
        // Everything fallible first: a refused forward leaves the state as it was.
        let engram_rows = self.engram_rows(tokens, &mut st.ngram)?;

        // Embedding, repeated into the N streams.
        let mut x = hc::embed_streams(&w.embed_tokens, tokens, n, d);
        // One-hot initial mix: the first site collapses stream 0 only.
        let mut pre_mix = vec![0f32; t * n];
        for r in 0..t {
            pre_mix[r * n] = 1.0;
        }

        let mut published = attention::Published::new(w.layers.len());
        for (il, lw) in w.layers.iter().enumerate() {
            if let (Some(ew), Some(rows)) = (&lw.engram, &engram_rows[il]) {
                block::forward_cpu(ew, &mut x, rows, t, n, eps);
            }
            let attn_maps = hc::maps(&lw.attn_hc, &x, t, &dims);
            let mut u = hc::collapse(&x, &pre_mix, t, n, d);
            rms_norm(&mut u, &lw.input_layernorm, eps);
            trace(ATTN_INPUT, il, &u);
            let y = attention::forward_cpu(
                lw,
                c,
                il,
                &self.ropes,
                &u,
                t,
                st.pos,
                &mut st.layers,
                &mut published,
            );
            trace(ATTN_OUT, il, &y);
            hc::post(&mut x, &y, &attn_maps.post, &attn_maps.comb, t, &dims);
            trace(ATTN_STREAMS, il, &x);

            let ffn_maps = hc::maps(&lw.ffn_hc, &x, t, &dims);
            let mut u = hc::collapse(&x, &attn_maps.pre, t, n, d);
            rms_norm(&mut u, &lw.post_attention_layernorm, eps);
            trace(MLP_INPUT, il, &u);
            let y = moe::forward_cpu(&lw.moe, &self.router, &u, tokens, t);
            trace(MOE_OUT, il, &y);
            hc::post(&mut x, &y, &ffn_maps.post, &ffn_maps.comb, t, &dims);
            trace(LAYER_OUT, il, &x);
            pre_mix = ffn_maps.pre;
        }
        st.pos += t;

        let nl = c.num_hidden_layers;
        let (x, pre_mix, t) = if last_only {
            (&x[(t - 1) * n * d..], &pre_mix[(t - 1) * n..], 1)
        } else {
            (&x[..], &pre_mix[..], t)
        };
        let mut out = hc::collapse(x, pre_mix, t, n, d);
        rms_norm(&mut out, &w.norm, eps);
        trace(HEAD_OUT, nl, &out);
        let logits = linear(&w.lm_head, &out, t);
        trace(LOGITS, nl, &logits);
        Ok(logits)
    }
}
