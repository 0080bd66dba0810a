//! The deepseek_v4 forward, top to bottom (`DeepseekV4Model.forward` + `lm_head`): embed into
//! `hc_mult` identical streams; per layer: mHC collapse, `input_layernorm`, attention, mHC
//! expand, mHC collapse, `post_attention_layernorm`, MoE, mHC expand; the head's collapse,
//! `norm`, `lm_head`.

use crate::attention::{self, Ropes};
use crate::config::DeepseekV4Config;
use crate::hc::{self, HcDims};
use crate::moe;
use crate::ops::{Rope, rms_norm};
use crate::state::SeqState;
use crate::weights::Weights;
use model_core::trace::{
    ATTN_INPUT, ATTN_OUT, ATTN_STREAMS, HEAD_OUT, LAYER_OUT, LOGITS, MLP_INPUT, MOE_OUT,
};
use model_core::{CausalLm, InputError, check_tokens};
use quant_codecs::ops::linear;

/// Bad input to a forward.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// No tokens, or a token id outside the vocabulary.
    #[error(transparent)]
    Input(#[from] InputError),
    /// The sequence state was made for a different model (or its caches were altered).
    #[error("the sequence state does not belong to this model: {0}")]
    StateMismatch(String),
    /// The sequence would outgrow the context a device state was allocated for.
    #[error(
        "the sequence needs {needed} tokens of context, the device state holds {ctx} (raise --ctx)"
    )]
    Context {
        /// Tokens the sequence would hold.
        needed: usize,
        /// The context allocated.
        ctx: usize,
    },
    /// The device failed (lost, out of memory, a kernel rejected).
    #[error("GPU: {0}")]
    Gpu(#[from] gpu_runtime::GpuError),
}

/// Called with every named intermediate: `(name, layer index, data [t, width])`, with the
/// names of [`model_core::trace`]: `attn_input` (after `input_layernorm`), `attn_out`,
/// `attn_streams`, `mlp_input` (after `post_attention_layernorm`), `moe_out`, `layer_out`; then
/// `head_out` (after `norm`) and `logits` with layer index `num_hidden_layers`.
pub use model_core::Trace;

/// A bound model: config + weights.
pub struct Model<'a> {
    /// The config.
    pub config: DeepseekV4Config,
    /// The weights.
    pub weights: Weights<'a>,
    ropes: Ropes,
}

impl<'a> Model<'a> {
    /// Wraps a config and its weights.
    pub fn new(config: DeepseekV4Config, weights: Weights<'a>) -> Model<'a> {
        let ropes = Ropes {
            main: Rope::new(config.rope_main(), config.head_dim),
            compress: Rope::new(config.rope_compress(), config.head_dim),
        };
        Model {
            config,
            weights,
            ropes,
        }
    }
}

impl CausalLm for Model<'_> {
    type State = SeqState;
    type Error = ForwardError;

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn new_state(&self) -> SeqState {
        SeqState::new(&self.config)
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
        if let Some(why) = st.mismatch(c) {
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

        // Embedding, repeated into the N streams.
        let mut x = hc::embed_streams(&w.embed_tokens, tokens, n, d);

        for (il, lw) in w.layers.iter().enumerate() {
            let mix = hc::pre(&lw.attn_hc, &x, t, &dims);
            let mut u = mix.input;
            rms_norm(&mut u, &lw.input_layernorm, eps);
            trace(ATTN_INPUT, il, &u);
            let y = attention::forward_cpu(
                &lw.attn,
                c,
                c.attn_kind(il),
                &self.ropes,
                &u,
                t,
                st.pos,
                &mut st.layers[il],
            );
            trace(ATTN_OUT, il, &y);
            hc::post(&mut x, &y, &mix.post, &mix.comb, t, &dims);
            trace(ATTN_STREAMS, il, &x);

            let mix = hc::pre(&lw.ffn_hc, &x, t, &dims);
            let mut u = mix.input;
            rms_norm(&mut u, &lw.post_attention_layernorm, eps);
            trace(MLP_INPUT, il, &u);
            let y = moe::forward_cpu(&lw.moe, &moe::Router::of(c), &u, tokens, t);
            trace(MOE_OUT, il, &y);
            hc::post(&mut x, &y, &mix.post, &mix.comb, t, &dims);
            trace(LAYER_OUT, il, &x);
        }
        st.pos += t;

        let nl = c.num_hidden_layers;
        let stride = dims.n * dims.d;
        let (x, t) = if last_only {
            (&x[(t - 1) * stride..], 1)
        } else {
            (&x[..], t)
        };
        let mut out = hc::head(&w.hc_head, x, t, &dims);
        rms_norm(&mut out, &w.norm, eps);
        trace(HEAD_OUT, nl, &out);
        let logits = linear(&w.lm_head, &out, t);
        trace(LOGITS, nl, &logits);
        Ok(logits)
    }
}
