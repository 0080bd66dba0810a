//! Choosing the next token from logits: greedy at temperature 0, else temperature, top-k and
//! top-p (nucleus) over a softmax in f64, drawn with a seeded generator so a run repeats.

/// Sampling settings (the `cortiq run` flags).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0 = greedy (argmax, lowest id on ties).
    pub temperature: f32,
    /// Keep the k most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1 = all).
    pub top_p: f32,
    /// Seed of the generator.
    pub seed: u64,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// A sampler: the settings and the generator's state.
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: Sampling,
    state: u64,
}

impl Sampler {
    /// A sampler seeded from `cfg.seed`.
    pub fn new(cfg: Sampling) -> Sampler {
        Sampler {
            cfg,
            state: cfg.seed ^ 0x9e37_79b9_7f4a_7c15,
        }
    }

    /// splitmix64, as a uniform number in [0, 1).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The next token for `logits` (one row of the vocabulary).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature <= 0.0 {
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
    fn top_k_1_is_greedy_and_top_p_keeps_the_nucleus() {
        let logits = [1.0, 5.0, 4.9, -3.0];
        let mut s = Sampler::new(Sampling {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
            seed: 7,
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
}
