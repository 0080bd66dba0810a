//! `CORTIQ_ISA` narrows the kernels to a smaller CPU's, and `--act auto` then keeps every
//! format on the f32 path where there are no hand-written integer kernels (the baseline: the
//! int8 path is then the portable reference, about 10x slower per weight than the f32
//! kernels). One test in its own binary: the instruction set is chosen once per process.

use quant_codecs::ops::{ActChoice, act_path, set_act_choice};
use quant_codecs::{ActPath, DType, Isa, MatRef, synthetic_payload};

#[test]
fn a_cpu_without_integer_kernels_takes_f32_under_auto() {
    // SAFETY: this binary's only test sets the variable before anything reads it.
    unsafe { std::env::set_var("CORTIQ_ISA", "baseline") };
    assert_eq!(Isa::detect(), Isa::Baseline);
    set_act_choice(ActChoice::Auto);
    for dtype in [DType::Q8_2f, DType::Q4tp, DType::Q2tp, DType::Mxfp4] {
        assert_eq!(act_path(dtype), ActPath::F32, "{}", dtype.name());
    }
    // Asked for by name, int8 still runs (the portable kernels: the same bits as any other).
    set_act_choice(ActChoice::Int8);
    assert_eq!(act_path(DType::Q4tp), ActPath::Int8);
    let (rows, cols) = (40, 96);
    let p = synthetic_payload(DType::Q4tp, rows, cols, 5).expect("payload");
    let w = MatRef::new(DType::Q4tp, rows, cols, &p).expect("matrix");
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
    let (mut a, mut b) = (vec![0.0; rows], vec![0.0; rows]);
    w.matmat_path(ActPath::Int8, &x, &mut a).expect("int8");
    w.matmat_path_with(Isa::Avx2, ActPath::Int8, &x, &mut b)
        .expect("int8 on AVX2 where the CPU has it");
    assert_eq!(
        a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    set_act_choice(ActChoice::F32);
}
