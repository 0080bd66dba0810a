//! The CPU matvec/matmat engine shared by every format: lane accumulators, the fixed
//! reduction order, row-parallel scheduling and run-time ISA dispatch.
//!
//! Every format reduces a row the same way: 16 f32 lanes, lane `j` of a 32-wide group taking
//! elements `j` and `j + 16` (in that order), the lanes folded by one fixed tree at the end.
//! The code is written once, as plain loops over fixed-size arrays, and compiled three times
//! (baseline x86-64, AVX2, AVX-512) behind `#[target_feature]`; the order of every f32
//! operation is the same in all three, so results are bit-identical whatever the CPU, and a
//! matmat row equals the matvec of that row bit for bit.

use rayon::prelude::*;

/// Accumulator lanes per token row.
pub(crate) const LANES: usize = 16;

/// The most activation rows one `matmat` call takes (a decode frame: verify window or prefill chunk).
pub const MAX_BATCH: usize = 8;

/// One format's row kernel: the dot products of one weight row with `NT` activation rows.
pub(crate) trait RowKernel: Sync {
    /// `xs` holds `NT` rows of `cols` activations back to back (already prepared by the format).
    fn row_dot<const NT: usize>(&self, r: usize, xs: &[f32], out: &mut [f32; NT]);
}

/// The instruction set a kernel call is compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Whatever the target's baseline allows (SSE2 on x86-64).
    Baseline,
    /// AVX2 + FMA + F16C (the FMA unit is not used: products and sums stay separately rounded).
    Avx2,
    /// AVX-512 F/BW/VL.
    Avx512,
}

impl Isa {
    /// The widest instruction set this CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if Isa::Avx512.available() {
                return Isa::Avx512;
            }
            if Isa::Avx2.available() {
                return Isa::Avx2;
            }
        }
        Isa::Baseline
    }

    /// Whether this CPU can run code compiled for `self`.
    pub fn available(self) -> bool {
        match self {
            Isa::Baseline => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Short name for reports.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Baseline => "baseline",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

/// `acc[t][j] += scale * (w[j] * x[j] + w[j + 16] * x[j + 16])` for one 32-wide group.
#[inline(always)]
pub(crate) fn scaled_group<const NT: usize>(
    acc: &mut [[f32; LANES]; NT],
    w: &[f32; 32],
    xs: &[f32],
    cols: usize,
    base: usize,
    scale: f32,
) {
    for (t, acc) in acc.iter_mut().enumerate() {
        let x = &xs[t * cols + base..][..32];
        for j in 0..LANES {
            let part = w[j] * x[j] + w[j + LANES] * x[j + LANES];
            acc[j] += scale * part;
        }
    }
}

/// `acc[t][j] += w[j] * x[j] + w[j + 16] * x[j + 16]` for one 32-wide group.
#[inline(always)]
pub(crate) fn plain_group<const NT: usize>(
    acc: &mut [[f32; LANES]; NT],
    w: &[f32; 32],
    xs: &[f32],
    cols: usize,
    base: usize,
) {
    for (t, acc) in acc.iter_mut().enumerate() {
        let x = &xs[t * cols + base..][..32];
        for j in 0..LANES {
            acc[j] += w[j] * x[j] + w[j + LANES] * x[j + LANES];
        }
    }
}

/// Folds 16 lanes by a fixed pairwise tree.
#[inline(always)]
pub(crate) fn fold(acc: &[f32; LANES]) -> f32 {
    let mut v = *acc;
    let mut width = LANES / 2;
    while width > 0 {
        for j in 0..width {
            v[j] += v[j + width];
        }
        width /= 2;
    }
    v[0]
}

#[inline(always)]
fn rows_generic<K: RowKernel, const NT: usize>(k: &K, r0: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
    let n = outs.first().map_or(0, |o| o.len());
    for i in 0..n {
        let mut out = [0.0f32; NT];
        k.row_dot::<NT>(r0 + i, xs, &mut out);
        for (t, o) in outs.iter_mut().enumerate() {
            o[i] = out[t];
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,bmi2")]
fn rows_avx2<K: RowKernel, const NT: usize>(k: &K, r0: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
    rows_generic::<K, NT>(k, r0, xs, outs)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c,bmi2")]
fn rows_avx512<K: RowKernel, const NT: usize>(k: &K, r0: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
    rows_generic::<K, NT>(k, r0, xs, outs)
}

fn rows_isa<K: RowKernel, const NT: usize>(isa: Isa, k: &K, r0: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `run` only passes Avx2 after `Isa::available` confirmed the features.
        Isa::Avx2 => unsafe { rows_avx2::<K, NT>(k, r0, xs, outs) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `run` only passes Avx512 after `Isa::available` confirmed the features.
        Isa::Avx512 => unsafe { rows_avx512::<K, NT>(k, r0, xs, outs) },
        _ => rows_generic::<K, NT>(k, r0, xs, outs),
    }
}

fn run_nt<K: RowKernel, const NT: usize>(isa: Isa, k: &K, rows: usize, cols: usize, xs: &[f32], ys: &mut [f32]) {
    let threads = rayon::current_num_threads().max(1);
    let chunk = rows.div_ceil(threads * 8).clamp(8, 4096);
    let nchunks = rows.div_ceil(chunk);
    // Transpose [NT][rows] outputs into per-chunk lists of NT disjoint slices.
    let mut tasks: Vec<Vec<&mut [f32]>> = (0..nchunks).map(|_| Vec::with_capacity(NT)).collect();
    for y in ys.chunks_mut(rows).take(NT) {
        for (task, part) in tasks.iter_mut().zip(y.chunks_mut(chunk)) {
            task.push(part);
        }
    }
    // Below ~64k weights a rayon fork costs more than it saves.
    if nchunks == 1 || rows * cols * NT < 1 << 16 {
        for (i, mut outs) in tasks.into_iter().enumerate() {
            rows_isa::<K, NT>(isa, k, i * chunk, xs, &mut outs);
        }
        return;
    }
    tasks
        .into_par_iter()
        .enumerate()
        .for_each(|(i, mut outs)| rows_isa::<K, NT>(isa, k, i * chunk, xs, &mut outs));
}

/// Runs `k` over all rows for `nt` activation rows: `ys[t * rows + r] = dot(row r, xs[t])`.
/// Callers have checked `1 <= nt <= MAX_BATCH` and the buffer lengths.
pub(crate) fn run<K: RowKernel>(isa: Isa, k: &K, rows: usize, cols: usize, nt: usize, xs: &[f32], ys: &mut [f32]) {
    let isa = if isa.available() { isa } else { Isa::Baseline };
    match nt {
        1 => run_nt::<K, 1>(isa, k, rows, cols, xs, ys),
        2 => run_nt::<K, 2>(isa, k, rows, cols, xs, ys),
        3 => run_nt::<K, 3>(isa, k, rows, cols, xs, ys),
        4 => run_nt::<K, 4>(isa, k, rows, cols, xs, ys),
        5 => run_nt::<K, 5>(isa, k, rows, cols, xs, ys),
        6 => run_nt::<K, 6>(isa, k, rows, cols, xs, ys),
        7 => run_nt::<K, 7>(isa, k, rows, cols, xs, ys),
        _ => run_nt::<K, 8>(isa, k, rows, cols, xs, ys),
    }
}
