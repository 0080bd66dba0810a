//! AVX-512 VNNI int8-activation kernels: the portable `int8` arithmetic, 16 blocks per vector.
//!
//! A chunk of 16 blocks of one weight row is decoded once into eight 64-byte vectors of
//! unsigned codes `u` (q8_2f: `code + 128`, q4tp: the nibble, q2tp: the bit pair, mxfp4:
//! `2 * e2m1 + 12` by a byte shuffle) and, for every token row, multiplied with the signed
//! activation codes by `vpdpbusd` (u8 x i8, exact i32 sums of 4), whose lanes are added
//! pairwise into one vector of 16 block sums `N_b`; `I_b = mul * N_b - off * sum_b(q)` is then
//! exactly the portable code's `sum c_i q_i`. The f32 part is the portable code's, lane for lane:
//! block `b` in lane `b % 16`, `fma(d_b * S_b, I_b, acc)`, padding lanes masked off.

// Register arrays are indexed by token row and vector on purpose: the indices are the algorithm.
#![allow(clippy::needless_range_loop)]

use core::arch::x86_64::*;

use crate::DType;
use crate::act8::ACT_BLOCK;
use crate::int8::{Acts, LANES8, MX_INT, Mat, Row};

/// How far ahead of the bytes being decoded the weight stream is prefetched.
const PREFETCH: usize = 4096;

/// Bytes of activation codes per 16-block chunk.
const CHUNK_Q: usize = LANES8 * ACT_BLOCK;

/// `[a0 + a1, a2 + a3, .., a14 + a15, b0 + b1, .., b14 + b15]`: pairwise sums, order kept.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn hadd(a: __m512i, b: __m512i) -> __m512i {
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    _mm512_add_epi32(
        _mm512_permutex2var_epi32(a, even, b),
        _mm512_permutex2var_epi32(a, odd, b),
    )
}

/// Up to 64 bytes of `s` from `at` (zero past its end), with a prefetch ahead.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn load64(s: &[u8], at: usize) -> __m512i {
    if at >= s.len() {
        return _mm512_setzero_si512();
    }
    let p = s[at..].as_ptr();
    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH).cast());
    let avail = s.len() - at;
    if avail >= 64 {
        // SAFETY: 64 bytes from `at` lie within `s`.
        unsafe { _mm512_loadu_si512(p.cast()) }
    } else {
        // SAFETY: masked-off bytes are not read (AVX-512 fault suppression); the first `avail`
        // bytes lie within `s`.
        unsafe { _mm512_maskz_loadu_epi8((1u64 << avail) - 1, p.cast()) }
    }
}

/// Up to 16 bytes of `s` from `at` (zero past its end).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn load16(s: &[u8], at: usize) -> __m128i {
    if at >= s.len() {
        return _mm_setzero_si128();
    }
    let avail = (s.len() - at).min(16);
    // SAFETY: the first `avail` bytes from `at` lie within `s`; masked-off bytes are not read.
    unsafe { _mm_maskz_loadu_epi8(((1u32 << avail) - 1) as u16, s[at..].as_ptr().cast()) }
}

/// Activation codes at `at` as one vector.
///
/// # Safety
/// `q` holds 64 bytes at `at`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn q64(q: *const i8, at: usize) -> __m512i {
    // SAFETY: the caller's contract.
    unsafe { _mm512_loadu_si512(q.add(at).cast()) }
}

