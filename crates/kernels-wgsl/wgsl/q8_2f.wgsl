// q8_2f rows: a 16-byte chunk is 16 int8 weights. The column scales multiply the activations
// (once per chunk, shared by every row a lane handles), the row scale the finished sum.
const CHUNK_VEC4: u32 = 4u;

fn row_chunks() -> u32 {
    return P.cols / 16u;
}

fn chunk_index(row: u32, c: u32) -> u32 {
    return row * (P.cols / 16u) + c;
}

fn chunk_scale(row: u32, c: u32) -> vec2<f32> {
    return vec2<f32>(1.0);
}

fn x_scale(c: u32, k: u32) -> vec4<f32> {
    let base = P.third + 2u * (c * 16u + 4u * k);
    // The column scales start on a word boundary whenever rows is even: two word loads.
    if ((P.third & 3u) == 0u) {
        return vec4<f32>(f16x2(ww[base / 4u]), f16x2(ww[base / 4u + 1u]));
    }
    return vec4<f32>(f16_at(base), f16_at(base + 2u), f16_at(base + 4u), f16_at(base + 6u));
}

fn i8x4(w: u32) -> vec4<f32> {
    let s = vec4<i32>(bitcast<i32>(w << 24u), bitcast<i32>(w << 16u), bitcast<i32>(w << 8u), bitcast<i32>(w));
    return vec4<f32>(s >> vec4<u32>(24u));
}

fn weight4(v: vec4<u32>, s: vec2<f32>, k: u32) -> vec4<f32> {
    return i8x4(v[k]);
}

fn row_finish(sum: f32, row: u32) -> f32 {
    return sum * f16_at(P.second + 2u * row);
}
