//! The int8-activation integer kernels (docs/codecs.md, "CPU int8 kernels"): activations are
//! quantised once per call with [`crate::act8`], each 32-block's integer dot product
//! `I_b = sum_i c_i q_i` is exact in i32, and the f32 part follows one fixed order on every
//! instruction set:
//!
//! * per token row, 16 f32 accumulators; block `b` goes to accumulator `b % 16` by
//!   `acc = fma(d_b * S_b, I_b as f32, acc)` (the factor `d_b * S_b` rounded once, `I_b` exact
//!   in f32 since `|I_b| < 2^24`), blocks in increasing order;
//! * the 16 accumulators are folded pairwise (`j + w` into `j` for `w` = 8, 4, 2, 1);
//! * q8_2f multiplies the folded sum by the row scale last.
//!
//! The portable code here is the reference; `int8_512` computes the same thing with AVX-512
//! VNNI, 16 blocks per vector, and `int8_256` with AVX2, 8 blocks per vector.

// Accumulator arrays are indexed by token row and block lane on purpose.
#![allow(clippy::needless_range_loop)]

use rayon::prelude::*;

use crate::act8::{ACT_BLOCK, quantize_block};
use crate::tiered::{scale_code, scale_table};
use crate::{DType, Isa, Layout, mxfp4, q2tp, q4tp, q8_2f};

/// How a matmat treats its activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ActPath {
    /// Exact f32 activations against weights decoded to f32 (the reference path; what
    /// [`crate::MatRef::matvec`] and [`crate::MatRef::matmat`] do).
    #[default]
    F32,
    /// Activations quantised to int8 per 32-block ([`crate::act8`]) and integer dot products
    /// with the weight codes, scales applied once per block. Dtypes without integer kernels
    /// (f32, f16, bf16, and mxfp8: see [`crate::DType::has_int8_kernel`]) take the f32 path.
    Int8,
}

/// Blocks per accumulator set (one AVX-512 vector of block sums).
pub(crate) const LANES8: usize = 16;

/// Where element `e` of block `b` lies in a token row's quantised activations: each format
/// reads its packed codes straight into the byte lanes of its dot-product instructions, and
/// the activations are permuted to match once per call. Per 16 blocks (a chunk: 512 codes,
/// eight 64-byte vectors), every order puts block `k` in one 4-byte lane, [`Order::lane`]`(k)`,
/// of each of the eight vectors, so one dot-product lane collects one block and a token row
/// costs no shuffles; the lanes hold the blocks in a permuted order that the weight decoding
/// makes cheap, and the block scales and sums are stored in that order too ([`Acts::slot`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Order {
    /// q8_2f: vector `u` holds code bytes `4u .. 4u + 4` (elements `4u + i`) of every block:
    /// the weights' 16x8 transpose of 32-bit words (three 2-vector shuffle stages) lands
    /// block `k` in lane `8 (k % 2) + k / 2`.
    Words,
    /// q4tp/mxfp4: vector `2p + h` holds elements `8p + 2i + h`, `i` = 0..3 (code bytes
    /// `4p .. 4p + 4`, low nibbles for `h = 0`), in lane `4 (k % 4) + k / 4`: the code bytes'
    /// in-lane 4x4 transpose of 32-bit words.
    Pairs4,
    /// q2tp: vector `4h + j` holds bit pair `j` of code bytes `4h + i`, `i` = 0..3 (elements
    /// `4 (4h + i) + j`), in lane `2 (k % 8) + k / 8`: one shuffle of the chunk's two 64-byte
    /// halves.
    Quads16,
}

impl Order {
    /// The 4-byte lane of a chunk's vectors that collects block `k` (`k < 16`).
    #[inline(always)]
    pub(crate) const fn lane(self, k: usize) -> usize {
        match self {
            Order::Words => 8 * (k % 2) + k / 2,
            Order::Pairs4 => 4 * (k % 4) + k / 4,
            Order::Quads16 => 2 * (k % 8) + k / 8,
        }
    }

    /// The block whose lane is `lane` (the inverse of [`Order::lane`]).
    pub(crate) const fn block_of(self, lane: usize) -> usize {
        let mut k = 0;
        while self.lane(k) != lane {
            k += 1;
        }
        k
    }

