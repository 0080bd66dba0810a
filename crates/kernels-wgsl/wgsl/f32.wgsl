// f32 rows (exact weights: the parity profile): a 16-byte chunk is 4 weights.
const CHUNK_VEC4: u32 = 1u;

fn row_chunks() -> u32 {
    return P.cols / 4u;
}

fn chunk_index(row: u32, c: u32) -> u32 {
    return row * (P.cols / 4u) + c;
}

fn chunk_scale(row: u32, c: u32) -> vec2<f32> {
    return vec2<f32>(1.0);
}

fn x_scale(c: u32, k: u32) -> vec4<f32> {
    return vec4<f32>(1.0);
}

fn weight4(v: vec4<u32>, s: vec2<f32>, k: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>(v);
}

fn row_finish(sum: f32, row: u32) -> f32 {
    return sum;
}
