//! Choosing the next token from logits: a repetition penalty over the recent tokens, then greedy
//! at temperature 0, else temperature, top-k, top-p (nucleus) and min-p over a softmax in f64,
//! drawn with a seeded generator so a run repeats. [`GenerationDefaults`] reads a model's own
//! settings (its `generation_config.json`), which the command line overrides.

use std::collections::VecDeque;

/// Sampling settings (the `cortiq run` flags).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0 = greedy (argmax, lowest id on ties).
    pub temperature: f32,
    /// Keep the k most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1 = all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one (0 = off).
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of recently seen tokens by this
    /// (1 = off; the CTRL / transformers `repetition_penalty` rule).
    pub repeat_penalty: f32,
    /// How many of the most recent tokens (prompt included) the penalties look at.
    pub repeat_last_n: usize,
    /// Subtracted from the logit of every recent token (OpenAI's `presence_penalty`; 0 = off).
    pub presence_penalty: f32,
    /// Subtracted from a recent token's logit once per occurrence (OpenAI's
    /// `frequency_penalty`; 0 = off).
    pub frequency_penalty: f32,
    /// Seed of the generator.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

/// A model's own sampling settings (the CMF header's generation defaults, from the checkpoint's
/// `generation_config.json`); absent fields are `None`.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct GenerationDefaults {
    /// `do_sample`: `false` means greedy.
    pub do_sample: Option<bool>,
    /// `temperature`.
    pub temperature: Option<f32>,
    /// `top_k`.
    pub top_k: Option<usize>,
    /// `top_p`.
    pub top_p: Option<f32>,
    /// `min_p`.
    pub min_p: Option<f32>,
    /// `repetition_penalty`.
    pub repetition_penalty: Option<f32>,
}

impl GenerationDefaults {
    /// Reads the fields from a `generation_config.json` value (`None` or malformed fields are
    /// absent).
    pub fn from_json(v: Option<&serde_json::Value>) -> GenerationDefaults {
        let Some(v) = v else {
            return GenerationDefaults::default();
        };
        let f = |k: &str| {
            v.get(k)
                .and_then(serde_json::Value::as_f64)
                .map(|x| x as f32)
        };
        GenerationDefaults {
            do_sample: v.get("do_sample").and_then(serde_json::Value::as_bool),
            temperature: f("temperature"),
            top_k: v
                .get("top_k")
                .and_then(serde_json::Value::as_u64)
                .map(|x| x as usize),
            top_p: f("top_p"),
            min_p: f("min_p"),
            repetition_penalty: f("repetition_penalty"),
        }
    }

    /// The same settings with every value outside its range dropped (with a warning): a
    /// config's `repetition_penalty: 0` or `top_p: 2` must not reach the sampler, where the
    /// command line would have refused them.
    pub fn checked(mut self) -> GenerationDefaults {
        fn keep(name: &str, v: &mut Option<f32>, ok: impl Fn(f32) -> bool) {
            if let Some(x) = *v
                && !(x.is_finite() && ok(x))
            {
                tracing::warn!(
                    "ignoring the model's generation default {name} = {x}: out of range"
                );
                *v = None;
            }
        }
        keep("temperature", &mut self.temperature, |x| x >= 0.0);
        keep("top_p", &mut self.top_p, |x| x > 0.0 && x <= 1.0);
        keep("min_p", &mut self.min_p, |x| (0.0..=1.0).contains(&x));
        keep("repetition_penalty", &mut self.repetition_penalty, |x| {
            x > 0.0
        });
        self
    }

    /// Whether any field is set.
    pub fn is_empty(&self) -> bool {
        *self == GenerationDefaults::default()
    }
}

/// A sampler: the settings and the generator's state.
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: Sampling,
    state: u64,
    recent: VecDeque<u32>,
}

impl Sampler {
    /// A sampler seeded from `cfg.seed`.
    pub fn new(cfg: Sampling) -> Sampler {
        Sampler {
            cfg,
            state: cfg.seed ^ 0x9e37_79b9_7f4a_7c15,
            recent: VecDeque::new(),
        }
    }

    /// The settings.
    pub fn settings(&self) -> &Sampling {
        &self.cfg
    }

    /// Records a token of the sequence (prompt or generated) for the repetition penalty.
    pub fn accept(&mut self, id: u32) {
        if !self.penalises() || self.cfg.repeat_last_n == 0 {
            return;
        }
        if self.recent.len() == self.cfg.repeat_last_n {
            self.recent.pop_front();
        }
        self.recent.push_back(id);
    }

    /// Forgets the recorded tokens (a new sequence).
    pub fn reset_history(&mut self) {
        self.recent.clear();
    }

