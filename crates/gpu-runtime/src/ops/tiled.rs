//! Long frames through the tiled matmat (kernels-wgsl's [`Tiled`]): what a prompt's frames of
//! 32-256 rows run for f16 matrices (the hyper-connection and router matrices of the 4- and
//! 2-bit profiles) and q8_2f matrices on int8 activations (the attention and GDN projections),
//! whose weights the 8-row kernel would decode once per 8 rows and whose activations it would
//! read once per row group. A frame whose tiles do not fill the device splits its columns; the
//! splits' partial sums go to one scratch buffer the device shares, and a second dispatch adds
//! them in split order and applies the epilogue.
//!
//! A row's sums are added in another order than the 8-row kernel's, so a long frame's values
//! differ from a frame of 8's in the last bits (within the same f64 bound, tested);
//! `CORTIQ_MATMAT=plain` keeps the 8-row kernel for every frame.
//!
//! The two-matrix epilogues (the GDN b/a pair, the shared expert's gate/up) and the grouped
//! experts keep their kernels.

use std::sync::Arc;

use kernels_wgsl::{Codec, Epilogue, Path, TILE_COLS, TILE_ROWS, TILE_TOKENS, Tiled};

use crate::arena::GpuMatrix;
use crate::ops::matvec::{Aux, Step, entry, matvec_layout, params_buffer, slice_entry};
use crate::{GpuContext, GpuError};

/// Fewest token rows of a frame that runs tiled (a frame of 32 fills half a tile; shorter
/// frames keep the 8-row kernel).
pub const MIN_ROWS: usize = 32;

/// Lanes a frame's tiles should reach before its columns are split: two workgroups of 256
/// per multiprocessor of an H100 or H200 (132); the wide variant's 64-lane workgroups split
/// until there are four times as many.
const TARGET_LANES: usize = 264 * 256;

/// Fewest column steps of one split.
const MIN_SPLIT_STEPS: usize = 4;

/// The layout: 0 and 1 the weights, 2 the parameters, 3 x (`int8`: the codes), 4 y; 5 the
/// codes' block scales and sums (`int8`); 6 the partial sums (`split`); 7 the
/// hyper-connection epilogues' buffer (`aux`).
pub(crate) fn layout(
    ctx: &GpuContext,
    int8: bool,
    aux: bool,
    split: bool,
) -> (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
    let split = split.then_some((6, false));
    let aux = aux.then_some((7, false));
    let extra: Vec<(u32, bool)> = split.into_iter().chain(aux).collect();
    matvec_layout(ctx, "tiled", int8, &extra)
}

/// Whether a frame of `nt` token rows of `m` (`codec`, activation path `path` as it will run)
/// under `epilogue` runs tiled. `streams`: the hyper-connection epilogues' H.
pub fn applies(
    ctx: &GpuContext,
    m: &GpuMatrix,
    codec: Codec,
    path: Path,
    nt: usize,
    epilogue: Epilogue,
    streams: Option<usize>,
) -> bool {
    let max_dim = ctx.limits.max_compute_workgroups_per_dimension as usize;
    let kernel = matches!(
        (codec, path),
        (Codec::F16, Path::F32 | Path::HwF16) | (Codec::Q8_2f, Path::Int8)
    );
    ctx.tiled_matmat
        && kernel
        && nt >= MIN_ROWS
        && nt.div_ceil(TILE_TOKENS as usize) <= max_dim
        && m.cols.is_multiple_of(TILE_COLS as usize)
        && Tiled::supports(epilogue)
        && (epilogue != Epilogue::HcReadout || streams == Some(4))
        && m.parts
            .iter()
            .all(|p| p.rows.div_ceil(TILE_ROWS as usize) <= max_dim)
}

/// How a grid of `tiles` workgroups of `lanes` lanes over `cols` columns splits them:
/// (splits, column steps per split). Splits only until the grid reaches `TARGET_LANES` (264
/// workgroups of 256), each at least `MIN_SPLIT_STEPS` (4) steps.
pub fn splits(tiles: usize, lanes: usize, cols: usize) -> (usize, usize) {
    let total = (cols / TILE_COLS as usize).max(1);
    let want = (TARGET_LANES / lanes.max(1))
        .div_ceil(tiles.max(1))
        .min(total / MIN_SPLIT_STEPS)
        .max(1);
    let steps = total.div_ceil(want);
    (total.div_ceil(steps), steps)
}

/// The partial-sum buffer of at least `bytes`, shared by every split dispatch of the device.
fn scratch(ctx: &GpuContext, bytes: u64) -> Arc<wgpu::Buffer> {
    let mut s = ctx.tiled_scratch.lock();
    if let Some(b) = s.as_ref().filter(|b| b.size() >= bytes) {
        return b.clone();
    }
    // A larger buffer replaces the smaller; bind groups keep the old one alive.
    let b = Arc::new(ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("tiled partial sums"),
        size: bytes.next_multiple_of(1 << 20),
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    }));
    *s = Some(b.clone());
    b
}

/// A tiled matmat's buffers besides the weights.
pub(crate) struct Operands<'a> {
    /// The f32 activations (the f16 kernels read them).
    pub x: &'a wgpu::Buffer,
    /// The int8 path's quantised activations.
    pub acts: Option<&'a crate::ops::act8::ActBuffers>,
    pub y: &'a wgpu::Buffer,
    pub aux: Option<Aux<'a>>,
}

