//! The synthetic release geometry: a model whose tensors each own their bytes (what the CPU
//! bench reads) computes exactly what the shared-payload one does.

use model_qwen4::synthetic::{Synthetic, release_config};
use model_qwen4::{CausalLm, Model};
use quant_codecs::DType;

#[test]
fn distinct_copies_compute_what_the_shared_payloads_do() {
    let config = release_config(2, 16);
    let dtype = |_: &str, _: usize, _: usize| DType::Q8_2f;
    let shared = Synthetic::new(&config, Box::new(dtype)).unwrap();
    let mut distinct = Synthetic::new(&config, Box::new(dtype)).unwrap();
    distinct.distinct().unwrap();
    // Every bound matrix has its own copy: at least the 2 x 16 experts' gate/up over the one
    // shared payload of that shape.
    let expert = 2 * 640 * 2560 + 4 * 2560 + 2 * 640 * 2;
    assert!(
        distinct.host_bytes() >= shared.host_bytes() + 31 * expert,
        "{} vs {}",
        distinct.host_bytes(),
        shared.host_bytes()
    );
    let ids = [5u32, 17, 248_000, 3];
    let run = |s: &Synthetic| {
        let m = Model::new(s.config.clone(), s.weights().unwrap());
        let mut st = m.new_state();
        m.forward(&ids, &mut st).unwrap()
    };
    let (a, b) = (run(&shared), run(&distinct));
    assert!(a.iter().all(|v| v.is_finite()));
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
}
