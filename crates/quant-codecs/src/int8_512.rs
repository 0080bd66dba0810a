//! AVX-512 VNNI int8-activation kernels: the portable `int8` arithmetic, 16 blocks per vector.
//!
//! A chunk of 16 blocks of one weight row is decoded once into eight 64-byte vectors of
//! unsigned codes `u` (q8_2f: `code + 128`, q4tp: the nibble, q2tp: twice the bit pair, mxfp4:
//! `2 * e2m1 + 12` by a byte shuffle) and, for every token row, multiplied with the signed
//! activation codes by `vpdpbusd` (u8 x i8, exact i32 sums of 4). The decoding puts block `k`
//! of the chunk in one 32-bit lane of all eight vectors (`Order::lane`), and the activations
//! are laid out to match, so eight `vpdpbusd` and one add give the 16 block sums `N_b` with no
//! shuffle per token row; `I_b = N_b - off * sum_b(q)` is then exactly the portable
//! code's `sum c_i q_i`. The f32 part is the portable code's, lane for lane: block `b`'s
//! `fma(d_b * S_b, I_b, acc)` in the lane that holds `b % 16`, padding lanes masked off.

// Register arrays are indexed by token row and vector on purpose: the indices are the algorithm.
#![allow(clippy::needless_range_loop)]

use core::arch::x86_64::*;

use crate::act8::ACT_BLOCK;
use crate::int8::{Acts, LANES8, MX_INT, Mat, Order};
use crate::tiered::EXP2Q_COEFFS;
use crate::{DType, q2tp, q4tp};

/// How far ahead of the bytes being decoded the weight stream is prefetched.
const PREFETCH: usize = 4096;

/// Bytes of activation codes per 16-block chunk.
const CHUNK_Q: usize = LANES8 * ACT_BLOCK;

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

/// The 16 block sums `init + N` of one chunk: lane [`Order::lane`]`(k)` of each of the eight
/// code vectors `w` meets block `k`'s activation codes at `q` (512 bytes), in two chains.
///
/// # Safety
/// `q` holds 512 bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn dot8(w: &[__m512i; 8], q: *const i8, init: __m512i) -> __m512i {
    let mut acc = [init, _mm512_setzero_si512()];
    for v in 0..8 {
        // SAFETY: the caller's contract; this load reads 64v .. 64v + 64.
        acc[v % 2] = _mm512_dpbusd_epi32(acc[v % 2], w[v], unsafe { q64(q, 64 * v) });
    }
    _mm512_add_epi32(acc[0], acc[1])
}

/// [`dot8`] for two weight rows `wa`, `wb` against the same activation codes, each vector of
/// which is loaded once; each row's sums are its own `dot8`'s (exact integer sums).
///
/// # Safety
/// `q` holds 512 bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn dot8x2(
    wa: &[__m512i; 8],
    wb: &[__m512i; 8],
    q: *const i8,
    init: __m512i,
) -> (__m512i, __m512i) {
    let mut a = [init, _mm512_setzero_si512()];
    let mut b = [init, _mm512_setzero_si512()];
    for v in 0..8 {
        // SAFETY: the caller's contract; this load reads 64v .. 64v + 64.
        let x = unsafe { q64(q, 64 * v) };
        a[v % 2] = _mm512_dpbusd_epi32(a[v % 2], wa[v], x);
        b[v % 2] = _mm512_dpbusd_epi32(b[v % 2], wb[v], x);
    }
    (_mm512_add_epi32(a[0], a[1]), _mm512_add_epi32(b[0], b[1]))
}

/// A 16-bit mask of the lanes whose blocks are below `nbl`.
fn lane_mask(order: Order, nbl: usize) -> __mmask16 {
    (0..nbl.min(LANES8)).fold(0, |m, k| m | (1 << order.lane(k)))
}

/// What a row's chunks need, built in registers by [`prep_rows`]: `Mat::row`'s fields, the q4tp/q2tp
/// scale ladder as two vectors. (Built through `Mat::row`, a row cost a call, a 168-byte
/// struct through memory and a 32-entry ladder in scalar code: at 1-5 chunks a row, the
/// cold experts' shapes, about as much as its chunks.)
#[derive(Clone, Copy)]
struct Prep<'a> {
    plane: &'a [u8],
    scales: &'a [u8],
    /// Rungs 0..16 and 16..32 (q2tp: halved, `S = scale / 2`); zero for the other formats.
    ladder: [__m512; 2],
    /// q8_2f: the row scale; otherwise 1.
    rs: f32,
}

