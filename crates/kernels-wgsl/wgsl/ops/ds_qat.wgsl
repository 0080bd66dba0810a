// DeepSeek-V4.1's quantisation-aware-training fake quantisers (model-dsv4's `v41::qat`): each
// `block`-wide slice of a row rounded onto the FP8 E4M3 or FP4 E2M1 grid times the block's
// scale, and back, round to nearest, ties to even. `mode` 0: E4M3 with a power-of-two scale
// `2^ceil(log2(max(amax, floor) * inv))` (the window KV: floor 1e-4, inv 1/448); 1: E2M1 with a
// power-of-two scale (indexer queries and keys: floor 6*2^-126, inv 1/6); 2: E2M1 with an E4M3
// scale `e4m3(max(amax, floor) / 6)` (the compressed entries: floor 6*2^-9). `map` 0: rows
// `0..rows` of `src` `[rows, width]` in place, one workgroup per row; 1 (a KV source's
// publish): workgroup `i` is the frame's i-th candidate group `g = past / rate + i`; when the
// frame completes it (and `g < maxe`), its pre-RoPE latent `src[i]` goes to `dst[g]` with the
// `compress` RoPE at position `g * rate` on the trailing `2 * half` channels, then the blocks.
// A lane per block, its values in order.
struct Params {
    rows: u32,
    width: u32,
    block: u32,
    mode: u32,
    map: u32,
    rate: u32,
    maxe: u32,
    half: u32,
    floor: u32,
    inv: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> src: array<f32>;
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;
@group(0) @binding(4) var<storage, read_write> cs: array<f32>;

// `2^ceil(log2(v))` from the bits, as the CPU forms it (v a positive normal).
fn pow2_ceil(v: f32) -> f32 {
    let b = bitcast<u32>(v);
    var k = i32((b >> 23u) & 0xffu) - 127;
    if ((b & 0x7fffffu) != 0u) {
        k = k + 1;
    }
    if (k < -126) {
        return exp2(f32(k));
    }
    return bitcast<f32>(u32(k + 127) << 23u);
}

// A magnitude rounded onto the E4M3 grid (three mantissa bits, ties to even; multiples of
// 2^-9 below 2^-6; 448 at most).
fn e4m3_rt(a: f32) -> f32 {
    if (a >= 448.0) {
        return 448.0;
    }
    if (a < 0.015625) {
        return round(a * 512.0) * (1.0 / 512.0);
    }
    let b = bitcast<u32>(a);
    let r = (b + 0x7ffffu + ((b >> 20u) & 1u)) & 0xfff00000u;
    return min(bitcast<f32>(r), 448.0);
}

// A magnitude (<= 6) rounded onto the E2M1 grid: the midpoints, an even lower code winning a
// tie (strict >), an odd one losing it (>=).
fn e2m1_rt(a: f32) -> f32 {
    var m = 0u;
    m += select(0u, 1u, a > 0.25);
    m += select(0u, 1u, a >= 0.75);
    m += select(0u, 1u, a > 1.25);
    m += select(0u, 1u, a >= 1.75);
    m += select(0u, 1u, a > 2.5);
    m += select(0u, 1u, a >= 3.5);
    m += select(0u, 1u, a > 5.0);
    var grid = array<f32, 8>(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0);
    return grid[m];
}

fn quantise(v: f32, s: f32) -> f32 {
    if (P.mode == 0u) {
        let q = clamp(v / s, -448.0, 448.0);
        let r = e4m3_rt(abs(q));
        return select(r, -r, q < 0.0) * s;
    }
    let q = clamp(v / s, -6.0, 6.0);
    let r = e2m1_rt(abs(q));
    return select(r, -r, q < 0.0) * s;
}

// The blocks of the row at `at` of `dst` (a lane each).
fn blocks(at: u32, li: u32) {
    let floor = bitcast<f32>(P.floor);
    let inv = bitcast<f32>(P.inv);
    for (var b = li; b < P.width / P.block; b += WG) {
        let b0 = at + b * P.block;
        var a = 0.0;
        for (var i = 0u; i < P.block; i++) {
            a = max(a, abs(dst[b0 + i]));
        }
        var s: f32;
        if (P.mode == 2u) {
            s = e4m3_rt(max(a, floor) / 6.0);
        } else {
            s = pow2_ceil(max(a, floor) * inv);
        }
        for (var i = 0u; i < P.block; i++) {
            dst[b0 + i] = quantise(dst[b0 + i], s);
        }
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    // A width that is not a whole number of blocks is published unrounded, as the CPU does.
    let rounds = P.width % P.block == 0u;
    if (P.map == 0u) {
        if (wid.x >= P.rows || !rounds) {
            return;
        }
        blocks(wid.x * P.width, li);
        return;
    }
    let g = F.past / P.rate + wid.x;
    if ((g + 1u) * P.rate > F.past + P.rows || g >= P.maxe) {
        return;
    }
    let src0 = wid.x * P.width;
    let at = g * P.width;
    for (var i = li; i < P.width; i += WG) {
        dst[at + i] = src[src0 + i];
    }
    storageBarrier();
    let t0 = g * P.rate * 2u * P.half;
    for (var i = li; i < P.half; i += WG) {
        let c = cs[t0 + i];
        let s = cs[t0 + P.half + i];
        let j = at + P.width - 2u * P.half + 2u * i;
        let a = src[src0 + P.width - 2u * P.half + 2u * i];
        let b = src[src0 + P.width - 2u * P.half + 2u * i + 1u];
        dst[j] = a * c - b * s;
        dst[j + 1u] = b * c + a * s;
    }
    storageBarrier();
    if (rounds) {
        blocks(at, li);
    }
}