    #[inline(always)]
    pub(crate) const fn pos(self, b: usize, e: usize) -> usize {
        let lane = 4 * self.lane(b % 16);
        (b / 16) * 512
            + lane
            + match self {
                Order::Words => (e / 4) * 64 + e % 4,
                Order::Pairs4 => (2 * (e / 8) + e % 2) * 64 + (e % 8) / 2,
                Order::Quads16 => {
                    let byte = e / 4;
                    (4 * (byte / 4) + e % 4) * 64 + byte % 4
                }
            }
    }

    /// `pos(b, e) - pos(b, 0)` for the 32 elements of block `b`.
    #[inline(always)]
    fn offsets(self, b: usize) -> [usize; ACT_BLOCK] {
        let base = self.pos(b, 0);
        core::array::from_fn(|e| self.pos(b, e) - base)
    }

    pub(crate) fn of(dtype: DType) -> Order {
        match dtype {
            DType::Q4tp | DType::Mxfp4 => Order::Pairs4,
            DType::Q2tp => Order::Quads16,
            _ => Order::Words,
        }
    }
}

/// The offset `off` of a format's unsigned codes `u` (what the dot-product instructions
/// multiply): the signed code is `c = u - off` (q2tp's `u` is twice its bit pair), so
/// `sum c q = sum u q - off * sum q`.
pub(crate) const fn code_offset(dtype: DType) -> i32 {
    match dtype {
        DType::Q4tp => 8,
        DType::Q2tp => 3,
        DType::Mxfp4 => 12,
        _ => 128,
    }
}

/// One cache line of activation codes: the codes live in these so that every 64-byte vector
/// load of them is aligned (a load split across two lines costs the load ports twice, and the
/// T=8 kernels are bound by those ports).
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
pub(crate) struct Line([i8; 64]);

/// `nt` activation rows quantised, each padded to `nbp` blocks (a multiple of 16) with zero
/// codes, zero scales and zero sums.
pub(crate) struct Acts {
    /// Real blocks per row.
    pub nb: usize,
    /// Padded blocks per row.
    pub nbp: usize,
    /// Codes, `nbp * 32` per row, in the format's [`Order`] (see [`Acts::q`]).
    lines: Vec<Line>,
    /// Block scales `d`, `nbp` per row, block `b` at [`Acts::slot`]`(b)`.
    pub d: Vec<f32>,
    /// Block code sums times the format's code offset, negated (`-off * sum_b q`, see
    /// [`code_offset`]), `nbp` per row, block `b` at [`Acts::slot`]`(b)`.
    pub osums: Vec<i32>,
    /// The layout of the codes.
    pub order: Order,
}

impl Acts {
    /// Quantises `xs` (`nt` rows of `cols`), multiplied element-wise by `cs` first if given,
    /// for a format whose codes are laid out in `order` and offset by `off`; wide rows of a
    /// batch are quantised in parallel on rayon's pool if `par`.
    pub(crate) fn new(
        xs: &[f32],
        cols: usize,
        (order, off): (Order, i32),
        cs: Option<&[f32]>,
        par: bool,
    ) -> Acts {
        let nt = xs.len() / cols;
        let mut a = Acts::zeroed(nt, cols, order);
        let nbp = a.nbp;
        let per = nbp * ACT_BLOCK;
        let work = |(t, out): (usize, RowParts)| {
            quantize_row(&xs[t * cols..][..cols], cs, (order, off), out)
        };
        let q: &mut [i8] = bytemuck::cast_slice_mut(&mut a.lines);
        let it = q
            .chunks_mut(per)
            .zip(a.d.chunks_mut(nbp))
            .zip(a.osums.chunks_mut(nbp));
        if par && nt > 1 && cols >= 2048 {
            it.collect::<Vec<_>>()
                .into_par_iter()
                .enumerate()
                .for_each(work);
        } else {
            it.enumerate().for_each(work);
        }
        a
    }

