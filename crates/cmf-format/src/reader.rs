//! [`Cmf`]: an opened, fully validated CMF file, and the views it hands out.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::ops::Range;
use std::path::{Path, PathBuf};

use quant_codecs::{CodecError, DType};

use crate::preamble::{CHECKED_PREFIX, Preamble, meta_checksum};
use crate::table::{self, TensorInfo};
use crate::{ALIGN, CmfError, DATA_START, Header};

/// The name used in errors for files built with [`Cmf::from_bytes`].
pub const IN_MEMORY: &str = "<memory>";

enum Backing {
    Mmap(memmap2::Mmap),
    Owned(Box<[u8]>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(b) => b,
        }
    }
}

/// An opened CMF model file.
///
/// Every constructor validates the whole container before returning (see `docs/cmf.md`,
/// "Validation"): afterwards the accessors hand out views without checking again. Payload
/// checksums are the one thing left to [`verify`](Cmf::verify), since they need every byte read.
pub struct Cmf {
    backing: Backing,
    path: PathBuf,
    on_disk: bool,
    header: Header,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    uid: u64,
    version: u32,
    optional_features: u64,
}

impl std::fmt::Debug for Cmf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cmf")
            .field("path", &self.path)
            .field("uid", &format_args!("{:016x}", self.uid))
            .field("architecture", &self.header.architecture)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// One tensor of an opened file: its record and its payload, borrowed from the file.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    /// The record from the tensor table.
    pub info: &'a TensorInfo,
    /// The payload, `info.nbytes` bytes at `info.offset` (zero-copy).
    pub bytes: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// The tensor's name.
    pub fn name(&self) -> &'a str {
        &self.info.name
    }
    /// The tensor's dtype.
    pub fn dtype(&self) -> DType {
        self.info.dtype
    }
    /// The tensor's shape.
    pub fn shape(&self) -> &'a [usize] {
        &self.info.shape
    }
}

impl Cmf {
    /// Opens and validates the file at `path`, memory-mapping it.
    ///
    /// Files shorter than the data region start are read into memory instead (they cannot be
    /// valid, and this keeps empty files away from `mmap`).
    ///
    /// # Safety
    ///
    /// This function is safe to call, but it maps the file: the views it hands out borrow the
    /// mapping, so the file **must not be truncated or modified** while the `Cmf` lives (another
    /// process doing so can change or remove bytes under a `&[u8]`). CMF files are written once,
    /// atomically by rename ([`CmfWriter`](crate::CmfWriter)), so replacing a file is fine; editing it
    /// in place is not. When that cannot be promised, use [`Cmf::read`].
    pub fn open(path: impl AsRef<Path>) -> Result<Cmf, CmfError> {
        let path = path.as_ref();
        let file = open_regular(path)?;
        let len = file.metadata().map_err(|e| CmfError::io(path, e))?.len();
        let backing = if len < DATA_START {
            Backing::Owned(read_all(file, path)?)
        } else {
            // SAFETY: the caller accepts the contract in `open`'s `# Safety` section: the file is
            // not truncated or modified while mapped. Nothing here writes through the mapping.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| CmfError::io(path, e))?;
            Backing::Mmap(map)
        };
        Cmf::validate(backing, path.to_path_buf(), true)
    }

    /// Reads the file at `path` into memory and validates it: no mapping, no contract.
    pub fn read(path: impl AsRef<Path>) -> Result<Cmf, CmfError> {
        let path = path.as_ref();
        let file = open_regular(path)?;
        Cmf::validate(
            Backing::Owned(read_all(file, path)?),
            path.to_path_buf(),
            true,
        )
    }

    /// Validates a file held in memory. Errors name the file [`IN_MEMORY`].
    ///
    /// This is the same validation [`open`](Cmf::open) runs, and any input returns `Ok` or
    /// `Err` without panicking (the crate's fuzz tests feed it mutated files).
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Result<Cmf, CmfError> {
        let bytes = bytes.into().into_boxed_slice();
        Cmf::validate(Backing::Owned(bytes), PathBuf::from(IN_MEMORY), false)
    }

