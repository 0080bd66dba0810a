// q4tp rows: a 16-byte chunk is one 32-weight group; word k holds elements 8k..8k+7 as nibbles.
const CHUNK_BYTES: u32 = 16u;
const CHUNK_VEC4: u32 = 8u;

var<private> row_lo: f32;
var<private> row_step: f32;

fn row_chunks() -> u32 {
    return P.cols / 32u;
}

fn row_setup(row: u32) {
    let p = ww[P.second / 4u + row];
    let ls = f16x2(p);
    row_lo = ls.x;
    row_step = ls.y;
}

fn nib4(w: u32) -> vec4<f32> {
    let n = (vec4<u32>(w) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u);
    return vec4<f32>(n) - vec4<f32>(8.0);
}

fn decode_chunk(row: u32, c: u32) {
    let gpr = P.cols / 32u;
    let code = scale_code(P.third + row * P.code_stride, c, P.code_stride);
    let s = exp2q(row_lo + f32(code) * row_step);
    let v = wv[row * gpr + c];
    wd[0] = nib4(v.x) * s;
    wd[1] = nib4(v.x >> 16u) * s;
    wd[2] = nib4(v.y) * s;
    wd[3] = nib4(v.y >> 16u) * s;
    wd[4] = nib4(v.z) * s;
    wd[5] = nib4(v.z >> 16u) * s;
    wd[6] = nib4(v.w) * s;
    wd[7] = nib4(v.w >> 16u) * s;
}

fn row_finish(sum: f32, row: u32) -> f32 {
    return sum;
}