    /// `nt` rows of `cols` activations with every code, scale and sum zero (the padding
    /// [`Acts::new`] leaves), to be filled chunk by chunk with [`ActChunk`]s.
    pub(crate) fn zeroed(nt: usize, cols: usize, order: Order) -> Acts {
        let nb = cols.div_ceil(ACT_BLOCK);
        let nbp = nb.div_ceil(LANES8) * LANES8;
        Acts {
            nb,
            nbp,
            lines: vec![Line([0; 64]); nt * nbp * ACT_BLOCK / 64],
            d: vec![0.0; nt * nbp],
            osums: vec![0; nt * nbp],
            order,
        }
    }

    /// Puts `part` (chunk `c` of token row `t`) in place.
    pub(crate) fn set_chunk(&mut self, t: usize, c: usize, part: &ActChunk) {
        let per = self.nbp * ACT_BLOCK;
        let q: &mut [i8] = bytemuck::cast_slice_mut(&mut self.lines);
        q[t * per + c * CHUNK_CODES..][..CHUNK_CODES].copy_from_slice(&part.q);
        let at = t * self.nbp + c * LANES8;
        self.d[at..at + LANES8].copy_from_slice(&part.d);
        self.osums[at..at + LANES8].copy_from_slice(&part.osums);
    }

    /// Where block `b`'s scale and sum lie within a token row's `nbp`.
    #[inline(always)]
    pub(crate) fn slot(&self, b: usize) -> usize {
        (b / 16) * 16 + self.order.lane(b % 16)
    }

    /// The codes, `nbp * 32` per row (64-byte aligned: `nbp` is a multiple of 16).
    #[inline(always)]
    pub(crate) fn q(&self) -> &[i8] {
        bytemuck::cast_slice(&self.lines)
    }
}

/// Codes per chunk of 16 blocks.
const CHUNK_CODES: usize = LANES8 * ACT_BLOCK;

/// One chunk (16 blocks) of one token row's quantised activations, as [`Acts::new`] lays it
/// out: quantised apart, so that several threads can share a row's quantisation.
pub(crate) struct ActChunk {
    q: [i8; CHUNK_CODES],
    d: [f32; LANES8],
    osums: [i32; LANES8],
}

impl ActChunk {
    /// Chunks in a row of `cols` activations.
    pub(crate) fn per_row(cols: usize) -> usize {
        cols.div_ceil(CHUNK_CODES)
    }

    /// Chunk `c` of the row `x` (all of the row's columns), scaled by the matrix's column
    /// scales `cs` first if given, for codes in `order` offset by `off`: the same values
    /// [`Acts::new`] puts there (a chunk's blocks sit at the same places relative to it).
    pub(crate) fn quantize(
        x: &[f32],
        cs: Option<&[f32]>,
        (order, off): (Order, i32),
        c: usize,
    ) -> ActChunk {
        let mut part = ActChunk {
            q: [0; CHUNK_CODES],
            d: [0.0; LANES8],
            osums: [0; LANES8],
        };
        let x = &x[c * CHUNK_CODES..];
        let x = &x[..x.len().min(CHUNK_CODES)];
        let cs = cs.map(|cs| &cs[c * CHUNK_CODES..][..x.len()]);
        quantize_row(
            x,
            cs,
            (order, off),
            ((&mut part.q, &mut part.d), &mut part.osums),
        );
        part
    }
}

/// One token row's quantised parts: codes, block scales, offset block sums.
type RowParts<'a> = ((&'a mut [i8], &'a mut [f32]), &'a mut [i32]);