    fn penalises(&self) -> bool {
        self.cfg.repeat_penalty != 1.0
            || self.cfg.presence_penalty != 0.0
            || self.cfg.frequency_penalty != 0.0
    }

    /// `logits` with the penalties applied to every recent token: the repetition penalty and
    /// the presence penalty once per token, the frequency penalty once per occurrence.
    fn penalised<'l>(&self, logits: &'l [f32]) -> std::borrow::Cow<'l, [f32]> {
        let (p, presence, frequency) = (
            self.cfg.repeat_penalty,
            self.cfg.presence_penalty,
            self.cfg.frequency_penalty,
        );
        if !self.penalises() || self.recent.is_empty() {
            return std::borrow::Cow::Borrowed(logits);
        }
        let mut out = logits.to_vec();
        let mut seen: Vec<u32> = self.recent.iter().copied().collect();
        seen.sort_unstable();
        for run in seen.chunk_by(|a, b| a == b) {
            if let Some(l) = out.get_mut(run[0] as usize) {
                *l = if *l > 0.0 { *l / p } else { *l * p };
                *l -= presence + frequency * run.len() as f32;
            }
        }
        std::borrow::Cow::Owned(out)
    }

    /// splitmix64, as a uniform number in [0, 1).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        (mix64(self.state) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The next token for `logits` (one row of the vocabulary).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let logits = self.penalised(logits);
        let logits = &logits[..];
        // A NaN or +inf logit (a damaged row) would make every probability NaN: such a row is
        // decided by argmax, whose rules for them are defined (NaN never wins, +inf does).
        let degenerate = logits.iter().any(|v| v.is_nan() || *v == f32::INFINITY)
            || logits.iter().all(|v| *v == f32::NEG_INFINITY);
        if self.cfg.temperature <= 0.0 || degenerate {
            return argmax(logits);
        }
        let mut order: Vec<u32> = (0..logits.len() as u32).collect();
        order.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        if self.cfg.top_k > 0 {
            order.truncate(self.cfg.top_k);
        }
        let t = self.cfg.temperature as f64;
        let top = logits[order[0] as usize] as f64;
        let mut probs: Vec<f64> = order
            .iter()
            .map(|&i| ((logits[i as usize] as f64 - top) / t).exp())
            .collect();
        let sum: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        // Nucleus: the smallest prefix (in probability order) whose mass reaches top_p.
        let mut keep = probs.len();
        let mut mass = 0.0;
        for (i, p) in probs.iter().enumerate() {
            mass += p;
            if mass >= self.cfg.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        // Min-p: drop what is less likely than `min_p` times the top token (probs are sorted).
        if self.cfg.min_p > 0.0 {
            let floor = probs[0] * self.cfg.min_p as f64;
            keep = probs[..keep]
                .iter()
                .take_while(|&&p| p >= floor)
                .count()
                .max(1);
        }
        let total: f64 = probs[..keep].iter().sum();
        let mut u = self.uniform() * total;
        for (i, p) in probs[..keep].iter().enumerate() {
            if u < *p {
                return order[i];
            }
            u -= p;
        }
        order[keep - 1]
    }
}

/// splitmix64's output function: a well-spread 64-bit value from any input.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A seed for a run that was given none, from the clock and the process id (it only has to
/// differ between runs), below 10^9 so it is easy to type back as `--seed`.
pub fn fresh_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    mix64(nanos ^ ((std::process::id() as u64) << 32)) % 1_000_000_000
}

