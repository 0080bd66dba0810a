//! The fixed 128-byte preamble at offset 0: magic, version, feature bits, where the header and
//! table are, and the checksum that covers them.

use std::path::Path;

use xxhash_rust::xxh3::Xxh3;

use crate::CmfError;

/// The first eight bytes of every CMF file.
pub const MAGIC: [u8; 8] = *b"CORTIQMF";
/// The format version this crate reads and writes.
pub const VERSION: u32 = 1;
/// Bytes in a version-1 preamble.
pub const PREAMBLE_LEN: u32 = 128;
/// Offset where the data region (the first tensor payload) starts.
pub const DATA_START: u64 = 4096;
/// Every tensor payload starts at a multiple of this many bytes.
///
/// 256 is wgpu's `min_storage_buffer_offset_alignment`, so a GPU can bind each tensor at its file
/// offset inside one uploaded region; it also covers AVX-512 (64 B) loads.
pub const ALIGN: u64 = 256;
/// `required_features` bits this reader understands (none are defined in version 1).
pub const KNOWN_REQUIRED_FEATURES: u64 = 0;
/// Preamble bytes covered by `meta_checksum`: everything before the checksum field.
pub(crate) const CHECKED_PREFIX: usize = 64;

/// The decoded preamble.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Preamble {
    pub version: u32,
    pub preamble_len: u32,
    pub required_features: u64,
    pub optional_features: u64,
    pub header_offset: u64,
    pub header_len: u64,
    pub table_offset: u64,
    pub table_len: u64,
    pub meta_checksum: u64,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

impl Preamble {
    /// Encodes the 128 bytes (reserved bytes zero).
    pub fn encode(&self) -> [u8; PREAMBLE_LEN as usize] {
        let mut b = [0u8; PREAMBLE_LEN as usize];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[12..16].copy_from_slice(&self.preamble_len.to_le_bytes());
        let fields = [
            self.required_features,
            self.optional_features,
            self.header_offset,
            self.header_len,
            self.table_offset,
            self.table_len,
            self.meta_checksum,
        ];
        for (i, f) in fields.iter().enumerate() {
            b[16 + 8 * i..24 + 8 * i].copy_from_slice(&f.to_le_bytes());
        }
        b
    }

    /// Decodes and checks the fields that need no other part of the file.
    pub fn decode(bytes: &[u8], path: &Path) -> Result<Preamble, CmfError> {
        if bytes.len() < MAGIC.len() || bytes[..8] != MAGIC {
            return Err(CmfError::BadMagic {
                path: path.to_path_buf(),
                found: bytes[..bytes.len().min(8)].to_vec(),
            });
        }
        if bytes.len() < PREAMBLE_LEN as usize {
            return Err(CmfError::OutOfBounds {
                path: path.to_path_buf(),
                what: "preamble".into(),
                offset: 0,
                len: PREAMBLE_LEN.into(),
                region: "the file",
                start: 0,
                end: bytes.len() as u64,
            });
        }
        let p = Preamble {
            version: u32_at(bytes, 8),
            preamble_len: u32_at(bytes, 12),
            required_features: u64_at(bytes, 16),
            optional_features: u64_at(bytes, 24),
            header_offset: u64_at(bytes, 32),
            header_len: u64_at(bytes, 40),
            table_offset: u64_at(bytes, 48),
            table_len: u64_at(bytes, 56),
            meta_checksum: u64_at(bytes, 64),
        };
        if p.version != VERSION {
            return Err(CmfError::UnsupportedVersion {
                path: path.to_path_buf(),
                found: p.version,
                supported: VERSION,
            });
        }
        let bad = |field, detail| CmfError::Preamble {
            path: path.to_path_buf(),
            field,
            detail,
        };
        if p.preamble_len != PREAMBLE_LEN {
            return Err(bad(
                "preamble_len",
                format!("expected {PREAMBLE_LEN}, found {}", p.preamble_len),
            ));
        }
        if let Some(i) = bytes[72..PREAMBLE_LEN as usize]
            .iter()
            .position(|&b| b != 0)
        {
            return Err(bad("reserved", format!("byte {} must be zero", 72 + i)));
        }
        let unknown = p.required_features & !KNOWN_REQUIRED_FEATURES;
        if unknown != 0 {
            return Err(CmfError::UnknownRequiredFeatures {
                path: path.to_path_buf(),
                bits: unknown,
            });
        }
        Ok(p)
    }
}

/// xxh3-64 (seed 0) of the checked preamble prefix, then the header, then the table.
pub(crate) fn meta_checksum(prefix: &[u8], header: &[u8], table: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(prefix);
    h.update(header);
    h.update(table);
    h.digest()
}
