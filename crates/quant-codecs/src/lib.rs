//! cortiq's number formats: the dtype vocabulary, quantisation, and the CPU kernels.
//!
//! The principal types are [`DType`] (every tensor in a CMF file carries one;
//! [`DType::expected_nbytes`] is the single source of truth for payload sizes) and [`MatRef`], a
//! validated view of one matrix payload with `matvec`, `matmat` and `dequantize`. Byte layouts
//! are specified in `docs/codecs.md`.
//!
//! ```
//! use quant_codecs::{DType, MatRef, quantize};
//!
//! let (rows, cols) = (4, 64);
//! let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0).collect();
//! let bytes = quantize(DType::Q4tp, rows, cols, &w).unwrap();
//! assert_eq!(bytes.len(), DType::Q4tp.expected_nbytes(&[rows, cols]).unwrap());
//!
//! let m = MatRef::new(DType::Q4tp, rows, cols, &bytes).unwrap();
//! let x = vec![1.0f32; cols];
//! let mut y = vec![0.0f32; rows];
//! m.matvec(&x, &mut y).unwrap();
//! let exact: f32 = w[..cols].iter().sum();
//! assert!((y[0] - exact).abs() < 0.05 * w[..cols].iter().map(|v| v.abs()).sum::<f32>());
//! ```
#![deny(missing_docs)]

#[cfg(target_endian = "big")]
compile_error!("cortiq's formats are little-endian and the kernels read them in place");

pub mod act8;
pub mod chain_profile;
mod dtype;
mod error;
pub mod float;
mod int8;
#[cfg(target_arch = "x86_64")]
mod int8_256;
#[cfg(target_arch = "x86_64")]
mod int8_512;
mod kernel;
mod many;
pub mod mxfp4;
pub mod mxfp8;
pub mod ops;
mod q2tp;
mod q4tp;
mod q8_2f;
#[cfg(target_arch = "x86_64")]
mod simd256;
#[cfg(target_arch = "x86_64")]
mod simd512;
mod stream;
pub mod team;
pub mod tiered;

use rayon::prelude::*;

pub use dtype::{DType, GROUP, Layout, split_matrix_shape};
pub use error::CodecError;
pub use float::round_bf16;
pub use int8::ActPath;
use kernel::Permute;
pub use kernel::{Isa, MAX_BATCH};
pub use many::Between;
pub use stream::{RowEncoder, column_maxima};

/// One product of [`MatRef::matmat_many`]: `ys = w xs`, `xs` `[nt, cols]` and `ys`
/// `[nt, rows]` row-major, `1 <= nt <= MAX_BATCH`.
#[derive(Debug)]
pub struct Product<'a, 'b> {
    /// The matrix.
    pub w: MatRef<'a>,
    /// The activation rows.
    pub xs: &'b [f32],
    /// The outputs.
    pub ys: &'b mut [f32],
}

/// One pair of [`MatRef::matmat_chain_on`]: `ys = second . between(first . xs)`.
pub struct Link<'a, 'b> {
    /// The first matrix (an expert's gate/up).
    pub first: MatRef<'a>,
    /// Its activation rows.
    pub xs: &'b [f32],
    /// The second matrix (the expert's down).
    pub second: MatRef<'a>,
    /// The second product's outputs.
    pub ys: &'b mut [f32],
}

/// A validated view of one `[rows, cols]` matrix payload in any dtype.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    layout: Layout,
    bytes: &'a [u8],
}

impl<'a> MatRef<'a> {
    /// Checks that `bytes` is exactly one `[rows, cols]` payload of `dtype`.
    pub fn new(
        dtype: DType,
        rows: usize,
        cols: usize,
        bytes: &'a [u8],
    ) -> Result<Self, CodecError> {
        let layout = Layout::new(dtype, rows, cols)?;
        layout.check_len(bytes)?;
        Ok(MatRef { layout, bytes })
    }

    /// The dtype.
    pub fn dtype(&self) -> DType {
        self.layout.dtype
    }

    /// Rows (output features).
    pub fn rows(&self) -> usize {
        self.layout.rows
    }

    /// Columns (input features).
    pub fn cols(&self) -> usize {
        self.layout.cols
    }

    /// The section layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The payload.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// `y = W x` for one activation row.
    pub fn matvec(&self, x: &[f32], y: &mut [f32]) -> Result<(), CodecError> {
        self.matmat_with(Isa::detect(), x, y)
    }