/// The per-row loop shared by the formats: `decode(row, c)` gives chunk `c`'s eight code
/// vectors and its 16 factors `S_b`, `dot(w, q)` the 16 block sums `N_b` against the
/// activation codes `q` (one chunk, 512 bytes); `I = mul * N - off * sums`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
fn drive<const NT: usize>(
    m: &Mat,
    a: &Acts,
    r0: usize,
    outs: &mut [&mut [f32]],
    (mul, off): (i32, i32),
    mut decode: impl FnMut(&Row, usize) -> ([__m512i; 8], __m512),
    dot: impl Fn(&[__m512i; 8], *const i8) -> __m512i,
) {
    let n = outs.first().map_or(0, |o| o.len());
    let per = a.nbp * ACT_BLOCK;
    let chunks = a.nb.div_ceil(LANES8);
    let offv = _mm512_set1_epi32(off);
    // Each row's 16 lanes wait here until 16 rows are done, to be folded together.
    let mut held = [[[0.0f32; LANES8]; LANES8]; NT];
    let mut rs = [1.0f32; LANES8];
    for i in 0..n {
        let row = m.row(r0 + i);
        let mut acc = [_mm512_setzero_ps(); NT];
        for c in 0..chunks {
            let nbl = (a.nb - c * LANES8).min(LANES8);
            let mask: __mmask16 = if nbl == LANES8 {
                0xFFFF
            } else {
                (1u16 << nbl) - 1
            };
            let (w, s) = decode(&row, c);
            for t in 0..NT {
                let at = t * a.nbp + c * LANES8;
                // SAFETY: token row `t` holds `nbp * 32` codes, and chunk `c < nbp / 16`.
                let nsum = dot(&w, unsafe { a.q.as_ptr().add(t * per + c * CHUNK_Q) });
                // SAFETY: `d` and `sums` hold `nbp` values per token row; 16 from `at` fit.
                let (sums, d) = unsafe {
                    (
                        _mm512_loadu_si512(a.sums.as_ptr().add(at).cast()),
                        _mm512_loadu_ps(a.d.as_ptr().add(at)),
                    )
                };
                let nsum = if mul == 2 {
                    _mm512_slli_epi32::<1>(nsum)
                } else {
                    nsum
                };
                let int = _mm512_sub_epi32(nsum, _mm512_mullo_epi32(sums, offv));
                let f = _mm512_mul_ps(d, s);
                acc[t] = _mm512_mask3_fmadd_ps(f, _mm512_cvtepi32_ps(int), acc[t], mask);
            }
        }
        let slot = i % LANES8;
        rs[slot] = row.rs;
        for t in 0..NT {
            // SAFETY: a row of `held` holds 16 f32.
            unsafe { _mm512_storeu_ps(held[t][slot].as_mut_ptr(), acc[t]) };
        }
        if slot == LANES8 - 1 || i + 1 == n {
            let first = i - slot;
            for t in 0..NT {
                let sums = fold16x16(&held[t]);
                for j in 0..=slot {
                    outs[t][first + j] = sums[j] * rs[j];
                }
            }
        }
    }
}

/// [`fold16`](crate::int8::fold16) of 16 rows at once: the same additions of the same operands (lane `j + w` into
/// lane `j` for `w` = 8, 4, 2, 1), two rows' halves per vector, so each row's sum is bit for
/// bit `fold16`'s; row `r`'s sum comes back in lane `r`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn fold16x16(rows: &[[f32; LANES8]; LANES8]) -> [f32; LANES8] {
    // SAFETY: each row holds 16 f32.
    let mut v: [__m512; 16] =
        core::array::from_fn(|r| unsafe { _mm512_loadu_ps(rows[r].as_ptr()) });
    // At width `w` a vector holds 16 / w rows of w lanes each, row by row; two vectors fold
    // into one holding twice the rows at half the width: its lanes come from `a` then `b`,
    // each row's first half plus its second.
    let mut w = 16;
    let mut count = 16;
    while w > 1 {
        let h = w / 2;
        let lo: [u32; 16] = core::array::from_fn(|k| {
            let (src, r, j) = (k / 8, (k % 8) / h, k % h);
            (src * 16 + r * w + j) as u32
        });
        let hi: [u32; 16] = core::array::from_fn(|k| lo[k] + h as u32);
        // SAFETY: both index tables hold 16 u32.
        let (lo, hi) = unsafe {
            (
                _mm512_loadu_si512(lo.as_ptr().cast()),
                _mm512_loadu_si512(hi.as_ptr().cast()),
            )
        };
        count /= 2;
        for i in 0..count {
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            v[i] = _mm512_add_ps(
                _mm512_permutex2var_ps(a, lo, b),
                _mm512_permutex2var_ps(a, hi, b),
            );
        }
        w = h;
    }
    let mut out = [0.0f32; LANES8];
    // SAFETY: `out` holds 16 f32.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), v[0]) };
    out
}

/// Per lane `k` of [`ladder_scales`]: bytes `5k / 8` and `5k / 8 + 1` of a chunk's codes as a
/// u16 (`0x80`: zero bytes above).
const PICK: [u32; 16] = {
    let mut a = [0u32; 16];
    let mut k = 0;
    while k < 16 {
        let b = (5 * k / 8) as u32;
        a[k] = 0x8080_0000 | ((b + 1) << 8) | b;
        k += 1;
    }
    a
};

/// Per lane `k`: the bit offset `5k % 8` of code `k` in its first byte.
const SHIFT: [u32; 16] = {
    let mut a = [0u32; 16];
    let mut k = 0;
    while k < 16 {
        a[k] = (5 * k % 8) as u32;
        k += 1;
    }
    a
};

