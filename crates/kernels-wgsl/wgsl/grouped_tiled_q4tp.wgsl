// q4tp's blocks for the expert-major grouped kernel (grouped_tiled.wgsl): a 16-byte chunk is
// one 32-weight block of nibbles (value n - 8) scaled by exp2q(lo + code * step). The int8
// activations come in the "pairs" order, so a chunk word's low and high nibbles meet two
// consecutive code words, as in the one-slot kernel.
const W_MUL: i32 = 1;
const X_OFF: i32 = 8;

fn block(row: u32, r: RowP, c: u32) -> Blk {
    let v = wv[row * (P.cols / 32u) + c];
    let m = 0x0f0f0f0fu;
    let a = vec4<u32>(v.x & m, (v.x >> 4u) & m, v.y & m, (v.y >> 4u) & m);
    let b = vec4<u32>(v.z & m, (v.z >> 4u) & m, v.w & m, (v.w >> 4u) & m);
    return Blk(a, b, exp2q(r.ls.x + f32(scale_code(r.cb, c)) * r.ls.y));
}