/// The 32 rungs of [`crate::tiered::scale_table`] (halved for q2tp) as two vectors: the same
/// operations in the same order as its `exp2q`, lane by lane, so the same bits.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn ladder_vectors(zero_rung: bool, halve: bool, lo: f32, step: f32) -> [__m512; 2] {
    let c = EXP2Q_COEFFS.map(f32::from_bits);
    let first = if zero_rung { -1.0 } else { 0.0 };
    // A loop, not `array::from_fn`: a closure does not inherit the target features.
    let mut out = [_mm512_setzero_ps(); 2];
    for (h, out) in out.iter_mut().enumerate() {
        let mut k = [0.0f32; 16];
        for (j, k) in k.iter_mut().enumerate() {
            *k = (16 * h + j) as f32 + first;
        }
        // SAFETY: `k` holds 16 f32.
        let k = unsafe { _mm512_loadu_ps(k.as_ptr()) };
        let t = _mm512_add_ps(_mm512_set1_ps(lo), _mm512_mul_ps(k, _mm512_set1_ps(step)));
        // `max` returns its second operand for a NaN, as `f32::max` returns -126.
        let t = _mm512_min_ps(
            _mm512_max_ps(t, _mm512_set1_ps(-126.0)),
            _mm512_set1_ps(127.0),
        );
        let i = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t);
        let f = _mm512_sub_ps(t, i);
        let mut p = _mm512_set1_ps(c[6]);
        for &cj in c[..6].iter().rev() {
            p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(cj));
        }
        let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvttps_epi32(i),
            _mm512_set1_epi32(127),
        ));
        let mut v = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
        if zero_rung && h == 0 {
            v = _mm512_mask_mov_ps(v, 1, _mm512_setzero_ps());
        }
        if halve {
            v = _mm512_mul_ps(v, _mm512_set1_ps(0.5));
        }
        *out = v;
    }
    out
}

/// Rows `r .. r + rows.len()` of `m` (16 at most), ready for their chunks. The q4tp/q2tp
/// rows' (lo, step) pairs are contiguous: all of them convert from f16 at once (exactly, as
/// `f16_bits_to_f32` does; a NaN's payload may differ, which the ladder's clamp hides).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
#[inline]
fn prep_rows<'a>(m: &Mat<'a>, r: usize, rows: &mut [Prep<'a>]) {
    let (l, bytes) = (&m.l, m.bytes);
    match l.dtype {
        DType::Q4tp | DType::Q2tp => {
            let q2 = l.dtype == DType::Q2tp;
            let tier = if q2 { q2tp::TIER } else { q4tp::TIER };
            let per_row = l.cols * tier.bits / 8;
            let params = &bytes[l.second + 4 * r..][..4 * rows.len()];
            let mut pairs = [0.0f32; 2 * LANES8];
            for (h, out) in pairs.chunks_exact_mut(LANES8).enumerate() {
                let at = 32 * h;
                let v = if at < params.len() {
                    let avail = (params.len() - at).min(32) as u32;
                    // SAFETY: the first `avail` bytes from `at` lie within `params`;
                    // masked-off bytes are not read.
                    unsafe {
                        _mm256_maskz_loadu_epi8(
                            ((1u64 << avail) - 1) as u32,
                            params[at..].as_ptr().cast(),
                        )
                    }
                } else {
                    _mm256_setzero_si256()
                };
                // SAFETY: `out` holds 16 f32.
                unsafe { _mm512_storeu_ps(out.as_mut_ptr(), _mm512_cvtph_ps(v)) };
            }
            for (j, row) in rows.iter_mut().enumerate() {
                let rr = r + j;
                row.plane = &bytes[rr * per_row..][..per_row];
                row.scales = &bytes[l.third + rr * l.code_stride..][..l.code_stride];
                row.ladder = ladder_vectors(tier.zero_rung, q2, pairs[2 * j], pairs[2 * j + 1]);
                row.rs = 1.0;
            }
        }
        _ => {
            for (j, row) in rows.iter_mut().enumerate() {
                let full = m.row(r + j);
                row.plane = full.plane;
                row.scales = full.scales;
                row.rs = full.rs;
            }
        }
    }
}

