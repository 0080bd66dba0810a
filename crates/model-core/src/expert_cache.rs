//! Which routed experts a layer keeps in its VRAM bank when they do not all fit (the rest are
//! computed on the CPU): the bank's slots, the expert -> slot map the host keeps beside the
//! device's, and the policy that decides, from the routing the device reads back each frame,
//! which cold expert to admit and which resident one it replaces.
//!
//! `Learned` values an expert by two decayed counts of the frames that routed to it: a slow
//! one ([`DECAY`] per frame: popularity, what an expert is worth over hundreds of tokens) and
//! a fast one ([`RECENT_DECAY`], weighted by [`RECENT_WEIGHT`]: the last few tokens, since
//! consecutive tokens route to overlapping experts). It admits a cold expert only when its
//! value beats the lowest resident value by [`MARGIN`]: a burst of one-off experts (a scan)
//! cannot flush the experts every frame uses, and a shift in what the text routes to is
//! followed within a few frames. Replayed on recorded routing (`CORTIQ_ROUTING_TRACE`,
//! docs/perf.md) the two counts together beat LRU at every bank size tried, where either alone
//! lost to it at some. `Lru` admits every cold expert over the least recently used one (the
//! usual cache, the baseline the learned one must beat); `Static` never changes what was
//! placed at load (llama.cpp's `--n-cpu-moe` keeps whole layers on the CPU this way).

/// How a layer's resident experts change while running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CachePolicy {
    /// Decayed routing frequency, admission only over a lower-scored resident.
    #[default]
    Learned,
    /// Every cold expert admitted over the least recently used resident.
    Lru,
    /// What was placed at load stays.
    Static,
}

impl std::str::FromStr for CachePolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<CachePolicy, String> {
        match s {
            "learned" => Ok(CachePolicy::Learned),
            "lru" => Ok(CachePolicy::Lru),
            "static" => Ok(CachePolicy::Static),
            _ => Err(format!(
                "expert cache policy `{s}`: expected learned, lru or static"
            )),
        }
    }
}

/// Per-frame decay of the slow count: a frame's routing counts half after about 139 frames.
/// (0.99 forgot too fast; 0.999 gave up a point at small banks for one at mid-size ones:
/// docs/perf.md.)
pub const DECAY: f32 = 0.995;

/// Per-frame decay of the fast count: a frame's routing counts half in the next frame.
pub const RECENT_DECAY: f32 = 0.5;

/// The fast count's weight in an expert's value: an expert routed in each of the last few
/// frames (fast count ~2) is worth twenty frames of the slow count's memory.
pub const RECENT_WEIGHT: f32 = 10.0;

/// How much higher a cold expert's value must be than the resident it would replace (each
/// trade is an upload).
pub const MARGIN: f32 = 1.0;

/// The learned policy's constants (measurement knobs: `CORTIQ_CACHE_DECAY`,
/// `CORTIQ_CACHE_RECENT_DECAY`, `CORTIQ_CACHE_RECENT_WEIGHT`, `CORTIQ_CACHE_MARGIN`).
#[derive(Debug, Clone, Copy)]
struct Tuning {
    decay: f32,
    recent_decay: f32,
    recent_weight: f32,
    margin: f32,
}

fn tuning() -> Tuning {
    static T: std::sync::OnceLock<Tuning> = std::sync::OnceLock::new();
    *T.get_or_init(|| {
        let get = |k: &str, d: f32| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(d)
        };
        Tuning {
            decay: get("CORTIQ_CACHE_DECAY", DECAY),
            recent_decay: get("CORTIQ_CACHE_RECENT_DECAY", RECENT_DECAY),
            recent_weight: get("CORTIQ_CACHE_RECENT_WEIGHT", RECENT_WEIGHT),
            margin: get("CORTIQ_CACHE_MARGIN", MARGIN),
        }
    })
}

/// What a retired slot holds: nothing (an upload into it failed; it is never used again).
const RETIRED: u32 = u32::MAX;

