// q2tp rows: a 16-byte chunk is two 32-weight groups; word k holds elements 16k..16k+15 as
// 2-bit codes (value c - 1.5); scale code 0 is the zero rung.
const CHUNK_VEC4: u32 = 16u;

fn row_chunks() -> u32 {
    return P.cols / 64u;
}

fn chunk_index(row: u32, c: u32) -> u32 {
    return row * (P.cols / 64u) + c;
}

fn group_scale(row: u32, g: u32, ls: vec2<f32>) -> f32 {
    let code = scale_code(P.third + row * P.code_stride, g);
    return select(exp2q(ls.x + f32(code - 1u) * ls.y), 0.0, code == 0u);
}

fn chunk_scale(row: u32, c: u32) -> vec2<f32> {
    let ls = f16x2(ww[P.second / 4u + row]);
    return vec2<f32>(group_scale(row, 2u * c, ls), group_scale(row, 2u * c + 1u, ls));
}

fn x_scale(c: u32, k: u32) -> vec4<f32> {
    return vec4<f32>(1.0);
}

fn weight4(v: vec4<u32>, s: vec2<f32>, k: u32) -> vec4<f32> {
    let w = v[k / 4u] >> (8u * (k % 4u));
    let c = (vec4<u32>(w) >> vec4<u32>(0u, 2u, 4u, 6u)) & vec4<u32>(3u);
    return (vec4<f32>(c) - vec4<f32>(1.5)) * select(s.y, s.x, k < 8u);
}

fn row_finish(sum: f32, row: u32) -> f32 {
    return sum;
}
