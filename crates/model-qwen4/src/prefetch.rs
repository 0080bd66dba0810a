//! Which experts the next layer is likely to route to, learned from the routing itself: for
//! each pair of consecutive layers with experts on the CPU, how often each expert of the
//! second was routed in a frame that routed each expert of the first. When a layer's routing
//! comes back, the next layer's likeliest experts that are not in its bank can be uploaded
//! before it routes (a prefetch), so that it computes them in VRAM.
//!
//! Consecutive layers see nearly the same hidden state (the residual stream), so a token that
//! routes like an earlier one in one layer tends to in the next: replayed on the H200's
//! recorded routing, the likeliest non-resident expert of the next layer was routed 41% of the
//! time (a guess among the non-resident ones: under 1%), docs/perf.md.

/// Co-routing counts of consecutive layers.
#[derive(Debug, Clone)]
pub struct CoRouting {
    experts: usize,
    /// `counts[l][a * experts + b]`: frames that routed expert `a` in layer `l` and `b` in the
    /// layer after it (allocated on first use).
    counts: Vec<Vec<u32>>,
}

impl CoRouting {
    /// Counts for `layers` layers of `experts` experts.
    pub fn new(layers: usize, experts: usize) -> CoRouting {
        CoRouting {
            experts,
            counts: vec![Vec::new(); layers],
        }
    }

    /// Records a frame that routed `from` in layer `layer` and `to` in the next one (ids at or
    /// past the expert count, empty slots, are skipped).
    pub fn observe(&mut self, layer: usize, from: &[u32], to: &[u32]) {
        let e = self.experts;
        let Some(c) = self.counts.get_mut(layer) else {
            return;
        };
        if c.is_empty() {
            c.resize(e * e, 0);
        }
        for &a in from.iter().filter(|&&a| (a as usize) < e) {
            let row = &mut c[a as usize * e..][..e];
            for &b in to.iter().filter(|&&b| (b as usize) < e) {
                row[b as usize] = row[b as usize].saturating_add(1);
            }
        }
    }

    /// How likely each expert of the layer after `layer` is, given that `layer` routed
    /// `from` this frame: the counts summed over `from` (all zero before anything was seen).
    pub fn likely(&self, layer: usize, from: &[u32]) -> Vec<u32> {
        let e = self.experts;
        let mut out = vec![0u32; e];
        let Some(c) = self.counts.get(layer).filter(|c| !c.is_empty()) else {
            return out;
        };
        for &a in from.iter().filter(|&&a| (a as usize) < e) {
            for (o, &n) in out.iter_mut().zip(&c[a as usize * e..][..e]) {
                *o = o.saturating_add(n);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counted by hand: two frames, one shared expert in the first layer.
    #[test]
    fn likely_sums_what_followed_each_routed_expert() {
        let mut c = CoRouting::new(3, 6);
        assert_eq!(c.likely(0, &[1]), vec![0; 6]);
        c.observe(0, &[1, 2], &[4, u32::MAX]);
        c.observe(0, &[1, 3], &[5, 4]);
        assert_eq!(c.likely(0, &[1]), vec![0, 0, 0, 0, 2, 1]);
        assert_eq!(c.likely(0, &[2, 3]), vec![0, 0, 0, 0, 2, 1]);
        assert_eq!(c.likely(0, &[0]), vec![0; 6]);
        assert_eq!(c.likely(1, &[1]), vec![0; 6], "another layer pair");
        c.observe(7, &[1], &[2]);
        assert_eq!(
            c.likely(7, &[1]),
            vec![0; 6],
            "a layer past the end is ignored"
        );
    }
}
