// mxfp4 rows: a 16-byte chunk is one 32-weight group of E2M1 nibbles; its E8M0 scale byte is in
// the scale plane.
const CHUNK_VEC4: u32 = 8u;

fn row_chunks() -> u32 {
    return P.cols / 32u;
}

fn chunk_index(row: u32, c: u32) -> u32 {
    return row * (P.cols / 32u) + c;
}

// E8M0 without branches: 255 is NaN, 0 is 2^-127, otherwise 2^(k - 127).
fn e8m0(k: u32) -> f32 {
    return bitcast<f32>(select(select(k << 23u, 0x00400000u, k == 0u), 0x7fc00000u, k == 255u));
}

fn chunk_scale(row: u32, c: u32) -> vec2<f32> {
    return vec2<f32>(e8m0(byte_at(P.second + row * (P.cols / 32u) + c)));
}

fn x_scale(c: u32, k: u32) -> vec4<f32> {
    return vec4<f32>(1.0);
}

// E2M1 by bit construction: magnitudes 0, 0.5 for m < 2, else bits 0x3F000000 + (m << 22).
fn weight4(v: vec4<u32>, s: vec2<f32>, k: u32) -> vec4<f32> {
    let w = v[k / 2u] >> (16u * (k % 2u));
    let n = (vec4<u32>(w) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u);
    let m = n & vec4<u32>(7u);
    let big = vec4<u32>(0x3f000000u) + (m << vec4<u32>(22u));
    let small = bitcast<vec4<u32>>(vec4<f32>(m) * 0.5);
    let mag = select(big, small, m < vec4<u32>(2u));
    return bitcast<vec4<f32>>(mag | ((n & vec4<u32>(8u)) << vec4<u32>(28u))) * s.x;
}

fn row_finish(sum: f32, row: u32) -> f32 {
    return sum;
}