/// q4tp/q2tp: chunk `c`'s 16 factors from the row's packed 5-bit scale codes (10 bytes per
/// chunk) through its 32-rung ladder.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn ladder_scales(row: &Row, c: usize) -> __m512 {
    let bytes = _mm512_broadcast_i32x4(load16(row.scales, 10 * c));
    // SAFETY: both tables hold 16 i32.
    let (pick, shift) = unsafe {
        (
            _mm512_loadu_si512(PICK.as_ptr().cast()),
            _mm512_loadu_si512(SHIFT.as_ptr().cast()),
        )
    };
    let idx = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_shuffle_epi8(bytes, pick), shift),
        _mm512_set1_epi32(31),
    );
    // SAFETY: the ladder holds 32 f32; each load reads 16.
    let (lo, hi) = unsafe {
        (
            _mm512_loadu_ps(row.ladder.as_ptr()),
            _mm512_loadu_ps(row.ladder.as_ptr().add(16)),
        )
    };
    _mm512_permutex2var_ps(lo, idx, hi)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn q8_2f_rows<const NT: usize>(m: &Mat, a: &Acts, r0: usize, outs: &mut [&mut [f32]]) {
    let flip = _mm512_set1_epi8(-128);
    let one = _mm512_set1_ps(1.0);
    let decode = |row: &Row, c: usize| {
        let w: [__m512i; 8] =
            core::array::from_fn(|j| _mm512_xor_si512(load64(row.plane, c * 512 + 64 * j), flip));
        (w, one)
    };
    let dot = |w: &[__m512i; 8], q: *const i8| {
        let z = _mm512_setzero_si512();
        // SAFETY: `q` holds one chunk, 512 bytes.
        let n: [__m512i; 8] =
            core::array::from_fn(|j| _mm512_dpbusd_epi32(z, w[j], unsafe { q64(q, 64 * j) }));
        hadd(
            hadd(hadd(n[0], n[1]), hadd(n[2], n[3])),
            hadd(hadd(n[4], n[5]), hadd(n[6], n[7])),
        )
    };
    drive::<NT>(m, a, r0, outs, (1, 128), decode, dot);
}

/// Chunk `c`'s 256 q4tp/mxfp4 code bytes as four vectors `o_p`: lane `4 (k % 4) + k / 4` of
/// `o_p` holds bytes `4p .. 4p + 4` of block `k` (an in-lane 4x4 transpose of 32-bit words),
/// matching `Order::Pairs4`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn pairs_words(plane: &[u8], c: usize) -> [__m512i; 4] {
    let z: [__m512i; 4] = core::array::from_fn(|j| load64(plane, c * 256 + 64 * j));
    let t0 = _mm512_unpacklo_epi32(z[0], z[1]);
    let t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    let t2 = _mm512_unpacklo_epi32(z[2], z[3]);
    let t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    [
        _mm512_unpacklo_epi64(t0, t2),
        _mm512_unpackhi_epi64(t0, t2),
        _mm512_unpacklo_epi64(t1, t3),
        _mm512_unpackhi_epi64(t1, t3),
    ]
}

