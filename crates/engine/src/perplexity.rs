//! `cortiq perplexity`: the perplexity of a model on a text, by sliding windows, and (against a
//! base model on the same windows) the mean KL divergence and top-1 agreement that say what a
//! quantisation profile costs.
//!
//! Windowing (the same as transformers' strided perplexity recipe): windows start at 0, S, 2S, ...
//! and span up to C tokens; each window scores the targets no earlier window scored (the first
//! window all but its first token), predicting token `t` from the window's logits at `t - 1`. So
//! with S < C every scored token after the first window sees at least C - S tokens of context
//! and every token but the first is scored; with S == C the token each window starts with is
//! not scored (it has no context in its window).
//! The uncertainty is llama.cpp's: `PPL * sqrt(var(nll) / (N - 1))`.

use serde::Serialize;

use crate::model::{AnyModel, ForwardError};

/// How to cut the text into windows.
#[derive(Debug, Clone, Copy)]
pub struct PerplexityOptions {
    /// Tokens per window (C).
    pub ctx: usize,
    /// Tokens between window starts (S), `1..=ctx`.
    pub stride: usize,
}

/// One window: tokens `begin..end` are fed, targets `first..end` are scored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// First token fed.
    pub begin: usize,
    /// One past the last token fed.
    pub end: usize,
    /// First target scored.
    pub first: usize,
}

/// Why no perplexity came out.
#[derive(Debug, thiserror::Error)]
pub enum PerplexityError {
    /// Bad `--ctx` / `--stride`.
    #[error("--ctx {ctx} --stride {stride}: need ctx >= 2 and 1 <= stride <= ctx")]
    Windows {
        /// C.
        ctx: usize,
        /// S.
        stride: usize,
    },
    /// Fewer than two tokens: nothing to predict.
    #[error("the text has {0} token(s); perplexity needs at least 2")]
    TooShort(usize),
    /// The base model's vocabulary differs.
    #[error("--kl-base has vocabulary {base}, the model {model}: KL needs the same tokens")]
    VocabMismatch {
        /// The model's vocabulary size.
        model: usize,
        /// The base's.
        base: usize,
    },
    /// A forward pass failed.
    #[error(transparent)]
    Forward(#[from] ForwardError),
}

/// The windows covering `n` tokens.
pub fn windows(n: usize, ctx: usize, stride: usize) -> Vec<Window> {
    let mut out = Vec::new();
    let mut prev_end = 0;
    let mut begin = 0;
    while begin < n {
        let end = (begin + ctx).min(n);
        out.push(Window {
            begin,
            end,
            first: prev_end.max(begin + 1),
        });
        prev_end = end;
        if end == n {
            break;
        }
        begin += stride;
    }
    out
}

/// A mean with its standard error.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Estimate {
    /// The value.
    pub value: f64,
    /// Its standard error.
    pub error: f64,
}

/// What the base comparison found.
#[derive(Debug, Clone, Serialize)]
pub struct KlReport {
    /// The base model's perplexity on the same windows.
    pub base_ppl: Estimate,
    /// Mean KL(base || model) in nats per token.
    pub mean_kl: Estimate,
    /// Largest KL of one token.
    pub max_kl: f64,
    /// Fraction of tokens whose argmax is the base's argmax.
    pub top1_agreement: Estimate,
}

/// The result.
#[derive(Debug, Clone, Serialize)]
pub struct PerplexityReport {
    /// Tokens in the text (after any limit).
    pub tokens: usize,
    /// Targets scored.
    pub scored: usize,
    /// Window size.
    pub ctx: usize,
    /// Stride.
    pub stride: usize,
    /// Mean negative log-likelihood, nats.
    pub mean_nll: f64,
    /// `exp(mean_nll)` and llama.cpp's uncertainty.
    pub ppl: Estimate,
    /// Per-token negative log-likelihoods, in target order.
    #[serde(skip)]
    pub nll: Vec<f64>,
    /// Against `--kl-base`.
    pub kl: Option<KlReport>,
}

/// Progress after each window.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Windows done.
    pub done: usize,
    /// Windows in all.
    pub total: usize,
    /// Perplexity so far.
    pub ppl: f64,
}

/// Log-softmax of one row, in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
    let lse = max
        + row
            .iter()
            .map(|&v| (v as f64 - max).exp())
            .sum::<f64>()
            .ln();
    row.iter().map(|&v| v as f64 - lse).collect()
}

