// The matvec/matmat declarations every codec and both activation paths share (the f32 path's
// activations are declared in matvec.wgsl, the int8 path's in matvec_i8.wgsl); `matvec_body`
// itself is generated per token-row count and rows per row group (kernels-wgsl's `Matvec::body`): a row group of LANES
// lanes computes R consecutive rows, lane l walking the 16-byte chunks l, l + LANES, ... of
// all of them, so each activation load serves R rows and each weight chunk, decoded once, all
// token rows. The row group's lanes are then reduced (`reduce`, from the subgroup or the
// shared-memory variant) and lane 0 writes y[t * y_stride + row_offset + row]. A 2-D grid
// covers more than 65535 workgroups.
//
// The f32 path is assembled as common.wgsl + <codec>.wgsl + reduce_{sg,smem}.wgsl + this file +
// matvec.wgsl + the generated body (the int8 path: see matvec_i8.wgsl). The codec supplies CHUNK_VEC4 (activation vec4s per chunk), row_chunks, chunk_index,
// chunk_scale, x_scale, weight4 and row_finish.

struct Params {
    // Rows of this part of the matrix, and its columns.
    rows: u32,
    cols: u32,
    // Where this part's rows start in y, and y's length per token row.
    row_offset: u32,
    y_stride: u32,
    // Byte offsets of the payload's second and third sections (docs/codecs.md).
    second: u32,
    third: u32,
    // Bytes of packed scale codes per row (q4tp, q2tp).
    code_stride: u32,
    // Workgroups along x of the grid; the workgroup index is x + y * wg_x.
    wg_x: u32,
    // The gate/up pair: rows of each half (the up rows start at `half`).
    half: u32,
    // The grouped variant: bytes per expert slot, and slots per activation row.
    slot_bytes: u32,
    x_div: u32,
    // The hyper-connection front's divisor (f32 bits: H).
    a: u32,
}

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

@group(0) @binding(2) var<uniform> P: Params;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

// Lanes per workgroup.
override WG: u32 = 256u;
// Lanes per row group: a power of two; the subgroup variant needs it equal to the subgroup size.
override LANES: u32 = 64u;
