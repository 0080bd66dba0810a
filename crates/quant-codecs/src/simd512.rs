//! AVX-512 row kernels: the same arithmetic as the portable code in each format module, in
//! the same order (per bank, two 16-lane halves of the 32 accumulator lanes, fused
//! multiply-adds, the portable `fold` at the end), so the results are bit-identical to it. The
//! compiler does not vectorise the portable group decoders well (it builds 2- and 4-wide
//! vectors around the packed codes), which is why these exist.

// Register arrays are indexed by bank and token row on purpose: the indices are the algorithm.
#![allow(clippy::needless_range_loop)]

use core::arch::x86_64::*;

use crate::kernel::{Acc, BANKS, LANES, fold};
use crate::mxfp4::e2m1;
use crate::tiered::{TieredRow, scale_code, tiered_row};
use crate::{GROUP, Layout, float, q8_2f};

/// How far ahead of the group being decoded the weight stream is prefetched, in bytes.
pub(crate) const PREFETCH: usize = 4096;

/// One token row's accumulators in registers: `BANKS` banks of two 16-lane halves.
type Regs = [[__m512; 2]; BANKS];

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c,bmi2")]
#[inline]
fn step<const NT: usize>(
    acc: &mut [[__m512; 2]; NT],
    w: (__m512, __m512),
    xs: &[f32],
    cols: usize,
    g: usize,
) {
    for (t, acc) in acc.iter_mut().enumerate() {
        let x = &xs[t * cols + g * GROUP..][..GROUP];
        // SAFETY: `x` holds 32 f32; each load reads 16 of them.
        let (x0, x1) = unsafe {
            (
                _mm512_loadu_ps(x.as_ptr()),
                _mm512_loadu_ps(x.as_ptr().add(16)),
            )
        };
        acc[0] = _mm512_fmadd_ps(w.0, x0, acc[0]);
        acc[1] = _mm512_fmadd_ps(w.1, x1, acc[1]);
    }
}

/// The shared row loop: `begin(r)` sets up a row, `group(&row, g)` decodes group `g` into the
/// two lane halves, `finish(&row, t, sum)` turns the folded lanes into the output.
///
/// Up to two token rows keep all four banks in registers and walk the groups once; more rows
/// walk the row once per bank (the row is in L1/L2 after the first walk), which keeps
/// `2 * NT` accumulators live instead of `8 * NT`. Both visit each bank's groups in
/// increasing order, so the sums are the same.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c,bmi2")]
#[inline]
#[allow(clippy::too_many_arguments)]
fn rows<S, const NT: usize>(
    r0: usize,
    cols: usize,
    groups: usize,
    xs: &[f32],
    outs: &mut [&mut [f32]],
    mut begin: impl FnMut(usize) -> S,
    mut group: impl FnMut(&S, usize) -> (__m512, __m512),
    mut finish: impl FnMut(&S, usize, f32) -> f32,
) {
    let n = outs.first().map_or(0, |o| o.len());
    let zero = _mm512_setzero_ps();
    for i in 0..n {
        let row = begin(r0 + i);
        let mut acc: [Regs; NT] = [[[zero; 2]; BANKS]; NT];
        if NT <= 2 {
            let mut g = 0;
            while g + BANKS <= groups {
                for b in 0..BANKS {
                    let w = group(&row, g + b);
                    let mut regs: [[__m512; 2]; NT] = core::array::from_fn(|t| acc[t][b]);
                    step::<NT>(&mut regs, w, xs, cols, g + b);
                    for t in 0..NT {
                        acc[t][b] = regs[t];
                    }
                }
                g += BANKS;
            }
            for b in 0..groups - g {
                let w = group(&row, g + b);
                let mut regs: [[__m512; 2]; NT] = core::array::from_fn(|t| acc[t][b]);
                step::<NT>(&mut regs, w, xs, cols, g + b);
                for t in 0..NT {
                    acc[t][b] = regs[t];
                }
            }
        } else {
            for b in 0..BANKS {
                let mut regs = [[zero; 2]; NT];
                let mut g = b;
                while g < groups {
                    let w = group(&row, g);
                    step::<NT>(&mut regs, w, xs, cols, g);
                    g += BANKS;
                }
                for t in 0..NT {
                    acc[t][b] = regs[t];
                }
            }
        }
        for t in 0..NT {
            let mut lanes: Acc = [[0.0; LANES]; BANKS];
            for (bank, regs) in lanes.iter_mut().zip(&acc[t]) {
                // SAFETY: each bank holds 32 f32; each store writes 16.
                unsafe {
                    _mm512_storeu_ps(bank.as_mut_ptr(), regs[0]);
                    _mm512_storeu_ps(bank.as_mut_ptr().add(16), regs[1]);
                }
            }
            outs[t][i] = finish(&row, t, fold(&lanes));
        }
    }
}

