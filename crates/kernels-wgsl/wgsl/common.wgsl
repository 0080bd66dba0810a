// Shared decoders: the WGSL twins of quant-codecs' byte layouts (docs/codecs.md). Every buffer
// is read as u32 words; bytes, halves and codes are extracted by shifting.

// The weight payload, bound twice: as 16-byte chunks for the code planes, and as words for the
// per-row and per-group parameters.
@group(0) @binding(0) var<storage, read> wv: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> ww: array<u32>;

// Byte `off` of the payload.
fn byte_at(off: u32) -> u32 {
    return (ww[off >> 2u] >> ((off & 3u) * 8u)) & 0xffu;
}

// The little-endian u16 at byte `off` (any alignment).
fn half_bits_at(off: u32) -> u32 {
    return byte_at(off) | (byte_at(off + 1u) << 8u);
}

// Two binary16 values packed in a word (low half first).
fn f16x2(w: u32) -> vec2<f32> {
    return vec2<f32>(f16_bits(w & 0xffffu), f16_bits(w >> 16u));
}

fn f16_at(off: u32) -> f32 {
    return f16_bits(half_bits_at(off));
}

// At least 16 valid bits of the payload from byte `off` on (lowest first): one word load, two
// when `off` is a word's last byte. A read past the end of the binding is clamped by the
// runtime, and only ever supplies bits a caller masks away (a code never spans past its row).
fn bits_at(off: u32) -> u32 {
    let sh = (off & 3u) * 8u;
    var v = ww[off >> 2u] >> sh;
    if (sh > 16u) {
        v = v | (ww[(off >> 2u) + 1u] << (32u - sh));
    }
    return v;
}

// A q4tp/q2tp group's 5-bit scale code: bit 5g of the row's code bytes starting at byte `base`.
fn scale_code(base: u32, g: u32) -> u32 {
    let bit = 5u * g;
    return (bits_at(base + (bit >> 3u)) >> (bit & 7u)) & 31u;
}
