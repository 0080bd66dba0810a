//! Source dtypes to f32: IEEE floats, DeepSeek's FP8 e4m3 with block scales (a
//! `weight_block_size` grid: 128x128 in V4, 32x32 in V4.1), FP8 rows with a scale per 32
//! inputs (V4.1's Engram tables, which are mxfp8 as stored), and the FP4 e2m1 experts (two per
//! byte, a scale per 32 inputs), plus exact integer tensors.

use quant_codecs::float::{bf16_bits_to_f32, f16_bits_to_f32};
use quant_codecs::mxfp4::{e2m1, e8m0};
use safetensors::Dtype;

use super::ConvertError;
use super::source::SourceTensor;

/// OCP FP8 E4M3 (the "fn" variant: no infinities, S.1111.111 is NaN): quant-codecs' decoder,
/// the one the CMF mxfp8 dtype uses, so the converter and the engine read FP8 alike.
pub use quant_codecs::mxfp8::e4m3;

/// Inputs per FP4 scale.
pub const FP4_GROUP: usize = 32;
/// Inputs per scale of an FP8 row-scaled table (mxfp8's group).
pub const MX8_GROUP: usize = quant_codecs::GROUP;

/// True for the dtypes [`plain_f32`] reads.
pub fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::F32 | Dtype::F16 | Dtype::BF16)
}

/// True for the integer dtypes [`integer_f32`] reads.
pub fn is_integer(d: Dtype) -> bool {
    matches!(
        d,
        Dtype::I64 | Dtype::I32 | Dtype::I16 | Dtype::U8 | Dtype::U16 | Dtype::U32
    )
}

/// A float tensor to f32 (exact for f32/f16/bf16).
pub fn plain_f32(t: &SourceTensor<'_>) -> Result<Vec<f32>, ConvertError> {
    let b = t.bytes;
    Ok(match t.dtype {
        Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| f16_bits_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        Dtype::BF16 => b
            .chunks_exact(2)
            .map(|c| bf16_bits_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        other => return Err(unsupported(t, other)),
    })
}

/// Largest integer magnitude f32 holds exactly, with every integer below it.
pub const F32_EXACT: i64 = 1 << 24;

/// An integer tensor's values.
pub fn integer_i64(t: &SourceTensor<'_>) -> Result<Vec<i64>, ConvertError> {
    let b = t.bytes;
    Ok(match t.dtype {
        Dtype::I64 => b
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect(),
        Dtype::I32 => b
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
            .collect(),
        Dtype::U32 => b
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
            .collect(),
        Dtype::I16 => b
            .chunks_exact(2)
            .map(|c| i16::from_le_bytes([c[0], c[1]]) as i64)
            .collect(),
        Dtype::U16 => b
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]) as i64)
            .collect(),
        Dtype::U8 => b.iter().map(|&x| x as i64).collect(),
        other => return Err(unsupported(t, other)),
    })
}

/// An integer tensor to f32, refusing any value that f32 does not hold exactly (|v| > 2^24).
pub fn integer_f32(t: &SourceTensor<'_>) -> Result<Vec<f32>, ConvertError> {
    let v = integer_i64(t)?;
    if let Some(bad) = v.iter().find(|x| x.abs() > F32_EXACT) {
        return Err(ConvertError::IntegerNotExact {
            path: t.file.to_path_buf(),
            tensor: t.name.to_string(),
            value: *bad,
        });
    }
    Ok(v.into_iter().map(|x| x as f32).collect())
}

/// Checks an FP8 e4m3 `[rows, cols]` weight against its block scale grid, which must be
/// `[ceil(rows/bm), ceil(cols/bn)]` for `block = [bm, bn]` (`weight_block_size`), E8M0 or a
/// float dtype. Returns the weight's shape.
pub fn fp8_grid(
    w: &SourceTensor<'_>,
    s: &SourceTensor<'_>,
    block: [usize; 2],
) -> Result<[usize; 2], ConvertError> {
    let [rows, cols] = matrix(w)?;
    if !matches!(s.dtype, Dtype::F8_E8M0) && !is_float(s.dtype) {
        return Err(unsupported(s, s.dtype));
    }
    if s.shape != fp8_grid_shape([rows, cols], block) {
        return Err(ConvertError::ScaleGrid {
            path: w.file.to_path_buf(),
            tensor: w.name.to_string(),
            weight: [rows, cols],
            block,
            found: s.shape.to_vec(),
        });
    }
    Ok([rows, cols])
}

/// The scale grid of a `[rows, cols]` FP8 weight in blocks of `block`: partial blocks at the
/// edges get a scale of their own.
pub fn fp8_grid_shape([rows, cols]: [usize; 2], block: [usize; 2]) -> [usize; 2] {
    [rows.div_ceil(block[0]), cols.div_ceil(block[1])]
}

/// FP8 e4m3 `[rows, cols]` times its block scale grid (see [`fp8_grid`]) to f32.
pub fn fp8_f32(
    w: &SourceTensor<'_>,
    s: &SourceTensor<'_>,
    block: [usize; 2],
) -> Result<Vec<f32>, ConvertError> {
    let [rows, cols] = fp8_grid(w, s, block)?;
    let gcols = cols.div_ceil(block[1]);
    let scales = scale_values(s)?;
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let srow = &scales[(r / block[0]) * gcols..][..gcols];
        let wrow = &w.bytes[r * cols..][..cols];
        out.extend(
            wrow.iter()
                .enumerate()
                .map(|(i, &b)| e4m3(b) * srow[i / block[1]]),
        );
    }
    Ok(out)
}

