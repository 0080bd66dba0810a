// q2tp's blocks for the expert-major grouped kernel (grouped_tiled.wgsl): a 16-byte chunk is
// two 32-weight blocks of 2-bit codes (value c - 1.5), block 2k + j in the chunk's words 2j and
// 2j + 1; a block's scale is exp2q(lo + (code - 1) * step), code 0 the zero rung. As in the
// one-slot kernel the integer dot product is `2 dot - 3 sum` and the factor carries 1/2.
const W_MUL: i32 = 2;
const X_OFF: i32 = 3;

fn quads(w: u32) -> vec4<u32> {
    let m = 0x03030303u;
    return vec4<u32>(w & m, (w >> 2u) & m, (w >> 4u) & m, (w >> 6u) & m);
}

fn block(row: u32, r: RowP, c: u32) -> Blk {
    let v = wv[row * (P.cols / 64u) + c / 2u];
    var p = v.xy;
    if ((c & 1u) == 1u) {
        p = v.zw;
    }
    let code = scale_code(r.cb, c);
    let s = select(exp2q(r.ls.x + (f32(code) - 1.0) * r.ls.y) * 0.5, 0.0, code == 0u);
    return Blk(quads(p.x), quads(p.y), s);
}
