// q8_2f rows: a 16-byte chunk is 16 int8 weights; the column scales multiply the weights, the
// row scale the finished sum.
const CHUNK_BYTES: u32 = 16u;
const CHUNK_VEC4: u32 = 4u;

fn row_chunks() -> u32 {
    return P.cols / 16u;
}

fn row_setup(row: u32) {}

fn i8x4(w: u32) -> vec4<f32> {
    let s = vec4<i32>(bitcast<i32>(w << 24u), bitcast<i32>(w << 16u), bitcast<i32>(w << 8u), bitcast<i32>(w));
    return vec4<f32>(s >> vec4<u32>(24u));
}

fn col_scales4(i: u32) -> vec4<f32> {
    let base = P.third + 2u * i;
    return vec4<f32>(f16_at(base), f16_at(base + 2u), f16_at(base + 4u), f16_at(base + 6u));
}

fn decode_chunk(row: u32, c: u32) {
    let v = wv[(row * P.cols) / 16u + c];
    let i = c * 16u;
    wd[0] = i8x4(v.x) * col_scales4(i);
    wd[1] = i8x4(v.y) * col_scales4(i + 4u);
    wd[2] = i8x4(v.z) * col_scales4(i + 8u);
    wd[3] = i8x4(v.w) * col_scales4(i + 12u);
}

fn row_finish(sum: f32, row: u32) -> f32 {
    return sum * f16_at(P.second + 2u * row);
}