/// The per-row loop shared by the formats: `decode(row, c)` gives chunk `c`'s eight code
/// vectors and its 16 factors `S_b`, both in the order's lanes; `I = N - off * sums`, the
/// dot products' chains starting from the negated offset sums that come with the
/// activations. Each lane accumulates its block's terms in block order, as the portable
/// code's lane `k % 16` does; a row's lanes go back to block order once, before the fold.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
fn drive<const NT: usize>(
    m: &Mat,
    a: &Acts,
    r0: usize,
    outs: &mut [&mut [f32]],
    mut decode: impl FnMut(&Prep, usize) -> ([__m512i; 8], __m512),
) {
    let n = outs.first().map_or(0, |o| o.len());
    let chunks = a.nb.div_ceil(LANES8);
    let tail = lane_mask(a.order, a.nb - (chunks - 1) * LANES8);
    let back: [u32; LANES8] = core::array::from_fn(|k| a.order.lane(k) as u32);
    // SAFETY: `back` holds 16 u32.
    let back = unsafe { _mm512_loadu_si512(back.as_ptr().cast()) };
    // Each row's 16 lanes wait here until 16 rows are done, to be folded together.
    let mut held = [[[0.0f32; LANES8]; LANES8]; NT];
    // The chunks walked per row before the next row's: with several token rows the activations
    // of a whole row (8 x 8192 columns: 80 KB of codes, offsets and scales) do not stay in a
    // core's L1, so 16 rows walk the columns a tile of about 24 KB of activations at a time,
    // their accumulators kept between tiles (each lane still adds its blocks in chunk order).
    let tile = (TILE_ACT_BYTES / (NT * (CHUNK_Q + 2 * 4 * LANES8))).max(1);
    let none = Prep {
        plane: &[],
        scales: &[],
        ladder: [_mm512_setzero_ps(); 2],
        rs: 1.0,
    };
    let mut rows = [none; LANES8];
    for g0 in (0..n).step_by(LANES8) {
        let g1 = (g0 + LANES8).min(n);
        let rows = &mut rows[..g1 - g0];
        prep_rows(m, r0 + g0, rows);
        let mut accs = [[_mm512_setzero_ps(); NT]; LANES8];
        for c0 in (0..chunks).step_by(tile) {
            let c1 = (c0 + tile).min(chunks);
            // With several token rows, two weight rows at a time: each activation vector is
            // loaded once for both rows' products (the loads, not the dot products, bound the
            // loop when eight token rows share one row's codes).
            let paired = if NT > 1 { rows.len() / 2 * 2 } else { 0 };
            for j in (0..paired).step_by(2) {
                let (lo, hi) = accs.split_at_mut(j + 1);
                let (acc_a, acc_b) = (&mut lo[j], &mut hi[0]);
                for c in c0..c1 {
                    let mask = if c + 1 == chunks { tail } else { 0xFFFF };
                    let (wa, sa) = decode(&rows[j], c);
                    let (wb, sb) = decode(&rows[j + 1], c);
                    for t in 0..NT {
                        let (osums, d, q) = chunk_acts(a, t, c);
                        // SAFETY: `q` holds the chunk's 512 codes.
                        let (ia, ib) = unsafe { dot8x2(&wa, &wb, q, osums) };
                        let fa = _mm512_mul_ps(d, sa);
                        let fb = _mm512_mul_ps(d, sb);
                        acc_a[t] =
                            _mm512_mask3_fmadd_ps(fa, _mm512_cvtepi32_ps(ia), acc_a[t], mask);
                        acc_b[t] =
                            _mm512_mask3_fmadd_ps(fb, _mm512_cvtepi32_ps(ib), acc_b[t], mask);
                    }
                }
            }
            for (row, acc) in rows.iter().zip(accs.iter_mut()).skip(paired) {
                for c in c0..c1 {
                    let mask = if c + 1 == chunks { tail } else { 0xFFFF };
                    let (w, s) = decode(row, c);
                    for t in 0..NT {
                        let (osums, d, q) = chunk_acts(a, t, c);
                        // SAFETY: `q` holds the chunk's 512 codes.
                        let int = unsafe { dot8(&w, q, osums) };
                        let f = _mm512_mul_ps(d, s);
                        acc[t] = _mm512_mask3_fmadd_ps(f, _mm512_cvtepi32_ps(int), acc[t], mask);
                    }
                }
            }
        }
        for (j, acc) in accs.iter().enumerate().take(rows.len()) {
            for t in 0..NT {
                let v = _mm512_permutexvar_ps(back, acc[t]);
                // SAFETY: a row of `held` holds 16 f32.
                unsafe { _mm512_storeu_ps(held[t][j].as_mut_ptr(), v) };
            }
        }
        for t in 0..NT {
            let sums = fold16x16(&held[t]);
            for (j, row) in rows.iter().enumerate() {
                outs[t][g0 + j] = sums[j] * row.rs;
            }
        }
    }
}

