//! The compressed token map: token ids whose text normalises alike (" The", "the", "THE")
//! share one compressed id, and the Engram hashes see only compressed ids.
//!
//! The reference derives the map from the tokenizer when the model is bound to it
//! (`build_compressed_token_map`): the per-token text comes from the HF tokenizer's
//! `decode([id], skip_special_tokens=False)` and `id_to_token(id)`, and the normalisation is a
//! `tokenizers` normalizer sequence. This crate has no tokenizer (the engine owns it), so
//! [`CompressedTokenMap::from_token_strings`] takes those two strings per token and does the
//! rest: the caller decodes, this module normalises and numbers. A converter may instead store
//! the map, read back with [`CompressedTokenMap::from_ids`].
//!
//! The normalisation uses `unicode-normalization-alignments`, the crate (and so the Unicode 9
//! tables) `tokenizers` itself normalises with, so that NFKC / NFD / accent stripping agree
//! with the reference's for every character, not only those of current Unicode.

use std::collections::HashMap;

use unicode_normalization_alignments::UnicodeNormalization;
use unicode_normalization_alignments::char::is_combining_mark;

use super::EngramError;

/// Token id -> compressed id, with the number of distinct compressed ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompressedTokenMap {
    ids: Vec<u32>,
    size: u64,
}

/// The private-use character that stands for a token that is exactly one space while
/// `Strip` runs (else it would become empty and merge with unrelated tokens).
const SENTINEL: char = '\u{E000}';

/// The reference's key normaliser, the `tokenizers` sequence NFKC, NFD, StripAccents,
/// Lowercase, `Replace(/[ \t\r\n]+/, " ")`, `Replace(/^ $/, U+E000)`, Strip, `Replace(U+E000,
/// " ")`, with each step as `tokenizers` implements it (Rust `char::to_lowercase` and
/// `char::is_whitespace`; `^ $` can only match the whole string, since no newline survives
/// the step before it).
pub fn normalize_token_text(text: &str) -> String {
    let nfkc: String = text.nfkc().map(|(c, _)| c).collect();
    let mut s = String::with_capacity(nfkc.len());
    let mut in_space_run = false;
    for c in nfkc
        .nfd()
        .map(|(c, _)| c)
        .filter(|&c| !is_combining_mark(c))
        .flat_map(char::to_lowercase)
    {
        if matches!(c, ' ' | '\t' | '\r' | '\n') {
            if !in_space_run {
                s.push(' ');
            }
            in_space_run = true;
        } else {
            s.push(c);
            in_space_run = false;
        }
    }
    if s == " " {
        s = SENTINEL.to_string();
    }
    s.trim_matches(char::is_whitespace).replace(SENTINEL, " ")
}

impl CompressedTokenMap {
    /// Derives the map as the reference's `build_compressed_token_map`: for token ids 0, 1, ...
    /// in order, `decoded` is the tokenizer's `decode([id], skip_special_tokens=False)` and
    /// `raw` its `id_to_token(id)`. A token whose decoded text holds U+FFFD (a partial UTF-8
    /// byte sequence) is keyed by its raw form; any other by [`normalize_token_text`] of its
    /// text, or by the text itself when that normalises to nothing. Distinct keys get ids
    /// 0, 1, 2, ... in order of first appearance.
    pub fn from_token_strings<S, I>(tokens: I) -> CompressedTokenMap
    where
        S: AsRef<str>,
        I: IntoIterator<Item = (S, Option<S>)>,
    {
        // A raw-form key and a normalised key are the same dict key in the reference when
        // the strings are equal, so both kinds share one map (`None`: no raw form).
        let mut keys: HashMap<Option<String>, u32> = HashMap::new();
        let mut ids = Vec::new();
        for (decoded, raw) in tokens {
            let text = decoded.as_ref();
            let key = if text.contains('\u{FFFD}') {
                raw.map(|r| r.as_ref().to_string())
            } else {
                let normalized = normalize_token_text(text);
                Some(if normalized.is_empty() {
                    text.to_string()
                } else {
                    normalized
                })
            };
            let next = keys.len() as u32;
            ids.push(*keys.entry(key).or_insert(next));
        }
        let size = keys.len() as u64;
        CompressedTokenMap { ids, size }
    }