/// One layer's bank: which expert each slot holds, and what the policy knows.
#[derive(Debug, Clone)]
pub struct LayerCache {
    /// Expert -> bank slot.
    slot_of: Vec<Option<u32>>,
    /// Bank slot -> expert ([`RETIRED`] for a slot taken out of use).
    expert_in: Vec<u32>,
    /// Slowly decayed routing count per expert.
    score: Vec<f32>,
    /// Quickly decayed routing count per expert.
    recent: Vec<f32>,
    /// The last frame that routed to each expert.
    seen: Vec<u64>,
    frame: u64,
}

/// One admission: `expert` goes into bank `slot`, which held `evicted`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// The expert uploaded.
    pub expert: u32,
    /// Its bank slot.
    pub slot: u32,
    /// The expert the slot held.
    pub evicted: u32,
}

impl LayerCache {
    /// A bank holding `resident` (slot `i` holds `resident[i]`) out of `experts`, with
    /// `scores` from an earlier run (or none).
    pub fn new(experts: usize, resident: &[u32], scores: Option<&[f32]>) -> LayerCache {
        let mut slot_of = vec![None; experts];
        for (slot, &x) in resident.iter().enumerate() {
            slot_of[x as usize] = Some(slot as u32);
        }
        let score = match scores {
            Some(s) if s.len() == experts => s.to_vec(),
            _ => vec![0.0; experts],
        };
        LayerCache {
            slot_of,
            expert_in: resident.to_vec(),
            score,
            recent: vec![0.0; experts],
            seen: vec![0; experts],
            frame: 0,
        }
    }

    /// The `capacity` experts with the highest `scores` (ties: the lower id), or the first
    /// `capacity` ids without scores.
    pub fn initial(experts: usize, capacity: usize, scores: Option<&[f32]>) -> Vec<u32> {
        let mut ids: Vec<u32> = (0..experts as u32).collect();
        if let Some(s) = scores.filter(|s| s.len() == experts) {
            ids.sort_by(|&a, &b| s[b as usize].total_cmp(&s[a as usize]).then(a.cmp(&b)));
        }
        ids.truncate(capacity.min(experts));
        ids
    }

    /// Expert -> bank slot.
    pub fn slots(&self) -> &[Option<u32>] {
        &self.slot_of
    }

    /// Resident experts.
    pub fn resident(&self) -> usize {
        self.expert_in.iter().filter(|&&x| x != RETIRED).count()
    }

    /// Takes back an admission whose upload could not start (no staging room): the slot
    /// holds the expert it held, which the device never stopped computing there.
    pub fn undo(&mut self, a: &Admission) {
        self.slot_of[a.expert as usize] = None;
        self.slot_of[a.evicted as usize] = Some(a.slot);
        self.expert_in[a.slot as usize] = a.evicted;
    }

    /// Takes an admission's slot out of use after its upload failed: neither its expert nor
    /// the one it evicted is resident (the caller marks both cold on the device).
    pub fn retire(&mut self, a: &Admission) {
        self.slot_of[a.expert as usize] = None;
        self.slot_of[a.evicted as usize] = None;
        self.expert_in[a.slot as usize] = RETIRED;
    }

    /// Each expert's slow count now (what a later run starts from: the fast one says
    /// nothing about the next run's first tokens).
    pub fn scores(&self) -> Vec<f32> {
        self.score.clone()
    }

    /// What keeping expert `x` is worth to the learned policy.
    fn value(&self, x: usize) -> f32 {
        self.score[x] + tuning().recent_weight * self.recent[x]
    }

