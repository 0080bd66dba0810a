// The int8 activation path (docs/codecs.md, "int8 activations"): activations arrive quantised
// by act_quant.wgsl, per 32-element block 8 words of int8 codes (in the order the codec's
// weight unpacking produces, so every weight word meets its activation word in one
// dot4I8Packed) and a (scale bits, code sum) pair. A block's integer dot product is exact; its
// f32 share is `f32(I) * (S * d)`.
//
// Assembled as common.wgsl + reduce_{sg,smem}.wgsl + matvec_common.wgsl + this file + the
// generated body (kernels-wgsl's `Matvec::body_i8`), which inlines the codec's unpacking.

@group(0) @binding(3) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> xd: array<vec2<u32>>;

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

fn dot8(u0: u32, u1: u32, u2: u32, u3: u32, u4: u32, u5: u32, u6: u32, u7: u32, a: vec4<u32>, b: vec4<u32>) -> i32 {
    return ((dot4I8Packed(u0, a.x) + dot4I8Packed(u1, a.y)) + (dot4I8Packed(u2, a.z) + dot4I8Packed(u3, a.w)))
        + ((dot4I8Packed(u4, b.x) + dot4I8Packed(u5, b.y)) + (dot4I8Packed(u6, b.z) + dot4I8Packed(u7, b.w)));
}