    fn validate(backing: Backing, path: PathBuf, on_disk: bool) -> Result<Cmf, CmfError> {
        let bytes = backing.bytes();
        let file_len = bytes.len() as u64;
        let p = Preamble::decode(bytes, &path)?;
        if p.header_offset < DATA_START {
            return Err(CmfError::Preamble {
                path,
                field: "header_offset",
                detail: format!(
                    "must be at least {DATA_START} (the data region start), found {}",
                    p.header_offset
                ),
            });
        }
        let header_range = region(&path, "header", p.header_offset, p.header_len, file_len)?;
        if p.table_offset < header_range.end as u64 {
            return Err(CmfError::Preamble {
                path,
                field: "table_offset",
                detail: format!(
                    "must be at or after the header's end {}, found {}",
                    header_range.end, p.table_offset
                ),
            });
        }
        let table_range = region(&path, "table", p.table_offset, p.table_len, file_len)?;
        let header_bytes = &bytes[header_range];
        let table_bytes = &bytes[table_range];
        let found = meta_checksum(&bytes[..CHECKED_PREFIX], header_bytes, table_bytes);
        if found != p.meta_checksum {
            return Err(CmfError::MetaChecksum {
                path,
                expected: p.meta_checksum,
                found,
            });
        }
        let header: Header = match serde_json::from_slice(header_bytes) {
            Ok(h) => h,
            Err(source) => return Err(CmfError::HeaderJson { path, source }),
        };
        header.validate(&path)?;
        let tensors = table::decode(table_bytes, &path)?;
        let by_name = check_tensors(&tensors, &path, p.header_offset)?;
        Ok(Cmf {
            path,
            on_disk,
            header,
            tensors,
            by_name,
            uid: p.meta_checksum,
            version: p.version,
            optional_features: p.optional_features,
            backing,
        })
    }

    /// The parsed header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The file's identity: its meta checksum (xxh3-64 over preamble fields, header and table).
    ///
    /// Two files with equal uids have the same header and table, and so, once verified, the
    /// same payloads; it keys caches of uploaded weights and sidecar references.
    pub fn uid(&self) -> u64 {
        self.uid
    }

    /// The path it was opened from, or `None` for [`from_bytes`](Cmf::from_bytes).
    pub fn path(&self) -> Option<&Path> {
        self.on_disk.then_some(self.path.as_path())
    }

    /// The path as used in error messages ([`IN_MEMORY`] for in-memory files).
    pub fn display_path(&self) -> &Path {
        &self.path
    }

    /// The format version (always [`VERSION`](crate::VERSION) for a file this reader accepted).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The `optional_features` bits, including ones this reader does not know.
    pub fn optional_features(&self) -> u64 {
        self.optional_features
    }

    /// The file's length in bytes.
    pub fn file_len(&self) -> u64 {
        self.backing.bytes().len() as u64
    }

    /// The whole file, e.g. to upload the data region at once and bind tensors at their offsets.
    pub fn as_bytes(&self) -> &[u8] {
        self.backing.bytes()
    }

    /// Every tensor's record, in table order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The index in table order of the tensor named `name` (its id: what a device arena or a
    /// trace keys a tensor by).
    pub fn tensor_index(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.by_name.get(name).and_then(|&i| self.tensor_at(i))
    }

    /// The tensor at `index` in table order.
    pub fn tensor_at(&self, index: usize) -> Option<TensorView<'_>> {
        let info = self.tensors.get(index)?;
        // Validation put every payload inside the file, so these casts cannot truncate.
        let start = info.offset as usize;
        let bytes = self
            .backing
            .bytes()
            .get(start..start + info.nbytes as usize)?;
        Some(TensorView { info, bytes })
    }

    /// Checks every payload against its checksum.
    ///
    /// Returns the single error when one tensor is bad and [`CmfError::Partial`] listing every
    /// bad tensor when several are.
    pub fn verify(&self) -> Result<(), CmfError> {
        let mut errors: Vec<CmfError> = (0..self.tensors.len())
            .filter_map(|i| self.verify_at(i).err())
            .collect();
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.remove(0)),
            _ => Err(CmfError::Partial(errors)),
        }
    }

    /// Checks one tensor's payload against its checksum.
    pub fn verify_tensor(&self, name: &str) -> Result<(), CmfError> {
        match self.by_name.get(name) {
            Some(&i) => self.verify_at(i),
            None => Err(CmfError::UnknownTensor {
                path: self.path.clone(),
                name: name.to_string(),
            }),
        }
    }

    fn verify_at(&self, index: usize) -> Result<(), CmfError> {
        let Some(view) = self.tensor_at(index) else {
            return Ok(());
        };
        let found = xxhash_rust::xxh3::xxh3_64(view.bytes);
        if found == view.info.checksum {
            Ok(())
        } else {
            Err(CmfError::Checksum {
                path: self.path.clone(),
                name: view.info.name.clone(),
                expected: view.info.checksum,
                found,
            })
        }
    }
}

