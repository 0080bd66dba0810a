//! [`CmfWriter`]: streams payloads to a temporary file and renames it into place on `finish`.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use quant_codecs::DType;
use xxhash_rust::xxh3::Xxh3;

use crate::preamble::{CHECKED_PREFIX, Preamble, meta_checksum};
use crate::table::{self, MAX_NAME_LEN, MAX_NDIM, TensorInfo};
use crate::{ALIGN, CmfError, DATA_START, Header, PREAMBLE_LEN, VERSION};

/// Bytes read from an `add_tensor_from_reader` source at a time.
const CHUNK: usize = 1 << 20;

/// Writes a CMF file atomically.
///
/// Payloads stream straight to a temporary file next to the target (`.{name}.tmp-{pid}[-n]`);
/// only the small tensor table is kept in memory. [`finish`](CmfWriter::finish) writes the header,
/// the table and the preamble, syncs, and renames the temporary file onto the target. Until then
/// the target path is untouched: if the writer is dropped, or fails with an I/O error or a short
/// reader, the temporary file is removed. Errors found before any byte is written (a bad name,
/// dtype or shape, a payload of the wrong length) leave the writer usable.
pub struct CmfWriter {
    target: PathBuf,
    tmp: PathBuf,
    file: Option<BufWriter<File>>,
    pos: u64,
    header: Header,
    entries: Vec<TensorInfo>,
    names: HashSet<String>,
}

impl std::fmt::Debug for CmfWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmfWriter")
            .field("target", &self.target)
            .field("tmp", &self.tmp)
            .field("tensors", &self.entries.len())
            .field("pos", &self.pos)
            .finish()
    }
}

impl CmfWriter {
    /// Starts writing a file that will appear at `path` when [`finish`](CmfWriter::finish) succeeds.
    pub fn create(path: impl AsRef<Path>, header: Header) -> Result<CmfWriter, CmfError> {
        let target = path.as_ref().to_path_buf();
        let Some(name) = target.file_name().map(|n| n.to_string_lossy().into_owned()) else {
            return Err(CmfError::io(
                &target,
                io::Error::new(io::ErrorKind::InvalidInput, "not a file path"),
            ));
        };
        let dir = match target.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let (tmp, file) = create_temp(&dir, &name)?;
        let mut w = CmfWriter {
            target,
            tmp,
            file: Some(BufWriter::with_capacity(CHUNK, file)),
            pos: 0,
            header,
            entries: Vec::new(),
            names: HashSet::new(),
        };
        w.write_zeros(DATA_START)?;
        Ok(w)
    }

    /// The header that `finish` will write.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The header, for changes until `finish` (e.g. provenance filled in while converting).
    pub fn header_mut(&mut self) -> &mut Header {
        &mut self.header
    }

    /// Replaces the header.
    pub fn set_header(&mut self, header: Header) {
        self.header = header;
    }

