//! Every module and every specialisation the runtime builds passes naga's validation, for the
//! two capability sets CI and the release machine have, and the subgroup-free modules also on
//! a device with no optional capability. No GPU needed.

use kernels_wgsl::{
    Caps, Codec, Epilogue, Matvec, Reduce, Specialization, registry, validate, validate_all,
};

fn assert_clean(caps: Caps) {
    let errors = validate_all(caps);
    assert!(
        errors.is_empty(),
        "{} module(s) failed under {caps:?}:\n{}",
        errors.len(),
        errors
            .iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join("\n\n")
    );
}

#[test]
fn every_module_validates_with_lavapipe_capabilities() {
    assert_clean(Caps::LAVAPIPE);
}

#[test]
fn every_module_validates_with_full_capabilities() {
    assert_clean(Caps::FULL);
}

#[test]
fn shared_memory_variants_need_no_optional_capability() {
    assert_clean(Caps::MINIMAL);
}

#[test]
fn subgroup_variants_are_refused_without_subgroups() {
    // The capability gate is real: the validator rejects subgroup builtins when told the
    // device lacks them, so the runtime's feature check is what keeps them off such devices.
    let k = Matvec {
        codec: Codec::Q4tp,
        reduce: Reduce::Subgroup,
        nt: 1,
        rows: 4,
        epilogue: Epilogue::None,
    };
    assert!(
        validate(
            &k.name(),
            &k.source(),
            Caps::MINIMAL,
            &Specialization::matvec(64, 32)
        )
        .is_err()
    );
}

#[test]
fn registry_names_are_systematic_and_unique() {
    let names: Vec<String> = registry().into_iter().map(|m| m.name).collect();
    let mut sorted = names.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), names.len());
    assert!(names.contains(&"matvec_mxfp4_sg_t1_r1".to_string()));
    assert!(names.contains(&"matvec_q2tp_smem_t8_r4".to_string()));
    assert_eq!(registry().len(), 2 * Codec::ALL.len() * 8 * 6 + 1);
    assert!(names.contains(&"matvec_q4tp_sg_t1_r2_gateup".to_string()));
}

#[test]
fn a_broken_module_reports_where() {
    let e = validate(
        "broken",
        "fn f() -> u32 { return 1.0; }",
        Caps::FULL,
        &Specialization(vec![]),
    )
    .unwrap_err();
    assert!(e.to_string().contains("broken"), "{e}");
    assert!(e.message.contains("broken.wgsl"), "{}", e.message);
}

#[test]
fn chunk_sizes_agree_between_rust_and_wgsl() {
    for codec in Codec::ALL {
        let k = Matvec {
            codec,
            reduce: Reduce::SharedMemory,
            nt: 1,
            rows: 1,
            epilogue: Epilogue::None,
        };
        let want = format!("const CHUNK_VEC4: u32 = {}u;", codec.chunk_vec4());
        assert!(k.source().contains(&want), "{codec:?}: {want}");
    }
}

#[test]
fn the_generated_body_names_every_accumulator_once() {
    let k = Matvec {
        codec: Codec::Mxfp4,
        reduce: Reduce::Subgroup,
        nt: 3,
        rows: 2,
        epilogue: Epilogue::None,
    };
    let body = k.body();
    for r in 0..2 {
        for t in 0..3 {
            assert_eq!(body.matches(&format!("var a{r}_{t} = 0.0;")).count(), 1);
        }
    }
    assert!(!body.contains("a2_0") && !body.contains("a0_3"));
}
