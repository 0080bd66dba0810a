//! Shared test helpers: payload generators, sample files, and `raw`, an independent encoder that
//! writes any preamble and table (valid or not) straight from docs/cmf.md.
#![allow(dead_code)]

use cmf_format::{Cmf, CmfWriter, Header};
use quant_codecs::DType;

/// A tiny deterministic generator (splitmix64) for payload bytes.
pub fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `n` pseudo-random bytes from `seed`.
pub fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut s = seed;
    (0..n).map(|_| splitmix(&mut s) as u8).collect()
}

/// A payload of the right length for `dtype` and `shape`: the container never interprets payloads.
pub fn payload(dtype: DType, shape: &[usize], seed: u64) -> Vec<u8> {
    random_bytes(
        seed,
        dtype.expected_nbytes(shape).expect("test shapes are valid"),
    )
}

/// One tensor of every dtype, plus a scalar and an empty tensor.
pub fn every_dtype() -> Vec<(String, DType, Vec<usize>)> {
    vec![
        ("f32.matrix".into(), DType::F32, vec![3, 5]),
        ("f32.scalar".into(), DType::F32, vec![]),
        ("f32.empty".into(), DType::F32, vec![0, 4]),
        ("f16.vector".into(), DType::F16, vec![7]),
        ("bf16.cube".into(), DType::BF16, vec![2, 3, 4]),
        ("q8_2f.matrix".into(), DType::Q8_2f, vec![4, 8]),
        ("q4tp.matrix".into(), DType::Q4tp, vec![4, 64]),
        ("q2tp.experts".into(), DType::Q2tp, vec![2, 3, 64]),
        ("mxfp4.matrix".into(), DType::Mxfp4, vec![8, 32]),
    ]
}

/// Writes the `every_dtype` tensors to `path`; returns their payloads in order.
pub fn write_every_dtype(path: &std::path::Path, header: Header) -> Vec<Vec<u8>> {
    let mut w = CmfWriter::create(path, header).unwrap();
    let mut payloads = Vec::new();
    for (i, (name, dtype, shape)) in every_dtype().into_iter().enumerate() {
        let p = payload(dtype, &shape, i as u64);
        w.add_tensor(&name, dtype, &shape, &p).unwrap();
        payloads.push(p);
    }
    w.finish().unwrap();
    payloads
}

/// The bytes of a small valid file with every dtype (via the real writer).
pub fn sample_file_bytes(tensors: usize) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.cmf");
    let mut h = Header::new("fuzz");
    h.config = serde_json::json!({"hidden_size": 8, "rope": {"theta": 1e6}});
    h.chat_template = Some("{{ x }}".into());
    let mut w = CmfWriter::create(&path, h).unwrap();
    for (i, (name, dtype, shape)) in every_dtype().into_iter().take(tensors).enumerate() {
        w.add_tensor(&name, dtype, &shape, &payload(dtype, &shape, i as u64))
            .unwrap();
    }
    w.finish().unwrap();
    let bytes = std::fs::read(&path).unwrap();
    Cmf::from_bytes(bytes.clone()).expect("sample is valid");
    bytes
}

pub mod raw {
    //! Hand-built files: every field under the test's control.

    use xxhash_rust::xxh3::{Xxh3, xxh3_64};

    /// One table entry, encoded exactly as given.
    #[derive(Clone, Debug)]
    pub struct Entry {
        pub name: Vec<u8>,
        pub dtype: u16,
        pub shape: Vec<u64>,
        pub offset: u64,
        pub nbytes: u64,
        /// `None`: the xxh3 of the bytes at `offset..offset+nbytes` (0 if outside the file).
        pub checksum: Option<u64>,
    }

    impl Entry {
        pub fn new(name: &str, dtype: u16, shape: &[u64], offset: u64, nbytes: u64) -> Entry {
            Entry {
                name: name.as_bytes().to_vec(),
                dtype,
                shape: shape.to_vec(),
                offset,
                nbytes,
                checksum: None,
            }
        }
    }