/// The index of the largest logit, the lowest on ties (NaN never wins).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax_with_the_lowest_id_on_ties() {
        let mut s = Sampler::new(Sampling::default());
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0, 0.5]), 1);
    }

    #[test]
    fn presence_and_frequency_penalties_follow_openai() {
        // logit - presence * [count > 0] - frequency * count, over the recent window.
        let mut s = Sampler::new(Sampling {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..Sampling::default()
        });
        for id in [1, 1, 1, 2] {
            s.accept(id);
        }
        let out = s.penalised(&[3.0, 3.0, 3.0, 1.0]);
        assert_eq!(&out[..], &[3.0, 3.0 - 0.5 - 0.75, 3.0 - 0.5 - 0.25, 1.0]);
        // Greedy picks what the penalties leave on top.
        assert_eq!(s.sample(&[3.0, 3.1, 3.0, 1.0]), 0);
    }

    #[test]
    fn top_k_1_is_greedy_and_top_p_keeps_the_nucleus() {
        let logits = [1.0, 5.0, 4.9, -3.0];
        let mut s = Sampler::new(Sampling {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
            seed: 7,
            ..Sampling::default()
        });
        for _ in 0..20 {
            assert_eq!(s.sample(&logits), 1);
        }
        // p(1) ~ 0.51, p(2) ~ 0.46: top_p 0.9 keeps exactly tokens 1 and 2.
        let mut s = Sampler::new(Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.9,
            seed: 3,
            ..Sampling::default()
        });
        let mut seen = [0usize; 4];
        for _ in 0..2000 {
            seen[s.sample(&logits) as usize] += 1;
        }
        assert_eq!(seen[0] + seen[3], 0, "{seen:?}");
        assert!(seen[1] > 800 && seen[2] > 700, "{seen:?}");
    }

    #[test]
    fn the_same_seed_repeats_and_the_frequencies_follow_the_softmax() {
        let logits = [0.0f32, (2.0f32).ln(), (3.0f32).ln()]; // probabilities 1/6, 2/6, 3/6
        let cfg = Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 42,
            ..Sampling::default()
        };
        let draw = |n| {
            let mut s = Sampler::new(cfg);
            (0..n).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(100), draw(100));
        let d = draw(60_000);
        for (tok, want) in [(0u32, 1.0 / 6.0), (1, 2.0 / 6.0), (2, 3.0 / 6.0)] {
            let f = d.iter().filter(|&&x| x == tok).count() as f64 / d.len() as f64;
            assert!((f - want).abs() < 0.01, "token {tok}: {f} vs {want}");
        }
    }

    #[test]
    fn min_p_drops_tokens_below_its_share_of_the_top_one() {
        // Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.2 keeps those >= 0.1 (tokens 0, 1, 2).
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.15f32.ln(), 0.05f32.ln()];
        let mut s = Sampler::new(Sampling {
            temperature: 1.0,
            min_p: 0.2,
            seed: 11,
            ..Sampling::default()
        });
        let mut seen = [0usize; 4];
        for _ in 0..3000 {
            seen[s.sample(&logits) as usize] += 1;
        }
        assert_eq!(seen[3], 0, "{seen:?}");
        // The kept mass renormalised: 0.5/0.95 of the draws are token 0.
        let f0 = seen[0] as f64 / 3000.0;
        assert!((f0 - 0.5 / 0.95).abs() < 0.03, "{seen:?}");
    }

    #[test]
    fn the_repeat_penalty_follows_the_ctrl_rule() {
        // Token 1 was seen: its positive logit 2.0 becomes 2.0 / 2.5 = 0.8 < token 2's 1.0;
        // token 0's negative logit -1 becomes -2.5.
        let mut s = Sampler::new(Sampling {
            repeat_penalty: 2.5,
            ..Sampling::default()
        });
        let logits = [-1.0f32, 2.0, 1.0];
        assert_eq!(s.sample(&logits), 1);
        s.accept(1);
        s.accept(1);
        assert_eq!(s.sample(&logits), 2);
        assert_eq!(&s.penalised(&logits)[..], &[-1.0, 0.8, 1.0]);
        s.accept(0);
        assert_eq!(&s.penalised(&logits)[..], &[-2.5, 0.8, 1.0]);
        // Only the last `repeat_last_n` tokens count.
        let mut s = Sampler::new(Sampling {
            repeat_penalty: 2.5,
            repeat_last_n: 1,
            ..Sampling::default()
        });
        s.accept(1);
        s.accept(0);
        assert_eq!(s.sample(&logits), 1);
    }

    #[test]
    fn generation_defaults_read_the_models_config() {
        let v =
            serde_json::json!({"do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95});
        let d = GenerationDefaults::from_json(Some(&v));
        assert_eq!(d.temperature, Some(0.6));
        assert_eq!(d.top_k, Some(20));
        assert_eq!(d.min_p, None);
        assert!(GenerationDefaults::from_json(None).is_empty());
        let bad =
            serde_json::json!({"temperature": -1, "top_p": 2, "repetition_penalty": 0, "top_k": 5});
        let d = GenerationDefaults::from_json(Some(&bad)).checked();
        assert_eq!(
            (d.temperature, d.top_p, d.repetition_penalty, d.top_k),
            (None, None, None, Some(5))
        );
    }

    #[test]
    fn non_finite_logits_never_poison_sampling() {
        let mut s = Sampler::new(Sampling {
            temperature: 1.0,
            seed: 5,
            ..Sampling::default()
        });
        for _ in 0..50 {
            assert_eq!(s.sample(&[0.0, f32::NAN, 2.0, -1.0]), 2);
            assert_eq!(s.sample(&[0.0, f32::INFINITY, 2.0]), 1);
        }
        // -inf alone is a masked token, not a degenerate row.
        for _ in 0..50 {
            assert_ne!(s.sample(&[f32::NEG_INFINITY, 0.0, 0.1]), 0);
        }
    }
}
