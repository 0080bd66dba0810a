// The matvec/matmat skeleton every codec shares. A workgroup of WG lanes computes WG / LANES
// rows; the LANES lanes of a row walk its 16-byte chunks (lane l takes chunks l, l + LANES, ...),
// decode each chunk once into `wd` and apply it to all NT token rows, then the row's lanes are
// reduced (`reduce`, from the subgroup or the shared-memory variant) and lane 0 writes
// y[t * y_stride + row_offset + row]. A 2-D grid covers more than 65535 workgroups.
//
// Assembled as common.wgsl + <codec>.wgsl + reduce_{sg,smem}.wgsl + this file
// (kernels-wgsl's `Variant::source`).

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
// Lanes per row: a power of two, a multiple of the subgroup size in the subgroup variant.
override LANES: u32 = 64u;
// Token rows, 1..=8: each weight chunk is decoded once and applied to all of them.
override NT: u32 = 1u;

var<private> wd: array<vec4<f32>, 16>;
var<workgroup> red: array<f32, WG>;

fn matvec_body(wid: vec3<u32>, li: u32, sg_size: u32, sg_lane: u32) {
    let wg = wid.x + wid.y * P.wg_x;
    let row = wg * (WG / LANES) + li / LANES;
    let lane = li % LANES;
    let live = row < P.rows;
    var acc: array<f32, 8>;
    if (live) {
        row_setup(row);
        let n = row_chunks();
        let x_row = P.cols / 4u;
        for (var c = lane; c < n; c = c + LANES) {
            decode_chunk(row, c);
            let xc = c * CHUNK_VEC4;
            for (var t = 0u; t < NT; t = t + 1u) {
                var s = acc[t];
                for (var k = 0u; k < CHUNK_VEC4; k = k + 1u) {
                    s = s + dot(wd[k], x[t * x_row + xc + k]);
                }
                acc[t] = s;
            }
        }
    }
    for (var t = 0u; t < NT; t = t + 1u) {
        let total = reduce(acc[t], li, lane, sg_size, sg_lane);
        if (live && lane == 0u) {
            y[t * P.y_stride + P.row_offset + row] = row_finish(total, row);
        }
    }
}