    /// `ys[t] = W xs[t]` for `t` in `0..T`, `T = xs.len() / cols` in `1..=MAX_BATCH`; `xs` and
    /// `ys` are row-major `[T, cols]` and `[T, rows]`. Each weight group is decoded once and
    /// applied to every row, and row `t` equals `matvec(xs[t])` bit for bit.
    pub fn matmat(&self, xs: &[f32], ys: &mut [f32]) -> Result<(), CodecError> {
        self.matmat_with(Isa::detect(), xs, ys)
    }

    /// [`MatRef::matmat`] compiled for a chosen instruction set (falls back to the baseline
    /// when the CPU lacks it). Results are bit-identical for every `isa`.
    pub fn matmat_with(&self, isa: Isa, xs: &[f32], ys: &mut [f32]) -> Result<(), CodecError> {
        let (rows, cols) = (self.rows(), self.cols());
        let nt = self.batch_rows(xs, ys)?;
        let (l, bytes) = (self.layout, self.bytes);
        match l.dtype {
            DType::F32 | DType::F16 | DType::BF16 => {
                let k = float::Kernel {
                    dtype: l.dtype,
                    cols,
                    bytes,
                };
                kernel::run(isa, &k, rows, cols, nt, xs, ys);
            }
            DType::Q8_2f => {
                let cs = q8_2f::col_scales(&l, bytes);
                let prepared: Vec<f32> = xs
                    .chunks_exact(cols)
                    .flat_map(|x| x.iter().zip(&cs).map(|(x, c)| x * c))
                    .collect();
                kernel::run(
                    isa,
                    &q8_2f::Kernel { l, bytes },
                    rows,
                    cols,
                    nt,
                    &prepared,
                    ys,
                );
            }
            DType::Q4tp => {
                let xp = Permute::Pairs.apply(xs);
                kernel::run(isa, &q4tp::Kernel { l, bytes }, rows, cols, nt, &xp, ys)
            }
            DType::Q2tp => {
                let xp = Permute::Quads.apply(xs);
                kernel::run(isa, &q2tp::Kernel { l, bytes }, rows, cols, nt, &xp, ys)
            }
            DType::Mxfp4 => {
                let xp = Permute::Pairs.apply(xs);
                kernel::run(isa, &mxfp4::Kernel { l, bytes }, rows, cols, nt, &xp, ys)
            }
            DType::Mxfp8 => kernel::run(isa, &mxfp8::Kernel { l, bytes }, rows, cols, nt, xs, ys),
        }
        Ok(())
    }

    /// [`MatRef::matmat`] with a chosen activation path: [`ActPath::F32`] is exactly
    /// `matmat`; [`ActPath::Int8`] quantises the activations to int8 once per call and runs
    /// the integer kernels (docs/codecs.md, "CPU int8 kernels"). Dtypes without integer kernels
    /// ([`DType::has_int8_kernel`]: the float dtypes and mxfp8) take the f32 path for `Int8`.
    pub fn matmat_path(&self, path: ActPath, xs: &[f32], ys: &mut [f32]) -> Result<(), CodecError> {
        self.matmat_path_with(Isa::detect(), path, xs, ys)
    }

    /// [`MatRef::matmat_path`] compiled for a chosen instruction set (falls back to the
    /// baseline when the CPU lacks it). Results are bit-identical for every `isa`, on either
    /// path, and row `t` equals the single-row call on `xs[t]` bit for bit.
    pub fn matmat_path_with(
        &self,
        isa: Isa,
        path: ActPath,
        xs: &[f32],
        ys: &mut [f32],
    ) -> Result<(), CodecError> {
        if path == ActPath::F32 || !self.dtype().has_int8_kernel() {
            return self.matmat_with(isa, xs, ys);
        }
        let nt = self.batch_rows(xs, ys)?;
        int8::run(isa, self.layout, self.bytes, nt, xs, ys);
        Ok(())
    }

    /// Several products `ys = W xs` at once on `path`, as one parallel region: with int8
    /// activations every product's rows are split into tasks scheduled together (a handful
    /// of small matrices, such as a layer's routed experts, cost one fork/join rather than one
    /// each); on the f32 path, and for dtypes without integer kernels, one product after
    /// another. Each product's result equals its own [`MatRef::matmat_path`] bit for bit.
    pub fn matmat_many(path: ActPath, products: &mut [Product<'_, '_>]) -> Result<(), CodecError> {
        Self::matmat_many_on(&team::Rayon, path, products)
    }

