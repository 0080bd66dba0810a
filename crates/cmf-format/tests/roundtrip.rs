//! Writing and reading back: every dtype, headers, sidecars, and the writer's atomicity.

mod common;

use std::io::Read;
use std::path::Path;

use cmf_format::{
    ALIGN, Cmf, CmfError, CmfWriter, DATA_START, Header, SidecarOf, SidecarRef, SourceFile,
};
use common::{every_dtype, payload, write_every_dtype};
use quant_codecs::DType;

fn dir_entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn every_dtype_round_trips_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.cmf");
    let payloads = write_every_dtype(&path, Header::new("test"));
    assert_eq!(
        dir_entries(dir.path()),
        ["m.cmf"],
        "no temporary file is left behind"
    );
    let file_bytes = std::fs::read(&path).unwrap();
    for cmf in [
        Cmf::open(&path).unwrap(),
        Cmf::read(&path).unwrap(),
        Cmf::from_bytes(file_bytes.clone()).unwrap(),
    ] {
        assert_eq!(cmf.tensors().len(), payloads.len());
        for (i, ((name, dtype, shape), p)) in every_dtype().into_iter().zip(&payloads).enumerate() {
            let t = cmf.tensor(&name).unwrap();
            assert_eq!((t.dtype(), t.shape()), (dtype, &shape[..]), "{name}");
            assert_eq!(t.bytes, &p[..], "{name}");
            assert_eq!(t.info.offset % ALIGN, 0);
            assert!(t.info.offset >= DATA_START);
            assert_eq!(
                cmf.tensor_at(i).unwrap().name(),
                name,
                "table order is write order"
            );
            cmf.verify_tensor(&name).unwrap();
        }
        cmf.verify().unwrap();
        assert_eq!(cmf.file_len(), file_bytes.len() as u64);
        assert!(cmf.tensor("absent").is_none());
        assert!(matches!(
            cmf.verify_tensor("absent"),
            Err(CmfError::UnknownTensor { .. })
        ));
    }
    let a = Cmf::open(&path).unwrap();
    let b = Cmf::from_bytes(file_bytes).unwrap();
    assert_eq!(a.uid(), b.uid());
    assert_eq!(a.path(), Some(path.as_path()));
    assert_eq!(b.path(), None);
}

#[test]
fn writing_is_deterministic_and_the_uid_tracks_content() {
    let dir = tempfile::tempdir().unwrap();
    let (p1, p2, p3) = (
        dir.path().join("a.cmf"),
        dir.path().join("b.cmf"),
        dir.path().join("c.cmf"),
    );
    write_every_dtype(&p1, Header::new("test"));
    write_every_dtype(&p2, Header::new("test"));
    write_every_dtype(&p3, Header::new("other"));
    assert_eq!(std::fs::read(&p1).unwrap(), std::fs::read(&p2).unwrap());
    let (u1, u3) = (Cmf::open(&p1).unwrap().uid(), Cmf::open(&p3).unwrap().uid());
    assert_ne!(u1, u3);
}

#[test]
fn full_header_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("h.cmf");
    let mut h = Header::new("qwen4_exp");
    h.config = serde_json::json!({"hidden_size": 2560, "rms_norm_eps": 1e-6, "layer_types": ["linear", "full"]});
    h.dims.hidden_size = Some(2560);
    h.dims.vocab_size = Some(151_936);
    h.tokenizer = Some(serde_json::json!({"model": {"type": "BPE"}}));
    h.chat_template = Some("{% for m in messages %}{{ m.content }}{% endfor %}".into());
    h.generation = Some(serde_json::json!({"temperature": 0.7}));
    h.quantization.profile = "q4tp-experts".into();
    h.quantization.extra.insert("experts".into(), "q4tp".into());
    h.provenance.converter = "test".into();
    h.provenance.sources = vec![SourceFile {
        file: "model-00001.safetensors".into(),
        bytes: 1 << 33,
    }];
    h.extra
        .insert("future_field".into(), serde_json::json!([1, 2]));
    let mut w = CmfWriter::create(&path, h.clone()).unwrap();
    w.header_mut().provenance.created = Some("2025-01-01T00:00:00Z".into());
    h.provenance.created = Some("2025-01-01T00:00:00Z".into());
    let path_back = w.finish().unwrap();
    assert_eq!(path_back, path);
    let cmf = Cmf::open(&path).unwrap();
    assert_eq!(cmf.header(), &h);
    assert!(cmf.tensors().is_empty());
    cmf.verify().unwrap();
}

/// Yields its data a few bytes at a time, like a socket or decompressor.
struct Trickle<'a>(&'a [u8], usize);

impl Read for Trickle<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.1.min(buf.len()).min(self.0.len());
        buf[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        Ok(n)
    }
}

