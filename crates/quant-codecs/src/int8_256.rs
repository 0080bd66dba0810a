//! AVX2 int8-activation kernels: `int8_512`'s arithmetic on 256-bit vectors, for the CPUs
//! without AVX-512 VNNI (most desktop x86 parts before and beside it).
//!
//! A chunk's 16 blocks are two halves of 8 lanes: every decoding step of `int8_512` works
//! within 128-bit lanes or within groups of at most 8 32-bit lanes, so half `h` of each of its
//! 64-byte vectors is the same decoding applied to half `h` of the input bytes, and the
//! activations' halves sit at 32 bytes into each of their 64-byte vectors. `vpdpbusd` becomes
//! `vpmaddubsw` (u8 x i8 in pairs to i16) and `vpmaddwd` by ones (pairs of i16 to i32): exact
//! while no i16 sum saturates, so several `vpmaddubsw` results are added in i16 first only as
//! far as each format's code range allows, and q8_2f (codes -128..127) multiplies `|c|` by
//! `q` with `c`'s sign (`vpsignb`), its sums starting from zero instead of the offset sums.
//! The integer block sums are the same integers in any order; the f32 part is the portable
//! code's, lane for lane, and each row's 16 lanes fold as [`fold16`] folds them, so every
//! result is the portable reference's bit for bit.

// Register arrays are indexed by token row and vector on purpose: the indices are the algorithm.
#![allow(clippy::needless_range_loop)]

use core::arch::x86_64::*;

use crate::act8::ACT_BLOCK;
use crate::int8::{Acts, LANES8, MX_INT, Mat, Order, fold16};
use crate::tiered::{EXP2Q_COEFFS, row_params};
use crate::{DType, q2tp, q4tp};

/// Bytes of activation codes per 16-block chunk.
const CHUNK_Q: usize = LANES8 * ACT_BLOCK;

/// Lanes per half chunk.
const HALF: usize = LANES8 / 2;

/// 32 bytes of `s` from `at`, zero past its end.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn load32(s: &[u8], at: usize) -> __m256i {
    if at + 32 <= s.len() {
        // SAFETY: 32 bytes from `at` lie within `s`.
        return unsafe { _mm256_loadu_si256(s[at..].as_ptr().cast()) };
    }
    let mut b = [0u8; 32];
    if at < s.len() {
        let n = s.len() - at;
        b[..n].copy_from_slice(&s[at..]);
    }
    // SAFETY: `b` holds 32 bytes.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

/// 16 bytes of `s` from `at`, zero past its end.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn load16(s: &[u8], at: usize) -> __m128i {
    if at + 16 <= s.len() {
        // SAFETY: 16 bytes from `at` lie within `s`.
        return unsafe { _mm_loadu_si128(s[at..].as_ptr().cast()) };
    }
    let mut b = [0u8; 16];
    if at < s.len() {
        let n = (s.len() - at).min(16);
        b[..n].copy_from_slice(&s[at..at + n]);
    }
    // SAFETY: `b` holds 16 bytes.
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

/// What a row's chunks need: its bytes, the q4tp/q2tp ladder (rungs `8v .. 8v + 8` in vector
/// `v`; q2tp's halved), the q8_2f row scale.
#[derive(Clone, Copy)]
struct Prep<'a> {
    plane: &'a [u8],
    scales: &'a [u8],
    ladder: [__m256; 4],
    rs: f32,
}