    /// Records a frame's routing (`routed`: every slot's expert) and returns at most `max`
    /// admissions among its cold experts (`cold`: the slots' experts not in VRAM, or
    /// `u32::MAX`) under `policy`, already applied to the map.
    pub fn frame(
        &mut self,
        routed: &[u32],
        cold: &[u32],
        policy: CachePolicy,
        max: usize,
    ) -> Vec<Admission> {
        self.frame += 1;
        let n = self.score.len();
        let mut touched: Vec<usize> = routed
            .iter()
            .map(|&x| x as usize)
            .filter(|&x| x < n)
            .collect();
        touched.sort_unstable();
        touched.dedup();
        // Decayed in full each frame (a few hundred multiplies) so that valuing a resident
        // is two loads: the victim search visits every slot.
        let t = tuning();
        // (Counts that reach nothing are flushed to zero: subnormal arithmetic is slow.)
        let decay = |v: &mut [f32], by: f32| {
            for s in v {
                *s = if *s > 1e-20 { *s * by } else { 0.0 };
            }
        };
        decay(&mut self.score, t.decay);
        decay(&mut self.recent, t.recent_decay);
        for &x in &touched {
            self.score[x] += 1.0;
            self.recent[x] += 1.0;
            self.seen[x] = self.frame;
        }
        if policy == CachePolicy::Static || self.resident() == 0 {
            return Vec::new();
        }
        let mut wanted: Vec<usize> = Vec::new();
        for x in cold.iter().map(|&x| x as usize) {
            if x < n && self.slot_of[x].is_none() && !wanted.contains(&x) {
                wanted.push(x);
            }
        }
        // The most valuable first. All are as recent to LRU: it takes the most often routed
        // of them (the slow count; in the order routed, which admits a random one, it hits
        // a third less often on recorded routing: a strong baseline, not a straw man).
        let by = |x: usize| match policy {
            CachePolicy::Learned => self.value(x),
            _ => self.score[x],
        };
        wanted.sort_by(|&a, &b| by(b).total_cmp(&by(a)));
        let mut out = Vec::new();
        for x in wanted {
            if out.len() == max {
                break;
            }
            let Some((slot, v)) = self.victim(policy, &[]) else {
                break;
            };
            // Experts of about equal value do not trade places (each trade is an upload); a
            // resident of no value (never routed to, nor by an earlier run) is no one's loss.
            let kept = self.value(v as usize);
            if policy == CachePolicy::Learned && kept > 0.0 && self.value(x) <= kept + t.margin {
                break;
            }
            out.push(self.swap(x, slot, v));
        }
        out
    }

    /// Admits up to `m` experts this layer is expected to route to next (`likely[x]`: how
    /// strongly; 0: not at all), the likeliest first, each over the lowest-valued resident not
    /// used in the last frame (a prefetch, before the frame routes; already applied to the
    /// map).
    pub fn prefetch(&mut self, likely: &[u32], m: usize) -> Vec<Admission> {
        if self.resident() == 0 {
            return Vec::new();
        }
        let n = likely.len().min(self.slot_of.len());
        let mut want: Vec<usize> = (0..n)
            .filter(|&x| likely[x] > 0 && self.slot_of[x].is_none())
            .collect();
        want.sort_by(|&a, &b| likely[b].cmp(&likely[a]).then(a.cmp(&b)));
        want.truncate(m);
        let mut out: Vec<Admission> = Vec::new();
        for x in want {
            // (Not a slot this prefetch just filled: those experts have no value yet.)
            let taken: Vec<u32> = out.iter().map(|a| a.slot).collect();
            let Some((slot, v)) = self.victim(CachePolicy::Learned, &taken) else {
                break;
            };
            out.push(self.swap(x, slot, v));
        }
        out
    }

    /// The slot to give up, not one of `taken`: one whose expert was not used in the current
    /// frame, the lowest value (learned) or the oldest use (LRU).
    fn victim(&self, policy: CachePolicy, taken: &[u32]) -> Option<(usize, u32)> {
        self.expert_in
            .iter()
            .enumerate()
            .filter(|&(slot, &v)| {
                v != RETIRED
                    && self.seen[v as usize] != self.frame
                    && !taken.contains(&(slot as u32))
            })
            .min_by(|a, b| match policy {
                CachePolicy::Lru => self.seen[*a.1 as usize].cmp(&self.seen[*b.1 as usize]),
                _ => self
                    .value(*a.1 as usize)
                    .total_cmp(&self.value(*b.1 as usize)),
            })
            .map(|(slot, &v)| (slot, v))
    }

