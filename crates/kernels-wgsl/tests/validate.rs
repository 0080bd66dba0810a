//! Every module and every specialisation the runtime builds passes naga's validation, for the
//! two capability sets CI and the release machine have, and the subgroup-free modules also on
//! a device with no optional capability. No GPU needed.

use kernels_wgsl::{Caps, Codec, Matvec, Reduce, Specialization, registry, validate, validate_all};

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
    };
    assert!(
        validate(
            &k.name(),
            &k.source(),
            Caps::MINIMAL,
            &Specialization::matvec(256, 64, 1, 4)
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
    assert!(names.contains(&"matvec_mxfp4_sg".to_string()));
    assert!(names.contains(&"matvec_q2tp_smem".to_string()));
    assert_eq!(registry().len(), 2 * Codec::ALL.len() + 1);
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
