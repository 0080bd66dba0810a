// Pure decoders shared by every module (no bindings): the WGSL twins of quant-codecs'
// f16_bits_to_f32 and exp2q (docs/codecs.md).

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

