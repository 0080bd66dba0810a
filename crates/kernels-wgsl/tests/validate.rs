//! Every module and every specialisation the runtime builds passes naga's validation, for the
//! two capability sets CI and the release machine have, and the subgroup-free modules also on
//! a device with no optional capability. No GPU needed.

use kernels_wgsl::{
    ActLayout, Caps, Codec, Epilogue, Matvec, Path, Reduce, Specialization, registry, validate,
    validate_all,
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
        path: Path::F32,
        grouped: false,
        segments: kernels_wgsl::Segments::One,
        lut_copies: 1,
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
    // f32 for every codec, the hardware f16 variant, int8 for the four quantised codecs (mxfp4's
    // with its table in 1, 16 and 32 copies); then the activation quantiser, the op kernels
    // and the bandwidth probes. Each: 6 shapes for 1..=8 token rows and the grouped variant,
    // and the 6 hyper-connection, 2 two-matrix and 3 MoE-output shapes for 1..=8 token rows. The tiled f16
    // matmat and the q8_2f one: 3 paths x 4 epilogues, direct and split, 4x4 and 8x8 a lane.
    // The expert-major
    // grouped kernels: q4tp, gate/up and plain.
    assert_eq!(
        registry().len(),
        2 * (Codec::ALL.len() + 1 + 3 + 3) * ((8 + 1) * 6 + 8 * 11)
            + 2
            + 3 * 4 * 2 * 2
            + kernels_wgsl::GroupedTiled::all().len()
            + kernels_wgsl::Op::ALL.len()
            // Grouped kernels over segmented banks (fixed and array bindings, 8 and 16
            // segments): the 3 plain shapes and the gate/up pair of every codec and path but
            // q8_2f's int8 and mxfp4's extra table copies.
            + 2 * (Codec::ALL.len() + 1 + 3 + 3 - 2) * 4 * 4
            // The folded hyper-connection norm's 6 shapes for 1..=8 token rows: the float
            // codecs on the f32 path and f16 on the hardware one, both reductions.
            + 2 * 4 * 8 * 6
    );
    assert!(names.contains(&"matvec_f16_hw_sg_t1_r1_hcfrontn".to_string()));
    assert!(names.contains(&"matvec_bf16_smem_t8_r4_hcreadn".to_string()));
    assert!(
        !names
            .iter()
            .any(|n| n.contains("_i8_") && n.contains("hcfrontn"))
    );
    assert!(
        !names
            .iter()
            .any(|n| n.contains("q4tp") && n.contains("hcreadn"))
    );
    assert!(names.contains(&"matvec_mxfp4_i8_sg_t1_r2_gateup_grouped_segarr16_lut16".to_string()));
    assert!(names.contains(&"matvec_q4tp_i8_smem_t1_r4_grouped_seg8".to_string()));
    assert!(names.contains(&"matvec_f16_hw_sg_t8_r4_hcread".to_string()));
    assert!(names.contains(&"matvec_q8_2f_i8_sg_t8_r2_gateup2".to_string()));
    assert!(names.contains(&"matvec_q4tp_i8_smem_t1_r2_pair2".to_string()));
    assert!(names.contains(&"matvec_q8_2f_i8_smem_t1_r3_hcread".to_string()));
    assert!(names.contains(&"grouped_tiled_q4tp_gateup".to_string()));
    assert!(names.contains(&"matvec_bf16_sg_t3_r1_hcfront".to_string()));
    assert!(!names.iter().any(|n| n.contains("hcread_grouped")));
    assert!(names.contains(&"matvec_q8_2f_i8_sg_t1_r2_moeout".to_string()));
    assert!(!names.iter().any(|n| n.contains("moeout_grouped")));
    assert!(names.contains(&"matvec_mxfp4_i8_sg_t1_r4_lut32".to_string()));
    assert!(names.contains(&"matvec_mxfp4_i8_smem_t1_r2_gateup_grouped_lut16".to_string()));
    assert!(names.contains(&"op_gdn_recur".to_string()));
    assert!(names.contains(&"tiled_f16_hw_hcread_split".to_string()));
    assert!(names.contains(&"tiled_f16".to_string()));
    assert!(names.contains(&"tiled_q8_2f_i8_hcfront".to_string()));
    assert!(names.contains(&"matvec_q4tp_i8_sg_t1_r2_gateup_grouped".to_string()));
    assert!(names.contains(&"matvec_q2tp_i8_sg_t8_r4".to_string()));
    assert!(names.contains(&"matvec_f16_hw_smem_t1_r1".to_string()));
    assert!(!names.iter().any(|n| n.starts_with("matvec_bf16_i8")));
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
            path: Path::F32,
            grouped: false,
            segments: kernels_wgsl::Segments::One,
            lut_copies: 1,
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
        path: Path::F32,
        grouped: false,
        segments: kernels_wgsl::Segments::One,
        lut_copies: 1,
    };
    let body = k.body();
    for r in 0..2 {
        for t in 0..3 {
            assert_eq!(body.matches(&format!("var a{r}_{t} = 0.0;")).count(), 1);
        }
    }
    assert!(!body.contains("a2_0") && !body.contains("a0_3"));
}

#[test]
fn activation_layouts_are_permutations_of_a_block() {
    for layout in [ActLayout::Natural, ActLayout::Pairs, ActLayout::Quads] {
        let mut seen = [false; 32];
        for e in 0..32 {
            let s = layout.slot(e);
            assert!(s < 32 && !seen[s], "{layout:?}: element {e} -> {s}");
            seen[s] = true;
        }
    }
    // q4tp's word k holds elements 8k..8k+7 as nibbles: the low nibbles (elements 8k, 8k+2,
    // 8k+4, 8k+6) are word 2k's bytes 0..3.
    assert_eq!(ActLayout::Pairs.slot(10), 4 * 2 + 1);
    assert_eq!(ActLayout::Pairs.slot(11), 4 * 3 + 1);
    // q2tp's field at shift 2j of word k holds element 16k + 4b + j in byte b.
    assert_eq!(ActLayout::Quads.slot(16 + 4 * 3 + 1), 4 * (4 + 1) + 3);
}

#[test]
fn the_int8_path_needs_no_optional_capability_and_hw_f16_needs_its_own() {
    let k = |codec, path| Matvec {
        codec,
        reduce: Reduce::SharedMemory,
        nt: 2,
        rows: 2,
        epilogue: Epilogue::None,
        path,
        grouped: false,
        segments: kernels_wgsl::Segments::One,
        lut_copies: 1,
    };
    let i8 = k(Codec::Q2tp, Path::Int8);
    validate(
        &i8.name(),
        &i8.source(),
        Caps::MINIMAL,
        &Specialization::matvec(128, 64),
    )
    .unwrap();
    let hw = k(Codec::F16, Path::HwF16);
    assert!(!Caps::MINIMAL.covers(hw.needs()));
    assert!(
        validate(
            &hw.name(),
            &hw.source(),
            Caps::MINIMAL,
            &Specialization::matvec(128, 64)
        )
        .is_err()
    );
}