/// The steps of `y = W x` for a frame [`applies`] accepted (shapes and buffers already
/// checked, and on the int8 path the activations' quantiser prepared, by the caller): per part
/// of `m`, the tiled matmat, and where its columns split, the reduction. `y_rows`: y's row
/// length.
pub(crate) fn prepare(
    ctx: &GpuContext,
    m: &GpuMatrix,
    ops: Operands<'_>,
    nt: usize,
    path: Path,
    epilogue: Epilogue,
    y_rows: usize,
) -> Result<Vec<Step>, GpuError> {
    let Operands { x, acts, y, aux } = ops;
    let int8 = path == Path::Int8;
    if int8 != acts.is_some() {
        return Err(GpuError::BadLength {
            what: "quantised activations of the tiled int8 matmat",
            expected: usize::from(int8),
            found: usize::from(acts.is_some()),
        });
    }
    let max_dim = ctx.limits.max_compute_workgroups_per_dimension as usize;
    let token_tiles = nt.div_ceil(TILE_TOKENS as usize);
    let total = m.cols / TILE_COLS as usize;
    let mut steps = Vec::new();
    for part in &m.parts {
        let row_tiles = part.rows.div_ceil(TILE_ROWS as usize);
        let groups = part.rows.div_ceil(4);
        let reduce_wgs = (nt * groups).div_ceil(Tiled::WG as usize);
        let mut k = Tiled {
            path,
            epilogue,
            split: false,
            wide: ctx.wide_tiles,
        };
        let (mut n_splits, mut per) = splits(row_tiles * token_tiles, k.lanes() as usize, m.cols);
        let bytes = (n_splits * nt * groups * 16) as u64;
        // Several parts would share the scratch buffer between their two steps: one split.
        if m.parts.len() > 1 || reduce_wgs > max_dim || bytes > ctx.max_binding() {
            (n_splits, per) = (1, total);
        }
        let split = n_splits > 1;
        k.split = split;
        let (bgl, pl) = ctx.tiled_layout(int8, aux.is_some(), split);
        let pipe = |entry_point: &str| {
            ctx.pipelines.get(
                &ctx.device,
                &k.name(),
                &|| k.source(),
                entry_point,
                &[],
                Some(pl),
            )
        };
        let (half, a) = match aux {
            Some(a) => ((part.rows - a.streams) as u32, (a.streams as f32).to_bits()),
            None => (0, 0),
        };
        let params: [u32; 12] = [
            part.rows as u32,
            m.cols as u32,
            part.row_start as u32,
            y_rows as u32,
            nt as u32,
            per as u32,
            half,
            a,
            groups as u32,
            n_splits as u32,
            part.layout.second as u32,
            0,
        ];
        let ubuf = params_buffer(ctx, "tiled params", &params);
        let part_buf = split.then(|| scratch(ctx, bytes));
        let mut entries = vec![
            entry(0, &part.buffer),
            entry(1, &part.buffer),
            entry(2, &ubuf),
            match acts {
                Some(a) => slice_entry(3, &a.xq, a.xq_offset, a.xq_bytes()),
                None => entry(3, x),
            },
            entry(4, y),
        ];
        if let Some(a) = acts {
            entries.push(slice_entry(5, &a.xd, a.xd_offset, a.xd_bytes()));
        }
        if let Some(b) = &part_buf {
            entries.push(entry(6, b));
        }
        if let Some(a) = aux {
            entries.push(entry(7, a.buffer));
        }
        let bg = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("tiled"),
            layout: bgl,
            entries: &entries,
        });
        let label = format!(
            "tiled {:?} {}x{} T{nt} {path:?} {epilogue:?} s{n_splits}",
            k.codec(),
            part.rows,
            m.cols
        );
        steps.push(
            Step::new(
                pipe(Tiled::ENTRY)?,
                vec![(bg.clone(), row_tiles as u32, token_tiles as u32)],
                label.clone(),
            )
            .with_tiles(n_splits as u32),
        );
        if split {
            steps.push(Step::new(
                pipe(Tiled::REDUCE_ENTRY)?,
                vec![(bg, reduce_wgs as u32, 1)],
                format!("{label} reduce"),
            ));
        }
    }
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_split_only_until_the_grid_fills() {
        // The HC read-out at 256 rows: 160 x 4 tiles, no split.
        assert_eq!(splits(640, 256, 320), (1, 10));
        // The HC front (324 x 10240) at 256 rows: 6 x 4 tiles, 11 splits of 30 steps; in
        // 64-lane workgroups 40 splits of 8.
        assert_eq!(splits(24, 256, 10240), (11, 30));
        assert_eq!(splits(24, 64, 10240), (40, 8));
        // Too few steps to split.
        assert_eq!(splits(1, 256, 64), (1, 2));
        // Every split at least MIN_SPLIT_STEPS steps, the steps all covered.
        for tiles in 1..300 {
            for cols in (32..4096).step_by(32 * 7) {
                let (s, per) = splits(tiles, 256, cols);
                let total = cols / 32;
                assert!(s * per >= total && (s - 1) * per < total, "{tiles} {cols}");
                assert!(s == 1 || per >= MIN_SPLIT_STEPS, "{tiles} {cols}");
            }
        }
    }
}