/// One activation row into its codes (in `order`), block scales and block sums, compiled for
/// the widest vector unit the CPU has (the same integer and f64 operations whichever: the
/// codes do not depend on it).
fn quantize_row(x: &[f32], cs: Option<&[f32]>, order: (Order, i32), out: RowParts) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
            // SAFETY: the features were detected.
            return unsafe { quantize_row_avx512(x, cs, order, out) };
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: the feature was detected.
            return unsafe { quantize_row_avx2(x, cs, order, out) };
        }
    }
    quantize_row_any(x, cs, order, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
fn quantize_row_avx512(x: &[f32], cs: Option<&[f32]>, order: (Order, i32), out: RowParts) {
    quantize_row_any(x, cs, order, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn quantize_row_avx2(x: &[f32], cs: Option<&[f32]>, order: (Order, i32), out: RowParts) {
    quantize_row_any(x, cs, order, out)
}

#[inline(always)]
fn quantize_row_any(
    x: &[f32],
    cs: Option<&[f32]>,
    (order, off): (Order, i32),
    ((q, d), s): RowParts,
) {
    let cols = x.len();
    for b in 0..cols.div_ceil(ACT_BLOCK) {
        let len = (cols - b * ACT_BLOCK).min(ACT_BLOCK);
        let mut buf = [0.0f32; ACT_BLOCK];
        let xb = &x[b * ACT_BLOCK..][..len];
        match cs {
            Some(cs) => {
                for ((o, &v), &c) in buf.iter_mut().zip(xb).zip(&cs[b * ACT_BLOCK..][..len]) {
                    *o = v * c;
                }
            }
            None => buf[..len].copy_from_slice(xb),
        }
        let mut qb = [0i8; ACT_BLOCK];
        let slot = (b / 16) * 16 + order.lane(b % 16);
        d[slot] = quantize_block(&buf[..len], &mut qb[..len]);
        s[slot] = -off * qb.iter().map(|&v| i32::from(v)).sum::<i32>();
        let base = order.pos(b, 0);
        let at = order.offsets(b);
        for e in 0..len {
            q[base + at[e]] = qb[e];
        }
    }
}

/// One quantised matrix for the integer kernels.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a> {
    pub l: Layout,
    pub bytes: &'a [u8],
}

/// A row, ready for its blocks.
pub(crate) struct Row<'a> {
    /// q4tp: the scale ladder; q2tp: the ladder halved (`S = scale / 2`).
    pub ladder: [f32; 32],
    /// The row's code bytes.
    pub plane: &'a [u8],
    /// q4tp/q2tp: packed 5-bit scale codes; mxfp4: E8M0 bytes; q8_2f: empty.
    pub scales: &'a [u8],
    /// q8_2f: the row scale; otherwise 1.
    pub rs: f32,
}

/// The signed value `2 * e2m1(n)` of each E2M1 code.
pub(crate) const MX_INT: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

impl<'a> Mat<'a> {
    #[inline(always)]
    pub(crate) fn row(&self, r: usize) -> Row<'a> {
        let (l, bytes) = (&self.l, self.bytes);
        match l.dtype {
            DType::Q4tp | DType::Q2tp => {
                let (tier, bits) = if l.dtype == DType::Q4tp {
                    (q4tp::TIER, 4)
                } else {
                    (q2tp::TIER, 2)
                };
                let (lo, step) = crate::tiered::row_params(l, bytes, r);
                let mut ladder = scale_table(&tier, lo, step);
                if l.dtype == DType::Q2tp {
                    for s in &mut ladder {
                        *s *= 0.5;
                    }
                }
                let per_row = l.cols * bits / 8;
                Row {
                    ladder,
                    plane: &bytes[r * per_row..][..per_row],
                    scales: &bytes[l.third + r * l.code_stride..][..l.code_stride],
                    rs: 1.0,
                }
            }
            DType::Mxfp4 => {
                let gpr = l.groups_per_row();
                Row {
                    ladder: [0.0; 32],
                    plane: &bytes[r * l.cols / 2..][..l.cols / 2],
                    scales: &bytes[l.second + r * gpr..][..gpr],
                    rs: 1.0,
                }
            }
            _ => Row {
                ladder: [0.0; 32],
                plane: &bytes[r * l.cols..][..l.cols],
                scales: &[],
                rs: q8_2f::row_scale(l, bytes, r),
            },
        }
    }

    /// Block `b`'s factor `S_b` and integer codes `c_i` in element order (zero past a short
    /// q8_2f tail).
    #[inline(always)]
    fn block(&self, row: &Row, b: usize) -> (f32, [i32; 32]) {
        let mut c = [0i32; 32];
        match self.l.dtype {
            DType::Q4tp => {
                for (k, &v) in row.plane[b * 16..][..16].iter().enumerate() {
                    c[2 * k] = i32::from(v & 15) - 8;
                    c[2 * k + 1] = i32::from(v >> 4) - 8;
                }
                (row.ladder[scale_code(row.scales, b)], c)
            }
            DType::Q2tp => {
                for (k, &v) in row.plane[b * 8..][..8].iter().enumerate() {
                    for j in 0..4 {
                        c[4 * k + j] = 2 * i32::from((v >> (2 * j)) & 3) - 3;
                    }
                }
                (row.ladder[scale_code(row.scales, b)], c)
            }
            DType::Mxfp4 => {
                for (k, &v) in row.plane[b * 16..][..16].iter().enumerate() {
                    c[2 * k] = i32::from(MX_INT[usize::from(v & 15)]);
                    c[2 * k + 1] = i32::from(MX_INT[usize::from(v >> 4)]);
                }
                (mxfp4::e8m0(row.scales[b]) * 0.5, c)
            }
            _ => {
                let start = b * ACT_BLOCK;
                let len = (self.l.cols - start).min(ACT_BLOCK);
                for (c, &v) in c.iter_mut().zip(&row.plane[start..][..len]) {
                    *c = i32::from(v as i8);
                }
                (1.0, c)
            }
        }
    }

    /// The reference row: `out[t] = dot(row r, acts t)` in the documented order.
    #[inline(always)]
    fn row_dot<const NT: usize>(&self, r: usize, a: &Acts, order: Order, out: &mut [f32]) {
        let row = self.row(r);
        let mut acc = [[0.0f32; LANES8]; NT];
        let per = a.nbp * ACT_BLOCK;
        for b in 0..a.nb {
            let (s, c) = self.block(&row, b);
            for t in 0..NT {
                let q = &a.q()[t * per..][..per];
                let mut i = 0i32;
                for e in 0..ACT_BLOCK {
                    i += c[e] * i32::from(q[order.pos(b, e)]);
                }
                let f = a.d[t * a.nbp + a.slot(b)] * s;
                let lane = &mut acc[t][b % LANES8];
                *lane = f.mul_add(i as f32, *lane);
            }
        }
        for t in 0..NT {
            out[t] = fold16(&acc[t]) * row.rs;
        }
    }
}

