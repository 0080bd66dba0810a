//! Recorded routing and what a cache policy would have made of it: the text format
//! `CORTIQ_ROUTING_TRACE` writes (one line per layer and frame, `layer: id id ...`, in the
//! order the frames ran) and a replay of [`LayerCache`] over it at any bank size, without a
//! model or a GPU. A hit rate depends on the routing alone, so a replay gives the same hits a
//! run with that bank would have had (`cortiq bench cache`).

use crate::expert_cache::{CachePolicy, LayerCache};
use crate::prefetch::CoRouting;

/// A line of a routing trace that does not parse.
#[derive(Debug, thiserror::Error)]
#[error("routing trace line {line}: {what}")]
pub struct TraceError {
    /// 1-based.
    pub line: usize,
    /// What was expected.
    pub what: String,
}

/// Every layer's routed experts, frame by frame.
#[derive(Debug, Clone, Default)]
pub struct RoutingTrace {
    /// `layers[l][f]`: the experts layer `l` routed to in its `f`-th frame.
    pub layers: Vec<Vec<Vec<u32>>>,
}

impl RoutingTrace {
    /// Parses the text `CORTIQ_ROUTING_TRACE` writes (`u32::MAX`, an empty slot, is skipped).
    pub fn parse(text: &str) -> Result<RoutingTrace, TraceError> {
        let mut t = RoutingTrace::default();
        for (i, line) in text.lines().enumerate() {
            let err = |what: String| TraceError { line: i + 1, what };
            if line.trim().is_empty() {
                continue;
            }
            let (layer, ids) = line
                .split_once(':')
                .ok_or_else(|| err("expected `layer: id id ...`".into()))?;
            let layer: usize = layer
                .trim()
                .parse()
                .map_err(|_| err(format!("layer `{}` is not a number", layer.trim())))?;
            if layer >= 4096 {
                return Err(err(format!("layer {layer}: expected fewer than 4096")));
            }
            let ids = ids
                .split_whitespace()
                .map(|x| {
                    x.parse::<u32>()
                        .map_err(|_| err(format!("expert id `{x}` is not a u32")))
                })
                .filter(|x| !matches!(x, Ok(u32::MAX)))
                .collect::<Result<Vec<u32>, TraceError>>()?;
            if t.layers.len() <= layer {
                t.layers.resize(layer + 1, Vec::new());
            }
            t.layers[layer].push(ids);
        }
        Ok(t)
    }

    /// One more than the largest expert id routed to.
    pub fn experts(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .flatten()
            .map(|&x| x as usize + 1)
            .max()
            .unwrap_or(0)
    }

    /// The most frames any layer ran.
    pub fn frames(&self) -> usize {
        self.layers.iter().map(Vec::len).max().unwrap_or(0)
    }
}

/// What a policy made of a trace.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Replayed {
    /// Routed (frame, expert) pairs after the warm-up, summed over layers.
    pub routed: u64,
    /// Those whose expert was in the bank.
    pub hits: u64,
    /// Uploads after the warm-up (admissions and prefetches).
    pub admitted: u64,
}

impl Replayed {
    /// The share of routed pairs computed in VRAM.
    pub fn hit_rate(&self) -> f64 {
        self.hits as f64 / self.routed.max(1) as f64
    }
}

/// Replays `trace` through a bank of `capacity` slots per layer that starts with the first
/// ids resident (as a run without saved scores does), admitting at most `max` experts per
/// layer and frame under `policy`, and (learned policy, `prefetch > 0`) prefetching that many
/// of the next layer's likeliest experts when a layer's routing is known, as a run does;
/// frames before `warm` are not counted.
pub fn replay(
    trace: &RoutingTrace,
    experts: usize,
    capacity: usize,
    policy: CachePolicy,
    max: usize,
    prefetch: usize,
    warm: usize,
) -> Replayed {
    let mut out = Replayed::default();
    let layers = trace.layers.len();
    let resident = LayerCache::initial(experts, capacity, None);
    let mut caches: Vec<LayerCache> = (0..layers)
        .map(|_| LayerCache::new(experts, &resident, None))
        .collect();
    let mut co = CoRouting::new(layers, experts);
    let prefetch = if policy == CachePolicy::Learned {
        prefetch
    } else {
        0
    };
    // Frame by frame, layer by layer: the order a run sees them in.
    for f in 0..trace.frames() {
        let mut last: Option<(usize, &[u32])> = None;
        for (l, frames) in trace.layers.iter().enumerate() {
            let Some(routed) = frames.get(f) else {
                continue;
            };
            let c = &mut caches[l];
            let cold: Vec<u32> = routed
                .iter()
                .map(|&x| match c.slots().get(x as usize) {
                    Some(Some(_)) => u32::MAX,
                    _ => x,
                })
                .collect();
            let admitted = c.frame(routed, &cold, policy, max);
            let mut uploads = admitted.len();
            if let Some((pl, pr)) = last.filter(|&(pl, _)| pl + 1 == l) {
                co.observe(pl, pr, routed);
            }
            if prefetch > 0 && l + 1 < layers {
                let likely = co.likely(l, routed);
                uploads += caches[l + 1].prefetch(&likely, prefetch).len();
            }
            if f >= warm {
                out.routed += routed.len() as u64;
                out.hits += cold.iter().filter(|&&x| x == u32::MAX).count() as u64;
                out.admitted += uploads as u64;
            }
            last = Some((l, routed));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_parses_and_a_bad_line_is_named() {
        let t = RoutingTrace::parse("0: 3 1\n1: 2 4294967295\n0: 3 5\n").unwrap();
        assert_eq!(t.layers, vec![vec![vec![3, 1], vec![3, 5]], vec![vec![2]]]);
        assert_eq!((t.experts(), t.frames()), (6, 2));
        let e = RoutingTrace::parse("0: 1\n0 2 3\n").unwrap_err();
        assert_eq!(e.line, 2);
        let e = RoutingTrace::parse("0: 1 x\n").unwrap_err();
        assert!(e.to_string().contains("`x`"), "{e}");
    }

    /// Counted by hand: a bank of one slot holding expert 0, routing 1, 1, 0, 1.
    #[test]
    fn replay_counts_hits_and_admissions() {
        let t = RoutingTrace::parse("0: 1\n0: 1\n0: 0\n0: 1\n").unwrap();
        // LRU admits 1 at once (hit at frame 2), then 0 (its own miss), then 1 again.
        let lru = replay(&t, 2, 1, CachePolicy::Lru, 1, 0, 0);
        assert_eq!((lru.routed, lru.hits, lru.admitted), (4, 1, 3));
        // Static never moves: expert 0's one frame is its only hit.
        let st = replay(&t, 2, 1, CachePolicy::Static, 1, 0, 0);
        assert_eq!((st.hits, st.admitted), (1, 0));
        // With the warm-up the first two frames are not counted.
        let w = replay(&t, 2, 1, CachePolicy::Lru, 1, 0, 2);
        assert_eq!((w.routed, w.hits), (2, 0));
    }
}
