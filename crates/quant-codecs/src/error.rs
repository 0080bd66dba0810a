//! The one error type of this crate: what was wrong, with the numbers that show it.

use crate::DType;

/// Everything a codec entry point can refuse. Each variant carries the dtype and the sizes
/// involved, so a caller (the CMF reader, a model loader) can name the tensor and print both.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The shape cannot be stored in this dtype (wrong rank, a dimension not a multiple of the group).
    #[error("{dtype} cannot hold shape {shape:?}: {reason}")]
    Shape {
        /// The dtype asked for.
        dtype: DType,
        /// The shape offered.
        shape: Vec<usize>,
        /// Why it does not fit.
        reason: &'static str,
    },
    /// A payload buffer whose length is not `expected_nbytes` of its dtype and shape.
    #[error("{dtype} payload for [{rows}, {cols}] must be {expected} bytes, found {found}")]
    PayloadLength {
        /// The payload's dtype.
        dtype: DType,
        /// Matrix rows.
        rows: usize,
        /// Matrix columns.
        cols: usize,
        /// `expected_nbytes(dtype, [rows, cols])`.
        expected: usize,
        /// The buffer's length.
        found: usize,
    },
    /// An f32 buffer (weights, activations, outputs) of the wrong length.
    #[error("{what} must hold {expected} f32 values, found {found}")]
    BufferLength {
        /// Which buffer: "weights", "x", "y", "out".
        what: &'static str,
        /// Required length.
        expected: usize,
        /// Actual length.
        found: usize,
    },
    /// A NaN or infinity among the weights handed to `quantize`.
    #[error("cannot quantize to {dtype}: weight at row {row}, column {col} is {value}")]
    NonFinite {
        /// Target dtype.
        dtype: DType,
        /// Row of the offending weight.
        row: usize,
        /// Column of the offending weight.
        col: usize,
        /// The value itself.
        value: f32,
    },
    /// `matmat` was asked for more token rows than the kernels batch.
    #[error("matmat takes 1..={max} activation rows, got {found}")]
    TooManyRows {
        /// The most rows one call handles.
        max: usize,
        /// Rows requested.
        found: usize,
    },
    /// A size computation overflowed `usize`.
    #[error("{dtype} size of shape {shape:?} overflows")]
    Overflow {
        /// The dtype.
        dtype: DType,
        /// The shape.
        shape: Vec<usize>,
    },
}