    /// A whole file. `build` lays out: preamble, zeros to 4096, `data` blobs at their offsets,
    /// then header and table, and computes the meta checksum unless `meta_checksum` is set.
    #[derive(Clone, Debug)]
    pub struct File {
        pub magic: [u8; 8],
        pub version: u32,
        pub preamble_len: u32,
        pub required: u64,
        pub optional: u64,
        pub reserved: [u8; 56],
        pub header: Vec<u8>,
        pub entries: Vec<Entry>,
        /// Extra table bytes after the entries.
        pub table_tail: Vec<u8>,
        /// `None`: the real entry count.
        pub count: Option<u64>,
        pub data: Vec<(u64, Vec<u8>)>,
        pub meta_checksum: Option<u64>,
    }

    impl Default for File {
        fn default() -> Self {
            File {
                magic: *b"CORTIQMF",
                version: 1,
                preamble_len: 128,
                required: 0,
                optional: 0,
                reserved: [0; 56],
                header: br#"{"format":"cmf","architecture":"raw"}"#.to_vec(),
                entries: Vec::new(),
                table_tail: Vec::new(),
                count: None,
                data: Vec::new(),
                meta_checksum: None,
            }
        }
    }

    pub fn table(entries: &[Entry], count: Option<u64>, tail: &[u8], file: &[u8]) -> Vec<u8> {
        let mut t = count.unwrap_or(entries.len() as u64).to_le_bytes().to_vec();
        for e in entries {
            t.extend_from_slice(&(e.name.len() as u16).to_le_bytes());
            t.extend_from_slice(&e.name);
            t.extend_from_slice(&e.dtype.to_le_bytes());
            t.push(e.shape.len() as u8);
            for d in &e.shape {
                t.extend_from_slice(&d.to_le_bytes());
            }
            t.extend_from_slice(&e.offset.to_le_bytes());
            t.extend_from_slice(&e.nbytes.to_le_bytes());
            let sum = e.checksum.unwrap_or_else(|| {
                let end = e.offset.saturating_add(e.nbytes);
                if end <= file.len() as u64 {
                    xxh3_64(&file[e.offset as usize..end as usize])
                } else {
                    0
                }
            });
            t.extend_from_slice(&sum.to_le_bytes());
        }
        t.extend_from_slice(tail);
        t
    }

    impl File {
        pub fn build(&self) -> Vec<u8> {
            let data_end = self
                .data
                .iter()
                .map(|(o, b)| *o as usize + b.len())
                .max()
                .unwrap_or(0)
                .max(4096);
            let mut f = vec![0u8; data_end];
            for (o, b) in &self.data {
                f[*o as usize..*o as usize + b.len()].copy_from_slice(b);
            }
            let header_offset = f.len() as u64;
            f.extend_from_slice(&self.header);
            let table = table(&self.entries, self.count, &self.table_tail, &f);
            let table_offset = f.len() as u64;
            f.extend_from_slice(&table);
            f[0..8].copy_from_slice(&self.magic);
            f[8..12].copy_from_slice(&self.version.to_le_bytes());
            f[12..16].copy_from_slice(&self.preamble_len.to_le_bytes());
            let fields = [
                self.required,
                self.optional,
                header_offset,
                self.header.len() as u64,
                table_offset,
                table.len() as u64,
            ];
            for (i, v) in fields.iter().enumerate() {
                f[16 + 8 * i..24 + 8 * i].copy_from_slice(&v.to_le_bytes());
            }
            f[72..128].copy_from_slice(&self.reserved);
            match self.meta_checksum {
                Some(m) => f[64..72].copy_from_slice(&m.to_le_bytes()),
                None => fix_meta(&mut f),
            }
            f
        }
    }

    fn field(f: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(f[at..at + 8].try_into().unwrap())
    }

    /// Recomputes the meta checksum from the preamble's offsets, if they lie inside the file.
    pub fn fix_meta(f: &mut [u8]) {
        if f.len() < 128 {
            return;
        }
        let len = f.len() as u64;
        let (ho, hl, to, tl) = (field(f, 32), field(f, 40), field(f, 48), field(f, 56));
        let inside = |o: u64, l: u64| o.checked_add(l).is_some_and(|e| e <= len);
        if !inside(ho, hl) || !inside(to, tl) {
            return;
        }
        let mut h = Xxh3::new();
        h.update(&f[..64]);
        h.update(&f[ho as usize..(ho + hl) as usize]);
        h.update(&f[to as usize..(to + tl) as usize]);
        let sum = h.digest();
        f[64..72].copy_from_slice(&sum.to_le_bytes());
    }
}
