//! Malformed files: each is refused by `Cmf::from_bytes` with the error that names the problem.

mod common;

use cmf_format::{Cmf, CmfError};
use common::raw::{self, Entry};
use quant_codecs::DType;

const F32: u16 = 0;

fn open(bytes: Vec<u8>) -> Result<Cmf, CmfError> {
    Cmf::from_bytes(bytes)
}

/// A valid raw file with two f32 tensors at 4096 and 4352.
fn two_tensors() -> raw::File {
    raw::File {
        data: vec![(4096, vec![1; 16]), (4352, vec![2; 8])],
        entries: vec![
            Entry::new("a", F32, &[4], 4096, 16),
            Entry::new("b", F32, &[2], 4352, 8),
        ],
        ..Default::default()
    }
}

#[test]
fn the_raw_builder_agrees_with_the_writer() {
    let cmf = open(two_tensors().build()).unwrap();
    cmf.verify().unwrap();
    assert_eq!(cmf.tensor("b").unwrap().bytes, &[2; 8]);
}

#[test]
fn every_truncation_is_refused() {
    let bytes = common::sample_file_bytes(9);
    for cut in 0..bytes.len() {
        let e = open(bytes[..cut].to_vec()).unwrap_err();
        if cut >= 128 {
            assert!(matches!(e, CmfError::OutOfBounds { .. }), "cut {cut}: {e}");
        }
    }
}

