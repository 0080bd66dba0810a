//! The Engram n-gram hashing of `deepseek_v41`, host side: from token ids to the table rows
//! each Engram layer gathers.
//!
//! What it owns, all computed from the config (and the tokenizer's compressed vocabulary) with
//! no tensor read:
//! - [`EngramLayout`]: the prime-sized bucket ranges of every (layer, n-gram order, head) and
//!   their offsets inside each layer's table (the reference's `EngramLayout`);
//! - [`hash_multipliers`]: the per-layer odd multipliers drawn from numpy's
//!   `default_rng(10007 * layer_id)`, reproduced bit for bit by [`numpy_rng`];
//! - [`CompressedTokenMap`]: token id -> compressed id, either stored (a converter's tensor, a
//!   fixture's `.npy`) or derived from the tokenizer's per-token strings exactly as the
//!   reference's `build_compressed_token_map` does ([`CompressedTokenMap::from_token_strings`]);
//! - [`EngramHasher`] with an [`NgramContext`]: the rolling XOR hash giving, per position, the
//!   row of every (layer, n-gram order, head), whole prompt at once or token by token with the
//!   last `max_ngram_size - 1` compressed ids carried between calls (cached decode).
//!
//! and, the parts that read tensors, [`EngramTable`]: one layer's mxfp8 table bound from
//! the CMF (behind its memory map) and the gather of the rows the hasher produced; and
//! [`block`]: the Engram module of a decoder layer, which gates those rows into the streams.
//!
//! Text only: the reference also marks image-span and padding tokens DEAD (they hash like the
//! sequence start and their gate is shut). Only the sequence start is DEAD here; padded
//! batches and image spans are not supported by this crate.
//!
//! Reference: `DeepseekV41NgramHashState`, `EngramLayout`, `compute_hash_multipliers` and
//! `build_compressed_token_map` in transformers main's `modeling_deepseek_v41.py`;
//! tools/reference/README.md §7 describes the witnesses the tests compare against.

pub mod block;
pub mod numpy_rng;
mod table;
mod token_map;

use std::num::NonZeroU64;

pub use table::{EngramTable, EngramTableError};
pub use token_map::{CompressedTokenMap, normalize_token_text};

use crate::config_v41::DeepseekV41Config;

/// Bad hashing input or constants: what was wrong, with the values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngramError {
    /// The prime search ran past `i64::MAX` (the reference holds primes and rows in int64).
    #[error("engram layout: no room for {count} primes above {start} within int64")]
    PrimeOverflow {
        /// Where the search started (`engram_vocab_size`).
        start: u64,
        /// Primes needed.
        count: usize,
    },
    /// The config has no Engram layer to hash for.
    #[error("engram: the config has no Engram layers (engram_layer_ids is empty)")]
    NoEngramLayers,
    /// The token map's distinct compressed ids do not number `engram_compressed_vocab_size`:
    /// every multiplier depends on that size, so the whole table would rehash to other rows.
    #[error(
        "engram token map: {found} compressed ids, but engram_compressed_vocab_size is {expected}"
    )]
    CompressedVocabMismatch {
        /// `engram_compressed_vocab_size`.
        expected: u64,
        /// Distinct compressed ids of the map.
        found: u64,
    },
    /// A stored token map whose ids do not cover `0..size` (a derived map always does).
    #[error("engram token map: {0}")]
    BadTokenMap(String),
    /// `engram_pad_token_id` has no entry in the token map.
    #[error("engram token map: pad token {pad} is past the map's {len} entries")]
    PadOutOfMap {
        /// `engram_pad_token_id`.
        pad: usize,
        /// Token map entries.
        len: usize,
    },
    /// An input token has no entry in the token map.
    #[error("engram: token {token} at position {position} is past the token map's {len} entries")]
    TokenOutOfRange {
        /// The token id.
        token: u32,
        /// Its position in the call's input.
        position: usize,
        /// Token map entries.
        len: usize,
    },
    /// An [`NgramContext`] made for another n-gram size.
    #[error("engram: context holds {found} look-back ids, this hasher needs {expected}")]
    ContextMismatch {
        /// `max_ngram_size - 1`.
        expected: usize,
        /// The context's length.
        found: usize,
    },
}

