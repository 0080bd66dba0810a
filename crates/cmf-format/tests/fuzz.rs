//! Fuzzing the reader: mutated real files and random bytes must give `Ok` or `Err`, never a
//! panic, and whatever `from_bytes` accepts must be safe to verify, view and dequantize.
//!
//! 100,000 cases in all (70,000 mutated + 30,000 random); a few seconds in the `test` profile.

mod common;

use std::sync::LazyLock;

use cmf_format::Cmf;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::Config;

/// Real files to mutate: every dtype, a two-tensor file, and a file with no tensors.
static SEEDS: LazyLock<Vec<Vec<u8>>> = LazyLock::new(|| {
    vec![
        common::sample_file_bytes(9),
        common::sample_file_bytes(2),
        common::sample_file_bytes(0),
    ]
});

fn config(cases: u32) -> Config {
    Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    }
}

/// The part of a file a mutation aims at.
#[derive(Debug, Clone, Copy)]
enum Region {
    Anywhere,
    Preamble,
    Header,
    Table,
}

#[derive(Debug, Clone)]
enum Mutation {
    FlipBit(Region, Index, u8),
    Overwrite(Region, Index, u8),
    SetU64(Region, Index, u64),
    SetU16(Region, Index, u16),
    Truncate(Index),
    Insert(Region, Index, Vec<u8>),
    Remove(Region, Index, usize),
}

fn region() -> impl Strategy<Value = Region> {
    prop_oneof![
        Just(Region::Anywhere),
        Just(Region::Preamble),
        Just(Region::Header),
        Just(Region::Table)
    ]
}

/// Values that sit on validation boundaries, and anything else.
fn interesting_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(8),
        Just(255),
        Just(256),
        Just(4096),
        Just(4352),
        Just(u32::MAX as u64),
        Just(u64::MAX),
        Just(u64::MAX - 255),
        Just(1 << 63),
        0u64..10_000,
        any::<u64>(),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (region(), any::<Index>(), 0u8..8).prop_map(|(r, i, b)| Mutation::FlipBit(r, i, b)),
        (region(), any::<Index>(), any::<u8>()).prop_map(|(r, i, b)| Mutation::Overwrite(r, i, b)),
        (region(), any::<Index>(), interesting_u64())
            .prop_map(|(r, i, v)| Mutation::SetU64(r, i, v)),
        (
            region(),
            any::<Index>(),
            prop_oneof![Just(0u16), Just(9), Just(u16::MAX), any::<u16>()]
        )
            .prop_map(|(r, i, v)| Mutation::SetU16(r, i, v)),
        any::<Index>().prop_map(Mutation::Truncate),
        (
            region(),
            any::<Index>(),
            prop::collection::vec(any::<u8>(), 1..16)
        )
            .prop_map(|(r, i, v)| Mutation::Insert(r, i, v)),
        (region(), any::<Index>(), 1usize..32).prop_map(|(r, i, n)| Mutation::Remove(r, i, n)),
    ]
}

fn field(f: &[u8], at: usize) -> usize {
    u64::from_le_bytes(f[at..at + 8].try_into().unwrap_or([0; 8])) as usize
}

/// The byte range of `r` in `f` as the preamble currently describes it, clamped to the file.
fn span(f: &[u8], r: Region) -> (usize, usize) {
    let len = f.len();
    let clamp = |o: usize, l: usize| {
        let s = o.min(len);
        (s, s.saturating_add(l).min(len))
    };
    let (s, e) = match r {
        Region::Anywhere => (0, len),
        Region::Preamble => (0, 128.min(len)),
        Region::Header if len >= 128 => clamp(field(f, 32), field(f, 40)),
        Region::Table if len >= 128 => clamp(field(f, 48), field(f, 56)),
        _ => (0, len),
    };
    if s < e { (s, e) } else { (0, len) }
}

fn pos(f: &[u8], r: Region, i: &Index) -> Option<usize> {
    let (s, e) = span(f, r);
    (e > s).then(|| s + i.index(e - s))
}