/// The 16 block lanes folded pairwise: lane `j + w` into lane `j` for `w` = 8, 4, 2, 1.
#[inline(always)]
pub(crate) fn fold16(acc: &[f32; LANES8]) -> f32 {
    let mut v = *acc;
    let mut w = LANES8 / 2;
    while w > 0 {
        for j in 0..w {
            v[j] += v[j + w];
        }
        w /= 2;
    }
    v[0]
}

/// Rows `r0 .. r0 + outs[0].len()`; `outs[t]` are token `t`'s outputs.
#[inline(always)]
fn rows_portable<const NT: usize>(
    m: &Mat,
    a: &Acts,
    order: Order,
    r0: usize,
    outs: &mut [&mut [f32]],
) {
    let n = outs.first().map_or(0, |o| o.len());
    let mut out = [0.0f32; NT];
    for i in 0..n {
        m.row_dot::<NT>(r0 + i, a, order, &mut out);
        for t in 0..NT {
            outs[t][i] = out[t];
        }
    }
}

/// The instruction set the rows run with; `Vnni` is `Isa::Avx512` on a CPU with AVX-512 VNNI
/// (`int8_512`); `Avx2`, and plain `Avx512` without VNNI, run `int8_256`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

pub(crate) fn rows_path<const NT: usize>(
    p: Path,
    m: &Mat,
    a: &Acts,
    order: Order,
    r0: usize,
    outs: &mut [&mut [f32]],
) {
    match p {
        Path::Portable => rows_portable::<NT>(m, a, order, r0, outs),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `run` picks Avx2 only after `Isa::available` confirmed the features.
        Path::Avx2 => unsafe { crate::int8_256::rows::<NT>(m, a, r0, outs) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `run` picks Avx512 only after `Isa::available` confirmed the features (AVX2
        // and FMA among them).
        Path::Avx512 => unsafe { crate::int8_256::rows::<NT>(m, a, r0, outs) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `run` picks Vnni only after confirming AVX-512 F/BW/VL and VNNI.
        Path::Vnni => unsafe { crate::int8_512::rows::<NT>(m, a, r0, outs) },
    }
}

fn run_nt<const NT: usize>(p: Path, m: &Mat, a: &Acts, order: Order, ys: &mut [f32]) {
    let (rows, cols) = (m.l.rows, m.l.cols);
    let threads = rayon::current_num_threads().max(1);
    let chunk = rows.div_ceil(threads * 8).clamp(8, 4096);
    let nchunks = rows.div_ceil(chunk);
    let mut tasks: Vec<Vec<&mut [f32]>> = (0..nchunks).map(|_| Vec::with_capacity(NT)).collect();
    for y in ys.chunks_mut(rows).take(NT) {
        for (task, part) in tasks.iter_mut().zip(y.chunks_mut(chunk)) {
            task.push(part);
        }
    }
    if nchunks == 1 || rows * cols * NT < 1 << 16 {
        for (i, mut outs) in tasks.into_iter().enumerate() {
            rows_path::<NT>(p, m, a, order, i * chunk, &mut outs);
        }
        return;
    }
    tasks
        .into_par_iter()
        .enumerate()
        .for_each(|(i, mut outs)| rows_path::<NT>(p, m, a, order, i * chunk, &mut outs));
}

pub(crate) fn path_of(isa: Isa) -> Path {
    let isa = if isa.available() { isa } else { Isa::Baseline };
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if is_x86_feature_detected!("avx512vnni") => Path::Vnni,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => Path::Avx512,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => Path::Avx2,
        _ => Path::Portable,
    }
}

/// Whether `isa` runs hand-written integer kernels (AVX-512 VNNI, or AVX2); elsewhere the
/// int8 path is the portable reference, exact but about 10x slower than the f32 kernels.
pub(crate) fn has_fast_kernels(isa: Isa) -> bool {
    path_of(isa) != Path::Portable
}

pub(crate) fn acts_of(m: &Mat, xs: &[f32]) -> Acts {
    acts_with(m, xs, true)
}

/// [`acts_of`] on the calling thread alone: for callers that must not enter rayon's pool
/// (a task that other tasks of the same region may be waiting on: waiting inside the pool,
/// it could pick up one of those and wait for itself).
pub(crate) fn acts_serial(m: &Mat, xs: &[f32]) -> Acts {
    acts_with(m, xs, false)
}

fn acts_with(m: &Mat, xs: &[f32], par: bool) -> Acts {
    let (cs, layout) = act_params(m);
    Acts::new(xs, m.l.cols, layout, cs.as_deref(), par)
}

/// What quantising activations for `m` takes besides them: q8_2f's column scales (its
/// activations are multiplied by them first), and the codes' order and offset.
pub(crate) fn act_params(m: &Mat) -> (Option<Vec<f32>>, (Order, i32)) {
    let l = &m.l;
    let cs = (l.dtype == DType::Q8_2f).then(|| q8_2f::col_scales(l, m.bytes));
    (cs, (Order::of(l.dtype), code_offset(l.dtype)))
}

/// `ys[t * rows + r] = dot(row r, xs[t])` for a quantised dtype, `nt` rows. Callers have
/// checked `1 <= nt <= MAX_BATCH` and the buffer lengths.
pub(crate) fn run(isa: Isa, l: Layout, bytes: &[u8], nt: usize, xs: &[f32], ys: &mut [f32]) {
    debug_assert!(l.dtype.has_int8_kernel());
    let order = Order::of(l.dtype);
    let m = Mat { l, bytes };
    let a = acts_of(&m, xs);
    let p = path_of(isa);
    match nt {
        1 => run_nt::<1>(p, &m, &a, order, ys),
        2 => run_nt::<2>(p, &m, &a, order, ys),
        3 => run_nt::<3>(p, &m, &a, order, ys),
        4 => run_nt::<4>(p, &m, &a, order, ys),
        5 => run_nt::<5>(p, &m, &a, order, ys),
        6 => run_nt::<6>(p, &m, &a, order, ys),
        7 => run_nt::<7>(p, &m, &a, order, ys),
        _ => run_nt::<8>(p, &m, &a, order, ys),
    }
}
