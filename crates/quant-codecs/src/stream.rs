//! Quantising a matrix a block of rows at a time, for matrices too large to hold as f32 at
//! once (a 248k-row embedding is 2.5 GB as f32): the code plane streams out block by block and
//! the small per-row sections are kept until the end. The bytes are exactly `quantize`'s.

use rayon::prelude::*;

use crate::float::f16_bits_to_f32;
use crate::{CodecError, DType, GROUP, Layout, float, mxfp4, mxfp8, q2tp, q4tp, q8_2f, tiered};

/// Each column's largest magnitude over a block of rows, folded into `acc` (the first pass
/// q8_2f needs before [`RowEncoder::new`]).
pub fn column_maxima(acc: &mut [f32], rows: &[f32]) {
    let m = q8_2f::col_max(rows, acc.len());
    for (a, b) in acc.iter_mut().zip(m) {
        *a = a.max(b);
    }
}

/// Quantises rows of a group format (q4tp, q2tp, mxfp4, mxfp8) into their code-plane bytes and
/// the same rows' bytes of the second and third sections.
pub(crate) fn group_rows(
    l: &Layout,
    w: &[f32],
    plane: &mut [u8],
    second: &mut [u8],
    third: &mut [u8],
) {
    let cols = l.cols;
    match l.dtype {
        DType::Q4tp | DType::Q2tp => {
            let tier = if l.dtype == DType::Q4tp {
                q4tp::TIER
            } else {
                q2tp::TIER
            };
            plane
                .par_chunks_mut(cols * tier.bits / 8)
                .zip(second.par_chunks_mut(4))
                .zip(third.par_chunks_mut(l.code_stride))
                .zip(w.par_chunks(cols))
                .for_each(|(((p, pr), c), row)| tiered::quantize_row(&tier, row, p, pr, c));
        }
        DType::Mxfp8 => {
            plane
                .par_chunks_mut(cols)
                .zip(second.par_chunks_mut(cols / GROUP))
                .zip(w.par_chunks(cols))
                .for_each(|((p, s), row)| mxfp8::quantize_row(row, p, s));
        }
        _ => {
            plane
                .par_chunks_mut(cols / 2)
                .zip(second.par_chunks_mut(cols / GROUP))
                .zip(w.par_chunks(cols))
                .for_each(|((p, s), row)| mxfp4::quantize_row(row, p, s));
        }
    }
}

/// A matrix being quantised block by block: [`push_rows`](RowEncoder::push_rows) returns each
/// block's code-plane bytes, [`finish`](RowEncoder::finish) the sections after the plane.
/// Concatenated they equal `quantize(dtype, rows, cols, all rows)` byte for byte.
#[derive(Debug)]
pub struct RowEncoder {
    l: Layout,
    next: usize,
    second: Vec<u8>,
    third: Vec<u8>,
    col_scales: Vec<f32>,
}

impl RowEncoder {
    /// Starts a `[rows, cols]` matrix. q8_2f needs `colmax`, every column's largest magnitude
    /// over all rows ([`column_maxima`]); the other dtypes ignore it.
    pub fn new(
        dtype: DType,
        rows: usize,
        cols: usize,
        colmax: Option<&[f32]>,
    ) -> Result<RowEncoder, CodecError> {
        let l = Layout::new(dtype, rows, cols)?;
        let mut third = Vec::new();
        let mut col_scales = Vec::new();
        if dtype == DType::Q8_2f {
            let colmax = colmax.ok_or(CodecError::BufferLength {
                what: "column maxima (q8_2f)",
                expected: cols,
                found: 0,
            })?;
            if colmax.len() != cols {
                return Err(CodecError::BufferLength {
                    what: "column maxima",
                    expected: cols,
                    found: colmax.len(),
                });
            }
            let cs16 = q8_2f::col_scales_from_max(colmax);
            col_scales = cs16.iter().map(|&h| f16_bits_to_f32(h)).collect();
            third = cs16.iter().flat_map(|h| h.to_le_bytes()).collect();
        }
        Ok(RowEncoder {
            l,
            next: 0,
            second: Vec::new(),
            third,
            col_scales,
        })
    }

    /// Quantises the next `w.len() / cols` rows; returns their code-plane bytes.
    pub fn push_rows(&mut self, w: &[f32]) -> Result<Vec<u8>, CodecError> {
        let l = self.l;
        let n = w.len() / l.cols;
        if n * l.cols != w.len() || self.next + n > l.rows {
            return Err(CodecError::BufferLength {
                what: "rows pushed (whole rows, at most the matrix's)",
                expected: (l.rows - self.next) * l.cols,
                found: w.len(),
            });
        }
        if l.dtype.is_quantized()
            && let Some(i) = w.iter().position(|v| !v.is_finite())
        {
            return Err(CodecError::NonFinite {
                dtype: l.dtype,
                row: self.next + i / l.cols,
                col: i % l.cols,
                value: w[i],
            });
        }
        self.next += n;
        let code_row = l.codes_len / l.rows;
        let mut plane = vec![0u8; n * code_row];
        match l.dtype {
            DType::F32 | DType::F16 | DType::BF16 => plane = float::encode(l.dtype, w),
            DType::Q8_2f => {
                let mut rs = vec![0u8; 2 * n];
                q8_2f::quantize_rows(w, l.cols, &self.col_scales, &mut plane, &mut rs);
                self.second.extend_from_slice(&rs);
            }
            _ => {
                let per_second = (l.third - l.second) / l.rows;
                let mut second = vec![0u8; n * per_second];
                let mut third = vec![0u8; n * l.code_stride];
                group_rows(&l, w, &mut plane, &mut second, &mut third);
                self.second.extend_from_slice(&second);
                self.third.extend_from_slice(&third);
            }
        }
        Ok(plane)
    }

    /// The bytes after the code plane; an error if not every row was pushed.
    pub fn finish(self) -> Result<Vec<u8>, CodecError> {
        if self.next != self.l.rows {
            return Err(CodecError::BufferLength {
                what: "rows pushed before finish",
                expected: self.l.rows,
                found: self.next,
            });
        }
        // The second section (row scales, row parameters or E8M0 scales), then the third
        // (column scales or packed scale codes; empty for mxfp4 and the float dtypes).
        let mut out = self.second;
        out.extend_from_slice(&self.third);
        Ok(out)
    }
}