    /// [`MatRef::matmat_many`] with the int8 region's tasks (the activations' quantisation, then
    /// the rows) run by `exec`, e.g. a [`team::Team`] whose threads are already awake. The
    /// results are the same bits whoever runs them.
    pub fn matmat_many_on(
        exec: &dyn team::Parallel,
        path: ActPath,
        products: &mut [Product<'_, '_>],
    ) -> Result<(), CodecError> {
        let mut many = Vec::new();
        for p in products.iter_mut() {
            let nt = p.w.batch_rows(p.xs, p.ys)?;
            if path == ActPath::F32 || !p.w.dtype().has_int8_kernel() {
                p.w.matmat_path(path, p.xs, p.ys)?;
            } else {
                many.push((p.w.layout, p.w.bytes, nt, p.xs, &mut *p.ys));
            }
        }
        if !many.is_empty() {
            many::run_many(Isa::detect(), exec, many);
        }
        Ok(())
    }

    /// Pairs `ys = second . between(first . xs)` at once on `path` (a whole expert MLP per
    /// pair: gate/up, the activation, down), `between(pair, y, x)` mapping pair `pair`'s first
    /// outputs `y` (`nt` rows of `first.rows()`) to its second's activations `x` (`nt` rows of
    /// `second.cols()`).
    /// With int8 activations and integer kernels for both matrices of every pair, one
    /// parallel region run by `exec` in which a pair's second product starts as soon as its
    /// first is done; otherwise each pair in turn. Each `ys` equals `second.matmat_path` on
    /// `between(first.matmat_path(xs))` bit for bit. `between` runs inside the region, on
    /// whichever thread finishes a pair's first product: it must not start rayon work of its
    /// own (with `exec` on rayon, a thread waiting in the pool may take up a task that waits
    /// for it).
    pub fn matmat_chain_on(
        exec: &dyn team::Parallel,
        path: ActPath,
        links: &mut [Link<'_, '_>],
        between: &many::Between<'_>,
    ) -> Result<(), CodecError> {
        let mut nts = Vec::with_capacity(links.len());
        for l in links.iter() {
            let nt = l.first.batch_of(l.xs)?;
            if l.ys.len() != nt * l.second.rows() {
                return Err(CodecError::BufferLength {
                    what: "y",
                    expected: nt * l.second.rows(),
                    found: l.ys.len(),
                });
            }
            nts.push(nt);
        }
        let int8 = path == ActPath::Int8
            && links
                .iter()
                .all(|l| l.first.dtype().has_int8_kernel() && l.second.dtype().has_int8_kernel());
        if !int8 {
            for (j, (l, &nt)) in links.iter_mut().zip(&nts).enumerate() {
                let mut y1 = vec![0.0f32; nt * l.first.rows()];
                l.first.matmat_path(path, l.xs, &mut y1)?;
                let mut mid = vec![0.0f32; nt * l.second.cols()];
                between(j, &y1, &mut mid);
                l.second.matmat_path(path, &mid, l.ys)?;
            }
            return Ok(());
        }
        let chain = links
            .iter_mut()
            .zip(&nts)
            .map(|(l, &nt)| {
                let first = int8::Mat {
                    l: l.first.layout,
                    bytes: l.first.bytes,
                };
                let second = int8::Mat {
                    l: l.second.layout,
                    bytes: l.second.bytes,
                };
                (first, nt, l.xs, second, &mut *l.ys)
            })
            .collect();
        many::run_chain(Isa::detect(), exec, chain, between);
        Ok(())
    }

    /// The token rows in `xs`, checked: `1..=MAX_BATCH` whole rows of `cols`.
    fn batch_of(&self, xs: &[f32]) -> Result<usize, CodecError> {
        let cols = self.cols();
        let nt = xs.len() / cols; // cols > 0: Layout::new refuses empty matrices
        if nt == 0 || nt > MAX_BATCH {
            return Err(CodecError::TooManyRows {
                max: MAX_BATCH,
                found: nt,
            });
        }
        if xs.len() != nt * cols {
            return Err(CodecError::BufferLength {
                what: "x",
                expected: nt * cols,
                found: xs.len(),
            });
        }
        Ok(nt)
    }

