// What both tiled int8 kernels (tiled_i8.wgsl, tiled_i8_8x8.wgsl) share: the activation codes
// and their block scales, a block's integer dot product, and the rows' f16 scales.

@group(0) @binding(3) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> xd: array<vec2<u32>>;

fn dot8v(wa: vec4<u32>, wb: vec4<u32>, xa: vec4<u32>, xb: vec4<u32>) -> f32 {
    return f32(((dot4I8Packed(wa.x, xa.x) + dot4I8Packed(wa.y, xa.y)) + (dot4I8Packed(wa.z, xa.z) + dot4I8Packed(wa.w, xa.w)))
        + ((dot4I8Packed(wb.x, xb.x) + dot4I8Packed(wb.y, xb.y)) + (dot4I8Packed(wb.z, xb.z) + dot4I8Packed(wb.w, xb.w))));
}

// The f16 scales of rows r0 .. r0 + 3 (past the end: the last row's; those sums are never
// written).
fn row_scales(r0: u32) -> vec4<f32> {
    let last = P.rows - 1u;
    return vec4<f32>(
        f16_at(P.second + 2u * min(r0, last)),
        f16_at(P.second + 2u * min(r0 + 1u, last)),
        f16_at(P.second + 2u * min(r0 + 2u, last)),
        f16_at(P.second + 2u * min(r0 + 3u, last)),
    );
}
