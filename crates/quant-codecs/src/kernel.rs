//! The CPU matvec/matmat engine shared by every format: lane accumulators, the fixed
//! reduction order, row-parallel scheduling and run-time ISA dispatch.
//!
//! Every format reduces a row the same way: each 32-wide group is decoded to f32 (scale applied,
//! exactly as `dequantize` computes it), lane `j` of bank `g % 4` accumulates `w[j] * x[j]` by a
//! fused multiply-add, and the banks and lanes are folded by one fixed tree at the end.
//! The code is written once, as plain loops over fixed-size arrays, and compiled three times
//! (baseline x86-64, AVX2, AVX-512) behind `#[target_feature]`, and hand-written for AVX-512
//! (`simd512`); the order of every f32 operation is the same in all of them, so results are bit-identical whatever the CPU, and a
//! matmat row equals the matvec of that row bit for bit.

use rayon::prelude::*;

/// Accumulator lanes per token row.
pub(crate) const LANES: usize = 32;

/// The most activation rows one `matmat` call takes (a decode frame: verify window or prefill chunk).
pub const MAX_BATCH: usize = 8;

/// One format's row kernel: the dot products of one weight row with `NT` activation rows.
pub(crate) trait RowKernel: Sync + Sized {
    /// `xs` holds `NT` rows of `cols` activations back to back (already prepared by the format).
    fn row_dot<const NT: usize>(&self, r: usize, xs: &[f32], out: &mut [f32; NT]);

    /// Rows `r0 .. r0 + outs[0].len()` with AVX-512. The default compiles the portable code
    /// for AVX-512; formats with hand-written kernels (`simd512`) override it.
    ///
    /// # Safety
    /// The CPU supports `Isa::Avx512`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn rows_avx512<const NT: usize>(&self, r0: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
        // SAFETY: the caller's contract is this function's.
        unsafe { rows_avx512_portable::<Self, NT>(self, r0, xs, outs) }
    }

    /// Rows with AVX2; the default compiles the portable code for AVX2, formats override it
    /// with `simd256`.
    ///
    /// # Safety
    /// The CPU supports `Isa::Avx2`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn rows_avx2<const NT: usize>(&self, r0: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
        // SAFETY: the caller's contract is this function's.
        unsafe { rows_avx2_portable::<Self, NT>(self, r0, xs, outs) }
    }
}

/// The instruction set a kernel call is compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Whatever the target's baseline allows (SSE2 on x86-64).
    Baseline,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL.
    Avx512,
}