/// Bucket layout of the n-gram hash tables: every (layer, n-gram order, head) owns a
/// prime-sized range of rows, and no prime is used twice.
///
/// The reference searches, for each layer and order, the next `n_heads` primes above
/// `engram_vocab_size - 1` that no earlier (layer, order, head) took. Each search restarts at
/// the same point and always takes the smallest untaken primes, so the taken set stays a
/// prefix of the primes above that point: the layout is the consecutive primes from
/// `engram_vocab_size` on, dealt out in (layer, order, head) order, which is how it is
/// computed here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngramLayout {
    n_layers: usize,
    max_ngram_size: usize,
    n_heads: usize,
    /// `[layer][order - 2][head]`, flat.
    primes: Vec<u64>,
    /// `[layer][(order - 2) * n_heads + head]`, flat: the running sum of the layer's primes.
    offsets: Vec<u64>,
    /// Per layer: the sum of its primes, i.e. the rows its table must have.
    table_rows: Vec<u64>,
}

impl EngramLayout {
    /// The layout of `n_layers` Engram tables hashing orders `2..=max_ngram_size` with
    /// `n_heads` heads each, primes searched from `vocab_size` (`engram_vocab_size`).
    ///
    /// `max_ngram_size < 2` or `n_heads == 0` give a layout with no columns (the config
    /// refuses both before it gets here).
    pub fn new(
        n_layers: usize,
        vocab_size: u64,
        max_ngram_size: usize,
        n_heads: usize,
    ) -> Result<EngramLayout, EngramError> {
        let cols = max_ngram_size.saturating_sub(1).saturating_mul(n_heads);
        let count = n_layers.saturating_mul(cols);
        let overflow = EngramError::PrimeOverflow {
            start: vocab_size,
            count,
        };
        let mut primes = Vec::with_capacity(count.min(1 << 20));
        // The first candidate is `(engram_vocab_size - 1) + 1`.
        let mut candidate = vocab_size;
        for _ in 0..count {
            loop {
                if candidate > i64::MAX as u64 {
                    return Err(overflow);
                }
                let c = candidate;
                candidate += 1;
                if is_prime(c) {
                    primes.push(c);
                    break;
                }
            }
        }
        let mut offsets = Vec::with_capacity(count);
        let mut table_rows = Vec::with_capacity(n_layers);
        for layer in primes.chunks(cols.max(1)).take(n_layers) {
            let mut total = 0u64;
            for &p in layer {
                offsets.push(total);
                total = total
                    .checked_add(p)
                    .filter(|&t| t <= i64::MAX as u64)
                    .ok_or(EngramError::PrimeOverflow {
                        start: vocab_size,
                        count,
                    })?;
            }
            table_rows.push(total);
        }
        table_rows.resize(n_layers, 0);
        Ok(EngramLayout {
            n_layers,
            max_ngram_size,
            n_heads,
            primes,
            offsets,
            table_rows,
        })
    }

    /// The layout `config`'s Engram fields describe.
    pub fn from_config(config: &DeepseekV41Config) -> Result<EngramLayout, EngramError> {
        EngramLayout::new(
            config.engram_layer_ids.len(),
            config.engram_vocab_size,
            config.engram_max_ngram_size,
            config.engram_n_heads,
        )
    }

    /// Engram layers (tables).
    pub fn n_layers(&self) -> usize {
        self.n_layers
    }

    /// Largest n-gram order hashed.
    pub fn max_ngram_size(&self) -> usize {
        self.max_ngram_size
    }

    /// Hash heads per order.
    pub fn n_heads(&self) -> usize {
        self.n_heads
    }

    /// Hash columns per layer: `(max_ngram_size - 1) * n_heads`, order-major.
    pub fn n_cols(&self) -> usize {
        self.max_ngram_size.saturating_sub(1) * self.n_heads
    }