#[test]
fn streamed_tensors_match_in_memory_ones() {
    let dir = tempfile::tempdir().unwrap();
    let big = payload(DType::F32, &[600, 1000], 9); // 2.4 MB: more than one 1 MiB chunk
    let small = payload(DType::Q4tp, &[4, 64], 3);
    let (a, b) = (dir.path().join("a.cmf"), dir.path().join("b.cmf"));
    let mut w = CmfWriter::create(&a, Header::new("t")).unwrap();
    w.add_tensor("big", DType::F32, &[600, 1000], &big).unwrap();
    w.add_tensor("small", DType::Q4tp, &[4, 64], &small)
        .unwrap();
    w.finish().unwrap();
    let mut w = CmfWriter::create(&b, Header::new("t")).unwrap();
    w.add_tensor_from_reader("big", DType::F32, &[600, 1000], Trickle(&big, 4093))
        .unwrap();
    w.add_tensor_from_reader("small", DType::Q4tp, &[4, 64], Trickle(&small, 7))
        .unwrap();
    w.finish().unwrap();
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    Cmf::open(&b).unwrap().verify().unwrap();
}

#[test]
fn dropped_writer_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.cmf");
    let mut w = CmfWriter::create(&path, Header::new("t")).unwrap();
    w.add_tensor("x", DType::F32, &[2], &[0; 8]).unwrap();
    assert_eq!(
        dir_entries(dir.path()).len(),
        1,
        "only the temporary file exists while writing"
    );
    assert!(!path.exists());
    drop(w);
    assert!(dir_entries(dir.path()).is_empty());
}

#[test]
fn refused_tensors_leave_the_writer_usable_and_the_target_absent() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.cmf");
    let mut w = CmfWriter::create(&path, Header::new("t")).unwrap();
    w.add_tensor("x", DType::F32, &[2], &[0; 8]).unwrap();
    let e = w.add_tensor("y", DType::F32, &[2], &[0; 7]).unwrap_err();
    assert!(
        matches!(
            e,
            CmfError::PayloadLength {
                expected: 8,
                found: 7,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("\"y\""), "{e}");
    assert!(matches!(
        w.add_tensor("x", DType::F32, &[2], &[0; 8]),
        Err(CmfError::DuplicateTensor { .. })
    ));
    assert!(matches!(
        w.add_tensor("", DType::F32, &[2], &[0; 8]),
        Err(CmfError::BadName { .. })
    ));
    assert!(matches!(
        w.add_tensor("q", DType::Mxfp4, &[4, 33], &[]),
        Err(CmfError::Tensor { .. })
    ));
    assert!(matches!(
        w.add_tensor("n", DType::F32, &[1; 9], &[0; 4]),
        Err(CmfError::BadName { .. })
    ));
    assert!(!path.exists());
    drop(w);
    assert!(dir_entries(dir.path()).is_empty());
}

#[test]
fn short_or_long_readers_abandon_the_file() {
    for (given, label) in [(7usize, "short"), (9, "long")] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.cmf");
        let mut w = CmfWriter::create(&path, Header::new("t")).unwrap();
        let data = vec![1u8; given];
        let e = w
            .add_tensor_from_reader("x", DType::F32, &[2], &data[..])
            .unwrap_err();
        assert!(
            matches!(e, CmfError::PayloadLength { expected: 8, .. }),
            "{label}: {e}"
        );
        assert!(
            dir_entries(dir.path()).is_empty(),
            "{label}: temporary file removed at once"
        );
        assert!(matches!(
            w.add_tensor("z", DType::F32, &[1], &[0; 4]),
            Err(CmfError::WriterPoisoned { .. })
        ));
        assert!(matches!(w.finish(), Err(CmfError::WriterPoisoned { .. })));
        assert!(dir_entries(dir.path()).is_empty());
    }
}

#[test]
fn existing_target_survives_failure_and_is_replaced_on_success() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.cmf");
    std::fs::write(&path, b"old contents").unwrap();
    let mut w = CmfWriter::create(&path, Header::new("t")).unwrap();
    w.add_tensor("x", DType::F32, &[2], &[0; 8]).unwrap();
    let _ = w
        .add_tensor_from_reader("y", DType::F32, &[2], &[0u8; 3][..])
        .unwrap_err();
    drop(w);
    assert_eq!(std::fs::read(&path).unwrap(), b"old contents");
    // An invalid header is refused at finish, also leaving the old file.
    let mut bad = Header::new("t");
    bad.format = "nope".into();
    let w = CmfWriter::create(&path, bad).unwrap();
    assert!(matches!(w.finish(), Err(CmfError::Header { .. })));
    assert_eq!(std::fs::read(&path).unwrap(), b"old contents");
    assert_eq!(dir_entries(dir.path()), ["m.cmf"]);
    write_every_dtype(&path, Header::new("t"));
    Cmf::open(&path).unwrap().verify().unwrap();
}

