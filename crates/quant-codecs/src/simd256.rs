//! AVX2 row kernels, for the CPUs without AVX-512 (most desktop parts): the same arithmetic and
//! order as the portable code and `simd512` (per bank, four 8-lane quarters of the 32
//! accumulator lanes, fused multiply-adds, the portable `fold`), so results are bit-identical.

// Register arrays are indexed by bank and token row on purpose: the indices are the algorithm.
#![allow(clippy::needless_range_loop)]

use core::arch::x86_64::*;

use crate::kernel::{Acc, BANKS, LANES, fold};
use crate::mxfp4::E2M1;
use crate::tiered::{TieredRow, scale_code, tiered_row};
use crate::{GROUP, Layout, float, q8_2f};

/// A group's 32 lanes as four 8-lane quarters.
type Quarters = [__m256; 4];

#[target_feature(enable = "avx2,fma,f16c,bmi2")]
#[inline]
fn step<const NT: usize>(acc: &mut [Quarters; NT], w: Quarters, xs: &[f32], cols: usize, g: usize) {
    for (t, acc) in acc.iter_mut().enumerate() {
        let x = &xs[t * cols + g * GROUP..][..GROUP];
        for q in 0..4 {
            // SAFETY: `x` holds 32 f32; this load reads 8 of them at 8q.
            let xq = unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * q)) };
            acc[q] = _mm256_fmadd_ps(w[q], xq, acc[q]);
        }
    }
}

/// The shared row loop (see `simd512::rows`): one token row keeps all four banks live (16
/// registers) and walks the groups once; more rows walk the row once per bank.
#[target_feature(enable = "avx2,fma,f16c,bmi2")]
#[inline]
#[allow(clippy::too_many_arguments)]
fn rows<S, const NT: usize>(
    r0: usize,
    cols: usize,
    groups: usize,
    xs: &[f32],
    outs: &mut [&mut [f32]],
    mut begin: impl FnMut(usize) -> S,
    mut group: impl FnMut(&S, usize) -> Quarters,
    mut finish: impl FnMut(&S, usize, f32) -> f32,
) {
    let n = outs.first().map_or(0, |o| o.len());
    let zero = _mm256_setzero_ps();
    for i in 0..n {
        let row = begin(r0 + i);
        let mut acc: [[Quarters; BANKS]; NT] = [[[zero; 4]; BANKS]; NT];
        if NT == 1 {
            let mut g = 0;
            while g < groups {
                let b = g % BANKS;
                let w = group(&row, g);
                let mut regs: [Quarters; NT] = core::array::from_fn(|t| acc[t][b]);
                step::<NT>(&mut regs, w, xs, cols, g);
                for t in 0..NT {
                    acc[t][b] = regs[t];
                }
                g += 1;
            }
        } else {
            for b in 0..BANKS {
                let mut regs = [[zero; 4]; NT];
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
                for q in 0..4 {
                    // SAFETY: each bank holds 32 f32; this store writes 8 at 8q.
                    unsafe { _mm256_storeu_ps(bank.as_mut_ptr().add(8 * q), regs[q]) };
                }
            }
            outs[t][i] = finish(&row, t, fold(&lanes));
        }
    }
}

/// Asks for the weight bytes `PREFETCH` ahead of `at` (see `simd512::prefetch`).
#[target_feature(enable = "avx2,fma,f16c,bmi2")]
#[inline]
fn prefetch(at: &[u8]) {
    // A prefetch never faults, so an address past the slice's end is harmless.
    _mm_prefetch::<_MM_HINT_T0>(at.as_ptr().wrapping_add(crate::simd512::PREFETCH).cast());
}

/// Loads 8 bytes as 8 u32 lanes.
#[target_feature(enable = "avx2")]
#[inline]
fn bytes8(b: &[u8]) -> __m256i {
    let b = &b[..8];
    // SAFETY: `b` holds 8 bytes.
    _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(b.as_ptr().cast()) })
}

/// f32, f16 and bf16 rows (tail after the fold, as the portable kernel).
#[target_feature(enable = "avx2,fma,f16c,bmi2")]
pub(crate) fn float_rows<const NT: usize>(
    k: &float::Kernel,
    r0: usize,
    xs: &[f32],
    outs: &mut [&mut [f32]],
) {
    let (cols, dtype, bytes) = (k.cols, k.dtype, k.bytes);
    let full = cols / GROUP;
    let size = dtype.element_size().unwrap_or(4);
    let group = |&r: &usize, g: usize| {
        let p = &bytes[(r * cols + g * GROUP) * size..][..GROUP * size];
        prefetch(p);
        let mut w = [_mm256_setzero_ps(); 4];
        for (q, w) in w.iter_mut().enumerate() {
            let at = p[8 * q * size..][..8 * size].as_ptr();
            // SAFETY: `at` points at 8 elements of the group.
            *w = unsafe {
                match dtype {
                    crate::DType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(at.cast())),
                    crate::DType::BF16 => {
                        let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(at.cast()));
                        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
                    }
                    _ => _mm256_loadu_ps(at.cast()),
                }
            };
        }
        w
    };
    let finish = |&r: &usize, t: usize, mut s: f32| {
        for i in full * GROUP..cols {
            s = float::element(dtype, bytes, r * cols + i).mul_add(xs[t * cols + i], s);
        }
        s
    };
    rows::<usize, NT>(r0, cols, full, xs, outs, |r| r, group, finish);
}

