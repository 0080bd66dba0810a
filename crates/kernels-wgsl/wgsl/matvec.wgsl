// The matvec/matmat skeleton every codec shares. A row group of LANES lanes computes R
// consecutive rows; lane l walks the 16-byte chunks l, l + LANES, ... of all R rows at once, so
// each activation vector it loads is used for R rows, and each weight chunk, decoded once, for
// all NT token rows. The row group's lanes are then reduced (`reduce`, from the subgroup or
// the shared-memory variant) and lane 0 writes y[t * y_stride + row_offset + row]. A 2-D grid
// covers more than 65535 workgroups.
//
// Assembled as common.wgsl + <codec>.wgsl + reduce_{sg,smem}.wgsl + this file
// (kernels-wgsl's `Matvec::source`). The codec supplies CHUNK_VEC4 (activation vec4s per chunk),
// row_chunks, chunk_index, chunk_scale, x_scale, weight4 and row_finish.

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
}

@group(0) @binding(2) var<uniform> P: Params;
@group(0) @binding(3) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

// Lanes per workgroup.
override WG: u32 = 256u;
// Lanes per row group: a power of two; the subgroup variant needs it equal to the subgroup size.
override LANES: u32 = 64u;
// Token rows, 1..=8: each weight chunk is decoded once and applied to all of them.
override NT: u32 = 1u;
// Rows per row group, 1..=4: each activation load is applied to all of them.
override R: u32 = 4u;

var<workgroup> red: array<f32, WG>;

fn matvec_body(wid: vec3<u32>, li: u32, sg_size: u32, sg_lane: u32) {
    let wg = wid.x + wid.y * P.wg_x;
    let row0 = (wg * (WG / LANES) + li / LANES) * R;
    let lane = li % LANES;
    let last = P.rows - 1u;
    let x_row = P.cols / 4u;
    let n = row_chunks();
    // acc[r * 8 + t]: row r of the group, token row t.
    var acc: array<f32, 32>;
    for (var c = lane; c < n; c = c + LANES) {
        var v: array<vec4<u32>, 4>;
        var s: array<vec2<f32>, 4>;
        for (var r = 0u; r < R; r = r + 1u) {
            // Rows past the end reuse the last row (their sums are never written).
            let row = min(row0 + r, last);
            v[r] = wv[chunk_index(row, c)];
            s[r] = chunk_scale(row, c);
        }
        for (var k = 0u; k < CHUNK_VEC4; k = k + 1u) {
            let xs = x_scale(c, k);
            for (var t = 0u; t < NT; t = t + 1u) {
                let xv = x[t * x_row + c * CHUNK_VEC4 + k] * xs;
                for (var r = 0u; r < R; r = r + 1u) {
                    acc[r * 8u + t] = acc[r * 8u + t] + dot(weight4(v[r], s[r], k), xv);
                }
            }
        }
    }
    for (var r = 0u; r < R; r = r + 1u) {
        for (var t = 0u; t < NT; t = t + 1u) {
            let total = reduce(acc[r * 8u + t], li, lane, sg_size, sg_lane);
            if (lane == 0u && row0 + r < P.rows) {
                y[t * P.y_stride + P.row_offset + row0 + r] = row_finish(total, row0 + r);
            }
        }
    }
}