    fn swap(&mut self, x: usize, slot: usize, v: u32) -> Admission {
        self.slot_of[v as usize] = None;
        self.slot_of[x] = Some(slot as u32);
        self.expert_in[slot] = x as u32;
        Admission {
            expert: x as u32,
            slot: slot as u32,
            evicted: v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: u32 = u32::MAX;

    fn cold(c: &LayerCache, routed: &[u32]) -> Vec<u32> {
        routed
            .iter()
            .map(|&x| {
                if c.slots()[x as usize].is_some() {
                    NONE
                } else {
                    x
                }
            })
            .collect()
    }

    /// A steady working set displaces the initial residents; a later one-off scan of other
    /// experts does not displace it under the learned policy, and does under LRU.
    #[test]
    fn learned_resists_a_scan_that_lru_follows() {
        for (policy, kept) in [(CachePolicy::Learned, true), (CachePolicy::Lru, false)] {
            let mut c = LayerCache::new(16, &[0, 1, 2, 3], None);
            let hot = [8u32, 9, 10, 11];
            for _ in 0..50 {
                let k = cold(&c, &hot);
                c.frame(&hot, &k, policy, 4);
            }
            let mut resident: Vec<u32> = (0..16)
                .filter(|&x| c.slots()[x as usize].is_some())
                .collect();
            resident.sort_unstable();
            assert_eq!(resident, hot, "{policy:?} learns the working set");
            for x in [12u32, 13, 14, 15] {
                let k = cold(&c, &[x]);
                c.frame(&[x], &k, policy, 4);
            }
            let still = hot.iter().all(|&x| c.slots()[x as usize].is_some());
            assert_eq!(still, kept, "{policy:?} after a scan");
        }
    }

    /// A stream with both a skewed popularity (Zipf 0.8 over a shuffled order) and locality
    /// (each routed expert repeats one of the previous frame's with probability `reuse`), the
    /// two things real routing has: the learned policy's hit rate beats LRU's and the static
    /// placement's at every bank size, from no locality to much.
    #[test]
    fn learned_beats_lru_and_static_on_popularity_with_locality() {
        let (experts, k, frames, warm) = (64usize, 4usize, 2000usize, 500usize);
        for reuse in [0.0, 0.3, 0.5] {
            let mut s = 7u64;
            let mut rand = move || {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (s >> 11) as f64 / (1u64 << 53) as f64
            };
            let mut rank: Vec<usize> = (0..experts).collect();
            for i in (1..experts).rev() {
                rank.swap(i, (rand() * (i + 1) as f64) as usize);
            }
            let w: Vec<f64> = rank.iter().map(|&r| ((r + 1) as f64).powf(-0.8)).collect();
            let total: f64 = w.iter().sum();
            let mut stream: Vec<Vec<u32>> = Vec::new();
            let mut prev: Vec<u32> = Vec::new();
            for _ in 0..frames {
                let mut cur: Vec<u32> = Vec::new();
                while cur.len() < k {
                    let x = if !prev.is_empty() && rand() < reuse {
                        prev[(rand() * prev.len() as f64) as usize]
                    } else {
                        let (mut u, mut x) = (rand() * total, 0);
                        while x + 1 < experts && u >= w[x] {
                            u -= w[x];
                            x += 1;
                        }
                        x as u32
                    };
                    if !cur.contains(&x) {
                        cur.push(x);
                    }
                }
                prev = cur.clone();
                stream.push(cur);
            }
            for capacity in [8usize, 16, 32] {
                let hits = |policy| {
                    let resident: Vec<u32> = (0..capacity as u32).collect();
                    let mut c = LayerCache::new(experts, &resident, None);
                    let mut h = 0;
                    for (f, r) in stream.iter().enumerate() {
                        let k = cold(&c, r);
                        if f >= warm {
                            h += k.iter().filter(|&&x| x == NONE).count();
                        }
                        c.frame(r, &k, policy, 1);
                    }
                    h
                };
                let (l, u, st) = (
                    hits(CachePolicy::Learned),
                    hits(CachePolicy::Lru),
                    hits(CachePolicy::Static),
                );
                assert!(
                    l > u && l > st,
                    "reuse {reuse}, {capacity} slots: learned {l}, lru {u}, static {st} hits"
                );
            }
        }
    }

    /// A prefetch takes the likeliest non-resident experts, over the lowest-valued residents
    /// not used in the last frame.
    #[test]
    fn prefetch_admits_the_likeliest_over_the_least_valued() {
        let mut c = LayerCache::new(8, &[0, 1, 2], None);
        c.frame(&[0, 1], &[NONE, NONE], CachePolicy::Learned, 1);
        c.frame(&[1], &[NONE], CachePolicy::Learned, 1);
        // Expert 2 was never routed, 0 not in the last frame, 1 in it.
        let likely = [0, 0, 0, 0, 5, 0, 9, 1];
        let a = c.prefetch(&likely, 2);
        assert_eq!(
            a.iter().map(|a| (a.expert, a.evicted)).collect::<Vec<_>>(),
            vec![(6, 2), (4, 0)]
        );
        assert_eq!(
            (c.slots()[6], c.slots()[4], c.slots()[1]),
            (Some(2), Some(0), Some(1))
        );
        assert!(c.prefetch(&[0; 8], 2).is_empty(), "nothing likely");
        assert!(
            c.prefetch(&likely, 2).iter().all(|a| a.expert == 7),
            "4 and 6 are in"
        );
    }

    #[test]
    fn static_never_changes_and_admissions_respect_max() {
        let mut c = LayerCache::new(8, &[0, 1], None);
        assert!(c.frame(&[5, 6], &[5, 6], CachePolicy::Static, 4).is_empty());
        let a = c.frame(&[5, 6], &[5, 6], CachePolicy::Lru, 1);
        assert_eq!(a.len(), 1);
        let x = a[0].expert as usize;
        assert_eq!(c.slots()[x], Some(a[0].slot));
        assert_eq!(c.slots()[a[0].evicted as usize], None);
        assert_eq!(c.resident(), 2);
    }

    /// An undone admission leaves the map as it was; a retired slot holds nothing and is
    /// never a victim again, so the bank shrinks by one and later admissions use the others.
    #[test]
    fn undo_restores_and_a_retired_slot_is_never_reused() {
        let mut c = LayerCache::new(8, &[0, 1], None);
        let before = c.slots().to_vec();
        let a = c.frame(&[5], &[5], CachePolicy::Lru, 1);
        c.undo(&a[0]);
        assert_eq!(c.slots(), &before[..]);
        let a = c.frame(&[6], &[6], CachePolicy::Lru, 1)[0];
        c.retire(&a);
        assert_eq!((c.slots()[6], c.slots()[a.evicted as usize]), (None, None));
        assert_eq!(c.resident(), 1);
        for x in 2..8u32 {
            let k = cold(&c, &[x]);
            for b in c.frame(&[x], &k, CachePolicy::Lru, 2) {
                assert_ne!(b.slot, a.slot, "a retired slot is reused");
            }
        }
        assert_eq!(c.resident(), 1);
    }

    #[test]
    fn the_initial_residents_are_the_top_scores() {
        let s = [0.5, 3.0, 0.0, 3.0, 1.0];
        assert_eq!(LayerCache::initial(5, 3, Some(&s)), vec![1, 3, 4]);
        assert_eq!(LayerCache::initial(5, 2, None), vec![0, 1]);
    }
}