    /// The moduli, `[layer][order - 2][head]` flattened (`engram_primes.npy`).
    pub fn primes(&self) -> &[u64] {
        &self.primes
    }

    /// The first row of each column's range inside its layer's table, `[layer][column]`
    /// flattened (`engram_offsets.npy`).
    pub fn offsets(&self) -> &[u64] {
        &self.offsets
    }

    /// The rows each layer's table has (`engram_num_embeddings`).
    pub fn table_rows(&self) -> &[u64] {
        &self.table_rows
    }
}

/// Whether `n` is prime: Miller-Rabin with the first twelve prime bases, which is exact for
/// every 64-bit `n` (trial division, as the reference does, would take ~1e9 steps per
/// candidate near `i64::MAX`).
pub fn is_prime(n: u64) -> bool {
    const BASES: [u64; 12] = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37];
    if n < 2 {
        return false;
    }
    for p in BASES {
        if n.is_multiple_of(p) {
            return n == p;
        }
    }
    let mul = |a: u64, b: u64| ((u128::from(a) * u128::from(b)) % u128::from(n)) as u64;
    let pow = |mut b: u64, mut e: u64| {
        let mut r = 1u64;
        while e > 0 {
            if e & 1 == 1 {
                r = mul(r, b);
            }
            b = mul(b, b);
            e >>= 1;
        }
        r
    };
    let s = (n - 1).trailing_zeros();
    let d = (n - 1) >> s;
    'bases: for a in BASES {
        let mut x = pow(a, d);
        if x == 1 || x == n - 1 {
            continue;
        }
        for _ in 1..s {
            x = mul(x, x);
            if x == n - 1 {
                continue 'bases;
            }
        }
        return false;
    }
    true
}

/// The hash multipliers, `[layer][look-back]` flattened (`max_ngram_size` per layer):
/// `2 * d + 1` with `d = default_rng(10007 * layer_id).integers(0, bound, size=N, dtype=int64)`
/// and `bound = max(1, (2^63 - 1) // compressed_vocab_size // 2)`. Odd and bounded so that
/// `compressed_id * multiplier` stays below `2^63`.
pub fn hash_multipliers(
    layer_ids: &[usize],
    max_ngram_size: usize,
    compressed_vocab_size: NonZeroU64,
) -> Vec<u64> {
    let bound = (i64::MAX as u64 / compressed_vocab_size.get() / 2).max(1) as i64;
    let mut out = Vec::with_capacity(layer_ids.len() * max_ngram_size);
    for &layer_id in layer_ids {
        let mut rng = numpy_rng::Pcg64::from_seed(10007 * layer_id as u128);
        for _ in 0..max_ngram_size {
            // `bound >= 1`, so the range is never empty.
            let d = rng.integers_i64(0, bound).unwrap_or(0) as u64;
            out.push(2 * d + 1);
        }
    }
    out
}

/// The n-gram look-back of one sequence: the compressed ids of its last `max_ngram_size - 1`
/// tokens, oldest first, `None` before the sequence start. Cloning it is the snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NgramContext {
    history: Vec<Option<u32>>,
}

impl NgramContext {
    /// Tokens seen so far that are still in the look-back (at most `max_ngram_size - 1`).
    pub fn len(&self) -> usize {
        self.history.iter().filter(|h| h.is_some()).count()
    }