/// Token row `t`'s activations for chunk `c` (`c < nbp / 16`): the 16 negated offset sums, the
/// 16 block scales and a pointer to the chunk's 512 codes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn chunk_acts(a: &Acts, t: usize, c: usize) -> (__m512i, __m512, *const i8) {
    let at = t * a.nbp + c * LANES8;
    // SAFETY: `d` and `osums` hold `nbp` values per token row and `c < nbp / 16`, so 16 from
    // `at` fit; token row `t` holds `nbp * 32` codes, so the chunk's 512 from its start do.
    unsafe {
        (
            _mm512_loadu_si512(a.osums.as_ptr().add(at).cast()),
            _mm512_loadu_ps(a.d.as_ptr().add(at)),
            a.q().as_ptr().add(t * a.nbp * ACT_BLOCK + c * CHUNK_Q),
        )
    }
}

/// Activation bytes (codes, offset sums and scales of every token row) of one column tile of
/// [`drive`]: about half a core's L1 data cache, leaving room for the weights streaming past.
const TILE_ACT_BYTES: usize = 24 << 10;

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

/// Per lane `l` of [`ladder_scales`], for the block `k` of that lane: bytes `5k / 8` and
/// `5k / 8 + 1` of a chunk's packed scale codes as a u16 (`0x80`: zero bytes above), and the
/// bit offset `5k % 8` of code `k` in its first byte.
const fn ladder_tables(order: Order) -> ([u32; 16], [u32; 16]) {
    let (mut pick, mut shift) = ([0u32; 16], [0u32; 16]);
    let mut l = 0;
    while l < 16 {
        let k = order.block_of(l);
        let b = (5 * k / 8) as u32;
        pick[l] = 0x8080_0000 | ((b + 1) << 8) | b;
        shift[l] = (5 * k % 8) as u32;
        l += 1;
    }
    (pick, shift)
}

const PAIRS4_LADDER: ([u32; 16], [u32; 16]) = ladder_tables(Order::Pairs4);
const QUADS16_LADDER: ([u32; 16], [u32; 16]) = ladder_tables(Order::Quads16);

/// q4tp/q2tp: chunk `c`'s 16 factors, in the order's lanes, from the row's packed 5-bit scale
/// codes (10 bytes per chunk) through its 32-rung ladder.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn ladder_scales(row: &Prep, c: usize, (pick, shift): &([u32; 16], [u32; 16])) -> __m512 {
    let bytes = _mm512_broadcast_i32x4(load16(row.scales, 10 * c));
    // SAFETY: both tables hold 16 i32.
    let (pick, shift) = unsafe {
        (
            _mm512_loadu_si512(pick.as_ptr().cast()),
            _mm512_loadu_si512(shift.as_ptr().cast()),
        )
    };
    let idx = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_shuffle_epi8(bytes, pick), shift),
        _mm512_set1_epi32(31),
    );
    _mm512_permutex2var_ps(row.ladder[0], idx, row.ladder[1])
}

/// Index tables of one stage of a 2-vector shuffle that swaps vector-index bit `s` with
/// lane-index bit `s` (for `vpermt2d`: lanes 16.. name the second vector): the outputs with
/// that vector bit 0 and 1.
const fn swap_stage(s: u32) -> ([u32; 16], [u32; 16]) {
    let (mut lo, mut hi) = ([0u32; 16], [0u32; 16]);
    let mut i = 0;
    while i < 16 {
        let from = ((i >> s) & 1) << 4;
        lo[i as usize] = (i & !(1 << s)) | from;
        hi[i as usize] = (i | (1 << s)) | from;
        i += 1;
    }
    (lo, hi)
}

const SWAPS: [([u32; 16], [u32; 16]); 3] = [swap_stage(0), swap_stage(1), swap_stage(2)];