    fn batch_rows(&self, xs: &[f32], ys: &[f32]) -> Result<usize, CodecError> {
        let rows = self.rows();
        let nt = self.batch_of(xs)?;
        if ys.len() != nt * rows {
            return Err(CodecError::BufferLength {
                what: "y",
                expected: nt * rows,
                found: ys.len(),
            });
        }
        Ok(nt)
    }

    /// The plain reference: each row dequantised, then summed left to right in f32. Slow; it
    /// exists so the fast kernels have a second implementation to be compared with.
    pub fn matvec_ref(&self, x: &[f32], y: &mut [f32]) -> Result<(), CodecError> {
        if x.len() != self.cols() || y.len() != self.rows() {
            return self.batch_rows(x, y).map(|_| ());
        }
        let mut row = vec![0.0f32; self.cols()];
        for (r, y) in y.iter_mut().enumerate() {
            self.dequantize_row(r, &mut row)?;
            *y = row.iter().zip(x).fold(0.0f32, |s, (w, x)| s + w * x);
        }
        Ok(())
    }

    /// Decodes row `r` into `out` (`cols` values).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<(), CodecError> {
        let l = &self.layout;
        if r >= l.rows {
            return Err(CodecError::BufferLength {
                what: "row index",
                expected: l.rows,
                found: r,
            });
        }
        if out.len() != l.cols {
            return Err(CodecError::BufferLength {
                what: "out",
                expected: l.cols,
                found: out.len(),
            });
        }
        match l.dtype {
            DType::F32 | DType::F16 | DType::BF16 => {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = float::element(l.dtype, self.bytes, r * l.cols + i);
                }
            }
            DType::Q8_2f => {
                let cs = q8_2f::col_scales(l, self.bytes);
                q8_2f::dequantize_row(l, self.bytes, &cs, r, out);
            }
            DType::Q4tp => q4tp::dequantize_row(l, self.bytes, r, out),
            DType::Q2tp => q2tp::dequantize_row(l, self.bytes, r, out),
            DType::Mxfp4 => mxfp4::dequantize_row(l, self.bytes, r, out),
            DType::Mxfp8 => mxfp8::dequantize_row(l, self.bytes, r, out),
        }
        Ok(())
    }

    /// Decodes the whole matrix into `out` (`rows * cols` values, row-major).
    pub fn dequantize(&self, out: &mut [f32]) -> Result<(), CodecError> {
        let l = self.layout;
        if out.len() != l.rows * l.cols {
            return Err(CodecError::BufferLength {
                what: "out",
                expected: l.rows * l.cols,
                found: out.len(),
            });
        }
        let cs = (l.dtype == DType::Q8_2f).then(|| q8_2f::col_scales(&l, self.bytes));
        out.par_chunks_mut(l.cols)
            .enumerate()
            .for_each(|(r, o)| match &cs {
                Some(cs) => q8_2f::dequantize_row(&l, self.bytes, cs, r, o),
                None => {
                    // Infallible: r < rows and o.len() == cols by construction.
                    let _ = self.dequantize_row(r, o);
                }
            });
        Ok(())
    }
}

/// Quantises (or, for float dtypes, encodes) a row-major `[rows, cols]` matrix.
///
/// Quantised dtypes refuse NaN and infinities; float dtypes store any value (f16/bf16 round
/// to nearest even).
pub fn quantize(dtype: DType, rows: usize, cols: usize, w: &[f32]) -> Result<Vec<u8>, CodecError> {
    let l = Layout::new(dtype, rows, cols)?;
    if w.len() != rows * cols {
        return Err(CodecError::BufferLength {
            what: "weights",
            expected: rows * cols,
            found: w.len(),
        });
    }
    if !dtype.is_quantized() {
        return Ok(float::encode(dtype, w));
    }
    if let Some(i) = w.iter().position(|v| !v.is_finite()) {
        return Err(CodecError::NonFinite {
            dtype,
            row: i / cols,
            col: i % cols,
            value: w[i],
        });
    }
    Ok(match dtype {
        DType::Q8_2f => q8_2f::quantize(&l, w),
        DType::Q4tp | DType::Q2tp | DType::Mxfp4 | DType::Mxfp8 => {
            let mut out = vec![0u8; l.nbytes];
            let (plane, rest) = out.split_at_mut(l.second);
            let (second, third) = rest.split_at_mut(l.third - l.second);
            stream::group_rows(&l, w, plane, second, third);
            out
        }
        DType::F32 | DType::F16 | DType::BF16 => unreachable!("float dtypes returned above"),
    })
}

