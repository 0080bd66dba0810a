// What q4tp's and q2tp's block decoders for the expert-major grouped kernel share: a row's
// (lo, step) f16 pair and the offset of its 5-bit scale codes, no prologue, no row factor.
struct RowP {
    ls: vec2<f32>,
    cb: u32,
}

fn prologue(li: u32) {}

fn row_params(row: u32) -> RowP {
    return RowP(f16x2(ww[P.second / 4u + row]), P.third + row * P.code_stride);
}

fn row_finish(sum: f32, row: u32) -> f32 {
    return sum;
}