    /// Whether no token has been seen.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The hashing state of a model: layout, multipliers and token map, immutable once built.
#[derive(Debug, Clone)]
pub struct EngramHasher {
    layout: EngramLayout,
    /// `[layer][look-back]`, `max_ngram_size` per layer.
    multipliers: Vec<u64>,
    token_map: CompressedTokenMap,
    /// Compressed id hashed in place of a token before the sequence start.
    pad_compressed: u64,
}

impl EngramHasher {
    /// Builds the hasher for `config` with the tokenizer's compressed token map, checking the
    /// map against the config as the reference's `bind_tokenizer` does (its size must be
    /// `engram_compressed_vocab_size`, and the pad token must have an entry).
    pub fn new(
        config: &DeepseekV41Config,
        token_map: CompressedTokenMap,
    ) -> Result<EngramHasher, EngramError> {
        if config.engram_layer_ids.is_empty() {
            return Err(EngramError::NoEngramLayers);
        }
        let expected = config.engram_compressed_vocab_size;
        let found = token_map.compressed_vocab_size();
        let cvs = NonZeroU64::new(expected)
            .filter(|_| found == expected)
            .ok_or(EngramError::CompressedVocabMismatch { expected, found })?;
        let pad = config.engram_pad_token_id;
        let pad_compressed = token_map.get(pad).ok_or(EngramError::PadOutOfMap {
            pad,
            len: token_map.len(),
        })?;
        let layout = match config.engram_layout() {
            Some(l) => l.clone(),
            None => EngramLayout::from_config(config)?,
        };
        Ok(EngramHasher {
            multipliers: hash_multipliers(
                &config.engram_layer_ids,
                config.engram_max_ngram_size,
                cvs,
            ),
            layout,
            token_map,
            pad_compressed: u64::from(pad_compressed),
        })
    }

    /// The bucket layout.
    pub fn layout(&self) -> &EngramLayout {
        &self.layout
    }

    /// The multipliers, `[layer][look-back]` flattened.
    pub fn multipliers(&self) -> &[u64] {
        &self.multipliers
    }

    /// The token map.
    pub fn token_map(&self) -> &CompressedTokenMap {
        &self.token_map
    }

    /// Row ids per position: `n_layers * n_cols`.
    pub fn ids_per_token(&self) -> usize {
        self.layout.n_layers * self.layout.n_cols()
    }

    /// An empty look-back (a new sequence).
    pub fn new_context(&self) -> NgramContext {
        NgramContext {
            history: vec![None; self.layout.max_ngram_size.saturating_sub(1)],
        }
    }

    /// Hashes a whole sequence from its start: `[T, n_layers, n_cols]` row ids, flattened.
    pub fn hash_prompt(&self, tokens: &[u32]) -> Result<Vec<u64>, EngramError> {
        let mut ctx = self.new_context();
        let mut out = Vec::new();
        self.hash_into(&mut ctx, tokens, &mut out)?;
        Ok(out)
    }