/// [`crate::tiered::scale_table`]'s rungs (halved for q2tp) with `exp2q`'s operations in its
/// order, lane by lane: the same bits.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn ladder_vectors(zero_rung: bool, halve: bool, lo: f32, step: f32) -> [__m256; 4] {
    let c = EXP2Q_COEFFS.map(f32::from_bits);
    let first = if zero_rung { -1.0 } else { 0.0 };
    let mut out = [_mm256_setzero_ps(); 4];
    for (v, out) in out.iter_mut().enumerate() {
        let mut k = [0.0f32; 8];
        for (j, k) in k.iter_mut().enumerate() {
            *k = (8 * v + j) as f32 + first;
        }
        // SAFETY: `k` holds 8 f32.
        let k = unsafe { _mm256_loadu_ps(k.as_ptr()) };
        let t = _mm256_add_ps(_mm256_set1_ps(lo), _mm256_mul_ps(k, _mm256_set1_ps(step)));
        // `max` returns its second operand for a NaN, as `f32::max` returns -126.
        let t = _mm256_min_ps(
            _mm256_max_ps(t, _mm256_set1_ps(-126.0)),
            _mm256_set1_ps(127.0),
        );
        let i = _mm256_floor_ps(t);
        let f = _mm256_sub_ps(t, i);
        let mut p = _mm256_set1_ps(c[6]);
        for &cj in c[..6].iter().rev() {
            p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(cj));
        }
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvttps_epi32(i),
            _mm256_set1_epi32(127),
        ));
        let mut x = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
        if zero_rung && v == 0 {
            x = _mm256_blend_ps::<1>(x, _mm256_setzero_ps());
        }
        if halve {
            x = _mm256_mul_ps(x, _mm256_set1_ps(0.5));
        }
        *out = x;
    }
    out
}

/// Row `r` of `m`, ready for its chunks.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn prep<'a>(m: &Mat<'a>, r: usize) -> Prep<'a> {
    let (l, bytes) = (&m.l, m.bytes);
    match l.dtype {
        DType::Q4tp | DType::Q2tp => {
            let q2 = l.dtype == DType::Q2tp;
            let tier = if q2 { q2tp::TIER } else { q4tp::TIER };
            let per_row = l.cols * tier.bits / 8;
            let (lo, step) = row_params(l, bytes, r);
            Prep {
                plane: &bytes[r * per_row..][..per_row],
                scales: &bytes[l.third + r * l.code_stride..][..l.code_stride],
                ladder: ladder_vectors(tier.zero_rung, q2, lo, step),
                rs: 1.0,
            }
        }
        _ => {
            let row = m.row(r);
            Prep {
                plane: row.plane,
                scales: row.scales,
                ladder: [_mm256_setzero_ps(); 4],
                rs: row.rs,
            }
        }
    }
}

/// Per lane `l` of half `h`: the bytes `5k / 8`, `5k / 8 + 1` of a chunk's packed scale codes
/// (`0x80`: zero above) and the bit offset `5k % 8` of block `k = order.block_of(8h + l)`.
const fn ladder_tables(order: Order) -> [([u32; 8], [u32; 8]); 2] {
    let mut out = [([0u32; 8], [0u32; 8]); 2];
    let mut l = 0;
    while l < 16 {
        let k = order.block_of(l);
        let b = (5 * k / 8) as u32;
        out[l / 8].0[l % 8] = 0x8080_0000 | ((b + 1) << 8) | b;
        out[l / 8].1[l % 8] = (5 * k % 8) as u32;
        l += 1;
    }
    out
}

const PAIRS4_LADDER: [([u32; 8], [u32; 8]); 2] = ladder_tables(Order::Pairs4);
const QUADS16_LADDER: [([u32; 8], [u32; 8]); 2] = ladder_tables(Order::Quads16);

/// q4tp/q2tp: half `h` of chunk `c`'s 16 factors, through the row's ladder.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn ladder_scales(row: &Prep, c: usize, h: usize, tables: &[([u32; 8], [u32; 8]); 2]) -> __m256 {
    let bytes = _mm256_broadcastsi128_si256(load16(row.scales, 10 * c));
    let (pick, shift) = &tables[h];
    // SAFETY: both tables hold 8 u32.
    let (pick, shift) = unsafe {
        (
            _mm256_loadu_si256(pick.as_ptr().cast()),
            _mm256_loadu_si256(shift.as_ptr().cast()),
        )
    };
    let idx = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_shuffle_epi8(bytes, pick), shift),
        _mm256_set1_epi32(31),
    );
    let l = &row.ladder;
    let bit3 = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(idx));
    let bit4 = _mm256_castsi256_ps(_mm256_slli_epi32::<27>(idx));
    let lo = _mm256_blendv_ps(
        _mm256_permutevar8x32_ps(l[0], idx),
        _mm256_permutevar8x32_ps(l[1], idx),
        bit3,
    );
    let hi = _mm256_blendv_ps(
        _mm256_permutevar8x32_ps(l[2], idx),
        _mm256_permutevar8x32_ps(l[3], idx),
        bit3,
    );
    _mm256_blendv_ps(lo, hi, bit4)
}

