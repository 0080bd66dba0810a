//! The checks every forward makes on its input tokens before touching a weight.

/// Tokens a forward cannot take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    /// No tokens.
    #[error("empty prompt: at least one token is required")]
    Empty,
    /// A token id outside the vocabulary.
    #[error("token id {id} at position {index} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange {
        /// Offending id.
        id: u32,
        /// Its index in the input.
        index: usize,
        /// Vocabulary size.
        vocab: usize,
    },
}

/// `Ok` when `tokens` is non-empty and every id is below `vocab`; else the first problem.
pub fn check_tokens(tokens: &[u32], vocab: usize) -> Result<(), InputError> {
    if tokens.is_empty() {
        return Err(InputError::Empty);
    }
    match tokens.iter().position(|&id| id as usize >= vocab) {
        Some(index) => Err(InputError::TokenOutOfRange {
            id: tokens[index],
            index,
            vocab,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_and_out_of_range_tokens_are_refused() {
        assert_eq!(check_tokens(&[], 4), Err(InputError::Empty));
        assert_eq!(check_tokens(&[0, 3], 4), Ok(()));
        assert_eq!(
            check_tokens(&[0, 4, 9], 4),
            Err(InputError::TokenOutOfRange {
                id: 4,
                index: 1,
                vocab: 4
            })
        );
    }
}