impl Isa {
    /// The widest instruction set this CPU supports, or a narrower one named by
    /// `CORTIQ_ISA` (`baseline`, `avx2`, `avx512`: to measure, or to test, the kernels a
    /// smaller CPU runs; a set the CPU lacks, or an unknown name, is ignored with a warning).
    pub fn detect() -> Isa {
        static CHOSEN: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let widest = Isa::widest();
            let Ok(name) = std::env::var("CORTIQ_ISA") else {
                return widest;
            };
            match [Isa::Baseline, Isa::Avx2, Isa::Avx512]
                .into_iter()
                .find(|i| i.name() == name)
            {
                Some(isa) if isa.available() => isa,
                _ => {
                    tracing::warn!(
                        "CORTIQ_ISA={name}: not one this CPU runs (baseline, avx2, avx512 up to \
                         {}); using {}",
                        widest.name(),
                        widest.name()
                    );
                    widest
                }
            }
        })
    }

    fn widest() -> Isa {
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

/// Accumulator banks: group `g` of a row accumulates into bank `g % BANKS`, so a row has
/// `BANKS` independent dependency chains per lane (fused multiply-adds have a 4-cycle latency).
pub(crate) const BANKS: usize = 4;

/// One token row's accumulators: `BANKS` banks of `LANES` lanes.
pub(crate) type Acc = [[f32; LANES]; BANKS];

/// A zeroed accumulator per token row.
#[inline(always)]
pub(crate) fn zeroed<const NT: usize>() -> [Acc; NT] {
    [[[0.0; LANES]; BANKS]; NT]
}

/// `acc[t][g % BANKS][j] = fma(w[j], x[t][g * 32 + j], acc[t][g % BANKS][j])` for group `g`.
#[inline(always)]
pub(crate) fn group_dot<const NT: usize>(
    acc: &mut [Acc; NT],
    w: &[f32; LANES],
    xs: &[f32],
    cols: usize,
    g: usize,
) {
    for (t, acc) in acc.iter_mut().enumerate() {
        let x: &[f32; LANES] = xs[t * cols + g * LANES..][..LANES]
            .try_into()
            .expect("32 lanes");
        let bank = &mut acc[g % BANKS];
        for j in 0..LANES {
            bank[j] = w[j].mul_add(x[j], bank[j]);
        }
    }
}

/// How a format's lanes map to a group's elements; activations are permuted once per call so
/// the decode loop reads packed bytes straight into lanes.
#[derive(Clone, Copy)]
pub(crate) enum Permute {
    /// Lanes 0..16 are the even elements, 16..32 the odd ones (two 4-bit codes per byte).
    Pairs,
    /// Lanes 8q..8q+8 are elements 4k + q (four 2-bit codes per byte).
    Quads,
}

impl Permute {
    /// The element that lane `j` of a group holds.
    pub(crate) const fn element(self, j: usize) -> usize {
        match self {
            Permute::Pairs => 2 * (j % 16) + j / 16,
            Permute::Quads => 4 * (j % 8) + j / 8,
        }
    }

    /// `xs` (whole 32-element groups) in lane order.
    pub(crate) fn apply(self, xs: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0f32; xs.len()];
        for (o, x) in out.chunks_exact_mut(LANES).zip(xs.chunks_exact(LANES)) {
            for (j, o) in o.iter_mut().enumerate() {
                *o = x[self.element(j)];
            }
        }
        out
    }
}

/// Folds one token row's accumulators: banks `(b0 + b1) + (b2 + b3)` lane by lane, then the
/// lanes by a fixed pairwise tree (lane `j + width` into lane `j`, width 16, 8, 4, 2, 1).
#[inline(always)]
pub(crate) fn fold(acc: &Acc) -> f32 {
    let mut v = [0.0f32; LANES];
    for j in 0..LANES {
        v[j] = (acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j]);
    }
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
fn rows_generic<K: RowKernel, const NT: usize>(
    k: &K,
    r0: usize,
    xs: &[f32],
    outs: &mut [&mut [f32]],
) {
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
fn rows_avx2_portable<K: RowKernel, const NT: usize>(
    k: &K,
    r0: usize,
    xs: &[f32],
    outs: &mut [&mut [f32]],
) {
    rows_generic::<K, NT>(k, r0, xs, outs)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c,bmi2")]
fn rows_avx512_portable<K: RowKernel, const NT: usize>(
    k: &K,
    r0: usize,
    xs: &[f32],
    outs: &mut [&mut [f32]],
) {
    rows_generic::<K, NT>(k, r0, xs, outs)
}

fn rows_isa<K: RowKernel, const NT: usize>(
    isa: Isa,
    k: &K,
    r0: usize,
    xs: &[f32],
    outs: &mut [&mut [f32]],
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `run` only passes Avx2 after `Isa::available` confirmed the features.
        Isa::Avx2 => unsafe { k.rows_avx2::<NT>(r0, xs, outs) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `run` only passes Avx512 after `Isa::available` confirmed the features.
        Isa::Avx512 => unsafe { k.rows_avx512::<NT>(r0, xs, outs) },
        _ => rows_generic::<K, NT>(k, r0, xs, outs),
    }
}

fn run_nt<K: RowKernel, const NT: usize>(
    isa: Isa,
    k: &K,
    rows: usize,
    cols: usize,
    xs: &[f32],
    ys: &mut [f32],
) {
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
pub(crate) fn run<K: RowKernel>(
    isa: Isa,
    k: &K,
    rows: usize,
    cols: usize,
    nt: usize,
    xs: &[f32],
    ys: &mut [f32],
) {
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