/// Asks for the weight bytes `PREFETCH` ahead of `at`: the kernels issue loads more slowly than
/// a plain read loop, and the hardware prefetcher alone leaves them waiting on memory (measured:
/// q8_2f 17 -> 21.5 GB/s on the 2-core development box).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c,bmi2")]
#[inline]
pub(crate) fn prefetch(at: &[u8]) {
    // A prefetch never faults, so an address past the slice's end is harmless.
    _mm_prefetch::<_MM_HINT_T0>(at.as_ptr().wrapping_add(PREFETCH).cast());
}

/// Loads 16 bytes as 16 u32 lanes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn bytes16(b: &[u8]) -> __m512i {
    let b = &b[..16];
    // SAFETY: `b` holds 16 bytes.
    _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(b.as_ptr().cast()) })
}

/// f32, f16 and bf16 rows (tail after the fold, as the portable kernel).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c,bmi2")]
pub(crate) fn float_rows<const NT: usize>(
    k: &float::Kernel,
    r0: usize,
    xs: &[f32],
    outs: &mut [&mut [f32]],
) {
    let (cols, dtype, bytes) = (k.cols, k.dtype, k.bytes);
    let full = cols / GROUP;
    let tail = |r: usize, t: usize, mut s: f32| {
        for i in full * GROUP..cols {
            s = float::element(dtype, bytes, r * cols + i).mul_add(xs[t * cols + i], s);
        }
        s
    };
    let size = dtype.element_size().unwrap_or(4);
    let group = |&r: &usize, g: usize| {
        let p = &bytes[(r * cols + g * GROUP) * size..][..GROUP * size];
        prefetch(p);
        // SAFETY: `p` holds one group of 32 elements; each load reads half of it.
        unsafe {
            match dtype {
                crate::DType::F16 => (
                    _mm512_cvtph_ps(_mm256_loadu_si256(p.as_ptr().cast())),
                    _mm512_cvtph_ps(_mm256_loadu_si256(p.as_ptr().add(32).cast())),
                ),
                crate::DType::BF16 => {
                    let h0 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.as_ptr().cast()));
                    let h1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.as_ptr().add(32).cast()));
                    (
                        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h0)),
                        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h1)),
                    )
                }
                _ => (
                    _mm512_loadu_ps(p.as_ptr().cast()),
                    _mm512_loadu_ps(p.as_ptr().add(64).cast()),
                ),
            }
        }
    };
    rows::<usize, NT>(
        r0,
        cols,
        full,
        xs,
        outs,
        |r| r,
        group,
        |&r, t, s| tail(r, t, s),
    );
}

/// q8_2f rows; `xs` already carries the column scales.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c,bmi2")]
pub(crate) fn q8_2f_rows<const NT: usize>(
    k: &q8_2f::Kernel,
    r0: usize,
    xs: &[f32],
    outs: &mut [&mut [f32]],
) {
    let (l, bytes) = (&k.l, k.bytes);
    let cols = l.cols;
    let full = cols / GROUP;
    let group = |&r: &usize, g: usize| {
        let q = &bytes[r * cols + g * GROUP..][..GROUP];
        prefetch(q);
        // SAFETY: `q` holds 32 bytes; each load reads 16.
        let (q0, q1) = unsafe {
            (
                _mm_loadu_si128(q.as_ptr().cast()),
                _mm_loadu_si128(q.as_ptr().add(16).cast()),
            )
        };
        (
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)),
        )
    };
    let finish = |&r: &usize, t: usize, mut s: f32| {
        let q = &bytes[r * cols..][..cols];
        for i in full * GROUP..cols {
            s = (q[i] as i8 as f32).mul_add(xs[t * cols + i], s);
        }
        s * q8_2f::row_scale(l, bytes, r)
    };
    rows::<usize, NT>(r0, cols, full, xs, outs, |r| r, group, finish);
}

