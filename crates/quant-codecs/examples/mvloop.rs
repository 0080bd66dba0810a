//! Times one matvec/matmat in a loop next to plain reads of the same bytes (one thread and all
//! threads), for profiling a kernel with `perf`:
//!
//! `cargo run --release -p quant-codecs --example mvloop -- q4tp 16384 8192 1 50 [baseline|avx2|avx512]`
use std::hint::black_box;
use std::time::Instant;

use quant_codecs::{DType, Isa, MatRef, quantize};
use rayon::prelude::*;

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 6 {
        eprintln!("usage: mvloop DTYPE ROWS COLS T ITERS [baseline|avx2|avx512]");
        std::process::exit(2);
    }
    let dtype = DType::from_name(&a[1]).expect("a dtype name");
    let num = |i: usize| a[i].parse::<usize>().expect("a number");
    let (rows, cols, nt, iters) = (num(2), num(3), num(4), num(5));
    let isa = match a.get(6).map(String::as_str) {
        Some("baseline") => Isa::Baseline,
        Some("avx2") => Isa::Avx2,
        _ => Isa::detect(),
    };
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
    let gbps = |f: &mut dyn FnMut()| {
        let t = Instant::now();
        for _ in 0..iters {
            f();
        }
        let s = t.elapsed().as_secs_f64() / iters as f64;
        (s * 1e3, p.len() as f64 / s / 1e9)
    };
    let (ms, k) = gbps(&mut || m.matmat_with(isa, &xs, &mut ys).unwrap());
    let (_, one) = gbps(&mut || {
        black_box(read_sum(black_box(p)));
    });
    let (_, all) = gbps(&mut || {
        black_box(
            p.par_chunks(1 << 20)
                .map(read_sum)
                .reduce(|| 0, u64::wrapping_add),
        );
    });
    println!(
        "{dtype} {rows}x{cols} t{nt} {}: {ms:.3} ms, {k:.2} GB/s; plain read {one:.2} GB/s (1 thread), {all:.2} GB/s (all)",
        isa.name()
    );
}

fn read_sum(p: &[u8]) -> u64 {
    let mut acc = [0u64; 8];
    for c in p.chunks_exact(64) {
        for (j, a) in acc.iter_mut().enumerate() {
            *a = a.wrapping_add(u64::from_le_bytes(c[8 * j..8 * j + 8].try_into().unwrap()));
        }
    }
    acc.iter().fold(0, |a, &b| a.wrapping_add(b))
}
