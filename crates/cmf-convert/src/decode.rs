//! Source dtypes to f32: IEEE floats, DeepSeek's FP8 e4m3 with 128x128 block scales, and the
//! FP4 e2m1 experts (two per byte, a scale per 32 inputs), plus exact integer tensors.

use quant_codecs::float::{bf16_bits_to_f32, f16_bits_to_f32};
use quant_codecs::mxfp4::{e2m1, e8m0};
use safetensors::Dtype;

use super::ConvertError;
use super::source::SourceTensor;

/// Side of DeepSeek's FP8 scale blocks (`weight_block_size` [128, 128]).
pub const FP8_BLOCK: usize = 128;
/// Inputs per FP4 scale.
pub const FP4_GROUP: usize = 32;

/// OCP FP8 E4M3 (the "fn" variant: no infinities, S.1111.111 is NaN).
pub fn e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0xf) as i32;
    let m = (b & 7) as f32;
    if e == 15 && b & 7 == 7 {
        return f32::NAN;
    }
    if e == 0 {
        sign * m / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

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

/// FP8 e4m3 `[rows, cols]` times its block scale grid `[ceil(rows/128), ceil(cols/128)]`
/// (E8M0 or F32) to f32.
pub fn fp8_f32(w: &SourceTensor<'_>, s: &SourceTensor<'_>) -> Result<Vec<f32>, ConvertError> {
    let [rows, cols] = matrix(w)?;
    let grid = [rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK)];
    expect_shape(s, &grid)?;
    let scales = scale_values(s)?;
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let srow = &scales[(r / FP8_BLOCK) * grid[1]..][..grid[1]];
        let wrow = &w.bytes[r * cols..][..cols];
        out.extend(
            wrow.iter()
                .enumerate()
                .map(|(i, &b)| e4m3(b) * srow[i / FP8_BLOCK]),
        );
    }
    Ok(out)
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