/// q8_2f rows; `xs` already carries the column scales.
#[target_feature(enable = "avx2,fma,f16c,bmi2")]
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
        core::array::from_fn(|i| {
            // SAFETY: `q` holds 32 bytes; this load reads 8 at 8i.
            let v = unsafe { _mm_loadl_epi64(q.as_ptr().add(8 * i).cast()) };
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
        })
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
#[target_feature(enable = "avx2,fma,f16c,bmi2")]
pub(crate) fn q4tp_rows<const NT: usize>(
    l: &Layout,
    bytes: &[u8],
    r0: usize,
    xs: &[f32],
    outs: &mut [&mut [f32]],
) {
    let tier = crate::q4tp::TIER;
    let (fifteen, eight) = (_mm256_set1_epi32(15), _mm256_set1_epi32(8));
    let group = |row: &TieredRow, g: usize| {
        let s = _mm256_set1_ps(row.table[scale_code(row.codes, g)]);
        let b = &row.plane[g * 16..][..16];
        prefetch(b);
        let (v0, v1) = (bytes8(b), bytes8(&b[8..]));
        let lo = |v| {
            _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(v, fifteen), eight)),
                s,
            )
        };
        let hi = |v| {
            _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32::<4>(v), eight)),
                s,
            )
        };
        [lo(v0), lo(v1), hi(v0), hi(v1)]
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
#[target_feature(enable = "avx2,fma,f16c,bmi2")]
pub(crate) fn q2tp_rows<const NT: usize>(
    l: &Layout,
    bytes: &[u8],
    r0: usize,
    xs: &[f32],
    outs: &mut [&mut [f32]],
) {
    let tier = crate::q2tp::TIER;
    let three = _mm256_set1_epi32(3);
    let half3 = _mm256_set1_ps(1.5);
    let group = |row: &TieredRow, g: usize| {
        let s = _mm256_set1_ps(row.table[scale_code(row.codes, g)]);
        prefetch(&row.plane[g * 8..]);
        let v = bytes8(&row.plane[g * 8..]);
        let level = |c| {
            _mm256_mul_ps(
                _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c, three)), half3),
                s,
            )
        };
        [
            level(v),
            level(_mm256_srli_epi32::<2>(v)),
            level(_mm256_srli_epi32::<4>(v)),
            level(_mm256_srli_epi32::<6>(v)),
        ]
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
#[target_feature(enable = "avx2,fma,f16c,bmi2")]
pub(crate) fn mxfp4_rows<const NT: usize>(
    l: &Layout,
    bytes: &[u8],
    r0: usize,
    xs: &[f32],
    outs: &mut [&mut [f32]],
) {
    let gpr = l.groups_per_row();
    // SAFETY: `E2M1` holds 8 f32.
    let lut = unsafe { _mm256_loadu_ps(E2M1.as_ptr()) };
    let (seven, eight) = (_mm256_set1_epi32(7), _mm256_set1_epi32(8));
    // Magnitude from the 8-entry table, sign bit 3 moved to bit 31: the same bits as `e2m1`.
    let e2m1 = |n: __m256i| {
        let mag = _mm256_permutevar8x32_ps(lut, _mm256_and_si256(n, seven));
        let sign = _mm256_slli_epi32::<28>(_mm256_and_si256(n, eight));
        _mm256_or_ps(mag, _mm256_castsi256_ps(sign))
    };
    let fifteen = _mm256_set1_epi32(15);
    let group = |&r: &usize, g: usize| {
        let s = _mm256_set1_ps(crate::mxfp4::e8m0(bytes[l.second + r * gpr + g]));
        let b = &bytes[(r * gpr + g) * 16..][..16];
        prefetch(b);
        let (v0, v1) = (bytes8(b), bytes8(&b[8..]));
        let lo = |v| _mm256_mul_ps(e2m1(_mm256_and_si256(v, fifteen)), s);
        let hi = |v| _mm256_mul_ps(e2m1(_mm256_srli_epi32::<4>(v)), s);
        [lo(v0), lo(v1), hi(v0), hi(v1)]
    };
    rows::<usize, NT>(r0, l.cols, gpr, xs, outs, |r| r, group, |_, _, s| s);
}
