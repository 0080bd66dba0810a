//! CPU matvec/matmat throughput per format, in GB/s of weight bytes, next to the machine's
//! memory read bandwidth measured in the same run (`read_ceiling`).
//!
//! `cargo bench -p quant-codecs --bench matvec`; `scripts/perf-table.py` turns criterion's
//! estimates into the table in docs/perf.md. `-- paths_` runs only the f32-vs-int8 activation
//! path groups (`paths_<format>/<path>/<shape>_t<T>`); `examples/int8_bw.rs` prints the same
//! cases as one table with the percentage of the read ceiling.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use quant_codecs::{ActPath, DType, MatRef};
use rayon::prelude::*;

fn read_ceiling(c: &mut Criterion) {
    let len = 1usize << 30;
    let buf: Vec<u64> = (0..len / 8).into_par_iter().map(|i| i as u64).collect();
    let mut g = c.benchmark_group("read_ceiling");
    g.throughput(Throughput::Bytes(len as u64));
    g.bench_function("sum_1GiB", |b| {
        b.iter(|| {
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
                .reduce(|| 0, u64::wrapping_add)
        })
    });
    g.finish();
}

fn shapes_for(dtype: DType) -> Vec<(&'static str, usize, usize, usize)> {
    let mut s = vec![
        ("2560x2560", 2560, 2560, 1),
        ("640x2560", 640, 2560, 1),
        ("10240x320", 10240, 320, 1),
        ("32768x16384", 32768, 16384, 1),
        ("32768x16384_t8", 32768, 16384, 8),
    ];
    if dtype == DType::Q8_2f {
        s.push(("248320x2560", 248320, 2560, 1));
    }
    s
}

fn matvec(c: &mut Criterion) {
    for dtype in DType::ALL {
        let mut g = c.benchmark_group(format!("matvec_{dtype}"));
        for (name, rows, cols, nt) in shapes_for(dtype) {
            let p = quant_codecs::synthetic_payload(dtype, rows, cols, 1).unwrap();
            let m = MatRef::new(dtype, rows, cols, &p).unwrap();
            let xs: Vec<f32> = (0..nt * cols)
                .map(|i| ((i % 17) as f32 - 8.0) / 8.0)
                .collect();
            let mut ys = vec![0.0f32; nt * rows];
            g.throughput(Throughput::Bytes(p.len() as u64));
            g.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| m.matmat(black_box(&xs), &mut ys).unwrap())
            });
        }
        g.finish();
    }
}

/// Both activation paths (`ActPath::F32`, `ActPath::Int8`) for the quantised formats: the
/// decode shapes and a matrix of about 1 GiB of weights (far beyond any L3), at T = 1 and 8.
fn paths(c: &mut Criterion) {
    for dtype in [DType::Q8_2f, DType::Q4tp, DType::Q2tp, DType::Mxfp4] {
        let big_rows = match dtype {
            DType::Q8_2f => 65536,
            DType::Q2tp => 262144,
            _ => 131072,
        };
        let mut g = c.benchmark_group(format!("paths_{dtype}"));
        for (name, rows, cols) in [
            ("2560x2560", 2560, 2560),
            ("10240x2560", 10240, 2560),
            ("1GiB", big_rows, 16384),
        ] {
            let p = quant_codecs::synthetic_payload(dtype, rows, cols, 1).unwrap();
            let m = MatRef::new(dtype, rows, cols, &p).unwrap();
            g.throughput(Throughput::Bytes(p.len() as u64));
            for nt in [1, 8] {
                let xs: Vec<f32> = (0..nt * cols)
                    .map(|i| ((i % 17) as f32 - 8.0) / 8.0)
                    .collect();
                let mut ys = vec![0.0f32; nt * rows];
                for (pname, path) in [("f32", ActPath::F32), ("int8", ActPath::Int8)] {
                    let id = BenchmarkId::new(pname, format!("{name}_t{nt}"));
                    g.bench_function(id, |b| {
                        b.iter(|| m.matmat_path(path, black_box(&xs), &mut ys).unwrap())
                    });
                }
            }
        }
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = read_ceiling, matvec, paths
}
criterion_main!(benches);