/// `int8_512`'s swap stage `s` of two vectors' halves: vector-index bit `s` traded with
/// lane-index bit `s` (`s` < 3, so within 8 lanes).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn swap(v: &mut [__m256i], a: usize, b: usize, s: usize) {
    let (x, y) = (v[a], v[b]);
    let (lo, hi) = match s {
        0 => (
            _mm256_blend_epi32::<0b1010_1010>(x, _mm256_slli_epi64::<32>(y)),
            _mm256_blend_epi32::<0b1010_1010>(_mm256_srli_epi64::<32>(x), y),
        ),
        1 => (_mm256_unpacklo_epi64(x, y), _mm256_unpackhi_epi64(x, y)),
        _ => (
            _mm256_permute2x128_si256::<0x20>(x, y),
            _mm256_permute2x128_si256::<0x31>(x, y),
        ),
    };
    v[a] = lo;
    v[b] = hi;
}

/// Half `h` of chunk `c`'s 256 q4tp/mxfp4 code bytes as four vectors (`int8_512`'s
/// `pairs_words`, per 128-bit lane).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn pairs_words(plane: &[u8], c: usize, h: usize) -> [__m256i; 4] {
    let mut z = [_mm256_setzero_si256(); 4];
    for (j, z) in z.iter_mut().enumerate() {
        *z = load32(plane, c * 256 + 64 * j + 32 * h);
    }
    let t0 = _mm256_unpacklo_epi32(z[0], z[1]);
    let t1 = _mm256_unpackhi_epi32(z[0], z[1]);
    let t2 = _mm256_unpacklo_epi32(z[2], z[3]);
    let t3 = _mm256_unpackhi_epi32(z[2], z[3]);
    [
        _mm256_unpacklo_epi64(t0, t2),
        _mm256_unpackhi_epi64(t0, t2),
        _mm256_unpacklo_epi64(t1, t3),
        _mm256_unpackhi_epi64(t1, t3),
    ]
}

/// A half chunk decoded: eight code vectors, the 8 factors, and whether the codes are signed
/// (q8_2f: multiplied as `|c|` by the activations with `c`'s sign, the sums starting at zero).
type Half = ([__m256i; 8], __m256);

