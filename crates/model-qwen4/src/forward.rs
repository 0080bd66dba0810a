//! The qwen4_exp forward, top to bottom (`Qwen4ExpTextModel.forward` + `lm_head`):
//! embed -> H identical streams; per layer: PLE (on `ple_layer_ids`), HC mix, GDN or QSA
//! attention, inject, HC mix, MoE, inject; final HC mixer (no final norm); `lm_head`.

use crate::config::Qwen4ExpTextConfig;
use crate::ops::Rope;
use crate::state::{LayerState, SeqState};
use crate::weights::{MixerWeights, Weights};
use crate::{gdn, hc, moe, ple, qsa};
use model_core::trace::{
    ATTN_INPUT, ATTN_OUT, ATTN_STREAMS, HEAD_OUT, LAYER_OUT, LOGITS, MLP_INPUT, MOE_OUT,
    PLE_STREAMS,
};
use model_core::{CausalLm, InputError, check_tokens};
use quant_codecs::ops::linear;

/// Bad input to a forward.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// No tokens, or a token id outside the vocabulary.
    #[error(transparent)]
    Input(#[from] InputError),
    /// The sequence state was made for a different model.
    #[error("the sequence state does not belong to this model (layer {0} differs)")]
    StateMismatch(usize),
    /// The sequence would outgrow the context the device state was allocated for.
    #[error(
        "the sequence needs {needed} tokens of context, the device state holds {ctx} (raise --ctx)"
    )]
    Context {
        /// Tokens the sequence would hold.
        needed: usize,
        /// The context allocated.
        ctx: usize,
    },
    /// Drafting asked of a file without an MTP head (`mtp.*`).
    #[error("the model file has no MTP head (mtp.* tensors)")]
    NoMtp,
    /// The device failed (lost, out of memory, a kernel rejected).
    #[error("GPU: {0}")]
    Gpu(#[from] gpu_runtime::GpuError),
}

/// Called with every named intermediate: `(name, layer index, data [t, width])`, with the
/// names of [`model_core::trace`]: `ple_streams` (streams after PLE), `attn_input` (the HC
/// read-out the mixer takes), `attn_out` (GDN / attention output), `attn_streams` (streams
/// after the injection), `mlp_input`, `moe_out`, `layer_out`; then `head_out` (the final HC
/// mixer's output) and `logits` with layer index `num_hidden_layers`.
pub use model_core::Trace;

/// A bound model: config + weights.
pub struct Model<'a> {
    /// The config.
    pub config: Qwen4ExpTextConfig,
    /// The weights.
    pub weights: Weights<'a>,
    rope: Rope,
}

impl<'a> Model<'a> {
    /// Wraps a config and its weights.
    pub fn new(config: Qwen4ExpTextConfig, weights: Weights<'a>) -> Model<'a> {
        let rope = Rope::new(config.rotary_dim(), config.rope().rope_theta);
        Model {
            config,
            weights,
            rope,
        }
    }
}

impl Model<'_> {
    /// The RoPE frequencies.
    pub(crate) fn rope(&self) -> &Rope {
        &self.rope
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
        self.run_many(&mut [(tokens, st)], trace, last_only)
    }
}

