//! The crate's one error type, [`CmfError`]: what was wrong, where, and the numbers that show it.

use std::path::PathBuf;

use quant_codecs::CodecError;

/// Everything opening, verifying or writing a CMF file can refuse.
///
/// Every variant names the file (`path`; `<memory>` for [`Cmf::from_bytes`](crate::Cmf::from_bytes))
/// and, where one is involved, the tensor or header field, with the expected value next to the
/// one found.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CmfError {
    /// An operating-system error reading, writing, syncing or renaming a file.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file does not start with `CORTIQMF`.
    #[error("{}: not a CMF file (magic {found:02x?}, expected \"CORTIQMF\")", path.display())]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// Up to the first 8 bytes of the file.
        found: Vec<u8>,
    },
    /// The format version is not one this reader understands.
    #[error("{}: CMF version {found} is not supported (this reader supports version {supported})", path.display())]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// The version in the file.
        found: u32,
        /// The version this reader supports.
        supported: u32,
    },
    /// A preamble field holds a value the format forbids (e.g. `preamble_len`, non-zero reserved bytes).
    #[error("{}: preamble field {field}: {detail}", path.display())]
    Preamble {
        /// The file.
        path: PathBuf,
        /// The field's name in docs/cmf.md.
        field: &'static str,
        /// Expected against found.
        detail: String,
    },
    /// The file needs features this reader does not implement.
    #[error("{}: file requires unknown features (required_features bits {bits:#018x})", path.display())]
    UnknownRequiredFeatures {
        /// The file.
        path: PathBuf,
        /// The unknown bits only.
        bits: u64,
    },
    /// A region (preamble, header, table or a tensor's payload) lies outside where it may.
    #[error("{}: {what} at offset {offset} with length {len} lies outside {region} [{start}, {end})", path.display())]
    OutOfBounds {
        /// The file.
        path: PathBuf,
        /// The region: `"preamble"`, `"header"`, `"table"`, or `tensor "name"`.
        what: String,
        /// Start of the region.
        offset: u64,
        /// Length of the region.
        len: u64,
        /// Where it must lie: `"the file"`, `"the data region"`.
        region: &'static str,
        /// First allowed offset.
        start: u64,
        /// End of the allowed range (exclusive): the file length, or `header_offset` for payloads.
        end: u64,
    },
    /// The xxh3-64 of preamble fields, header and table differs from `meta_checksum`.
    #[error("{}: metadata checksum mismatch (preamble says {expected:#018x}, header+table hash to {found:#018x})", path.display())]
    MetaChecksum {
        /// The file.
        path: PathBuf,
        /// The stored checksum.
        expected: u64,
        /// The checksum computed.
        found: u64,
    },
    /// The header is not valid JSON of the expected shape.
    #[error("{}: header JSON: {source}", path.display())]
    HeaderJson {
        /// The file.
        path: PathBuf,
        /// The parser's error (with line and column).
        source: serde_json::Error,
    },
    /// A header field holds a value the format forbids.
    #[error("{}: header field `{field}`: {detail}", path.display())]
    Header {
        /// The file.
        path: PathBuf,
        /// The field, as a JSON path (`format`, `sidecars[1].file`).
        field: String,
        /// Expected against found.
        detail: String,
    },
    /// The binary tensor table is malformed.
    #[error("{}: tensor table entry {index}: {detail}", path.display())]
    Table {
        /// The file.
        path: PathBuf,
        /// The entry's index (the count field reports index 0).
        index: u64,
        /// What is wrong, with the numbers.
        detail: String,
    },
    /// A tensor's name is empty, too long or not valid.
    #[error("{}: tensor name {name:?}: {detail}", path.display())]
    BadName {
        /// The file.
        path: PathBuf,
        /// The name (lossily decoded if it was not UTF-8).
        name: String,
        /// Why it is refused.
        detail: String,
    },
    /// Two tensors share a name.
    #[error("{}: duplicate tensor name {name:?}", path.display())]
    DuplicateTensor {
        /// The file.
        path: PathBuf,
        /// The repeated name.
        name: String,
    },
    /// No tensor of this name exists.
    #[error("{}: no tensor named {name:?}", path.display())]
    UnknownTensor {
        /// The file.
        path: PathBuf,
        /// The name asked for.
        name: String,
    },
    /// A tensor's dtype or shape is invalid (unknown dtype id, shape the dtype cannot hold).
    #[error("{}: tensor {name:?}: {source}", path.display())]
    Tensor {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// What quant-codecs refused.
        source: CodecError,
    },
    /// A payload's length differs from `expected_nbytes(dtype, shape)`.
    #[error("{}: tensor {name:?} ({dtype} {shape:?}) must be {expected} bytes, found {found}", path.display())]
    PayloadLength {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// Its dtype.
        dtype: quant_codecs::DType,
        /// Its shape.
        shape: Vec<usize>,
        /// `dtype.expected_nbytes(shape)`.
        expected: u64,
        /// The length in the table, or the bytes a writer was given.
        found: u64,
    },
    /// A tensor's data offset is not a multiple of [`ALIGN`](crate::ALIGN).
    #[error("{}: tensor {name:?} at offset {offset} is not aligned to {align} bytes", path.display())]
    Misaligned {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// Its offset.
        offset: u64,
        /// The required alignment.
        align: u64,
    },
    /// Two tensors' payloads share bytes.
    #[error("{}: tensors {a:?} [{a_start}, {a_end}) and {b:?} [{b_start}, {b_end}) overlap", path.display())]
    Overlap {
        /// The file.
        path: PathBuf,
        /// The earlier tensor.
        a: String,
        /// Its start offset.
        a_start: u64,
        /// Its end offset.
        a_end: u64,
        /// The later tensor.
        b: String,
        /// Its start offset.
        b_start: u64,
        /// Its end offset.
        b_end: u64,
    },
    /// A payload's xxh3-64 differs from the table's checksum.
    #[error("{}: tensor {name:?} checksum mismatch (table says {expected:#018x}, payload hashes to {found:#018x})", path.display())]
    Checksum {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The checksum in the table.
        expected: u64,
        /// The checksum computed.
        found: u64,
    },
    /// Several errors, e.g. every corrupt tensor found by [`Cmf::verify`](crate::Cmf::verify).
    #[error("{} errors:\n{}", .0.len(), .0.iter().map(|e| format!("  {e}")).collect::<Vec<_>>().join("\n"))]
    Partial(Vec<CmfError>),
    /// A sidecar could not be found or resolved.
    #[error("{}: sidecar {role:?}: {detail}", path.display())]
    Sidecar {
        /// The main file.
        path: PathBuf,
        /// The role asked for.
        role: String,
        /// What went wrong.
        detail: String,
    },
    /// A sidecar file exists but is not the one the main file was written with.
    #[error("{}: not the {role:?} sidecar its main file expects: {field} is {found}, expected {expected}", path.display())]
    SidecarMismatch {
        /// The sidecar file.
        path: PathBuf,
        /// The role asked for.
        role: String,
        /// What differs: `"uid"` or `"sidecar_of.role"`.
        field: &'static str,
        /// The value the main file records.
        expected: String,
        /// The value the sidecar has.
        found: String,
    },
    /// The writer failed earlier (an I/O error or a short reader) and has removed its temporary file.
    #[error("{}: the writer failed earlier and can no longer be used", path.display())]
    WriterPoisoned {
        /// The target file.
        path: PathBuf,
    },
}

impl CmfError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> CmfError {
        CmfError::Io {
            path: path.into(),
            source,
        }
    }

    /// The individual errors: the list of a [`CmfError::Partial`], or this error alone.
    pub fn errors(&self) -> Vec<&CmfError> {
        match self {
            CmfError::Partial(v) => v.iter().collect(),
            e => vec![e],
        }
    }
}
