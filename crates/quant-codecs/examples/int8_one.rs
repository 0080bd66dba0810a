//! One case of `int8_bw` for profiling: `int8_one FORMAT ROWS COLS T PATH(f32|int8) ITERS`.

use std::time::Instant;

use quant_codecs::{ActPath, DType, MatRef, synthetic_payload};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let dtype = DType::from_name(&a[1]).expect("format");
    let (rows, cols, nt): (usize, usize, usize) = (
        a[2].parse().unwrap(),
        a[3].parse().unwrap(),
        a[4].parse().unwrap(),
    );
    let path = if a[5] == "int8" {
        ActPath::Int8
    } else {
        ActPath::F32
    };
    let iters: usize = a[6].parse().unwrap();
    let p = synthetic_payload(dtype, rows, cols, 1).unwrap();
    let m = MatRef::new(dtype, rows, cols, &p).unwrap();
    let xs: Vec<f32> = (0..nt * cols)
        .map(|i| ((i % 17) as f32 - 8.0) / 8.0)
        .collect();
    let mut ys = vec![0.0f32; nt * rows];
    m.matmat_path(path, &xs, &mut ys).unwrap();
    let t = Instant::now();
    for _ in 0..iters {
        m.matmat_path(path, &xs, &mut ys).unwrap();
    }
    let s = t.elapsed().as_secs_f64() / iters as f64;
    println!(
        "{dtype} {rows}x{cols} T={nt} {:?}: {:.2} GB/s",
        path,
        p.len() as f64 / s / 1e9
    );
}
