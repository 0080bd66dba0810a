//! Random weights made in memory, for benchmarks at a released geometry without a file: the
//! payload of one `[rows, cols]` matrix quantised from noise at the scale a trained layer has
//! (`1/sqrt(cols)`, so activations neither vanish nor blow up over dozens of layers).
//!
//! Each model crate's `synthetic` module names its tensors and decides which share a payload;
//! this one makes the bytes.

use quant_codecs::{CodecError, DType, Layout, quantize};

/// xorshift noise in `[-a, a]`, deterministic in `seed`.
pub fn noise(n: usize, seed: u64, a: f32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * a
        })
        .collect()
}

/// A `[rows, cols]` payload of `dtype` quantised from noise of amplitude `1/sqrt(cols)`, each
/// row `x` scaled by `row_scale(x)`. A tall matrix (a vocabulary) is a block of 256 rows
/// quantised once and tiled: every section of these formats is per row but q8_2f's column
/// scales, which are per matrix and stay as they are (quantising 129,280 x 4,096 values
/// would take longer than the benchmark).
pub fn payload(
    dtype: DType,
    rows: usize,
    cols: usize,
    seed: u64,
    row_scale: &dyn Fn(usize) -> f32,
) -> Result<Vec<u8>, CodecError> {
    let block = if rows > 8192 && rows.is_multiple_of(256) {
        256
    } else {
        rows
    };
    let mut vals = noise(block * cols, seed, 1.0 / (cols as f32).sqrt());
    for (x, row) in vals.chunks_mut(cols).enumerate() {
        let f = row_scale(x);
        if f != 1.0 {
            row.iter_mut().for_each(|v| *v *= f);
        }
    }
    let small = quantize(dtype, block, cols, &vals)?;
    if block == rows {
        Ok(small)
    } else {
        tile_rows(dtype, block, rows, cols, &small)
    }
}

/// The payload of a `[rows, cols]` matrix whose rows repeat the `block` rows of `small`.
fn tile_rows(
    dtype: DType,
    block: usize,
    rows: usize,
    cols: usize,
    small: &[u8],
) -> Result<Vec<u8>, CodecError> {
    let (ls, lb) = (
        Layout::new(dtype, block, cols)?,
        Layout::new(dtype, rows, cols)?,
    );
    let sections = |l: &Layout| [(0, l.second), (l.second, l.third), (l.third, l.nbytes)];
    let mut out = Vec::with_capacity(lb.nbytes);
    for ((s0, s1), (b0, b1)) in sections(&ls).into_iter().zip(sections(&lb)) {
        let part = &small[s0..s1];
        let want = b1 - b0;
        if want == part.len() {
            out.extend_from_slice(part);
        } else {
            while out.len() < b0 + want {
                out.extend_from_slice(part);
            }
            out.truncate(b0 + want);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tiled_payload_decodes_to_its_block_repeated() {
        // Every row of the tall payload equals the row of the block it repeats (f64 witness:
        // the block quantised alone).
        for dtype in [DType::Q4tp, DType::Mxfp4, DType::F16] {
            let (rows, cols) = (256 * 33, 64);
            let tall = payload(dtype, rows, cols, 9, &|_| 1.0).unwrap();
            let small = payload(dtype, 256, cols, 9, &|_| 1.0).unwrap();
            let t = quant_codecs::MatRef::new(dtype, rows, cols, &tall).unwrap();
            let s = quant_codecs::MatRef::new(dtype, 256, cols, &small).unwrap();
            let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
            for r in [0, 255, 256, 257, rows - 1] {
                t.dequantize_row(r, &mut a).unwrap();
                s.dequantize_row(r % 256, &mut b).unwrap();
                assert_eq!(a, b, "{dtype:?} row {r}");
            }
        }
    }
}
