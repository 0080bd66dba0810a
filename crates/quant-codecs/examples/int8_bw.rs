//! Quick throughput table for both activation paths: weight GB/s per format, shape and batch,
//! next to the memory read ceiling measured in the same run (the bench's `read_ceiling`).
//!
//! `cargo run --release -p quant-codecs --example int8_bw [-- SECONDS_PER_CASE]`

use std::hint::black_box;
use std::time::Instant;

use quant_codecs::{ActPath, DType, MatRef, synthetic_payload};
use rayon::prelude::*;

/// Median seconds per call of `f`, over at least 3 calls and about `budget` seconds.
fn time(budget: f64, mut f: impl FnMut()) -> f64 {
    f();
    let mut v = Vec::new();
    let start = Instant::now();
    while v.len() < 3 || (start.elapsed().as_secs_f64() < budget && v.len() < 200) {
        let t = Instant::now();
        f();
        v.push(t.elapsed().as_secs_f64());
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let budget: f64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.5);
    let len = 1usize << 30;
    let buf: Vec<u64> = (0..len / 8).into_par_iter().map(|i| i as u64).collect();
    let ceiling = len as f64
        / time(budget, || {
            black_box(
                buf.par_chunks(1 << 16)
                    .map(|c| {
                        let mut acc = [0u64; 8];
                        for w in c.chunks_exact(8) {
                            for j in 0..8 {
                                acc[j] = acc[j].wrapping_add(w[j]);
                            }
                        }
                        acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
                    })
                    .reduce(|| 0, u64::wrapping_add),
            );
        })
        / 1e9;
    drop(buf);
    println!(
        "read_ceiling {ceiling:.1} GB/s ({} threads)",
        rayon::current_num_threads()
    );
    println!("| format | shape | T | f32 GB/s | f32 % | int8 GB/s | int8 % | int8 rows/s vs T=1 |");
    println!("|---|---|---|---|---|---|---|---|");
    for dtype in [DType::Q8_2f, DType::Q4tp, DType::Q2tp, DType::Mxfp4] {
        let big_rows = match dtype {
            DType::Q8_2f => 65536,
            DType::Q2tp => 262144,
            _ => 131072,
        };
        for (rows, cols) in [(2560, 2560), (10240, 2560), (big_rows, 16384)] {
            let p = synthetic_payload(dtype, rows, cols, 1).unwrap();
            let m = MatRef::new(dtype, rows, cols, &p).unwrap();
            let mut t1_int8 = 0.0;
            for nt in [1usize, 8] {
                let xs: Vec<f32> = (0..nt * cols)
                    .map(|i| ((i % 17) as f32 - 8.0) / 8.0)
                    .collect();
                let mut ys = vec![0.0f32; nt * rows];
                let mut gbs = [0.0f64; 2];
                for (k, path) in [ActPath::F32, ActPath::Int8].into_iter().enumerate() {
                    let s = time(budget, || {
                        m.matmat_path(path, black_box(&xs), &mut ys).unwrap()
                    });
                    gbs[k] = p.len() as f64 / s / 1e9;
                }
                if nt == 1 {
                    t1_int8 = gbs[1];
                }
                println!(
                    "| {dtype} | {rows}x{cols} ({:.0} MiB) | {nt} | {:.1} | {:.0}% | {:.1} | {:.0}% | {:.2}x |",
                    p.len() as f64 / (1u64 << 20) as f64,
                    gbs[0],
                    100.0 * gbs[0] / ceiling,
                    gbs[1],
                    100.0 * gbs[1] / ceiling,
                    nt as f64 * gbs[1] / t1_int8,
                );
            }
        }
    }
}