/// The row loop: `decode(row, c, h)` gives half `h` of chunk `c`; `GROUP` `vpmaddubsw` results
/// are summed in i16 before widening (the most that cannot saturate for the format's codes);
/// `SIGNED` marks q8_2f's signed codes.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn drive<const NT: usize, const GROUP: usize, const SIGNED: bool>(
    m: &Mat,
    a: &Acts,
    r0: usize,
    outs: &mut [&mut [f32]],
    mut decode: impl FnMut(&Prep, usize, usize) -> Half,
) {
    let n = outs.first().map_or(0, |o| o.len());
    let per = a.nbp * ACT_BLOCK;
    let chunks = a.nb.div_ceil(LANES8);
    let tail_blocks = a.nb - (chunks - 1) * LANES8;
    // Per half, the lanes whose blocks of the last chunk are real.
    let tail: [__m256; 2] = core::array::from_fn(|h| {
        let mut m = [0u32; HALF];
        for (l, m) in m.iter_mut().enumerate() {
            if a.order.block_of(HALF * h + l) < tail_blocks {
                *m = u32::MAX;
            }
        }
        // SAFETY: `m` holds 8 u32.
        unsafe { _mm256_castsi256_ps(_mm256_loadu_si256(m.as_ptr().cast())) }
    });
    let all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    let ones = _mm256_set1_epi16(1);
    for i in 0..n {
        let row = prep(m, r0 + i);
        let mut acc = [[_mm256_setzero_ps(); 2]; NT];
        for c in 0..chunks {
            for h in 0..2 {
                let mask = if c + 1 == chunks { tail[h] } else { all };
                let (w, s) = decode(&row, c, h);
                // Loops, not `array::map`: a closure's body is not inlined here.
                let ws = w;
                let mut wa = w;
                if SIGNED {
                    for v in 0..8 {
                        wa[v] = _mm256_abs_epi8(w[v]);
                    }
                }
                for t in 0..NT {
                    let at = t * a.nbp + c * LANES8 + HALF * h;
                    // SAFETY: `d` and `osums` hold `nbp` values per token row; 8 from `at`
                    // fit.
                    let (osums, d) = unsafe {
                        (
                            _mm256_loadu_si256(a.osums.as_ptr().add(at).cast()),
                            _mm256_loadu_ps(a.d.as_ptr().add(at)),
                        )
                    };
                    // SAFETY: token row `t` holds `nbp * 32` codes and chunk `c < nbp / 16`:
                    // the eight 32-byte loads below lie within it.
                    let q = unsafe { a.q().as_ptr().add(t * per + c * CHUNK_Q + 32 * h) };
                    let mut int = if SIGNED {
                        _mm256_setzero_si256()
                    } else {
                        osums
                    };
                    for g in (0..8).step_by(GROUP) {
                        let mut s16 = _mm256_setzero_si256();
                        for v in g..g + GROUP {
                            // SAFETY: see `q`.
                            let qv = unsafe { _mm256_loadu_si256(q.add(64 * v).cast()) };
                            let qv = if SIGNED {
                                _mm256_sign_epi8(qv, ws[v])
                            } else {
                                qv
                            };
                            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wa[v], qv));
                        }
                        int = _mm256_add_epi32(int, _mm256_madd_epi16(s16, ones));
                    }
                    let f = _mm256_mul_ps(d, s);
                    let fma = _mm256_fmadd_ps(f, _mm256_cvtepi32_ps(int), acc[t][h]);
                    acc[t][h] = _mm256_blendv_ps(acc[t][h], fma, mask);
                }
            }
        }
        for t in 0..NT {
            let mut lanes = [0.0f32; LANES8];
            // SAFETY: `lanes` holds 16 f32.
            unsafe {
                _mm256_storeu_ps(lanes.as_mut_ptr(), acc[t][0]);
                _mm256_storeu_ps(lanes.as_mut_ptr().add(HALF), acc[t][1]);
            }
            let blocks: [f32; LANES8] = core::array::from_fn(|k| lanes[a.order.lane(k)]);
            outs[t][i] = fold16(&blocks) * row.rs;
        }
    }
}

#[target_feature(enable = "avx2,fma")]
fn q8_2f_rows<const NT: usize>(m: &Mat, a: &Acts, r0: usize, outs: &mut [&mut [f32]]) {
    let one = _mm256_set1_ps(1.0);
    let decode = |row: &Prep, c: usize, h: usize| -> Half {
        let mut w = [_mm256_setzero_si256(); 8];
        for (j, w) in w.iter_mut().enumerate() {
            *w = load32(row.plane, c * 512 + 64 * j + 32 * h);
        }
        for s in 0..3 {
            for v in (0..8).filter(|v| v & (1 << s) == 0) {
                swap(&mut w, v, v | (1 << s), s);
            }
        }
        (w, one)
    };
    drive::<NT, 1, true>(m, a, r0, outs, decode);
}

#[target_feature(enable = "avx2,fma")]
fn q4tp_rows<const NT: usize>(m: &Mat, a: &Acts, r0: usize, outs: &mut [&mut [f32]]) {
    let low = _mm256_set1_epi8(15);
    let decode = |row: &Prep, c: usize, h: usize| -> Half {
        let o = pairs_words(row.plane, c, h);
        let mut w = [_mm256_setzero_si256(); 8];
        for p in 0..4 {
            w[2 * p] = _mm256_and_si256(o[p], low);
            w[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(o[p]), low);
        }
        (w, ladder_scales(row, c, h, &PAIRS4_LADDER))
    };
    // u <= 15, |q| <= 127: a pair 3810, eight of them 30480.
    drive::<NT, 8, false>(m, a, r0, outs, decode);
}