#[test]
fn verify_finds_flipped_payload_bytes_that_open_accepts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.cmf");
    write_every_dtype(&path, Header::new("t"));
    let clean = Cmf::open(&path).unwrap();
    let (a, b) = (
        clean.tensor("q4tp.matrix").unwrap().info.clone(),
        clean.tensor("f16.vector").unwrap().info.clone(),
    );
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[a.offset as usize + 5] ^= 0x10;
    let one = Cmf::from_bytes(bytes.clone()).expect("open does not read payloads");
    let e = one.verify().unwrap_err();
    assert!(
        matches!(&e, CmfError::Checksum { name, .. } if name == "q4tp.matrix"),
        "{e}"
    );
    one.verify_tensor("f16.vector").unwrap();
    bytes[b.offset as usize] ^= 1;
    let two = Cmf::from_bytes(bytes).unwrap();
    let e = two.verify().unwrap_err();
    let names: Vec<String> = e
        .errors()
        .iter()
        .map(|e| match e {
            CmfError::Checksum { name, .. } => name.clone(),
            other => panic!("unexpected {other}"),
        })
        .collect();
    assert_eq!(names, ["f16.vector", "q4tp.matrix"]);
    assert!(matches!(e, CmfError::Partial(_)));
}

fn write_sidecar(path: &Path, role: &str, seed: u64) -> Cmf {
    let mut h = Header::new("mtp-head");
    h.sidecar_of = Some(SidecarOf {
        role: role.into(),
        extra: Default::default(),
    });
    let mut w = CmfWriter::create(path, h).unwrap();
    w.add_tensor(
        "mtp.fc.weight",
        DType::Q8_2f,
        &[4, 8],
        &payload(DType::Q8_2f, &[4, 8], seed),
    )
    .unwrap();
    w.finish().unwrap();
    Cmf::open(path).unwrap()
}

#[test]
fn sidecars_open_by_role_and_refuse_mismatches() {
    let dir = tempfile::tempdir().unwrap();
    let side_path = dir.path().join("model.mtp.cmf");
    let side = write_sidecar(&side_path, "mtp", 1);
    let main_path = dir.path().join("model.cmf");
    let mut h = Header::new("qwen4_exp");
    h.sidecars
        .push(SidecarRef::to("mtp", "model.mtp.cmf", &side).unwrap());
    write_every_dtype(&main_path, h);
    let main = Cmf::open(&main_path).unwrap();
    let opened = main.open_sidecar("mtp").unwrap();
    assert_eq!(opened.uid(), side.uid());
    assert!(opened.tensor("mtp.fc.weight").is_some());

    // Unknown role.
    let e = main.open_sidecar("draft").unwrap_err();
    assert!(
        matches!(&e, CmfError::Sidecar { role, .. } if role == "draft"),
        "{e}"
    );
    // A reference to a file that is not a sidecar of that role is refused when recorded.
    assert!(matches!(
        SidecarRef::to("other", "x", &side),
        Err(CmfError::SidecarMismatch { .. })
    ));
    // The sidecar replaced by another file: its uid differs.
    write_sidecar(&side_path, "mtp", 2);
    let e = main.open_sidecar("mtp").unwrap_err();
    assert!(
        matches!(&e, CmfError::SidecarMismatch { field: "uid", .. }),
        "{e}"
    );
    assert!(e.to_string().contains("model.mtp.cmf"), "{e}");
    // Missing sidecar file: an I/O error naming it.
    std::fs::remove_file(&side_path).unwrap();
    let e = main.open_sidecar("mtp").unwrap_err();
    assert!(
        matches!(&e, CmfError::Io { path, .. } if path.ends_with("model.mtp.cmf")),
        "{e}"
    );
    // In-memory files cannot resolve sidecars.
    let mem = Cmf::from_bytes(std::fs::read(&main_path).unwrap()).unwrap();
    assert!(matches!(
        mem.open_sidecar("mtp"),
        Err(CmfError::Sidecar { .. })
    ));
}

#[test]
fn sidecar_with_the_right_uid_but_wrong_role_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let side = write_sidecar(&dir.path().join("s.cmf"), "draft", 1);
    // Forge a reference with the right uid and the wrong role, as a buggy converter might.
    let mut h = Header::new("a");
    h.sidecars.push(SidecarRef {
        role: "mtp".into(),
        file: "s.cmf".into(),
        uid: side.uid(),
    });
    write_every_dtype(&dir.path().join("m.cmf"), h);
    let e = Cmf::open(dir.path().join("m.cmf"))
        .unwrap()
        .open_sidecar("mtp")
        .unwrap_err();
    assert!(
        matches!(
            &e,
            CmfError::SidecarMismatch {
                field: "sidecar_of.role",
                ..
            }
        ),
        "{e}"
    );
}
