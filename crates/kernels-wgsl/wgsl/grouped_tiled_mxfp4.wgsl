// mxfp4's blocks for the expert-major grouped kernel (grouped_tiled.wgsl): a 16-byte chunk is
// one 32-weight block of E2M1 nibbles, its E8M0 scale a byte of the second section. A byte's
// two nibbles become two int8 `2 * e2m1` through a table in workgroup memory (filled by the
// prologue; the chunk loop's first barrier orders it), so the factor carries 1/2, as in the
// one-slot kernel.
const W_MUL: i32 = 1;
const X_OFF: i32 = 0;

var<workgroup> lut: array<u32, 256>;

struct RowP {
    nb: u32,
}

fn prologue(li: u32) {
    for (var i = li; i < 256u; i += KWG) {
        lut[i] = mx_pair(i);
    }
}

fn row_params(row: u32) -> RowP {
    return RowP(P.cols / 32u);
}

fn pairs(w: u32) -> vec2<u32> {
    return vec2<u32>(lut[w & 0xffu] | (lut[(w >> 8u) & 0xffu] << 16u), lut[(w >> 16u) & 0xffu] | (lut[w >> 24u] << 16u));
}

fn block(row: u32, r: RowP, c: u32) -> Blk {
    let v = wv[row * r.nb + c];
    let s = e8m0_i8(byte_at(P.second + row * r.nb + c)) * 0.5;
    return Blk(vec4<u32>(pairs(v.x), pairs(v.y)), vec4<u32>(pairs(v.z), pairs(v.w)), s);
}

fn row_finish(sum: f32, row: u32) -> f32 {
    return sum;
}
