//! The prompt cache: snapshots of sequence states keyed by the token ids they hold, so a
//! request whose prompt extends an earlier one (the next turn of a conversation, a shared
//! system prompt and tools) starts from that state instead of prefilling from zero.
//!
//! A state is only reusable whole: a recurrent layer (GDN, the PLE conv) cannot be rolled
//! back to an earlier position, so an entry serves a prompt when its ids are a prefix of the
//! prompt. The server therefore keeps the states at the boundaries later prompts are likely
//! to extend: right after each prompt and at the end of each reply. Memory is bounded by a
//! byte budget (host memory for CPU states, device memory for GPU ones); the least recently
//! used entries go first.

use crate::model::AnyState;

struct Entry {
    ids: Vec<u32>,
    state: AnyState,
    /// The logits after the last id, where known: a prompt equal to `ids` needs no forward.
    logits: Option<Vec<f32>>,
    bytes: u64,
    used: u64,
}

/// Snapshots by the ids they hold, within a byte budget.
pub struct PromptCache {
    entries: Vec<Entry>,
    budget: u64,
    bytes: u64,
    clock: u64,
}

impl PromptCache {
    /// An empty cache holding at most `budget` bytes of states (0: the cache is off).
    pub fn new(budget: u64) -> PromptCache {
        PromptCache {
            entries: Vec::new(),
            budget,
            bytes: 0,
            clock: 0,
        }
    }

    /// Whether a state of `bytes` would be kept.
    pub fn takes(&self, bytes: u64) -> bool {
        bytes > 0 && bytes <= self.budget
    }

    /// The entry holding the longest prefix of `ids` that can start them: a proper prefix (the
    /// rest is fed, the last id's logits start the reply), or all of `ids` where the entry
    /// kept the logits after them. The ids it holds, its state and those logits.
    pub fn lookup(&mut self, ids: &[u32]) -> Option<(usize, &AnyState, Option<&[f32]>)> {
        self.clock += 1;
        let best = self
            .entries
            .iter_mut()
            .filter(|e| ids.starts_with(&e.ids) && (e.ids.len() < ids.len() || e.logits.is_some()))
            .max_by_key(|e| e.ids.len())?;
        best.used = self.clock;
        let logits = (best.ids.len() == ids.len())
            .then_some(best.logits.as_deref())
            .flatten();
        Some((best.ids.len(), &best.state, logits))
    }

    /// Keeps `state`, which holds exactly `ids`, and the logits after them where given
    /// (replacing an entry of the same ids), dropping the least recently used entries to stay
    /// within the budget; a state larger than the whole budget is not kept.
    pub fn insert(&mut self, ids: Vec<u32>, state: AnyState, logits: Option<Vec<f32>>) {
        let bytes = state.bytes() + logits.as_ref().map_or(0, |l| 4 * l.len() as u64);
        if ids.is_empty() || !self.takes(bytes) {
            return;
        }
        self.clock += 1;
        // The same ids hold the same state: refresh the entry, keeping what it knows.
        if let Some(e) = self.entries.iter_mut().find(|e| e.ids == ids) {
            e.used = self.clock;
            if e.logits.is_none() && logits.is_some() {
                let grow = 4 * logits.as_ref().map_or(0, |l| l.len() as u64);
                e.logits = logits;
                e.bytes += grow;
                self.bytes += grow;
            }
            return;
        }
        while self.bytes + bytes > self.budget {
            let Some(i) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].used) else {
                break;
            };
            let old = self.entries.swap_remove(i);
            self.bytes -= old.bytes;
        }
        self.bytes += bytes;
        self.entries.push(Entry {
            ids,
            state,
            logits,
            bytes,
            used: self.clock,
        });
    }

    /// Entries kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of the states kept.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LoadedModel;

    fn state_of(model: &LoadedModel, ids: &[u32]) -> AnyState {
        let m = model.model();
        let mut st = m.new_state();
        m.forward_last(ids, &mut st).unwrap();
        st
    }

    #[test]
    fn the_longest_proper_prefix_wins_and_the_least_recent_goes_first() {
        let model = LoadedModel::new(crate::embedded_model().unwrap()).unwrap();
        let a = state_of(&model, &[1, 2]);
        let b = state_of(&model, &[1, 2, 3, 4]);
        let c = state_of(&model, &[9, 9, 9]);
        let (ba, bb) = (a.bytes(), b.bytes());
        assert!(ba > 0 && bb > ba, "a state's size grows with its tokens");
        let mut cache = PromptCache::new(ba + bb);
        cache.insert(vec![1, 2], a, None);
        cache.insert(vec![1, 2, 3, 4], b, None);
        assert_eq!(cache.bytes(), ba + bb);
        assert_eq!(cache.lookup(&[1, 2, 3, 4, 5]).map(|e| e.0), Some(4));
        assert_eq!(cache.lookup(&[1, 2, 3]).map(|e| e.0), Some(2));
        // A prompt equal to an entry leaves nothing to feed: the shorter one serves it.
        assert_eq!(cache.lookup(&[1, 2, 3, 4]).map(|e| e.0), Some(2));
        assert!(cache.lookup(&[2, 1, 3]).is_none());
        // [1, 2] was used last: the new entry evicts [1, 2, 3, 4].
        let cb = c.bytes();
        cache.insert(vec![9, 9, 9], c, None);
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.bytes(), ba + cb);
        assert_eq!(cache.lookup(&[1, 2, 3, 4, 5]).map(|e| e.0), Some(2));
        // Nothing larger than the budget is kept; a zero budget keeps nothing.
        let mut off = PromptCache::new(0);
        off.insert(vec![1, 2], state_of(&model, &[1, 2]), None);
        assert!(off.is_empty());
        // An entry with its logits serves a prompt equal to its ids, with those logits.
        let mut cache = PromptCache::new(1 << 30);
        cache.insert(vec![5, 6], state_of(&model, &[5, 6]), Some(vec![0.5; 3]));
        let (n, _, logits) = cache.lookup(&[5, 6]).unwrap();
        assert_eq!((n, logits), (2, Some(&[0.5f32; 3][..])));
        // The same ids again (a reply that fed nothing more) keep the logits.
        cache.insert(vec![5, 6], state_of(&model, &[5, 6]), None);
        assert_eq!(cache.len(), 1);
        assert!(cache.lookup(&[5, 6]).is_some_and(|e| e.2.is_some()));
        assert_eq!(
            cache.lookup(&[5, 6, 7]).map(|e| (e.0, e.2.is_some())),
            Some((2, false))
        );
    }
}