#[target_feature(enable = "avx2,fma")]
fn mxfp4_rows<const NT: usize>(m: &Mat, a: &Acts, r0: usize, outs: &mut [&mut [f32]]) {
    let low = _mm256_set1_epi8(15);
    let lut: [u8; 16] = core::array::from_fn(|n| (MX_INT[n] + 12) as u8);
    // SAFETY: `lut` holds 16 bytes.
    let lut = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(lut.as_ptr().cast()) });
    let to_lanes: [u8; 16] = core::array::from_fn(|l| Order::Pairs4.block_of(l) as u8);
    // SAFETY: `to_lanes` holds 16 bytes.
    let to_lanes = unsafe { _mm_loadu_si128(to_lanes.as_ptr().cast()) };
    let decode = |row: &Prep, c: usize, h: usize| -> Half {
        let o = pairs_words(row.plane, c, h);
        let mut w = [_mm256_setzero_si256(); 8];
        for p in 0..4 {
            w[2 * p] = _mm256_shuffle_epi8(lut, _mm256_and_si256(o[p], low));
            w[2 * p + 1] =
                _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16::<4>(o[p]), low));
        }
        // S = e8m0(k) / 2: k << 23, with 0 -> 2^-127 and 255 -> NaN, halved.
        let bytes = _mm_shuffle_epi8(load16(row.scales, 16 * c), to_lanes);
        let bytes = if h == 0 {
            bytes
        } else {
            _mm_srli_si128::<8>(bytes)
        };
        let k = _mm256_cvtepu8_epi32(bytes);
        let mut bits = _mm256_slli_epi32::<23>(k);
        let zero = _mm256_cmpeq_epi32(k, _mm256_setzero_si256());
        bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x0040_0000), zero);
        let nan = _mm256_cmpeq_epi32(k, _mm256_set1_epi32(255));
        bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc0_0000), nan);
        let s = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0.5));
        (w, s)
    };
    // u <= 24, |q| <= 127: a pair 6096, four of them 24384.
    drive::<NT, 4, false>(m, a, r0, outs, decode);
}

#[target_feature(enable = "avx2,fma")]
fn q2tp_rows<const NT: usize>(m: &Mat, a: &Acts, r0: usize, outs: &mut [&mut [f32]]) {
    let six = _mm256_set1_epi8(6);
    let decode = |row: &Prep, c: usize, h: usize| -> Half {
        let mut z = [
            load32(row.plane, c * 128 + 32 * h),
            load32(row.plane, c * 128 + 64 + 32 * h),
        ];
        swap(&mut z, 0, 1, 0);
        let mut w = [_mm256_setzero_si256(); 8];
        for j in 0..2 {
            w[4 * j] = _mm256_and_si256(_mm256_slli_epi16::<1>(z[j]), six);
            w[4 * j + 1] = _mm256_and_si256(_mm256_srli_epi16::<1>(z[j]), six);
            w[4 * j + 2] = _mm256_and_si256(_mm256_srli_epi16::<3>(z[j]), six);
            w[4 * j + 3] = _mm256_and_si256(_mm256_srli_epi16::<5>(z[j]), six);
        }
        (w, ladder_scales(row, c, h, &QUADS16_LADDER))
    };
    // u <= 6, |q| <= 127: a pair 1524, eight of them 12192.
    drive::<NT, 8, false>(m, a, r0, outs, decode);
}

/// Rows `r0 .. r0 + outs[0].len()` of a quantised matrix; `outs[t]` are token `t`'s outputs.
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn rows<const NT: usize>(m: &Mat, a: &Acts, r0: usize, outs: &mut [&mut [f32]]) {
    match m.l.dtype {
        DType::Q8_2f => q8_2f_rows::<NT>(m, a, r0, outs),
        DType::Q4tp => q4tp_rows::<NT>(m, a, r0, outs),
        DType::Q2tp => q2tp_rows::<NT>(m, a, r0, outs),
        _ => mxfp4_rows::<NT>(m, a, r0, outs),
    }
}