fn argmax(row: &[f64]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

fn mean_err(sum: f64, sum2: f64, n: usize) -> Estimate {
    let mean = sum / n as f64;
    let var = (sum2 / n as f64 - mean * mean).max(0.0);
    let error = if n > 1 {
        (var / (n - 1) as f64).sqrt()
    } else {
        0.0
    };
    Estimate { value: mean, error }
}

fn ppl_of(sum: f64, sum2: f64, n: usize) -> Estimate {
    let m = mean_err(sum, sum2, n);
    let ppl = m.value.exp();
    Estimate {
        value: ppl,
        error: ppl * m.error,
    }
}

/// Scores `ids` under `model` (and `base`, when given) window by window.
pub fn perplexity(
    model: &AnyModel<'_>,
    base: Option<&AnyModel<'_>>,
    ids: &[u32],
    opts: PerplexityOptions,
    on_progress: &mut dyn FnMut(Progress),
) -> Result<PerplexityReport, PerplexityError> {
    let PerplexityOptions { ctx, stride } = opts;
    if ctx < 2 || stride == 0 || stride > ctx {
        return Err(PerplexityError::Windows { ctx, stride });
    }
    if ids.len() < 2 {
        return Err(PerplexityError::TooShort(ids.len()));
    }
    let vocab = model.vocab_size();
    if let Some(b) = base
        && b.vocab_size() != vocab
    {
        return Err(PerplexityError::VocabMismatch {
            model: vocab,
            base: b.vocab_size(),
        });
    }
    let wins = windows(ids.len(), ctx, stride);
    let mut nll = Vec::with_capacity(ids.len() - 1);
    let (mut s, mut s2) = (0.0f64, 0.0f64);
    let (mut bs, mut bs2, mut ks, mut ks2, mut kmax, mut same) = (0.0, 0.0, 0.0, 0.0, 0.0f64, 0);
    for (wi, w) in wins.iter().enumerate() {
        let tokens = &ids[w.begin..w.end];
        let logits = model.forward_prefill(tokens)?;
        let base_logits = base.map(|b| b.forward_prefill(tokens)).transpose()?;
        for (i, &id) in ids[w.first..w.end].iter().enumerate() {
            // Target `w.first + i` is predicted by the logits of the token before it.
            let row = (w.first + i - 1 - w.begin) * vocab;
            let lp = log_softmax(&logits[row..row + vocab]);
            let target = id as usize;
            let v = -lp[target];
            nll.push(v);
            s += v;
            s2 += v * v;
            if let Some(bl) = &base_logits {
                let lb = log_softmax(&bl[row..row + vocab]);
                let bv = -lb[target];
                bs += bv;
                bs2 += bv * bv;
                let kl: f64 = lb
                    .iter()
                    .zip(&lp)
                    .map(|(&b, &m)| b.exp() * (b - m))
                    .sum::<f64>()
                    .max(0.0);
                ks += kl;
                ks2 += kl * kl;
                kmax = kmax.max(kl);
                same += usize::from(argmax(&lb) == argmax(&lp));
            }
        }
        on_progress(Progress {
            done: wi + 1,
            total: wins.len(),
            ppl: (s / nll.len() as f64).exp(),
        });
    }
    let n = nll.len();
    let kl = base.map(|_| {
        let p = same as f64 / n as f64;
        KlReport {
            base_ppl: ppl_of(bs, bs2, n),
            mean_kl: mean_err(ks, ks2, n),
            max_kl: kmax,
            top1_agreement: Estimate {
                value: p,
                error: (p * (1.0 - p) / n as f64).sqrt(),
            },
        }
    });
    Ok(PerplexityReport {
        tokens: ids.len(),
        scored: n,
        ctx,
        stride,
        mean_nll: s / n as f64,
        ppl: ppl_of(s, s2, n),
        nll,
        kl,
    })
}

impl PerplexityReport {
    /// The final lines, llama.cpp style.
    pub fn write_text(&self, w: &mut dyn std::io::Write) -> std::io::Result<()> {
        writeln!(
            w,
            "scored {} of {} tokens (ctx {}, stride {})",
            self.scored, self.tokens, self.ctx, self.stride
        )?;
        writeln!(w, "PPL = {:.4} +/- {:.5}", self.ppl.value, self.ppl.error)?;
        if let Some(k) = &self.kl {
            writeln!(
                w,
                "base PPL = {:.4} +/- {:.5}",
                k.base_ppl.value, k.base_ppl.error
            )?;
            writeln!(
                w,
                "mean KL = {:.6} +/- {:.6} (max {:.4})",
                k.mean_kl.value, k.mean_kl.error, k.max_kl
            )?;
            writeln!(
                w,
                "top-1 agreement = {:.3}% +/- {:.3}%",
                100.0 * k.top1_agreement.value,
                100.0 * k.top1_agreement.error
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_score_every_target_once() {
        for n in [2usize, 3, 10, 255, 256, 257, 1000] {
            for (ctx, stride) in [(2, 1), (2, 2), (8, 3), (256, 128), (256, 256), (5, 5)] {
                let ws = windows(n, ctx, stride);
                let mut scored = Vec::new();
                for w in &ws {
                    assert!(w.end - w.begin <= ctx && w.first > w.begin && w.first <= w.end);
                    scored.extend(w.first..w.end);
                }
                // With overlap every target is scored once; with stride == ctx the token a
                // window starts with has no context in it and is skipped (as in transformers'
                // recipe).
                let want: Vec<usize> = if stride < ctx {
                    (1..n).collect()
                } else {
                    (1..n).filter(|t| t % stride != 0).collect()
                };
                assert_eq!(scored, want, "n {n} ctx {ctx} stride {stride}");
            }
        }
    }

    #[test]
    fn log_softmax_and_uncertainty_against_closed_forms() {
        let lp = log_softmax(&[0.0, 0.0, 0.0, 0.0]);
        for v in lp {
            assert!((v + 4f64.ln()).abs() < 1e-15);
        }
        // nll values 1 and 3: mean 2, population variance 1, error sqrt(1 / 1) = 1.
        let e = ppl_of(4.0, 10.0, 2);
        assert!((e.value - 2f64.exp()).abs() < 1e-12);
        assert!((e.error - 2f64.exp()).abs() < 1e-12);
    }
}
