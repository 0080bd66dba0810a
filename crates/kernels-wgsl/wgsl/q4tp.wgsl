// q4tp rows: a 16-byte chunk is one 32-weight group; word k holds elements 8k..8k+7 as nibbles
// (value n - 8), scaled by exp2q(lo + code * step).
const CHUNK_VEC4: u32 = 8u;

fn row_chunks() -> u32 {
    return P.cols / 32u;
}

fn chunk_index(row: u32, c: u32) -> u32 {
    return row * (P.cols / 32u) + c;
}

fn chunk_scale(row: u32, c: u32) -> vec2<f32> {
    let ls = f16x2(ww[P.second / 4u + row]);
    let code = scale_code(P.third + row * P.code_stride, c);
    return vec2<f32>(exp2q(ls.x + f32(code) * ls.y));
}

fn x_scale(c: u32, k: u32) -> vec4<f32> {
    return vec4<f32>(1.0);
}

fn weight4(v: vec4<u32>, s: vec2<f32>, k: u32) -> vec4<f32> {
    let w = v[k / 2u] >> (16u * (k % 2u));
    let n = (vec4<u32>(w) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u);
    return (vec4<f32>(n) - vec4<f32>(8.0)) * s.x;
}

fn row_finish(sum: f32, row: u32) -> f32 {
    return sum;
}
