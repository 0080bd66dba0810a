//! The binary tensor table: one fixed-order record per tensor, little-endian.
//!
//! ```text
//! count: u64
//! per entry: name_len: u16, name: [u8; name_len] (UTF-8), dtype: u16, ndim: u8 (<= 8),
//!            shape: [u64; ndim], offset: u64, nbytes: u64, checksum: u64
//! ```
//!
//! Decoding checks the encoding only (lengths, UTF-8, known dtype ids, shape fits `usize`);
//! placement and size rules are checked by the reader, which knows the file.

use std::path::Path;

use quant_codecs::DType;

use crate::CmfError;

/// Most dimensions a tensor may have.
pub const MAX_NDIM: usize = 8;

/// Longest tensor name in bytes.
pub const MAX_NAME_LEN: usize = u16::MAX as usize;

/// Bytes of the smallest possible entry (a one-byte name, a scalar): bounds `count` before allocating.
const MIN_ENTRY: u64 = 2 + 1 + 2 + 1 + 8 * 3;

/// One tensor's record in the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Its unique, non-empty name, e.g. `model.layers.0.mlp.down_proj.weight`.
    pub name: String,
    /// Its storage dtype.
    pub dtype: DType,
    /// Its shape, outermost first (matrices are `[rows, cols]`).
    pub shape: Vec<usize>,
    /// Absolute file offset of the payload (a multiple of [`ALIGN`](crate::ALIGN)).
    pub offset: u64,
    /// Payload length, equal to `dtype.expected_nbytes(shape)`.
    pub nbytes: u64,
    /// xxh3-64 (seed 0) of the payload.
    pub checksum: u64,
}

impl TensorInfo {
    /// The number of elements (the product of the shape; 1 for a scalar).
    pub fn elements(&self) -> u64 {
        self.shape
            .iter()
            .fold(1u64, |acc, &d| acc.saturating_mul(d as u64))
    }
}

/// Appends the table encoding of `entries` to a new buffer.
pub(crate) fn encode(entries: &[TensorInfo]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + entries.len() * 64);
    out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    for e in entries {
        // The writer checked name length and ndim before accepting the tensor.
        out.extend_from_slice(&(e.name.len() as u16).to_le_bytes());
        out.extend_from_slice(e.name.as_bytes());
        out.extend_from_slice(&e.dtype.id().to_le_bytes());
        out.push(e.shape.len() as u8);
        for &d in &e.shape {
            out.extend_from_slice(&(d as u64).to_le_bytes());
        }
        out.extend_from_slice(&e.offset.to_le_bytes());
        out.extend_from_slice(&e.nbytes.to_le_bytes());
        out.extend_from_slice(&e.checksum.to_le_bytes());
    }
    out
}

/// A cursor that reports where the table ran out.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
    index: u64,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], CmfError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(CmfError::Table {
                path: self.path.to_path_buf(),
                index: self.index,
                detail: format!(
                    "table ends inside {what}: needs {n} bytes at table offset {}, table is {} bytes",
                    self.pos,
                    self.bytes.len()
                ),
            });
        };
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], CmfError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self, what: &str) -> Result<u8, CmfError> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, CmfError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64, CmfError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn err(&self, detail: String) -> CmfError {
        CmfError::Table {
            path: self.path.to_path_buf(),
            index: self.index,
            detail,
        }
    }
}

/// Decodes a whole table; it must end exactly at the end of `bytes`.
pub(crate) fn decode(bytes: &[u8], path: &Path) -> Result<Vec<TensorInfo>, CmfError> {
    let mut c = Cursor {
        bytes,
        pos: 0,
        path,
        index: 0,
    };
    let count = c.u64("the entry count")?;
    let most = (bytes.len() as u64).saturating_sub(8) / MIN_ENTRY;
    if count > most {
        return Err(c.err(format!(
            "count {count} cannot fit in a {}-byte table (at most {most} entries)",
            bytes.len()
        )));
    }
    // `count <= most <= bytes.len()`, so this allocation is bounded by the table's size.
    let mut entries = Vec::with_capacity(count as usize);
    for index in 0..count {
        c.index = index;
        let name_len = c.u16("name_len")? as usize;
        let raw = c.take(name_len, "the name")?;
        let name = std::str::from_utf8(raw).map_err(|e| CmfError::BadName {
            path: path.to_path_buf(),
            name: String::from_utf8_lossy(raw).into_owned(),
            detail: format!("table entry {index}: not UTF-8 ({e})"),
        })?;
        if name.is_empty() {
            return Err(CmfError::BadName {
                path: path.to_path_buf(),
                name: String::new(),
                detail: format!("table entry {index}: names must not be empty"),
            });
        }
        let id = c.u16("dtype")?;
        let dtype = DType::from_id(id)
            .ok_or_else(|| c.err(format!("tensor {name:?}: unknown dtype id {id}")))?;
        let ndim = c.u8("ndim")? as usize;
        if ndim > MAX_NDIM {
            return Err(c.err(format!(
                "tensor {name:?}: ndim {ndim} exceeds the maximum {MAX_NDIM}"
            )));
        }
        let mut shape = Vec::with_capacity(ndim);
        for _ in 0..ndim {
            let d = c.u64("shape")?;
            let d = usize::try_from(d).map_err(|_| {
                c.err(format!(
                    "tensor {name:?}: dimension {d} does not fit this platform's usize"
                ))
            })?;
            shape.push(d);
        }
        let offset = c.u64("offset")?;
        let nbytes = c.u64("nbytes")?;
        let checksum = c.u64("checksum")?;
        entries.push(TensorInfo {
            name: name.to_string(),
            dtype,
            shape,
            offset,
            nbytes,
            checksum,
        });
    }
    if c.pos != bytes.len() {
        c.index = count;
        return Err(c.err(format!(
            "{} trailing bytes after the last entry (table_len {}, entries end at {})",
            bytes.len() - c.pos,
            bytes.len(),
            c.pos
        )));
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<TensorInfo> {
        vec![
            TensorInfo {
                name: "a".into(),
                dtype: DType::F32,
                shape: vec![],
                offset: 4096,
                nbytes: 4,
                checksum: 7,
            },
            TensorInfo {
                name: "layers.0.w".into(),
                dtype: DType::Mxfp4,
                shape: vec![2, 4, 64],
                offset: 4352,
                nbytes: 272,
                checksum: u64::MAX,
            },
        ]
    }

    #[test]
    fn round_trip() {
        let t = sample();
        let bytes = encode(&t);
        assert_eq!(
            bytes.len(),
            8 + (2 + 1 + 2 + 1 + 24) + (2 + 10 + 2 + 1 + 24 + 24)
        );
        assert_eq!(decode(&bytes, Path::new("t")).unwrap(), t);
    }

    #[test]
    fn every_truncation_and_extension_is_refused() {
        let bytes = encode(&sample());
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut], Path::new("t")).is_err(), "cut {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(matches!(
            decode(&longer, Path::new("t")),
            Err(CmfError::Table { index: 2, .. })
        ));
    }

    #[test]
    fn huge_count_does_not_allocate() {
        let mut bytes = encode(&sample());
        bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            decode(&bytes, Path::new("t")),
            Err(CmfError::Table { index: 0, .. })
        ));
    }
}