/// The payload of rows `start..end` of a `[rows, cols]` matrix, as a `[end - start, cols]`
/// matrix of the same dtype: each section's rows are cut out (q8_2f's column scales, shared by
/// every row, are copied whole). The GPU arena splits tensors larger than one binding this way.
pub fn slice_rows(
    dtype: DType,
    rows: usize,
    cols: usize,
    bytes: &[u8],
    start: usize,
    end: usize,
) -> Result<Vec<u8>, CodecError> {
    if start >= end || end > rows {
        return Err(CodecError::BufferLength {
            what: "row range end",
            expected: rows,
            found: end,
        });
    }
    gather_rows(dtype, rows, cols, bytes, &(start..end).collect::<Vec<_>>())
}

/// The payload of rows `order[0], order[1], ...` of a `[rows, cols]` matrix, as an
/// `[order.len(), cols]` matrix of the same dtype: every per-row section gathered in that
/// order (q8_2f's column scales, shared by every row, copied whole), so row `i` of the result
/// decodes to exactly row `order[i]` of the input.
pub fn gather_rows(
    dtype: DType,
    rows: usize,
    cols: usize,
    bytes: &[u8],
    order: &[usize],
) -> Result<Vec<u8>, CodecError> {
    let l = Layout::new(dtype, rows, cols)?;
    l.check_len(bytes)?;
    if let Some(&bad) = order.iter().find(|&&r| r >= rows) {
        return Err(CodecError::BufferLength {
            what: "gathered row index (below rows)",
            expected: rows,
            found: bad,
        });
    }
    let part = Layout::new(dtype, order.len(), cols)?;
    let mut out = Vec::with_capacity(part.nbytes);
    let gather = |out: &mut Vec<u8>, base: usize, per_row: usize| {
        for &r in order {
            out.extend_from_slice(&bytes[base + r * per_row..base + (r + 1) * per_row]);
        }
    };
    gather(&mut out, 0, l.codes_len / rows);
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => {}
        DType::Q8_2f => {
            gather(&mut out, l.second, 2);
            out.extend_from_slice(&bytes[l.third..]);
        }
        DType::Q4tp | DType::Q2tp => {
            gather(&mut out, l.second, 4);
            gather(&mut out, l.third, l.code_stride);
        }
        DType::Mxfp4 | DType::Mxfp8 => gather(&mut out, l.second, l.groups_per_row()),
    }
    debug_assert_eq!(out.len(), part.nbytes);
    Ok(out)
}

/// The rows of `parts` (one dtype, one width) one after another, as one matrix: every
/// per-row section concatenated. q8_2f's column scales are the first part's: the other parts'
/// rows decode right only where their own column scales enter elsewhere (the GPU's int8 path,
/// whose shared quantiser scales each part's activations by its own).
pub fn concat_rows(parts: &[MatRef<'_>]) -> Result<Vec<u8>, CodecError> {
    let Some(first) = parts.first() else {
        return Err(CodecError::BufferLength {
            what: "matrices to concatenate",
            expected: 1,
            found: 0,
        });
    };
    let (dtype, cols) = (first.dtype(), first.cols());
    if let Some(bad) = parts
        .iter()
        .find(|p| p.dtype() != dtype || p.cols() != cols)
    {
        return Err(CodecError::BufferLength {
            what: "columns of a concatenated matrix (one dtype, one width)",
            expected: cols,
            found: bad.cols(),
        });
    }
    let rows: usize = parts.iter().map(|p| p.rows()).sum();
    let whole = Layout::new(dtype, rows, cols)?;
    let mut out = Vec::with_capacity(whole.nbytes);
    let section = |out: &mut Vec<u8>, which: fn(&Layout) -> (usize, usize)| {
        for p in parts {
            let (at, len) = which(p.layout());
            out.extend_from_slice(&p.bytes()[at..at + len]);
        }
    };
    section(&mut out, |l| (0, l.codes_len));
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => {}
        DType::Q8_2f => {
            section(&mut out, |l| (l.second, l.third - l.second));
            out.extend_from_slice(&first.bytes()[first.layout().third..]);
        }
        DType::Q4tp | DType::Q2tp => {
            section(&mut out, |l| (l.second, l.third - l.second));
            section(&mut out, |l| (l.third, l.nbytes - l.third));
        }
        DType::Mxfp4 | DType::Mxfp8 => section(&mut out, |l| (l.second, l.nbytes - l.second)),
    }
    if out.len() != whole.nbytes {
        return Err(CodecError::BufferLength {
            what: "concatenated payload bytes",
            expected: whole.nbytes,
            found: out.len(),
        });
    }
    Ok(out)
}

