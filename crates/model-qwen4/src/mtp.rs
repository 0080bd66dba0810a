//! The multi-token-prediction head (`mtp.*`, [`MtpWeights`]) on the CPU, and the trunk's final
//! streams it reads.
//!
//! At trunk position `p` the head takes the trunk's final streams `Hs_p` `[H, D]` (the last
//! layer's output, before the head mixer) and the token after `p`, `t_{p+1}`:
//! `e' = fc_embedding(norm_D(embed(t_{p+1})))`, `h_k = fc_hidden(norm_{H*D}(Hs_p)_k)` per stream,
//! `X_k = h_k + e'`; one decoder layer (indexed attention over the head's own cache of positions
//! `0..=p`, MoE, two hyper-connection sites, no PLE) gives `X'`, and
//! `lm_head(mixer(X'))` predicts `t_{p+2}`. A chained draft feeds `X'` and the drafted token
//! back at position `p + 1`. The hidden norm is over all `H*D` values as one vector (vLLM's
//! reading of the released head and the original engine's; llama.cpp normalises per stream).
//! Both norms are zero-centred (`1 + w`), as every norm of the model.

use model_core::trace::LAYER_OUT;
use quant_codecs::ops::linear;

use crate::forward::{ForwardError, Model};
use crate::ops::rms_norm_1p;
use crate::qsa::{self, AttnState};
use crate::state::SeqState;
use crate::weights::{MixerWeights, MtpWeights};
use crate::{CausalLm, hc, moe};

/// The head's cache: its attention layer's keys, values and indexer keys, one entry per trunk
/// position it has run at.
#[derive(Debug, Clone, Default)]
pub struct MtpState {
    /// The layer's caches.
    pub attn: AttnState,
}

impl MtpState {
    /// Entries held (the next position the head runs at).
    pub fn len(&self, m: &Model<'_>) -> usize {
        let c = &m.config;
        self.attn.k.len() / (c.num_key_value_heads * c.head_dim)
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.attn.k.is_empty()
    }

    /// Drops the entries from position `n` on (a rejected draft's).
    pub fn truncate(&mut self, m: &Model<'_>, n: usize) {
        qsa::truncate(&m.config, &mut self.attn, n);
    }
}

/// What the head computed for its rows.
pub struct MtpOut {
    /// Its output streams `[t, H*D]` (what a chained draft takes as `Hs`).
    pub streams: Vec<f32>,
    /// The last row's logits `[vocab]` (empty when not asked for).
    pub logits: Vec<f32>,
}

impl Model<'_> {
    /// The MTP head, when the file has one.
    pub fn mtp(&self) -> Option<&MtpWeights<'_>> {
        self.weights.mtp.as_deref()
    }

    /// Feeds `tokens` like [`CausalLm::forward`] and returns the logits of every row
    /// `[t, vocab]` (of the last row when `last_only`) with every row's final streams
    /// `[t, H*D]` (what the MTP head reads).
    pub fn forward_streams(
        &self,
        tokens: &[u32],
        st: &mut SeqState,
        last_only: bool,
    ) -> Result<(Vec<f32>, Vec<f32>), ForwardError> {
        let last = self.config.num_hidden_layers - 1;
        let mut streams = Vec::new();
        let logits = self.run(
            tokens,
            st,
            &mut |name, layer, data| {
                if name == LAYER_OUT && layer == last {
                    streams = data.to_vec();
                }
            },
            last_only,
        )?;
        Ok((logits, streams))
    }

    /// Runs the MTP head over `t` rows at positions `st.len()..`: row `r` takes the streams
    /// `hs[r]` (`[t, H*D]`: the trunk's final streams at that position, or the head's own
    /// output for a chained draft) and `tokens[r]`, the token after that position; the
    /// logits of the last row when `logits` (else none: entries made for later steps).
    /// Errors when the file has no head or a token is outside the vocabulary.
    pub fn mtp_forward(
        &self,
        hs: &[f32],
        tokens: &[u32],
        st: &mut MtpState,
        logits: bool,
    ) -> Result<MtpOut, ForwardError> {
        let c = &self.config;
        let w = self.mtp().ok_or(ForwardError::NoMtp)?;
        model_core::check_tokens(tokens, c.vocab_size)?;
        let t = tokens.len();
        let (h, d) = (c.hc_count, c.hidden_size);
        let hd = h * d;
        assert_eq!(hs.len(), t * hd, "streams of every row");
        let eps = c.rms_norm_eps as f32;

        let mut e = vec![0f32; t * d];
        for (r, &id) in tokens.iter().enumerate() {
            let row = &mut e[r * d..(r + 1) * d];
            let embed = &self.weights.embed;
            embed.dequantize_row(id as usize, row).expect("id checked");
        }
        rms_norm_1p(&mut e, &w.pre_fc_norm_embedding, d, eps);
        let e = linear(&w.fc_embedding, &e, t);
        let mut hn = hs.to_vec();
        rms_norm_1p(&mut hn, &w.pre_fc_norm_hidden, hd, eps);
        // Every stream of every row through the one projection: `t * H` rows of D.
        let mut x = linear(&w.fc_hidden, &hn, t * h);
        for r in 0..t {
            for k in 0..h {
                let xs = &mut x[r * hd + k * d..r * hd + (k + 1) * d];
                for (a, b) in xs.iter_mut().zip(&e[r * d..(r + 1) * d]) {
                    *a += b;
                }
            }
        }

        let lw = &w.layer;
        let MixerWeights::Attn(aw) = &lw.mixer else {
            unreachable!("bound as indexed attention")
        };
        let mix = hc::forward_cpu(&lw.attn_hc, &x, t, h, d, eps);
        let p = qsa::project(aw, &mix.input, t);
        let o = qsa::attend(aw, c, self.rope(), &p, 0, t, &mut st.attn);
        let y = linear(&aw.o, &o, t);
        hc::inject(&mut x, &y, &mix.inject, t, h, d);
        let mix = hc::forward_cpu(&lw.mlp_hc, &x, t, h, d, eps);
        let y = moe::forward_cpu(&lw.moe, c, &mix.input, t);
        hc::inject(&mut x, &y, &mix.inject, t, h, d);

        let logits = if logits {
            let last = &x[(t - 1) * hd..];
            let mixed = hc::forward_cpu(&w.final_mixer, last, 1, h, d, eps);
            linear(&self.weights.lm_head, &mixed.input, 1)
        } else {
            Vec::new()
        };
        Ok(MtpOut { streams: x, logits })
    }
}