    /// Hashes `tokens`, which continue the sequence `ctx` has seen, appending
    /// `[tokens.len(), n_layers, n_cols]` row ids to `out` and advancing `ctx`.
    ///
    /// Position t hashes compressed ids `c[t], c[t-1], ..., c[t-N+1]`; a look-back that
    /// reaches before the sequence start uses the pad's compressed id for that and every
    /// longer shift. With `p_s = c[t-s] * mult[layer][s]`, `h_1 = p_0 ^ p_1`,
    /// `h_i = h_(i-1) ^ p_i`; order i+1, head j reads row
    /// `h_i % primes[layer][i-1][j] + offsets[layer][(i-1) * H + j]`.
    ///
    /// On error nothing is appended and `ctx` is unchanged.
    pub fn hash_into(
        &self,
        ctx: &mut NgramContext,
        tokens: &[u32],
        out: &mut Vec<u64>,
    ) -> Result<(), EngramError> {
        let n = self.layout.max_ngram_size;
        if ctx.history.len() != n.saturating_sub(1) {
            return Err(EngramError::ContextMismatch {
                expected: n.saturating_sub(1),
                found: ctx.history.len(),
            });
        }
        // Map every token first, so that a bad one leaves `out` and `ctx` untouched.
        let compressed = tokens
            .iter()
            .enumerate()
            .map(|(position, &token)| {
                self.token_map
                    .get(token as usize)
                    .ok_or(EngramError::TokenOutOfRange {
                        token,
                        position,
                        len: self.token_map.len(),
                    })
            })
            .collect::<Result<Vec<u32>, _>>()?;
        let (h, cols) = (self.layout.n_heads, self.layout.n_cols());
        out.reserve(tokens.len() * self.ids_per_token());
        let mut window = vec![0u64; n];
        for c in compressed {
            // window[s] = c[t - s], the pad from the first shift that leaves the sequence on.
            window[0] = u64::from(c);
            let mut blocked = false;
            for (s, slot) in window.iter_mut().enumerate().skip(1) {
                let prev = ctx.history[ctx.history.len() - s];
                blocked |= prev.is_none();
                *slot = match prev {
                    Some(p) if !blocked => u64::from(p),
                    _ => self.pad_compressed,
                };
            }
            for layer in 0..self.layout.n_layers {
                let mult = &self.multipliers[layer * n..(layer + 1) * n];
                let primes = &self.layout.primes[layer * cols..(layer + 1) * cols];
                let offsets = &self.layout.offsets[layer * cols..(layer + 1) * cols];
                // Products stay below 2^63 (the multiplier bound); wrapping only keeps a
                // map that breaks that promise from panicking.
                let mut rolling = window[0].wrapping_mul(mult[0]);
                for i in 1..n {
                    rolling ^= window[i].wrapping_mul(mult[i]);
                    let col = (i - 1) * h;
                    for j in 0..h {
                        out.push(rolling % primes[col + j] + offsets[col + j]);
                    }
                }
            }
            if !ctx.history.is_empty() {
                ctx.history.rotate_left(1);
                if let Some(last) = ctx.history.last_mut() {
                    *last = Some(c);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trial_division(n: u64) -> bool {
        n >= 2
            && (2..)
                .take_while(|d| d * d <= n)
                .all(|d| !n.is_multiple_of(d))
    }

    #[test]
    fn miller_rabin_is_exact() {
        for n in 0..20_000u64 {
            assert_eq!(is_prime(n), trial_division(n), "{n}");
        }
        for n in 16_000_000..16_002_000u64 {
            assert_eq!(is_prime(n), trial_division(n), "{n}");
        }
        // 2^61 - 1 and the largest prime below 2^63; a Carmichael number and a strong
        // pseudoprime to bases 2, 3, 5, 7.
        assert!(is_prime((1 << 61) - 1));
        assert!(is_prime(9_223_372_036_854_775_783));
        assert!(!is_prime(561));
        assert!(!is_prime(3_215_031_751));
        assert!(!is_prime(i64::MAX as u64));
    }

    /// The reference's search, literally: per (layer, order) restart at `vocab_size - 1` and
    /// take the next `n_heads` primes not yet used.
    fn reference_primes(layers: usize, vocab: u64, ngram: usize, heads: usize) -> Vec<u64> {
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        for _ in 0..layers {
            for _ in 0..ngram - 1 {
                let mut current = vocab - 1;
                for _ in 0..heads {
                    let mut c = current + 1;
                    while !trial_division(c) || seen.contains(&c) {
                        c += 1;
                    }
                    seen.insert(c);
                    out.push(c);
                    current = c;
                }
            }
        }
        out
    }

    #[test]
    fn consecutive_primes_equal_the_reference_search() {
        for (layers, vocab, ngram, heads) in [(2, 97, 4, 2), (3, 1000, 3, 5), (1, 2, 5, 3)] {
            let layout = EngramLayout::new(layers, vocab, ngram, heads).unwrap();
            assert_eq!(
                layout.primes(),
                reference_primes(layers, vocab, ngram, heads),
                "{layers} {vocab} {ngram} {heads}"
            );
            let cols = layout.n_cols();
            for (l, rows) in layout.table_rows().iter().enumerate() {
                let primes = &layout.primes()[l * cols..(l + 1) * cols];
                assert_eq!(*rows, primes.iter().sum::<u64>());
                assert_eq!(layout.offsets()[l * cols], 0);
                assert_eq!(
                    layout.offsets()[(l + 1) * cols - 1] + primes[cols - 1],
                    *rows
                );
            }
        }
    }
}