    /// The tensors added so far.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.entries
    }

    /// Appends a tensor whose payload is in memory. `bytes.len()` must equal
    /// `dtype.expected_nbytes(shape)`.
    pub fn add_tensor(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        bytes: &[u8],
    ) -> Result<(), CmfError> {
        let nbytes = self.check_new(name, dtype, shape)?;
        if bytes.len() as u64 != nbytes {
            return Err(self.length_error(name, dtype, shape, nbytes, bytes.len() as u64));
        }
        self.add_tensor_from_reader(name, dtype, shape, bytes)
    }

    /// Appends a tensor whose payload is read from `reader` in chunks, hashing as it goes.
    ///
    /// The reader must yield exactly `dtype.expected_nbytes(shape)` bytes; fewer or more is an
    /// error that abandons the whole file (the temporary file is removed).
    pub fn add_tensor_from_reader(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        mut reader: impl Read,
    ) -> Result<(), CmfError> {
        let nbytes = self.check_new(name, dtype, shape)?;
        let result = self.stream(name, dtype, shape, nbytes, &mut reader);
        if result.is_err() {
            self.abandon();
        }
        result
    }

    fn stream(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        nbytes: u64,
        reader: &mut dyn Read,
    ) -> Result<(), CmfError> {
        let pad = self.pos.next_multiple_of(ALIGN) - self.pos;
        self.write_zeros(pad)?;
        let offset = self.pos;
        let mut hasher = Xxh3::new();
        let mut buf = vec![0u8; CHUNK.min(nbytes as usize).max(1)];
        let mut done = 0u64;
        while done < nbytes {
            let want = buf.len().min((nbytes - done) as usize);
            let n = match reader.read(&mut buf[..want]) {
                Ok(0) => return Err(self.length_error(name, dtype, shape, nbytes, done)),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(CmfError::io(&self.target, e)),
            };
            hasher.update(&buf[..n]);
            self.write(&buf[..n])?;
            done += n as u64;
        }
        let mut probe = [0u8; 1];
        loop {
            match reader.read(&mut probe) {
                Ok(0) => break,
                Ok(_) => return Err(self.length_error(name, dtype, shape, nbytes, nbytes + 1)),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(CmfError::io(&self.target, e)),
            }
        }
        self.names.insert(name.to_string());
        self.entries.push(TensorInfo {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            offset,
            nbytes,
            checksum: hasher.digest(),
        });
        Ok(())
    }

    /// Writes header, table and preamble, syncs, and renames onto the target. Returns the target.
    pub fn finish(mut self) -> Result<PathBuf, CmfError> {
        let result = self.finish_inner();
        if result.is_err() {
            self.abandon();
        }
        result
    }

    fn finish_inner(&mut self) -> Result<PathBuf, CmfError> {
        self.header.validate(&self.target)?;
        let header = serde_json::to_vec(&self.header).map_err(|source| CmfError::HeaderJson {
            path: self.target.clone(),
            source,
        })?;
        let table = table::encode(&self.entries);
        let header_offset = self.pos;
        self.write(&header)?;
        let table_offset = self.pos;
        self.write(&table)?;
        let mut pre = Preamble {
            version: VERSION,
            preamble_len: PREAMBLE_LEN,
            required_features: 0,
            optional_features: 0,
            header_offset,
            header_len: header.len() as u64,
            table_offset,
            table_len: table.len() as u64,
            meta_checksum: 0,
        };
        pre.meta_checksum = meta_checksum(&pre.encode()[..CHECKED_PREFIX], &header, &table);
        let Some(buffered) = self.file.take() else {
            return Err(CmfError::WriterPoisoned {
                path: self.target.clone(),
            });
        };
        let tmp = self.tmp.clone();
        let io_err = |e| CmfError::io(&tmp, e);
        let mut file = buffered.into_inner().map_err(|e| io_err(e.into_error()))?;
        file.seek(SeekFrom::Start(0)).map_err(io_err)?;
        file.write_all(&pre.encode()).map_err(io_err)?;
        file.sync_all().map_err(io_err)?;
        drop(file);
        std::fs::rename(&self.tmp, &self.target).map_err(|e| CmfError::io(&self.target, e))?;
        // The rename is done: from here on the temporary path no longer exists.
        self.tmp = PathBuf::new();
        sync_dir(&self.target);
        Ok(self.target.clone())
    }

    /// Checks a new tensor before any byte is written; returns its payload length.
    fn check_new(&self, name: &str, dtype: DType, shape: &[usize]) -> Result<u64, CmfError> {
        if self.file.is_none() {
            return Err(CmfError::WriterPoisoned {
                path: self.target.clone(),
            });
        }
        let bad = |detail: String| CmfError::BadName {
            path: self.target.clone(),
            name: name.to_string(),
            detail,
        };
        if name.is_empty() {
            return Err(bad("names must not be empty".into()));
        }
        if name.len() > MAX_NAME_LEN {
            return Err(bad(format!(
                "{} bytes long, the limit is {MAX_NAME_LEN}",
                name.len()
            )));
        }
        if self.names.contains(name) {
            return Err(CmfError::DuplicateTensor {
                path: self.target.clone(),
                name: name.to_string(),
            });
        }
        if shape.len() > MAX_NDIM {
            return Err(bad(format!(
                "shape {shape:?} has more than {MAX_NDIM} dimensions"
            )));
        }
        let n = dtype
            .expected_nbytes(shape)
            .map_err(|source| CmfError::Tensor {
                path: self.target.clone(),
                name: name.to_string(),
                source,
            })?;
        Ok(n as u64)
    }

    fn length_error(
        &self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        expected: u64,
        found: u64,
    ) -> CmfError {
        CmfError::PayloadLength {
            path: self.target.clone(),
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            expected,
            found,
        }
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), CmfError> {
        let Some(f) = self.file.as_mut() else {
            return Err(CmfError::WriterPoisoned {
                path: self.target.clone(),
            });
        };
        if let Err(e) = f.write_all(bytes) {
            let err = CmfError::io(&self.tmp, e);
            self.abandon();
            return Err(err);
        }
        self.pos += bytes.len() as u64;
        Ok(())
    }

    fn write_zeros(&mut self, n: u64) -> Result<(), CmfError> {
        const ZEROS: [u8; 4096] = [0; 4096];
        let mut left = n;
        while left > 0 {
            let k = left.min(ZEROS.len() as u64) as usize;
            self.write(&ZEROS[..k])?;
            left -= k as u64;
        }
        Ok(())
    }

    /// Drops the file handle and removes the temporary file; later calls report `WriterPoisoned`.
    fn abandon(&mut self) {
        self.file = None;
        if !self.tmp.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.tmp);
            self.tmp = PathBuf::new();
        }
    }
}

impl Drop for CmfWriter {
    fn drop(&mut self) {
        self.abandon();
    }
}

/// Creates `.{name}.tmp-{pid}` in `dir`, or `…-{pid}-{n}` if that exists, never reusing a file.
/// The temporary files writers of `target` left or are using (`.{name}.tmp-{pid}[-n]` beside
/// it), each with the id of the process that made it. A caller removes those of processes that
/// no longer run (a conversion killed hard), or its own on an interrupt.
pub fn temp_files(target: &Path) -> Vec<(PathBuf, u32)> {
    let Some(name) = target.file_name().map(|n| n.to_string_lossy().into_owned()) else {
        return Vec::new();
    };
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let prefix = format!(".{name}.tmp-");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut out: Vec<(PathBuf, u32)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let file_name = e.file_name().to_string_lossy().into_owned();
            let rest = file_name.strip_prefix(&prefix)?;
            let pid = rest.split('-').next()?.parse().ok()?;
            Some((e.path(), pid))
        })
        .collect();
    out.sort();
    out
}

fn create_temp(dir: &Path, name: &str) -> Result<(PathBuf, File), CmfError> {
    let pid = std::process::id();
    for n in 0..1000u32 {
        let file_name = if n == 0 {
            format!(".{name}.tmp-{pid}")
        } else {
            format!(".{name}.tmp-{pid}-{n}")
        };
        let tmp = dir.join(file_name);
        match OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(CmfError::io(tmp, e)),
        }
    }
    Err(CmfError::io(
        dir,
        io::Error::new(io::ErrorKind::AlreadyExists, "no free temporary file name"),
    ))
}

/// Makes the rename durable where the platform allows syncing a directory; best effort.
fn sync_dir(target: &Path) {
    #[cfg(unix)]
    if let Some(dir) = target.parent() {
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    #[cfg(not(unix))]
    let _ = target;
}
