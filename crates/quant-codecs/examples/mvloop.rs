//! Runs one matvec in a loop for profiling: `cargo run --release -p quant-codecs --example mvloop -- q4tp 16384 8192 1 50`.
use quant_codecs::{DType, MatRef, quantize};
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let dtype = DType::from_name(&a[1]).expect("dtype");
    let (rows, cols, nt, iters): (usize, usize, usize, usize) = (
        a[2].parse().unwrap(),
        a[3].parse().unwrap(),
        a[4].parse().unwrap(),
        a[5].parse().unwrap(),
    );
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 2654435761usize) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let q = quantize(dtype, rows, cols, &w).unwrap();
    drop(w);
    // Tensors in a CMF file are 256-byte aligned; a Vec<u8> is not.
    let mut buf = vec![0u8; q.len() + 256];
    let off = buf.as_ptr().align_offset(256);
    buf[off..off + q.len()].copy_from_slice(&q);
    let p = &buf[off..off + q.len()];
    let m = MatRef::new(dtype, rows, cols, p).unwrap();
    let xs = vec![0.5f32; nt * cols];
    let mut ys = vec![0.0f32; nt * rows];
    let t = std::time::Instant::now();
    for _ in 0..iters {
        m.matmat(&xs, &mut ys).unwrap();
    }
    let s = t.elapsed().as_secs_f64() / iters as f64;
    println!(
        "{dtype} {rows}x{cols} t{nt}: {:.3} ms, {:.2} GB/s",
        s * 1e3,
        p.len() as f64 / s / 1e9
    );
    let t = std::time::Instant::now();
    let mut z = 0u64;
    for _ in 0..iters {
        z = z.wrapping_add(std::hint::black_box(read_sum(std::hint::black_box(p))));
    }
    let s = t.elapsed().as_secs_f64() / iters as f64;
    println!(
        "  one-thread read of the same bytes: {:.2} GB/s ({z})",
        p.len() as f64 / s / 1e9
    );
}

#[allow(dead_code)]
fn read_sum(p: &[u8]) -> u64 {
    let mut acc = [0u64; 8];
    for c in p.chunks_exact(64) {
        for j in 0..8 {
            acc[j] =
                acc[j].wrapping_add(u64::from_le_bytes(c[8 * j..8 * j + 8].try_into().unwrap()));
        }
    }
    acc.iter().fold(0, |a, &b| a.wrapping_add(b))
}
