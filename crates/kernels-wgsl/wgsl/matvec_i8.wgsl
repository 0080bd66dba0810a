// The int8 activation path (docs/codecs.md, "int8 activations"): activations arrive quantised
// by act_quant.wgsl, per 32-element block 8 words of int8 codes (in the order the codec's
// weight unpacking produces, so every weight word meets its activation word in one
// dot4I8Packed) and a (scale bits, code sum) pair. A block's integer dot product is exact; its
// f32 share is `f32(I) * (S * d)`.
//
// Assembled as common.wgsl + i8_codes.wgsl + reduce_{sg,smem}.wgsl + matvec_common.wgsl + this
// file + the generated body (kernels-wgsl's `Matvec::body_i8`), which inlines the codec's
// unpacking.

@group(0) @binding(3) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> xd: array<vec2<u32>>;

fn dot8(u0: u32, u1: u32, u2: u32, u3: u32, u4: u32, u5: u32, u6: u32, u7: u32, a: vec4<u32>, b: vec4<u32>) -> i32 {
    return ((dot4I8Packed(u0, a.x) + dot4I8Packed(u1, a.y)) + (dot4I8Packed(u2, a.z) + dot4I8Packed(u3, a.w)))
        + ((dot4I8Packed(u4, b.x) + dot4I8Packed(u5, b.y)) + (dot4I8Packed(u6, b.z) + dot4I8Packed(u7, b.w)));
}