fn apply(f: &mut Vec<u8>, m: &Mutation) {
    match m {
        Mutation::FlipBit(r, i, b) => {
            if let Some(p) = pos(f, *r, i) {
                f[p] ^= 1 << b;
            }
        }
        Mutation::Overwrite(r, i, v) => {
            if let Some(p) = pos(f, *r, i) {
                f[p] = *v;
            }
        }
        Mutation::SetU64(r, i, v) => {
            // Preamble u64 fields sit at 16, 24, ..., 64: aim there so offsets get hit squarely.
            let p = match r {
                Region::Preamble => Some(16 + 8 * i.index(7)),
                _ => pos(f, *r, i),
            };
            if let Some(p) = p.filter(|p| p + 8 <= f.len()) {
                f[p..p + 8].copy_from_slice(&v.to_le_bytes());
            }
        }
        Mutation::SetU16(r, i, v) => {
            if let Some(p) = pos(f, *r, i).filter(|p| p + 2 <= f.len()) {
                f[p..p + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        Mutation::Truncate(i) => {
            let n = i.index(f.len() + 1);
            f.truncate(n);
        }
        Mutation::Insert(r, i, v) => {
            if let Some(p) = pos(f, *r, i) {
                f.splice(p..p, v.iter().copied());
            }
        }
        Mutation::Remove(r, i, n) => {
            if let Some(p) = pos(f, *r, i) {
                let end = (p + n).min(f.len());
                f.drain(p..end);
            }
        }
    }
}

/// Whatever is accepted must be usable without panics; errors must render.
fn exercise(bytes: Vec<u8>) {
    match Cmf::from_bytes(bytes) {
        Err(e) => {
            let _ = e.to_string();
        }
        Ok(cmf) => {
            if let Err(e) = cmf.verify() {
                let _ = e.to_string();
            }
            for (i, info) in cmf.tensors().iter().enumerate() {
                let t = cmf.tensor_at(i).expect("validated tensors have views");
                assert_eq!(t.bytes.len() as u64, info.nbytes);
                assert_eq!(cmf.tensor(&info.name).map(|v| v.info), Some(info));
                let _ = cmf.verify_tensor(&info.name);
                let _ = quant_codecs::dequantize(t.dtype(), t.shape(), t.bytes);
            }
            serde_json::to_vec(cmf.header()).expect("an accepted header serialises");
        }
    }
}

proptest! {
    #![proptest_config(config(70_000))]

    #[test]
    fn mutated_files_never_panic(
        seed in 0usize..3,
        mutations in prop::collection::vec(mutation(), 1..5),
        fix_checksum in any::<bool>(),
    ) {
        let mut f = SEEDS[seed].clone();
        for m in &mutations {
            apply(&mut f, m);
        }
        // Half the cases repair the meta checksum, so mutations reach the header and table parsers.
        if fix_checksum {
            common::raw::fix_meta(&mut f);
        }
        exercise(f);
    }
}

proptest! {
    #![proptest_config(config(30_000))]

    #[test]
    fn random_bytes_never_panic(
        kind in 0u8..3,
        body in prop::collection::vec(any::<u8>(), 0..600),
        header in prop::collection::vec(any::<u8>(), 0..64),
        table in prop::collection::vec(any::<u8>(), 0..128),
    ) {
        let f = match kind {
            // Pure noise.
            0 => body,
            // A plausible start (magic, version, preamble_len), then noise.
            1 => {
                let mut f = b"CORTIQMF\x01\0\0\0\x80\0\0\0".to_vec();
                f.extend_from_slice(&body);
                f
            }
            // A valid preamble around a random header and a random table, checksum fixed.
            _ => {
                let mut f = vec![0u8; 4096];
                f.extend_from_slice(&body);
                let (ho, to) = (f.len(), f.len() + header.len());
                f.extend_from_slice(&header);
                f.extend_from_slice(&table);
                f[..16].copy_from_slice(b"CORTIQMF\x01\0\0\0\x80\0\0\0");
                for (i, v) in [ho, header.len(), to, table.len()].into_iter().enumerate() {
                    f[32 + 8 * i..40 + 8 * i].copy_from_slice(&(v as u64).to_le_bytes());
                }
                common::raw::fix_meta(&mut f);
                f
            }
        };
        exercise(f);
    }
}

/// Sanity check that the mutation fuzzer reaches deep validation: with repaired checksums some
/// mutated files must still open, and some must fail after the checksum (in the table checks).
#[test]
fn the_fuzzer_reaches_the_table_checks() {
    let seed = &SEEDS[0];
    let (mut opened, mut table_errors) = (0, 0);
    let mut s = 1u64;
    for _ in 0..2000 {
        let mut f = seed.clone();
        let (ts, te) = span(&f, Region::Table);
        let p = ts + (common::splitmix(&mut s) as usize) % (te - ts);
        f[p] ^= 1 << (common::splitmix(&mut s) % 8);
        common::raw::fix_meta(&mut f);
        match Cmf::from_bytes(f) {
            Ok(_) => opened += 1,
            Err(e) if !matches!(e, cmf_format::CmfError::MetaChecksum { .. }) => table_errors += 1,
            Err(_) => {}
        }
    }
    assert!(
        opened > 0 && table_errors > 0,
        "opened {opened}, table errors {table_errors}"
    );
}
