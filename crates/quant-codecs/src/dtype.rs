//! The dtype vocabulary: stable numeric ids, names, and the byte size of any shape in any dtype.
//!
//! Ids are part of the CMF file format and never change meaning. `mxfp4` is 21, as in the
//! original engine; the others are ours (the original's were not recorded) and are spaced so a
//! family of related formats can grow in place (the OCP MX family: mxfp4 21, mxfp8 22).

use crate::CodecError;

/// A storage dtype of a tensor.
///
/// Float dtypes hold any shape, element by element, little-endian. The quantised dtypes hold
/// matrices: the last two dimensions are `[rows, cols]` (rows = output features) and any
/// leading dimensions stack independent matrices back to back (a fused expert tensor
/// `[E, rows, cols]` is `E` matrices, each with its own sections).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16 (the upper half of a binary32).
    BF16,
    /// int8 codes with an f16 scale per row and an f16 scale per column.
    Q8_2f,
    /// 4-bit codes, groups of 32, a 5-bit log-spaced scale code per group, per-row (lo, step).
    Q4tp,
    /// 2-bit codes, groups of 32, a 5-bit scale code per group with a zero rung, per-row (lo, step).
    Q2tp,
    /// OCP MX FP4: E2M1 codes, groups of 32, an E8M0 scale per group.
    Mxfp4,
    /// OCP MX FP8 (E4M3): one E4M3 code byte per element, groups of 32, an E8M0 scale per
    /// group. DeepSeek-V4.1's Engram tables are stored this way, so they convert verbatim.
    Mxfp8,
}

/// Elements per quantisation group along a row, for q4tp, q2tp, mxfp4 and mxfp8.
pub const GROUP: usize = 32;