/// An FP8 table with a scale per 32 inputs of a row (DeepSeek-V4.1's Engram tables): E4M3
/// `[rows, cols]` and E8M0 `[rows, cols/32]`, which is exactly an mxfp8 payload's two planes.
/// Returns `[rows, cols]`.
pub fn mx8_shape(w: &SourceTensor<'_>, s: &SourceTensor<'_>) -> Result<[usize; 2], ConvertError> {
    if w.dtype != Dtype::F8_E4M3 {
        return Err(unsupported(w, w.dtype));
    }
    let [rows, cols] = matrix(w)?;
    if s.dtype != Dtype::F8_E8M0 {
        return Err(ConvertError::UnsupportedDtype {
            path: s.file.to_path_buf(),
            tensor: s.name.to_string(),
            dtype: format!(
                "{:?} (the scales of an FP8 row table must be F8_E8M0, one per {MX8_GROUP} inputs)",
                s.dtype
            ),
        });
    }
    if cols == 0 || !cols.is_multiple_of(MX8_GROUP) {
        return Err(ConvertError::Shape {
            path: w.file.to_path_buf(),
            tensor: w.name.to_string(),
            expected: format!("FP8 rows of a multiple of {MX8_GROUP} values"),
            found: w.shape.to_vec(),
        });
    }
    expect_shape(s, &[rows, cols / MX8_GROUP])?;
    Ok([rows, cols])
}

/// An FP8 row table (see [`mx8_shape`]) to f32: `e4m3(code) * e8m0(scale)`, as mxfp8 decodes.
pub fn mx8_f32(w: &SourceTensor<'_>, s: &SourceTensor<'_>) -> Result<Vec<f32>, ConvertError> {
    let [_, cols] = mx8_shape(w, s)?;
    let gpr = cols / MX8_GROUP;
    Ok(w.bytes
        .iter()
        .enumerate()
        .map(|(i, &b)| e4m3(b) * e8m0(s.bytes[(i / cols) * gpr + (i % cols) / MX8_GROUP]))
        .collect())
}

/// FP4 experts: `I8 [rows, cols/2]` (low nibble = even input) and E8M0 `[rows, cols/32]`.
/// Returns the logical `[rows, cols]`.
pub fn fp4_shape(w: &SourceTensor<'_>, s: &SourceTensor<'_>) -> Result<[usize; 2], ConvertError> {
    let [rows, half] = matrix(w)?;
    let cols = half * 2;
    if s.dtype != Dtype::F8_E8M0 {
        return Err(unsupported(s, s.dtype));
    }
    if !cols.is_multiple_of(FP4_GROUP) {
        return Err(ConvertError::Shape {
            path: w.file.to_path_buf(),
            tensor: w.name.to_string(),
            expected: format!("packed FP4 with a multiple of {FP4_GROUP} inputs per row"),
            found: w.shape.to_vec(),
        });
    }
    expect_shape(s, &[rows, cols / FP4_GROUP])?;
    Ok([rows, cols])
}

/// FP4 experts to f32.
pub fn fp4_f32(w: &SourceTensor<'_>, s: &SourceTensor<'_>) -> Result<Vec<f32>, ConvertError> {
    let [_, cols] = fp4_shape(w, s)?;
    let gpr = cols / FP4_GROUP;
    let mut out = Vec::with_capacity(w.bytes.len() * 2);
    for (i, &b) in w.bytes.iter().enumerate() {
        let e = 2 * i;
        let (r, c) = (e / cols, e % cols);
        let scale = e8m0(s.bytes[r * gpr + c / FP4_GROUP]);
        out.push(e2m1(b & 0xf) * scale);
        out.push(e2m1(b >> 4) * scale);
    }
    Ok(out)
}

fn scale_values(s: &SourceTensor<'_>) -> Result<Vec<f32>, ConvertError> {
    match s.dtype {
        Dtype::F8_E8M0 => Ok(s.bytes.iter().map(|&k| e8m0(k)).collect()),
        Dtype::F32 | Dtype::BF16 | Dtype::F16 => plain_f32(s),
        other => Err(unsupported(s, other)),
    }
}

fn matrix(t: &SourceTensor<'_>) -> Result<[usize; 2], ConvertError> {
    match t.shape {
        &[r, c] => Ok([r, c]),
        _ => Err(ConvertError::Shape {
            path: t.file.to_path_buf(),
            tensor: t.name.to_string(),
            expected: "a 2-D matrix".into(),
            found: t.shape.to_vec(),
        }),
    }
}

fn expect_shape(t: &SourceTensor<'_>, shape: &[usize]) -> Result<(), ConvertError> {
    if t.shape != shape {
        return Err(ConvertError::Shape {
            path: t.file.to_path_buf(),
            tensor: t.name.to_string(),
            expected: format!("{shape:?}"),
            found: t.shape.to_vec(),
        });
    }
    Ok(())
}

fn unsupported(t: &SourceTensor<'_>, d: Dtype) -> ConvertError {
    ConvertError::UnsupportedDtype {
        path: t.file.to_path_buf(),
        tensor: t.name.to_string(),
        dtype: format!("{d:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::e4m3;

    #[test]
    fn e4m3_known_values() {
        assert_eq!(e4m3(0x00), 0.0);
        assert_eq!(e4m3(0x38), 1.0); // e=7, m=0
        assert_eq!(e4m3(0x7e), 448.0); // largest finite
        assert_eq!(e4m3(0xfe), -448.0);
        assert_eq!(e4m3(0x01), 2f32.powi(-9)); // smallest subnormal
        assert!(e4m3(0x7f).is_nan());
    }
}
