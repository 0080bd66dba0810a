//! Which routed experts a layer keeps in its VRAM bank when they do not all fit (the rest are
//! computed on the CPU): the bank's slots, the expert -> slot map the host keeps beside the
//! device's, and the policy that decides, from the routing the device reads back each frame,
//! which cold expert to admit and which resident one it replaces.
//!
//! `Learned` keeps a per-expert score, the count of frames that routed to it decayed by
//! [`DECAY`] per frame (frequency with recency), and admits a cold expert only when its score
//! beats the lowest resident score by [`MARGIN`]: a burst of one-off experts (a scan) cannot flush the
//! experts every frame uses, and a shift in what the text routes to is followed within a few
//! dozen frames. `Lru` admits every cold expert over the least recently used one (the usual
//! cache, the baseline the learned one must beat); `Static` never changes what was placed at
//! load (llama.cpp's `--n-cpu-moe` keeps whole layers on the CPU this way).

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

/// Per-frame decay of a score: a frame's routing counts half after about 139 frames. (0.99
/// with a margin of 2, the first choice, converged more slowly than LRU followed; slower
/// decays with a smaller margin measured best: docs/perf.md.)
pub const DECAY: f32 = 0.995;

/// How much higher a cold expert's score must be than the resident it would replace.
pub const MARGIN: f32 = 1.0;

/// The learned policy's decay and margin: [`DECAY`] and [`MARGIN`], or `CORTIQ_CACHE_DECAY`
/// and `CORTIQ_CACHE_MARGIN` (measurement knobs, docs/perf.md).
fn tuning() -> (f32, f32) {
    static T: std::sync::OnceLock<(f32, f32)> = std::sync::OnceLock::new();
    *T.get_or_init(|| {
        let get = |k: &str, d: f32| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(d)
        };
        (
            get("CORTIQ_CACHE_DECAY", DECAY),
            get("CORTIQ_CACHE_MARGIN", MARGIN),
        )
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
    /// Decayed routing count per expert, as of frame `seen[x]`.
    score: Vec<f32>,
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

    /// Each expert's score now (what a later run starts from).
    pub fn scores(&self) -> Vec<f32> {
        (0..self.score.len()).map(|x| self.score_now(x)).collect()
    }

    fn score_now(&self, x: usize) -> f32 {
        self.score[x] * tuning().0.powf((self.frame - self.seen[x]) as f32)
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
        for &x in &touched {
            self.score[x] = self.score_now(x) + 1.0;
            self.seen[x] = self.frame;
        }
        if policy == CachePolicy::Static || self.resident() == 0 {
            return Vec::new();
        }
        let mut wanted: Vec<usize> = cold
            .iter()
            .map(|&x| x as usize)
            .filter(|&x| x < n && self.slot_of[x].is_none())
            .collect();
        wanted.sort_unstable();
        wanted.dedup();
        // The most valuable first: the highest score (learned) or any (LRU: all are as recent).
        wanted.sort_by(|&a, &b| self.score_now(b).total_cmp(&self.score_now(a)));
        let mut out = Vec::new();
        for x in wanted {
            if out.len() == max {
                break;
            }
            // The victim: not used this frame, the lowest score (learned) or the oldest use.
            let victim = self
                .expert_in
                .iter()
                .enumerate()
                .filter(|&(_, &v)| v != RETIRED && self.seen[v as usize] != self.frame)
                .min_by(|a, b| match policy {
                    CachePolicy::Lru => self.seen[*a.1 as usize].cmp(&self.seen[*b.1 as usize]),
                    _ => self
                        .score_now(*a.1 as usize)
                        .total_cmp(&self.score_now(*b.1 as usize)),
                })
                .map(|(slot, &v)| (slot, v));
            let Some((slot, v)) = victim else { break };
            // A margin of one frame's use: experts of about equal score do not trade places
            // (each trade is an upload).
            if policy == CachePolicy::Learned
                && self.score_now(x) <= self.score_now(v as usize) + tuning().1
            {
                break;
            }
            self.slot_of[v as usize] = None;
            self.slot_of[x] = Some(slot as u32);
            self.expert_in[slot] = x as u32;
            out.push(Admission {
                expert: x as u32,
                slot: slot as u32,
                evicted: v,
            });
        }
        out
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