/// q4tp rows; `xs` is in `Permute::Pairs` lane order.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c,bmi2")]
pub(crate) fn q4tp_rows<const NT: usize>(
    l: &Layout,
    bytes: &[u8],
    r0: usize,
    xs: &[f32],
    outs: &mut [&mut [f32]],
) {
    let tier = crate::q4tp::TIER;
    let (fifteen, eight) = (_mm512_set1_epi32(15), _mm512_set1_epi32(8));
    let group = |row: &TieredRow, g: usize| {
        let s = _mm512_set1_ps(row.table[scale_code(row.codes, g)]);
        prefetch(&row.plane[g * 16..]);
        let v = bytes16(&row.plane[g * 16..]);
        let lo = _mm512_sub_epi32(_mm512_and_si512(v, fifteen), eight);
        let hi = _mm512_sub_epi32(_mm512_srli_epi32::<4>(v), eight);
        (
            _mm512_mul_ps(_mm512_cvtepi32_ps(lo), s),
            _mm512_mul_ps(_mm512_cvtepi32_ps(hi), s),
        )
    };
    let begin = |r| tiered_row(&tier, l, bytes, r);
    rows::<TieredRow, NT>(
        r0,
        l.cols,
        l.cols / GROUP,
        xs,
        outs,
        begin,
        group,
        |_, _, s| s,
    );
}

/// q2tp rows; `xs` is in `Permute::Quads` lane order.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c,bmi2")]
pub(crate) fn q2tp_rows<const NT: usize>(
    l: &Layout,
    bytes: &[u8],
    r0: usize,
    xs: &[f32],
    outs: &mut [&mut [f32]],
) {
    let tier = crate::q2tp::TIER;
    let three = _mm512_set1_epi32(3);
    let half3 = _mm512_set1_ps(1.5);
    let sh0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    let sh1 = _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6);
    let group = |row: &TieredRow, g: usize| {
        let s = _mm512_set1_ps(row.table[scale_code(row.codes, g)]);
        let b = &row.plane[g * 8..][..8];
        prefetch(b);
        // SAFETY: `b` holds 8 bytes.
        let q = unsafe { _mm_loadl_epi64(b.as_ptr().cast()) };
        let v = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(q, q));
        let c0 = _mm512_and_si512(_mm512_srlv_epi32(v, sh0), three);
        let c1 = _mm512_and_si512(_mm512_srlv_epi32(v, sh1), three);
        (
            _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(c0), half3), s),
            _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(c1), half3), s),
        )
    };
    let begin = |r| tiered_row(&tier, l, bytes, r);
    rows::<TieredRow, NT>(
        r0,
        l.cols,
        l.cols / GROUP,
        xs,
        outs,
        begin,
        group,
        |_, _, s| s,
    );
}

/// mxfp4 rows; `xs` is in `Permute::Pairs` lane order.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c,bmi2")]
pub(crate) fn mxfp4_rows<const NT: usize>(
    l: &Layout,
    bytes: &[u8],
    r0: usize,
    xs: &[f32],
    outs: &mut [&mut [f32]],
) {
    let gpr = l.groups_per_row();
    let lut: [f32; 16] = core::array::from_fn(|n| e2m1(n as u8));
    // SAFETY: `lut` holds 16 f32.
    let lut = unsafe { _mm512_loadu_ps(lut.as_ptr()) };
    let fifteen = _mm512_set1_epi32(15);
    let group = |&r: &usize, g: usize| {
        let s = _mm512_set1_ps(crate::mxfp4::e8m0(bytes[l.second + r * gpr + g]));
        prefetch(&bytes[(r * gpr + g) * 16..]);
        let v = bytes16(&bytes[(r * gpr + g) * 16..]);
        let lo = _mm512_permutexvar_ps(_mm512_and_si512(v, fifteen), lut);
        let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v), lut);
        (_mm512_mul_ps(lo, s), _mm512_mul_ps(hi, s))
    };
    rows::<usize, NT>(r0, l.cols, gpr, xs, outs, |r| r, group, |_, _, s| s);
}