/// `v[a]` and `v[b]` through stage `s` of [`swap_stage`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn swap(v: &mut [__m512i], a: usize, b: usize, s: usize) {
    // SAFETY: both tables hold 16 u32.
    let (lo, hi) = unsafe {
        (
            _mm512_loadu_si512(SWAPS[s].0.as_ptr().cast()),
            _mm512_loadu_si512(SWAPS[s].1.as_ptr().cast()),
        )
    };
    let (x, y) = (v[a], v[b]);
    v[a] = _mm512_permutex2var_epi32(x, lo, y);
    v[b] = _mm512_permutex2var_epi32(x, hi, y);
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn q8_2f_rows<const NT: usize>(m: &Mat, a: &Acts, r0: usize, outs: &mut [&mut [f32]]) {
    let flip = _mm512_set1_epi8(-128);
    let one = _mm512_set1_ps(1.0);
    let decode = |row: &Prep, c: usize| {
        // Vector `v` holds blocks 2v and 2v + 1 (32-bit word `8 (k % 2) + u` of vector `k / 2`
        // is word `u` of block `k`); swapping the three vector-index bits with the three low
        // lane-index bits makes vector `u` hold word `u` of block `k` in lane `8 (k % 2) + k / 2`.
        let mut w: [__m512i; 8] =
            core::array::from_fn(|j| _mm512_xor_si512(load64(row.plane, c * 512 + 64 * j), flip));
        for s in 0..3 {
            for v in (0..8).filter(|v| v & (1 << s) == 0) {
                swap(&mut w, v, v | (1 << s), s);
            }
        }
        (w, one)
    };
    drive::<NT>(m, a, r0, outs, decode);
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

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn q4tp_rows<const NT: usize>(m: &Mat, a: &Acts, r0: usize, outs: &mut [&mut [f32]]) {
    let low = _mm512_set1_epi8(15);
    let decode = |row: &Prep, c: usize| {
        let o = pairs_words(row.plane, c);
        let mut w = [_mm512_setzero_si512(); 8];
        for p in 0..4 {
            w[2 * p] = _mm512_and_si512(o[p], low);
            w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16::<4>(o[p]), low);
        }
        (w, ladder_scales(row, c, &PAIRS4_LADDER))
    };
    drive::<NT>(m, a, r0, outs, decode);
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn mxfp4_rows<const NT: usize>(m: &Mat, a: &Acts, r0: usize, outs: &mut [&mut [f32]]) {
    let low = _mm512_set1_epi8(15);
    let lut: [u8; 16] = core::array::from_fn(|n| (MX_INT[n] + 12) as u8);
    // SAFETY: `lut` holds 16 bytes.
    let lut = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(lut.as_ptr().cast()) });
    // The E8M0 bytes of a chunk in the lanes' block order.
    let to_lanes: [u8; 16] = core::array::from_fn(|l| Order::Pairs4.block_of(l) as u8);
    // SAFETY: `to_lanes` holds 16 bytes.
    let to_lanes = unsafe { _mm_loadu_si128(to_lanes.as_ptr().cast()) };
    let decode = |row: &Prep, c: usize| {
        let o = pairs_words(row.plane, c);
        let mut w = [_mm512_setzero_si512(); 8];
        for p in 0..4 {
            w[2 * p] = _mm512_shuffle_epi8(lut, _mm512_and_si512(o[p], low));
            w[2 * p + 1] =
                _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16::<4>(o[p]), low));
        }
        // S = e8m0(k) / 2: k << 23, with 0 -> 2^-127 and 255 -> NaN, halved.
        let k = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(load16(row.scales, 16 * c), to_lanes));
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
    drive::<NT>(m, a, r0, outs, decode);
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
fn q2tp_rows<const NT: usize>(m: &Mat, a: &Acts, r0: usize, outs: &mut [&mut [f32]]) {
    // Each bit pair `u` as `2u` (the signed code is `2u - 3`), so the sums need no doubling.
    let six = _mm512_set1_epi8(6);
    let decode = |row: &Prep, c: usize| {
        // Half `v` holds blocks 8v .. 8v + 8, two 32-bit words each (word `h` of block `k` in
        // lane `2 (k % 8) + h`); swapping vector-index bit 0 with lane-index bit 0 makes
        // vector `h` hold word `h` of block `k` in lane `2 (k % 8) + k / 8`.
        let mut z: [__m512i; 2] = core::array::from_fn(|j| load64(row.plane, c * 128 + 64 * j));
        swap(&mut z, 0, 1, 0);
        let mut w = [_mm512_setzero_si512(); 8];
        for h in 0..2 {
            w[4 * h] = _mm512_and_si512(_mm512_slli_epi16::<1>(z[h]), six);
            w[4 * h + 1] = _mm512_and_si512(_mm512_srli_epi16::<1>(z[h]), six);
            w[4 * h + 2] = _mm512_and_si512(_mm512_srli_epi16::<3>(z[h]), six);
            w[4 * h + 3] = _mm512_and_si512(_mm512_srli_epi16::<5>(z[h]), six);
        }
        (w, ladder_scales(row, c, &QUADS16_LADDER))
    };
    drive::<NT>(m, a, r0, outs, decode);
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