/// A valid payload with random codes and realistic scales (no NaN, no subnormal scale), built
/// directly rather than by quantising: benchmarks need gigabytes of weights whose values do not
/// matter, and quantising that much would dominate their run. Deterministic in `seed`.
pub fn synthetic_payload(
    dtype: DType,
    rows: usize,
    cols: usize,
    seed: u64,
) -> Result<Vec<u8>, CodecError> {
    let l = Layout::new(dtype, rows, cols)?;
    let mut b = vec![0u8; l.nbytes];
    b.par_chunks_mut(1 << 20).enumerate().for_each(|(i, c)| {
        let mut s = (seed ^ 0x9e37_79b9_7f4a_7c15)
            .wrapping_add(i as u64)
            .wrapping_mul(0x2545_f491_4f6c_dd1d)
            | 1;
        for w in c.chunks_mut(8) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            w.copy_from_slice(&s.to_le_bytes()[..w.len()]);
        }
    });
    let half = |v: f32| float::f32_to_f16_bits(v).to_le_bytes();
    match dtype {
        DType::F32 => b.par_chunks_exact_mut(4).for_each(|w| {
            let v =
                (u32::from_le_bytes([w[0], w[1], w[2], w[3]]) >> 9) as f32 / (1 << 23) as f32 - 0.5;
            w.copy_from_slice(&v.to_le_bytes());
        }),
        // Exponent byte near 2^-7 (f16: 0x1c-0x23 range), random sign and mantissa.
        DType::F16 => b
            .par_chunks_exact_mut(2)
            .for_each(|w| w[1] = 0x20 | (w[1] & 0x83)),
        DType::BF16 => b
            .par_chunks_exact_mut(2)
            .for_each(|w| w[1] = 0x3c | (w[1] & 0x80)),
        DType::Q8_2f => {
            for w in b[l.second..].chunks_exact_mut(2) {
                w.copy_from_slice(&half(0.01));
            }
        }
        DType::Q4tp | DType::Q2tp => {
            for w in b[l.second..l.third].chunks_exact_mut(4) {
                w[..2].copy_from_slice(&half(-10.0));
                w[2..].copy_from_slice(&half(0.25));
            }
        }
        DType::Mxfp4 => {
            for k in &mut b[l.second..] {
                *k = 110 + *k % 20;
            }
        }
        DType::Mxfp8 => {
            let (codes, scales) = b.split_at_mut(l.second);
            // S.1111.111 is NaN: the largest finite code instead.
            for c in codes.iter_mut().filter(|c| **c & 0x7f == 0x7f) {
                *c ^= 1;
            }
            for k in scales {
                *k = 110 + *k % 20;
            }
        }
    }
    Ok(b)
}

/// Decodes a whole tensor of any shape (stacked matrices for quantised dtypes) to f32.
pub fn dequantize(dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Vec<f32>, CodecError> {
    let expected = dtype.expected_nbytes(shape)?;
    if bytes.len() != expected {
        let (_, rows, cols) =
            split_matrix_shape(dtype, shape).unwrap_or((1, 1, shape.iter().product()));
        return Err(CodecError::PayloadLength {
            dtype,
            rows,
            cols,
            expected,
            found: bytes.len(),
        });
    }
    if let Some(size) = dtype.element_size() {
        return Ok((0..bytes.len() / size)
            .map(|i| float::element(dtype, bytes, i))
            .collect());
    }
    let (batch, rows, cols) = split_matrix_shape(dtype, shape)?;
    let one = Layout::new(dtype, rows, cols)?.nbytes;
    let count = batch
        .checked_mul(rows * cols)
        .ok_or_else(|| CodecError::Overflow {
            dtype,
            shape: shape.to_vec(),
        })?;
    let mut out = vec![0.0f32; count];
    for (b, o) in out.chunks_exact_mut(rows * cols).enumerate() {
        MatRef::new(dtype, rows, cols, &bytes[b * one..(b + 1) * one])?.dequantize(o)?;
    }
    Ok(out)
}
