// Weight codes as int8 for the int8 activation path's dot products (matvec_i8.wgsl and the
// expert-major grouped kernels): mxfp4's E2M1 pairs and E8M0 scales.

fn e2m1x2(n: u32) -> u32 {
    let m = n & 7u;
    var v = m;
    if (m >= 2u) {
        v = (2u + (m & 1u)) << ((m >> 1u) - 1u);
    }
    if ((n & 8u) != 0u) {
        v = u32(-i32(v));
    }
    return v & 0xffu;
}

// mxfp4: byte -> its two E2M1 nibbles as int8 `2 * e2m1` (low nibble in byte 0); the table
// in workgroup memory is generated with the body (its copies vary).
fn mx_pair(b: u32) -> u32 {
    return e2m1x2(b & 15u) | (e2m1x2(b >> 4u) << 8u);
}

// E8M0 as in mxfp4.wgsl: 255 is NaN, 0 is 2^-127, otherwise 2^(k - 127).
fn e8m0_i8(k: u32) -> f32 {
    return bitcast<f32>(select(select(k << 23u, 0x00400000u, k == 0u), 0x7fc00000u, k == 255u));
}
