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

// binary16 bits (low 16 bits of `h`) to f32, exactly, by bit construction (the same as
// quant-codecs' `f16_bits_to_f32`; `unpack2x16float` needs a capability some devices lack).
fn f16_bits(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let em = h & 0x7fffu;
    let e = em & 0x7c00u;
    let normal = (em << 13u) + (112u << 23u);
    let infnan = (em << 13u) | 0x7f800000u;
    let sub = bitcast<u32>(f32(em) * bitcast<f32>(0x33800000u));
    var mag = normal;
    if (e == 0x7c00u) {
        mag = infnan;
    } else if (e == 0u) {
        mag = sub;
    }
    return bitcast<f32>(mag | sign);
}

// Two binary16 values packed in a word (low half first).
fn f16x2(w: u32) -> vec2<f32> {
    return vec2<f32>(f16_bits(w & 0xffffu), f16_bits(w >> 16u));
}

fn f16_at(off: u32) -> f32 {
    return f16_bits(half_bits_at(off));
}

// exp2q: the polynomial 2^t every cortiq decoder uses (docs/codecs.md, "exp2q").
fn exp2q(t_in: f32) -> f32 {
    let t = min(max(t_in, -126.0), 127.0);
    let i = floor(t);
    let f = t - i;
    var p = bitcast<f32>(0x39635e05u);
    p = p * f + bitcast<f32>(0x3aa306d3u);
    p = p * f + bitcast<f32>(0x3c1e98cdu);
    p = p * f + bitcast<f32>(0x3d634140u);
    p = p * f + bitcast<f32>(0x3e75feefu);
    p = p * f + bitcast<f32>(0x3f317213u);
    p = p * f + bitcast<f32>(0x3f800000u);
    return p * bitcast<f32>(u32(i32(i) + 127) << 23u);
}

// A q4tp/q2tp group's 5-bit scale code: bit 5g of the row's code bytes starting at byte `base`.
fn scale_code(base: u32, g: u32, code_stride: u32) -> u32 {
    let bit = 5u * g;
    let b = bit >> 3u;
    var v = byte_at(base + b);
    if (b + 1u < code_stride) {
        v = v | (byte_at(base + b + 1u) << 8u);
    }
    return (v >> (bit & 7u)) & 31u;
}
