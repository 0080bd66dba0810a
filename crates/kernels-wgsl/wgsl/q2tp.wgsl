// q2tp rows: a 16-byte chunk is two 32-weight groups; word k holds elements 16k..16k+15 as
// 2-bit codes (value c - 1.5); scale code 0 is the zero rung.
const CHUNK_BYTES: u32 = 16u;
const CHUNK_VEC4: u32 = 16u;

var<private> row_lo: f32;
var<private> row_step: f32;

fn row_chunks() -> u32 {
    return P.cols / 64u;
}

fn row_setup(row: u32) {
    let p = ww[P.second / 4u + row];
    let ls = f16x2(p);
    row_lo = ls.x;
    row_step = ls.y;
}

fn crumb4(w: u32) -> vec4<f32> {
    let c = (vec4<u32>(w) >> vec4<u32>(0u, 2u, 4u, 6u)) & vec4<u32>(3u);
    return vec4<f32>(c) - vec4<f32>(1.5);
}

fn group_scale(row: u32, g: u32) -> f32 {
    let code = scale_code(P.third + row * P.code_stride, g, P.code_stride);
    return select(exp2q(row_lo + f32(code - 1u) * row_step), 0.0, code == 0u);
}

fn decode_word(w: u32, s: f32, at: u32) {
    wd[at] = crumb4(w) * s;
    wd[at + 1u] = crumb4(w >> 8u) * s;
    wd[at + 2u] = crumb4(w >> 16u) * s;
    wd[at + 3u] = crumb4(w >> 24u) * s;
}

fn decode_chunk(row: u32, c: u32) {
    let v = wv[(row * P.cols / 4u) / 16u + c];
    let s0 = group_scale(row, 2u * c);
    let s1 = group_scale(row, 2u * c + 1u);
    decode_word(v.x, s0, 0u);
    decode_word(v.y, s0, 4u);
    decode_word(v.z, s1, 8u);
    decode_word(v.w, s1, 12u);
}

fn row_finish(sum: f32, row: u32) -> f32 {
    return sum;
}