/// The dot product of q4tp/mxfp4 codes (`Order::Pairs4`): every lane collects one block, in
/// two chains, then the lanes return to block order.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn dot_pairs(w: &[__m512i; 8], q: *const i8) -> __m512i {
    let mut acc = [_mm512_setzero_si512(); 2];
    for v in 0..8 {
        // SAFETY: `q` holds one chunk, 512 bytes; this load reads 64v .. 64v + 64.
        acc[v % 2] = _mm512_dpbusd_epi32(acc[v % 2], w[v], unsafe { q64(q, 64 * v) });
    }
    let back = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_epi32(back, _mm512_add_epi32(acc[0], acc[1]))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn q4tp_rows<const NT: usize>(m: &Mat, a: &Acts, r0: usize, outs: &mut [&mut [f32]]) {
    let low = _mm512_set1_epi8(15);
    let decode = |row: &Row, c: usize| {
        let o = pairs_words(row.plane, c);
        let mut w = [_mm512_setzero_si512(); 8];
        for p in 0..4 {
            w[2 * p] = _mm512_and_si512(o[p], low);
            w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16::<4>(o[p]), low);
        }
        (w, ladder_scales(row, c))
    };
    drive::<NT>(m, a, r0, outs, (1, 8), decode, |w, q| dot_pairs(w, q));
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn mxfp4_rows<const NT: usize>(m: &Mat, a: &Acts, r0: usize, outs: &mut [&mut [f32]]) {
    let low = _mm512_set1_epi8(15);
    let lut: [u8; 16] = core::array::from_fn(|n| (MX_INT[n] + 12) as u8);
    // SAFETY: `lut` holds 16 bytes.
    let lut = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(lut.as_ptr().cast()) });
    let decode = |row: &Row, c: usize| {
        let o = pairs_words(row.plane, c);
        let mut w = [_mm512_setzero_si512(); 8];
        for p in 0..4 {
            w[2 * p] = _mm512_shuffle_epi8(lut, _mm512_and_si512(o[p], low));
            w[2 * p + 1] =
                _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16::<4>(o[p]), low));
        }
        // S = e8m0(k) / 2: k << 23, with 0 -> 2^-127 and 255 -> NaN, halved.
        let k = _mm512_cvtepu8_epi32(load16(row.scales, 16 * c));
        let mut bits = _mm512_slli_epi32::<23>(k);
        bits = _mm512_mask_mov_epi32(
            bits,
            _mm512_cmpeq_epi32_mask(k, _mm512_setzero_si512()),
            _mm512_set1_epi32(0x0040_0000),
        );
        bits = _mm512_mask_mov_epi32(
            bits,
            _mm512_cmpeq_epi32_mask(k, _mm512_set1_epi32(255)),
            _mm512_set1_epi32(0x7fc0_0000),
        );
        let s = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0.5));
        (w, s)
    };
    drive::<NT>(m, a, r0, outs, (1, 12), decode, |w, q| dot_pairs(w, q));
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn q2tp_rows<const NT: usize>(m: &Mat, a: &Acts, r0: usize, outs: &mut [&mut [f32]]) {
    let three = _mm512_set1_epi8(3);
    let decode = |row: &Row, c: usize| {
        let mut w = [_mm512_setzero_si512(); 8];
        for j in 0..2 {
            let v = load64(row.plane, c * 128 + 64 * j);
            w[4 * j] = _mm512_and_si512(v, three);
            w[4 * j + 1] = _mm512_and_si512(_mm512_srli_epi16::<2>(v), three);
            w[4 * j + 2] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), three);
            w[4 * j + 3] = _mm512_and_si512(_mm512_srli_epi16::<6>(v), three);
        }
        (w, ladder_scales(row, c))
    };
    let dot = |w: &[__m512i; 8], q: *const i8| {
        let n: [__m512i; 2] = core::array::from_fn(|j| {
            let mut s = _mm512_setzero_si512();
            for b in 0..4 {
                // SAFETY: `q` holds one chunk, 512 bytes; this load reads 256j + 64b .. + 64.
                s = _mm512_dpbusd_epi32(s, w[4 * j + b], unsafe { q64(q, 256 * j + 64 * b) });
            }
            s
        });
        hadd(n[0], n[1])
    };
    drive::<NT>(m, a, r0, outs, (2, 3), decode, dot);
}

/// Rows `r0 .. r0 + outs[0].len()` of a quantised matrix; `outs[t]` are token `t`'s outputs.
///
/// # Safety
/// The CPU supports AVX-512 F/BW/VL and VNNI (and AVX2/FMA).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
pub(crate) unsafe fn rows<const NT: usize>(m: &Mat, a: &Acts, r0: usize, outs: &mut [&mut [f32]]) {
    match m.l.dtype {
        DType::Q8_2f => q8_2f_rows::<NT>(m, a, r0, outs),
        DType::Q4tp => q4tp_rows::<NT>(m, a, r0, outs),
        DType::Q2tp => q2tp_rows::<NT>(m, a, r0, outs),
        _ => mxfp4_rows::<NT>(m, a, r0, outs),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::int8::fold16;

    /// Each row's sum is bit for bit the one-row fold's, on values whose sums round
    /// differently in every other order.
    #[test]
    fn sixteen_rows_fold_as_each_alone() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni")) {
            return;
        }
        let mut s = 1u32;
        let rows: [[f32; LANES8]; LANES8] = core::array::from_fn(|_| {
            core::array::from_fn(|_| {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                let e = (s >> 24) as i32 % 40 - 20;
                (s as f32 / u32::MAX as f32 - 0.5) * (e as f32).exp2()
            })
        });
        // SAFETY: the features were detected above.
        let got = unsafe { fold16x16(&rows) };
        for r in 0..LANES8 {
            assert_eq!(got[r].to_bits(), fold16(&rows[r]).to_bits(), "row {r}");
        }
    }
}