fn read_all(mut file: File, path: &Path) -> Result<Box<[u8]>, CmfError> {
    let mut v = Vec::new();
    file.read_to_end(&mut v)
        .map_err(|e| CmfError::io(path, e))?;
    Ok(v.into_boxed_slice())
}

/// `[offset, offset + len)` as a slice range, if it lies inside a file of `file_len` bytes.
fn region(
    path: &Path,
    what: &str,
    offset: u64,
    len: u64,
    file_len: u64,
) -> Result<Range<usize>, CmfError> {
    match offset.checked_add(len) {
        // `end <= file_len`, the length of an in-memory slice, so both fit `usize`.
        Some(end) if end <= file_len => Ok(offset as usize..end as usize),
        _ => Err(CmfError::OutOfBounds {
            path: path.to_path_buf(),
            what: what.to_string(),
            offset,
            len,
            region: "the file",
            start: 0,
            end: file_len,
        }),
    }
}

/// The per-tensor rules: unique names, sizes that match dtype and shape, aligned payloads inside
/// the data region, no overlaps. Returns the name index.
fn check_tensors(
    tensors: &[TensorInfo],
    path: &Path,
    data_end: u64,
) -> Result<HashMap<String, usize>, CmfError> {
    let mut by_name = HashMap::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        if by_name.insert(t.name.clone(), i).is_some() {
            return Err(CmfError::DuplicateTensor {
                path: path.to_path_buf(),
                name: t.name.clone(),
            });
        }
        let codec_err = |source| CmfError::Tensor {
            path: path.to_path_buf(),
            name: t.name.clone(),
            source,
        };
        // A zero dimension makes any byte size 0, but consumers still multiply the others:
        // the element count must fit `usize` whatever the dtype.
        if t.shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d.max(1)))
            .is_none()
        {
            return Err(codec_err(CodecError::Overflow {
                dtype: t.dtype,
                shape: t.shape.clone(),
            }));
        }
        let expected = t.dtype.expected_nbytes(&t.shape).map_err(codec_err)?;
        if expected as u64 != t.nbytes {
            return Err(CmfError::PayloadLength {
                path: path.to_path_buf(),
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                expected: expected as u64,
                found: t.nbytes,
            });
        }
        if t.offset % ALIGN != 0 {
            return Err(CmfError::Misaligned {
                path: path.to_path_buf(),
                name: t.name.clone(),
                offset: t.offset,
                align: ALIGN,
            });
        }
        let inside = t.offset >= DATA_START
            && t.offset
                .checked_add(t.nbytes)
                .is_some_and(|end| end <= data_end);
        if !inside {
            return Err(CmfError::OutOfBounds {
                path: path.to_path_buf(),
                what: format!("tensor {:?}", t.name),
                offset: t.offset,
                len: t.nbytes,
                region: "the data region",
                start: DATA_START,
                end: data_end,
            });
        }
    }
    // Every payload is now inside the data region, so `offset + nbytes` cannot overflow.
    let mut order: Vec<&TensorInfo> = tensors.iter().filter(|t| t.nbytes > 0).collect();
    order.sort_by_key(|t| t.offset);
    for w in order.windows(2) {
        let (a, b) = (w[0], w[1]);
        if a.offset + a.nbytes > b.offset {
            return Err(CmfError::Overlap {
                path: path.to_path_buf(),
                a: a.name.clone(),
                a_start: a.offset,
                a_end: a.offset + a.nbytes,
                b: b.name.clone(),
                b_start: b.offset,
                b_end: b.offset + b.nbytes,
            });
        }
    }
    Ok(by_name)
}

/// What a path that is not a regular file is, in words (`None` for a regular file): opening a
/// directory as a model fails obscurely, reading a device never ends, opening a FIFO blocks.
pub fn non_regular_kind(meta: &std::fs::Metadata) -> Option<&'static str> {
    let t = meta.file_type();
    if t.is_file() {
        return None;
    }
    if t.is_dir() {
        return Some("a directory");
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return Some("a FIFO");
        }
        if t.is_socket() {
            return Some("a socket");
        }
        if t.is_char_device() || t.is_block_device() {
            return Some("a device");
        }
    }
    Some("not a regular file")
}

/// Opens `path` for reading if it is a regular file; otherwise an error saying what it is.
fn open_regular(path: &Path) -> Result<File, CmfError> {
    let meta = std::fs::metadata(path).map_err(|e| CmfError::io(path, e))?;
    if let Some(kind) = non_regular_kind(&meta) {
        return Err(CmfError::io(
            path,
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("is {kind}, not a regular file (a CMF model is one file)"),
            ),
        ));
    }
    File::open(path).map_err(|e| CmfError::io(path, e))
}