    /// A stored map (token id -> compressed id). The ids must cover `0..size` with no gap,
    /// as every derived map does; `size` is then the compressed vocabulary size.
    pub fn from_ids(ids: Vec<u32>) -> Result<CompressedTokenMap, EngramError> {
        let size = ids.iter().map(|&i| u64::from(i) + 1).max().unwrap_or(0);
        // More ids than tokens leaves a gap for sure; checked first so that a corrupt map
        // with a huge id does not allocate for it.
        if size > ids.len() as u64 {
            return Err(EngramError::BadTokenMap(format!(
                "compressed id {} on a map of {} tokens leaves ids unused; a derived map \
                 numbers its keys without gaps",
                size - 1,
                ids.len()
            )));
        }
        let mut seen = vec![false; size as usize];
        for &i in &ids {
            seen[i as usize] = true;
        }
        if let Some(gap) = seen.iter().position(|s| !s) {
            return Err(EngramError::BadTokenMap(format!(
                "compressed id {gap} is never used but {} is; a derived map numbers its keys \
                 without gaps",
                size - 1
            )));
        }
        Ok(CompressedTokenMap { ids, size })
    }

    /// [`Self::from_ids`] from signed ids (as numpy stores them), refusing any outside `u32`.
    pub fn from_i64(ids: &[i64]) -> Result<CompressedTokenMap, EngramError> {
        let ids = ids
            .iter()
            .enumerate()
            .map(|(token, &i)| {
                u32::try_from(i).map_err(|_| {
                    EngramError::BadTokenMap(format!("token {token} maps to {i}, outside 0..2^32"))
                })
            })
            .collect::<Result<Vec<u32>, _>>()?;
        CompressedTokenMap::from_ids(ids)
    }

    /// The compressed id of `token`, if the map has it.
    pub fn get(&self, token: usize) -> Option<u32> {
        self.ids.get(token).copied()
    }

    /// Token ids covered.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether the map covers no token.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Distinct compressed ids (`engram_compressed_vocab_size` when it matches the config).
    pub fn compressed_vocab_size(&self) -> u64 {
        self.size
    }

    /// The map, indexed by token id.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalisation_follows_the_reference_sequence() {
        // Lowercase, accents stripped, whitespace runs collapsed, then stripped.
        assert_eq!(normalize_token_text("  Caf\u{e9}\n\t THE "), "cafe the");
        // NFKC folds compatibility forms (ligature, full-width).
        assert_eq!(normalize_token_text("\u{fb01}X\u{ff21}"), "fixa");
        // A token that is exactly one space survives Strip; two spaces collapse to it.
        assert_eq!(normalize_token_text(" "), " ");
        assert_eq!(normalize_token_text("  "), " ");
        assert_eq!(normalize_token_text("\n"), " ");
        // NFKC turns no-break and ideographic spaces into plain ones, which then collapse.
        assert_eq!(normalize_token_text("a\u{a0}\u{3000}b"), "a b");
        // Other whitespace is stripped at the ends but not collapsed inside.
        assert_eq!(normalize_token_text("\u{b}"), "");
        assert_eq!(normalize_token_text("\u{b}a\u{b}\u{b}b"), "a\u{b}\u{b}b");
        // Accents go before lowercasing; a literal U+E000 becomes a space too (as upstream).
        assert_eq!(normalize_token_text("\u{130}"), "i");
        assert_eq!(normalize_token_text("\u{1e9e}"), "\u{df}");
        assert_eq!(normalize_token_text("x\u{e000}y"), "x y");
    }

    #[test]
    fn keys_number_in_order_of_first_appearance() {
        let toks = [
            ("The", None),
            (" the", None),
            ("\u{FFFD}", Some("\u{2581}x")),
            ("\u{b}", None),
            ("THE", None),
            ("\u{FFFD}", Some("\u{2581}y")),
            ("\u{b}", None),
        ];
        let m = CompressedTokenMap::from_token_strings(toks);
        // "the", "the", raw "▁x", "\u{b}" (normalises to nothing: keyed by its text).
        assert_eq!(m.ids(), &[0, 0, 1, 2, 0, 3, 2]);
        assert_eq!(m.compressed_vocab_size(), 4);
    }

    #[test]
    fn stored_maps_must_cover_their_ids() {
        assert_eq!(
            CompressedTokenMap::from_ids(vec![0, 1, 1, 0])
                .unwrap()
                .compressed_vocab_size(),
            2
        );
        assert!(matches!(
            CompressedTokenMap::from_ids(vec![0, 2]),
            Err(EngramError::BadTokenMap(_))
        ));
        assert!(matches!(
            CompressedTokenMap::from_i64(&[0, -1]),
            Err(EngramError::BadTokenMap(_))
        ));
    }
}
