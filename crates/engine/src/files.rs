//! Opening what a user names: only regular files are read (a directory, a device or a FIFO is
//! refused with a message saying what it is), and text is read with a size limit, so no input
//! can make the engine read without bound or block forever.

use std::io::Read;
use std::path::{Path, PathBuf};

/// Largest text file `perplexity` and `run -f` read (256 MiB: about 60 M tokens, hours of CPU
/// scoring; a larger file is refused rather than silently truncated).
pub const MAX_TEXT_BYTES: u64 = 256 << 20;

/// Why a named file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The file does not exist or cannot be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The path given.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Not a regular file.
    #[error("{}: is {kind}, not a regular file", path.display())]
    NotRegular {
        /// The path given.
        path: PathBuf,
        /// What it is instead ("a directory", "a FIFO", ...).
        kind: &'static str,
    },
    /// Larger than the limit.
    #[error("{}: {size} bytes is larger than the {limit}-byte limit for a text file", path.display())]
    TooLarge {
        /// The path given.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// Not UTF-8 text.
    #[error("{}: not UTF-8 text (invalid byte at offset {offset})", path.display())]
    NotText {
        /// The path given.
        path: PathBuf,
        /// Where the first invalid byte is.
        offset: usize,
    },
}

/// Checks that `path` is a regular file (following links); returns its size.
pub fn check_regular(path: &Path) -> Result<u64, FileError> {
    let meta = std::fs::metadata(path).map_err(|source| FileError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    match cmf_format::non_regular_kind(&meta) {
        None => Ok(meta.len()),
        Some(kind) => Err(FileError::NotRegular {
            path: path.to_path_buf(),
            kind,
        }),
    }
}

/// Reads the UTF-8 text file at `path`, refusing anything but a regular file of at most `limit`
/// bytes (the read itself is bounded too, should the file grow meanwhile).
pub fn read_text(path: &Path, limit: u64) -> Result<String, FileError> {
    let size = check_regular(path)?;
    let too_large = |size| FileError::TooLarge {
        path: path.to_path_buf(),
        size,
        limit,
    };
    if size > limit {
        return Err(too_large(size));
    }
    let io = |source| FileError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut bytes = Vec::with_capacity(size as usize);
    std::fs::File::open(path)
        .map_err(io)?
        .take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64));
    }
    String::from_utf8(bytes).map_err(|e| FileError::NotText {
        path: path.to_path_buf(),
        offset: e.utf8_error().valid_up_to(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_bounded_utf8_files_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.txt");
        std::fs::write(&p, "héllo").unwrap();
        assert_eq!(read_text(&p, 100).unwrap(), "héllo");
        assert!(matches!(
            read_text(&p, 3),
            Err(FileError::TooLarge { size: 6, .. })
        ));
        assert!(matches!(
            read_text(dir.path(), 100),
            Err(FileError::NotRegular {
                kind: "a directory",
                ..
            })
        ));
        #[cfg(unix)]
        assert!(matches!(
            check_regular(Path::new("/dev/zero")),
            Err(FileError::NotRegular {
                kind: "a device",
                ..
            })
        ));
        std::fs::write(&p, [b'a', 0xff]).unwrap();
        assert!(matches!(
            read_text(&p, 100),
            Err(FileError::NotText { offset: 1, .. })
        ));
        assert!(matches!(
            read_text(&dir.path().join("missing"), 100),
            Err(FileError::Io { .. })
        ));
    }
}
