// bf16 rows: a 16-byte chunk is 8 weights; each is the upper half of an f32.
const CHUNK_BYTES: u32 = 16u;
const CHUNK_VEC4: u32 = 2u;

fn row_chunks() -> u32 {
    return P.cols / 8u;
}

fn row_setup(row: u32) {}

fn bf2(w: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u));
}

fn decode_chunk(row: u32, c: u32) {
    let v = wv[(row * P.cols * 2u) / 16u + c];
    wd[0] = vec4<f32>(bf2(v.x), bf2(v.y));
    wd[1] = vec4<f32>(bf2(v.z), bf2(v.w));
}

fn row_finish(sum: f32, row: u32) -> f32 {
    return sum;
}
