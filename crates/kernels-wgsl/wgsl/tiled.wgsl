// The tiled matmat for long frames (a prompt's 32-256 token rows): a workgroup of 256 lanes
// computes a tile of TM token rows x TN matrix rows, walking the columns TK at a time with both
// operands staged in workgroup memory, so a weight chunk is read and decoded once per TM token
// rows (the 8-row kernel decodes it once per 8 rows, and reads every activation once per row
// group: at 256 rows the HC matrices ran at ~5 TFLOP/s on an H100, bound by the activations'
// traffic). Each lane keeps 4 token rows x 4 consecutive matrix rows (a read-out column's 4
// streams) in four vec4 accumulators.
//
// This file: what every variant shares. Assembled (kernels-wgsl's `Tiled`) as decode.wgsl +
// common.wgsl + [f16: the codec's chunk decoder] + this file + [int8: tiled_i8_common.wgsl] +
// the kernel (tiled_f16.wgsl, tiled_i8.wgsl, or their 8x8-a-lane forms) + the epilogue's
// `emit4` + `finish`. A frame whose tiles are too few to fill the device
// splits its columns over the grid's z: each split writes its sums to `part` and
// `tiled_reduce` adds the splits in order and applies the epilogue.

struct Params {
    // Rows of this part of the matrix, and its columns (a multiple of TK).
    rows: u32,
    cols: u32,
    // Where this part's rows start in y, and y's length per token row.
    row_offset: u32,
    y_stride: u32,
    // Token rows of the frame.
    nt: u32,
    // TK-column steps per split.
    steps: u32,
    // The hyper-connection front: its low-rank rows (the injection rows follow).
    half: u32,
    // The front's divisor (f32 bits of H).
    a: u32,
    // Groups of 4 rows (ceil(rows / 4)): the row stride of `part`.
    groups: u32,
    // Splits of the columns (the grid's z).
    splits: u32,
    // q8_2f: the byte offset of the rows' f16 scales in the payload.
    second: u32,
    pad: u32,
}

@group(0) @binding(2) var<uniform> P: Params;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

const TM: u32 = 64u;
const TN: u32 = 64u;
const TK: u32 = 32u;

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

// A lane's sums of token row t, rows r0 .. r0 + 3; past the frame's or the matrix's end
// dropped (rows r0 + 1 .. past the end: by the epilogue).
fn finish_one(z: u32, t: u32, r0: u32, v: vec4<f32>) {
    if (r0 < P.rows && t < P.nt) {
        finish(z, t, r0, v);
    }
}

// A lane's sums: token rows t .. t + 3 (a0 .. a3) of matrix rows r0 .. r0 + 3.
fn finish4(z: u32, t: u32, r0: u32, a0: vec4<f32>, a1: vec4<f32>, a2: vec4<f32>, a3: vec4<f32>) {
    finish_one(z, t, r0, a0);
    finish_one(z, t + 1u, r0, a1);
    finish_one(z, t + 2u, r0, a2);
    finish_one(z, t + 3u, r0, a3);
}
