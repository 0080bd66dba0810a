// f16 rows: a 16-byte chunk is 8 weights.
const CHUNK_BYTES: u32 = 16u;
const CHUNK_VEC4: u32 = 2u;

fn row_chunks() -> u32 {
    return P.cols / 8u;
}

fn row_setup(row: u32) {}

fn decode_chunk(row: u32, c: u32) {
    let v = wv[(row * P.cols * 2u) / 16u + c];
    wd[0] = vec4<f32>(f16x2(v.x), f16x2(v.y));
    wd[1] = vec4<f32>(f16x2(v.z), f16x2(v.w));
}

fn row_finish(sum: f32, row: u32) -> f32 {
    return sum;
}
