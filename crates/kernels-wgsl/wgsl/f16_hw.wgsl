// f16 rows through the hardware conversion (`unpack2x16float`, where the adapter has the
// SHADER_F16_IN_F32 capability): a 16-byte chunk is 8 weights.
const CHUNK_VEC4: u32 = 2u;

fn row_chunks() -> u32 {
    return P.cols / 8u;
}

fn chunk_index(row: u32, c: u32) -> u32 {
    return row * (P.cols / 8u) + c;
}

fn chunk_scale(row: u32, c: u32) -> vec2<f32> {
    return vec2<f32>(1.0);
}

fn x_scale(c: u32, k: u32) -> vec4<f32> {
    return vec4<f32>(1.0);
}

fn weight4(v: vec4<u32>, s: vec2<f32>, k: u32) -> vec4<f32> {
    if (k == 0u) {
        return vec4<f32>(unpack2x16float(v.x), unpack2x16float(v.y));
    }
    return vec4<f32>(unpack2x16float(v.z), unpack2x16float(v.w));
}

fn row_finish(sum: f32, row: u32) -> f32 {
    return sum;
}