impl Model<'_> {
    /// Feeds several sequences at once, each its own tokens after whatever its state holds,
    /// and returns each one's last logits row `[vocab]`. Row-wise work (the projections, the
    /// hyper-connections, the experts, the head) runs once over the rows of all of them, so a
    /// weight is read once per step rather than once per sequence; the conv, recurrence and
    /// attention run per sequence on its own state. The same math as one forward per sequence.
    pub fn forward_batch(
        &self,
        seqs: &mut [(&[u32], &mut SeqState)],
    ) -> Result<Vec<Vec<f32>>, ForwardError> {
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let v = self.config.vocab_size;
        let logits = self.run_many(seqs, &mut |_, _, _| {}, true)?;
        Ok(logits.chunks(v).map(<[f32]>::to_vec).collect())
    }

    fn check_state(&self, st: &SeqState) -> Result<(), ForwardError> {
        let w = &self.weights;
        if st.layers.len() != w.layers.len() || st.ple_conv.len() != w.layers.len() {
            return Err(ForwardError::StateMismatch(
                st.layers.len().min(w.layers.len()),
            ));
        }
        for (il, (lw, ls)) in w.layers.iter().zip(&st.layers).enumerate() {
            let same = matches!(
                (&lw.mixer, ls),
                (MixerWeights::Gdn(_), LayerState::Gdn(_))
                    | (MixerWeights::Attn(_), LayerState::Attn(_))
            );
            if !same {
                return Err(ForwardError::StateMismatch(il));
            }
        }
        Ok(())
    }

    /// The forward over the rows of every sequence in `seqs` (in order); logits of every row,
    /// or of each sequence's last row when `last_only`.
    fn run_many(
        &self,
        seqs: &mut [(&[u32], &mut SeqState)],
        trace: &mut Trace<'_>,
        last_only: bool,
    ) -> Result<Vec<f32>, ForwardError> {
        let c = &self.config;
        let w = &self.weights;
        for (tokens, st) in seqs.iter() {
            check_tokens(tokens, c.vocab_size)?;
            self.check_state(st)?;
        }
        // Row offsets: sequence i owns rows starts[i]..starts[i + 1].
        let mut starts = vec![0usize];
        for (tokens, _) in seqs.iter() {
            starts.push(starts.last().copied().unwrap_or(0) + tokens.len());
        }
        let t = *starts.last().unwrap_or(&0);
        let (h, d) = (c.hc_count, c.hidden_size);
        let hd = h * d;
        let eps = c.rms_norm_eps as f32;

        // Embedding, repeated into the H streams.
        let mut x = vec![0f32; t * hd];
        let mut row = vec![0f32; d];
        let all = seqs.iter().flat_map(|(tokens, _)| tokens.iter());
        for (r, &id) in all.enumerate() {
            w.embed
                .dequantize_row(id as usize, &mut row)
                .expect("id checked");
            for k in 0..h {
                x[r * hd + k * d..r * hd + (k + 1) * d].copy_from_slice(&row);
            }
        }

        // N-gram rows for the PLE layers (same token history for every PLE module).
        let history: Vec<Vec<i64>> = seqs
            .iter()
            .map(|(tokens, st)| {
                let mut hist = st.ngram_ctx.clone();
                hist.extend(tokens.iter().map(|&id| id as i64));
                hist
            })
            .collect();

        for (il, lw) in w.layers.iter().enumerate() {
            if let Some(pw) = &lw.ple {
                for (i, (tokens, st)) in seqs.iter_mut().enumerate() {
                    let ts = tokens.len();
                    let rows = ple::ngram_rows(
                        &pw.hash,
                        &history[i],
                        ts,
                        c.ngram_size,
                        c.heads_per_ngram,
                        c.eos_id().expect("validated"),
                    );
                    let xs = &mut x[starts[i] * hd..starts[i + 1] * hd];
                    ple::forward_cpu(pw, c, xs, &rows, ts, &mut st.ple_conv[il]);
                }
                trace(PLE_STREAMS, il, &x);
            }

            let mix = hc::forward_cpu(&lw.attn_hc, &x, t, h, d, eps);
            trace(ATTN_INPUT, il, &mix.input);
            let y = match &lw.mixer {
                MixerWeights::Gdn(gw) => {
                    let p = gdn::project(gw, &mix.input, t);
                    let mut o = Vec::new();
                    for (i, (tokens, st)) in seqs.iter_mut().enumerate() {
                        let LayerState::Gdn(gs) = &mut st.layers[il] else {
                            return Err(ForwardError::StateMismatch(il));
                        };
                        o.extend(gdn::recur(gw, c, &p, starts[i], tokens.len(), gs));
                    }
                    linear(&gw.out, &o, t)
                }
                MixerWeights::Attn(aw) => {
                    let p = qsa::project(aw, &mix.input, t);
                    let mut o = Vec::new();
                    for (i, (tokens, st)) in seqs.iter_mut().enumerate() {
                        let LayerState::Attn(as_) = &mut st.layers[il] else {
                            return Err(ForwardError::StateMismatch(il));
                        };
                        o.extend(qsa::attend(
                            aw,
                            c,
                            &self.rope,
                            &p,
                            starts[i],
                            tokens.len(),
                            as_,
                        ));
                    }
                    linear(&aw.o, &o, t)
                }
            };
            trace(ATTN_OUT, il, &y);
            hc::inject(&mut x, &y, &mix.inject, t, h, d);
            trace(ATTN_STREAMS, il, &x);

            let mix = hc::forward_cpu(&lw.mlp_hc, &x, t, h, d, eps);
            trace(MLP_INPUT, il, &mix.input);
            let y = moe::forward_cpu(&lw.moe, c, &mix.input, t);
            trace(MOE_OUT, il, &y);
            hc::inject(&mut x, &y, &mix.inject, t, h, d);
            trace(LAYER_OUT, il, &x);
        }

        let keep = c.ngram_size.saturating_sub(1);
        for (i, (tokens, st)) in seqs.iter_mut().enumerate() {
            st.ngram_ctx = history[i][history[i].len() - keep..].to_vec();
            st.pos += tokens.len();
        }

        let nl = c.num_hidden_layers;
        let (x, t) = if last_only {
            let mut last = Vec::with_capacity(seqs.len() * hd);
            for &end in &starts[1..] {
                last.extend_from_slice(&x[(end - 1) * hd..end * hd]);
            }
            (last, seqs.len())
        } else {
            (x, t)
        };
        let mixed = hc::forward_cpu(&w.final_mixer, &x, t, h, d, eps);
        trace(HEAD_OUT, nl, &mixed.input);
        let logits = linear(&w.lm_head, &mixed.input, t);
        trace(LOGITS, nl, &logits);
        Ok(logits)
    }
}