impl DType {
    /// Every dtype, in id order.
    pub const ALL: [DType; 8] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_2f,
        DType::Q4tp,
        DType::Q2tp,
        DType::Mxfp4,
        DType::Mxfp8,
    ];

    /// The stable numeric id stored in files.
    pub const fn id(self) -> u16 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::BF16 => 2,
            DType::Q8_2f => 8,
            DType::Q4tp => 12,
            DType::Q2tp => 13,
            DType::Mxfp4 => 21,
            DType::Mxfp8 => 22,
        }
    }

    /// The dtype with this id, if any.
    pub fn from_id(id: u16) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.id() == id)
    }

    /// The short lowercase name used on the command line and in docs.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::Q8_2f => "q8_2f",
            DType::Q4tp => "q4tp",
            DType::Q2tp => "q2tp",
            DType::Mxfp4 => "mxfp4",
            DType::Mxfp8 => "mxfp8",
        }
    }

    /// The dtype with this name, if any.
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
    }

    /// True for the quantised matrix formats (which need a 2-D or stacked shape).
    pub const fn is_quantized(self) -> bool {
        !matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// True for the dtypes the int8-activation kernels read (`ActPath::Int8`): q8_2f, q4tp,
    /// q2tp and mxfp4. The others (the float dtypes, and mxfp8, whose E4M3 codes are not small
    /// integers under one scale) take the f32 path whatever the activation path asks for.
    pub const fn has_int8_kernel(self) -> bool {
        matches!(
            self,
            DType::Q8_2f | DType::Q4tp | DType::Q2tp | DType::Mxfp4
        )
    }

    /// Bytes per element of a float dtype; `None` for quantised ones.
    pub const fn element_size(self) -> Option<usize> {
        match self {
            DType::F32 => Some(4),
            DType::F16 | DType::BF16 => Some(2),
            _ => None,
        }
    }

    /// The exact payload size of `shape` in this dtype, or why the shape does not fit.
    pub fn expected_nbytes(self, shape: &[usize]) -> Result<usize, CodecError> {
        let overflow = || CodecError::Overflow {
            dtype: self,
            shape: shape.to_vec(),
        };
        if let Some(size) = self.element_size() {
            return shape
                .iter()
                .try_fold(size, |acc, &d| acc.checked_mul(d))
                .ok_or_else(overflow);
        }
        let (batch, rows, cols) = split_matrix_shape(self, shape)?;
        let one = Layout::new(self, rows, cols)?.nbytes;
        one.checked_mul(batch).ok_or_else(overflow)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Splits a quantised tensor's shape into (stacked matrices, rows, cols).
pub fn split_matrix_shape(
    dtype: DType,
    shape: &[usize],
) -> Result<(usize, usize, usize), CodecError> {
    let err = |reason| CodecError::Shape {
        dtype,
        shape: shape.to_vec(),
        reason,
    };
    if shape.len() < 2 {
        return Err(err(
            "a quantised tensor needs at least two dimensions [rows, cols]",
        ));
    }
    let rows = shape[shape.len() - 2];
    let cols = shape[shape.len() - 1];
    let batch = shape[..shape.len() - 2]
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or(CodecError::Overflow {
            dtype,
            shape: shape.to_vec(),
        })?;
    Ok((batch, rows, cols))
}

/// Where each section of one quantised matrix lies in its payload, in bytes from the start.
///
/// The formulas are the ones `docs/codecs.md` states; every reader and kernel takes offsets
/// from here rather than recomputing them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// The dtype.
    pub dtype: DType,
    /// Matrix rows (output features).
    pub rows: usize,
    /// Matrix columns (input features).
    pub cols: usize,
    /// Bytes of the code plane (int8, nibble, 2-bit, E2M1 or E4M3 codes), which starts at offset 0.
    pub codes_len: usize,
    /// Offset of the second section: q8_2f row scales, q4tp/q2tp per-row (lo, step), mxfp4 and
    /// mxfp8 E8M0 scales.
    pub second: usize,
    /// Offset of the third section: q8_2f column scales, q4tp/q2tp 5-bit scale codes; `nbytes`
    /// for mxfp4 and mxfp8.
    pub third: usize,
    /// Bytes of packed 5-bit scale codes per row (q4tp/q2tp); 0 otherwise.
    pub code_stride: usize,
    /// Total payload bytes.
    pub nbytes: usize,
}

impl Layout {
    /// The layout of one `[rows, cols]` matrix of a quantised dtype.
    pub fn new(dtype: DType, rows: usize, cols: usize) -> Result<Layout, CodecError> {
        let shape_err = |reason| CodecError::Shape {
            dtype,
            shape: vec![rows, cols],
            reason,
        };
        let overflow = || CodecError::Overflow {
            dtype,
            shape: vec![rows, cols],
        };
        if rows == 0 || cols == 0 {
            return Err(shape_err("a matrix needs at least one row and one column"));
        }
        let n = rows.checked_mul(cols).ok_or_else(overflow)?;
        let (codes_len, second, third, code_stride, nbytes) = match dtype {
            DType::F32 | DType::F16 | DType::BF16 => {
                let size = dtype.element_size().unwrap_or(4);
                let total = n.checked_mul(size).ok_or_else(overflow)?;
                (total, total, total, 0, total)
            }
            DType::Q8_2f => {
                let rs = n;
                let cs = rs.checked_add(2 * rows).ok_or_else(overflow)?;
                let total = cs.checked_add(cols.checked_mul(2).ok_or_else(overflow)?);
                (n, rs, cs, 0, total.ok_or_else(overflow)?)
            }
            DType::Q4tp | DType::Q2tp => {
                if !cols.is_multiple_of(GROUP) {
                    return Err(shape_err("cols must be a multiple of 32"));
                }
                let codes = if dtype == DType::Q4tp { n / 2 } else { n / 4 };
                let gpr = cols / GROUP;
                let cst = (gpr * 5).div_ceil(8);
                let third = codes.checked_add(rows.checked_mul(4).ok_or_else(overflow)?);
                let third = third.ok_or_else(overflow)?;
                let total = third.checked_add(rows.checked_mul(cst).ok_or_else(overflow)?);
                (codes, codes, third, cst, total.ok_or_else(overflow)?)
            }
            DType::Mxfp4 => {
                if !cols.is_multiple_of(GROUP) {
                    return Err(shape_err("cols must be a multiple of 32"));
                }
                let codes = n / 2;
                let total = codes + n / GROUP;
                (codes, codes, total, 0, total)
            }
            DType::Mxfp8 => {
                if !cols.is_multiple_of(GROUP) {
                    return Err(shape_err("cols must be a multiple of 32"));
                }
                // n / 32 <= n, so only the sum can overflow.
                let total = n.checked_add(n / GROUP).ok_or_else(overflow)?;
                (n, n, total, 0, total)
            }
        };
        Ok(Layout {
            dtype,
            rows,
            cols,
            codes_len,
            second,
            third,
            code_stride,
            nbytes,
        })
    }

    /// Groups of 32 per row (quantised group formats).
    pub const fn groups_per_row(&self) -> usize {
        self.cols / GROUP
    }

    /// Checks that `bytes` is exactly one payload of this layout.
    pub fn check_len(&self, bytes: &[u8]) -> Result<(), CodecError> {
        if bytes.len() != self.nbytes {
            return Err(CodecError::PayloadLength {
                dtype: self.dtype,
                rows: self.rows,
                cols: self.cols,
                expected: self.nbytes,
                found: bytes.len(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_and_unique() {
        assert_eq!(
            DType::Mxfp4.id(),
            21,
            "mxfp4 keeps the original engine's id"
        );
        for d in DType::ALL {
            assert_eq!(DType::from_id(d.id()), Some(d));
            assert_eq!(DType::from_name(d.name()), Some(d));
        }
        assert_eq!(DType::Mxfp8.id(), 22, "mxfp8 sits next to mxfp4");
        assert_eq!(DType::from_id(3), None);
    }

    #[test]
    fn sizes_follow_the_documented_formulas() {
        // docs/codecs.md, section "Sizes".
        let (r, c) = (2304usize, 5120usize);
        assert_eq!(
            DType::Mxfp4.expected_nbytes(&[r, c]).unwrap(),
            r * c * 17 / 32
        );
        assert_eq!(
            DType::Mxfp8.expected_nbytes(&[r, c]).unwrap(),
            r * c * 33 / 32
        );
        assert_eq!(
            DType::Q8_2f.expected_nbytes(&[r, c]).unwrap(),
            r * c + 2 * r + 2 * c
        );
        let cst = (c / 32 * 5).div_ceil(8);
        assert_eq!(
            DType::Q4tp.expected_nbytes(&[r, c]).unwrap(),
            r * c / 2 + 4 * r + r * cst
        );
        assert_eq!(
            DType::Q2tp.expected_nbytes(&[r, c]).unwrap(),
            r * c / 4 + 4 * r + r * cst
        );
        assert_eq!(DType::BF16.expected_nbytes(&[3, 5, 7]).unwrap(), 210);
        assert_eq!(DType::F32.expected_nbytes(&[]).unwrap(), 4);
        assert_eq!(
            DType::Q4tp.expected_nbytes(&[8, 640, 96]).unwrap(),
            8 * DType::Q4tp.expected_nbytes(&[640, 96]).unwrap()
        );
    }

    #[test]
    fn q4tp_sizes_are_whole_words_when_rows_are_a_multiple_of_4() {
        // The original engine's test: every section is a whole number of u32 words then.
        for cols in [32, 64, 96, 160, 2560] {
            for rows in [4, 8, 640] {
                let l = Layout::new(DType::Q4tp, rows, cols).unwrap();
                assert_eq!(l.nbytes % 4, 0, "{rows}x{cols}");
                assert_eq!(l.third % 4, 0);
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        assert!(matches!(
            DType::Mxfp4.expected_nbytes(&[4, 33]),
            Err(CodecError::Shape { .. })
        ));
        assert!(matches!(
            DType::Mxfp8.expected_nbytes(&[4, 48]),
            Err(CodecError::Shape { .. })
        ));
        assert!(matches!(
            DType::Mxfp8.expected_nbytes(&[usize::MAX / 32, 32]),
            Err(CodecError::Overflow { .. })
        ));
        assert!(matches!(
            DType::Q8_2f.expected_nbytes(&[7]),
            Err(CodecError::Shape { .. })
        ));
        assert!(matches!(
            DType::Mxfp4.expected_nbytes(&[1 << 40, 1 << 40, 0]),
            Err(CodecError::Shape { .. })
        ));
        assert_eq!(DType::F32.expected_nbytes(&[3, 0]).unwrap(), 0);
        assert!(matches!(
            DType::F32.expected_nbytes(&[usize::MAX, 2]),
            Err(CodecError::Overflow { .. })
        ));
        assert!(matches!(
            DType::Q4tp.expected_nbytes(&[usize::MAX / 2, 64]),
            Err(CodecError::Overflow { .. })
        ));
    }
}