#[test]
fn wrong_magic_version_and_preamble_fields() {
    let e = open(b"GGUF\x03\0\0\0".to_vec()).unwrap_err();
    assert!(
        matches!(&e, CmfError::BadMagic { found, .. } if found == b"GGUF\x03\0\0\0"),
        "{e}"
    );
    assert!(e.to_string().contains("<memory>"), "{e}");
    assert!(matches!(open(Vec::new()), Err(CmfError::BadMagic { .. })));
    let e = open(
        raw::File {
            version: 2,
            ..two_tensors()
        }
        .build(),
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            CmfError::UnsupportedVersion {
                found: 2,
                supported: 1,
                ..
            }
        ),
        "{e}"
    );
    let e = open(
        raw::File {
            preamble_len: 64,
            ..two_tensors()
        }
        .build(),
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            CmfError::Preamble {
                field: "preamble_len",
                ..
            }
        ),
        "{e}"
    );
    let mut reserved = [0; 56];
    reserved[55] = 1;
    let e = open(
        raw::File {
            reserved,
            ..two_tensors()
        }
        .build(),
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            CmfError::Preamble {
                field: "reserved",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn unknown_required_features_are_refused_and_optional_ones_ignored() {
    let e = open(
        raw::File {
            required: 1 << 5,
            ..two_tensors()
        }
        .build(),
    )
    .unwrap_err();
    assert!(
        matches!(e, CmfError::UnknownRequiredFeatures { bits: 32, .. }),
        "{e}"
    );
    let cmf = open(
        raw::File {
            optional: u64::MAX,
            ..two_tensors()
        }
        .build(),
    )
    .unwrap();
    assert_eq!(cmf.optional_features(), u64::MAX);
}

#[test]
fn meta_checksum_covers_preamble_header_and_table() {
    let e = open(
        raw::File {
            meta_checksum: Some(1),
            ..two_tensors()
        }
        .build(),
    )
    .unwrap_err();
    assert!(
        matches!(e, CmfError::MetaChecksum { expected: 1, .. }),
        "{e}"
    );
    let good = two_tensors().build();
    let header_offset = u64::from_le_bytes(good[32..40].try_into().unwrap()) as usize;
    for at in [24, header_offset + 3, good.len() - 1] {
        let mut bad = good.clone();
        bad[at] ^= 4;
        let e = open(bad).unwrap_err();
        assert!(matches!(e, CmfError::MetaChecksum { .. }), "byte {at}: {e}");
    }
}

#[test]
fn bad_header_json_is_refused_with_its_field() {
    let e = open(
        raw::File {
            header: b"{\"format\":".to_vec(),
            ..two_tensors()
        }
        .build(),
    )
    .unwrap_err();
    assert!(matches!(e, CmfError::HeaderJson { .. }), "{e}");
    let e = open(
        raw::File {
            header: br#"{"format":"cmf"}"#.to_vec(),
            ..two_tensors()
        }
        .build(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("architecture"), "{e}");
    let h = br#"{"format":"gguf","architecture":"x"}"#.to_vec();
    let e = open(
        raw::File {
            header: h,
            ..two_tensors()
        }
        .build(),
    )
    .unwrap_err();
    assert!(
        matches!(&e, CmfError::Header { field, .. } if field == "format"),
        "{e}"
    );
    let h =
        br#"{"format":"cmf","architecture":"x","sidecars":[{"role":"m","file":"../x","uid":"1"}]}"#
            .to_vec();
    let e = open(
        raw::File {
            header: h,
            ..two_tensors()
        }
        .build(),
    )
    .unwrap_err();
    assert!(
        matches!(&e, CmfError::Header { field, .. } if field == "sidecars[0].file"),
        "{e}"
    );
    let deep = format!(
        "{{\"format\":\"cmf\",\"architecture\":\"x\",\"config\":{}{}}}",
        "[".repeat(5000),
        "]".repeat(5000)
    );
    let e = open(
        raw::File {
            header: deep.into_bytes(),
            ..two_tensors()
        }
        .build(),
    )
    .unwrap_err();
    assert!(
        matches!(e, CmfError::HeaderJson { .. }),
        "deep nesting is an error, not a stack overflow: {e}"
    );
}

fn with_entries(entries: Vec<Entry>) -> Result<Cmf, CmfError> {
    open(
        raw::File {
            entries,
            ..two_tensors()
        }
        .build(),
    )
}

#[test]
fn misplaced_tensors_are_refused() {
    let e = with_entries(vec![
        Entry::new("a", F32, &[4], 4096, 16),
        Entry::new("b", F32, &[2], 4100, 8),
    ])
    .unwrap_err();
    assert!(
        matches!(&e, CmfError::Misaligned { name, offset: 4100, align: 256, .. } if name == "b"),
        "{e}"
    );
    let overlapping = raw::File {
        data: vec![(4096, vec![1; 512])],
        entries: vec![
            Entry::new("a", F32, &[128], 4096, 512),
            Entry::new("b", F32, &[2], 4352, 8),
        ],
        ..Default::default()
    };
    let e = open(overlapping.build()).unwrap_err();
    assert!(
        matches!(&e, CmfError::Overlap { a, b, .. } if a == "a" && b == "b"),
        "{e}"
    );
    let e = with_entries(vec![Entry::new("a", F32, &[4], 3840, 16)]).unwrap_err();
    assert!(
        matches!(
            e,
            CmfError::OutOfBounds {
                offset: 3840,
                start: 4096,
                ..
            }
        ),
        "{e}"
    );
    let e = with_entries(vec![Entry::new("a", F32, &[1024], 4096, 4096)]).unwrap_err();
    assert!(
        matches!(&e, CmfError::OutOfBounds { what, .. } if what.contains("\"a\"")),
        "{e}"
    );
    let e = with_entries(vec![Entry::new("a", F32, &[4], u64::MAX - 255, 16)]).unwrap_err();
    assert!(
        matches!(e, CmfError::OutOfBounds { .. }),
        "offset + nbytes overflow: {e}"
    );
    // Empty tensors may share an offset with anything.
    let ok = with_entries(vec![
        Entry::new("a", F32, &[4], 4096, 16),
        Entry::new("e", F32, &[0], 4096, 0),
    ]);
    ok.unwrap().verify().unwrap();
}

#[test]
fn sizes_must_match_dtype_and_shape() {
    let e = with_entries(vec![Entry::new("a", F32, &[5], 4096, 16)]).unwrap_err();
    assert!(
        matches!(
            e,
            CmfError::PayloadLength {
                expected: 20,
                found: 16,
                ..
            }
        ),
        "{e}"
    );
    let e = with_entries(vec![Entry::new("q", DType::Mxfp4.id(), &[1, 33], 4096, 16)]).unwrap_err();
    assert!(
        matches!(&e, CmfError::Tensor { name, .. } if name == "q"),
        "{e}"
    );
    let e = with_entries(vec![Entry::new("q", DType::Q8_2f.id(), &[16], 4096, 16)]).unwrap_err();
    assert!(matches!(e, CmfError::Tensor { .. }), "{e}");
    let e = with_entries(vec![Entry::new("a", F32, &[1 << 40, 1 << 40], 4096, 16)]).unwrap_err();
    assert!(
        matches!(e, CmfError::Tensor { .. }),
        "overflowing shape: {e}"
    );
    // Zero bytes, but 2^80 elements before the zero: consumers multiplying dims would overflow.
    let e = with_entries(vec![Entry::new(
        "z",
        DType::Mxfp4.id(),
        &[1 << 40, 1 << 40, 0],
        4096,
        0,
    )])
    .unwrap_err();
    assert!(
        matches!(e, CmfError::Tensor { .. }),
        "overflowing element count: {e}"
    );
}

#[test]
fn table_encoding_errors() {
    let e = with_entries(vec![Entry::new("a", 3, &[4], 4096, 16)]).unwrap_err();
    assert!(e.to_string().contains("unknown dtype id 3"), "{e}");
    let e = with_entries(vec![Entry::new("a", F32, &[1; 9], 4096, 4)]).unwrap_err();
    assert!(matches!(e, CmfError::Table { .. }), "{e}");
    let e = with_entries(vec![Entry::new("", F32, &[4], 4096, 16)]).unwrap_err();
    assert!(matches!(e, CmfError::BadName { .. }), "{e}");
    let mut bad = Entry::new("a", F32, &[4], 4096, 16);
    bad.name = vec![0xff, 0xfe];
    assert!(matches!(
        with_entries(vec![bad]),
        Err(CmfError::BadName { .. })
    ));
    let e = with_entries(vec![
        Entry::new("a", F32, &[4], 4096, 16),
        Entry::new("a", F32, &[2], 4352, 8),
    ])
    .unwrap_err();
    assert!(matches!(e, CmfError::DuplicateTensor { .. }), "{e}");
    let e = open(
        raw::File {
            table_tail: vec![0],
            ..two_tensors()
        }
        .build(),
    )
    .unwrap_err();
    assert!(matches!(e, CmfError::Table { index: 2, .. }), "{e}");
    let e = open(
        raw::File {
            count: Some(3),
            ..two_tensors()
        }
        .build(),
    )
    .unwrap_err();
    assert!(matches!(e, CmfError::Table { .. }), "{e}");
    let e = open(
        raw::File {
            count: Some(u64::MAX),
            ..two_tensors()
        }
        .build(),
    )
    .unwrap_err();
    assert!(matches!(e, CmfError::Table { index: 0, .. }), "{e}");
}

#[test]
fn header_and_table_offsets_are_checked() {
    let good = two_tensors().build();
    let set = |at: usize, v: u64| {
        let mut b = good.clone();
        b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        raw::fix_meta(&mut b);
        b
    };
    let e = open(set(32, 100)).unwrap_err();
    assert!(
        matches!(
            e,
            CmfError::Preamble {
                field: "header_offset",
                ..
            }
        ),
        "{e}"
    );
    let e = open(set(40, u64::MAX)).unwrap_err();
    assert!(
        matches!(&e, CmfError::OutOfBounds { what, .. } if what == "header"),
        "{e}"
    );
    let e = open(set(48, 4096)).unwrap_err();
    assert!(
        matches!(
            e,
            CmfError::Preamble {
                field: "table_offset",
                ..
            }
        ),
        "{e}"
    );
    let e = open(set(56, good.len() as u64)).unwrap_err();
    assert!(
        matches!(&e, CmfError::OutOfBounds { what, .. } if what == "table"),
        "{e}"
    );
}
