// Gated DeltaNet's causal depthwise conv + SiLU over q|k|v, one lane per channel: the layer's
// last K-1 inputs (the state) are the left context of this frame's T rows, and the state then
// becomes the last K-1 of those.
struct Params {
    t: u32,
    c: u32,
    k: u32,
    wg_x: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> qkv: array<f32>;
@group(0) @binding(3) var<storage, read_write> w: array<f32>;
@group(0) @binding(4) var<storage, read_write> state: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

// Value `i` of the sequence [state (K-1 values) | the frame's T rows] of channel `ch`, read
// where it lives (no private copy: a frame may have any number of rows).
fn conv_in(i: u32, km1: u32, ch: u32) -> f32 {
    if (i < km1) {
        return state[i * P.c + ch];
    }
    return qkv[(F.row0 + i - km1) * P.c + ch];
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let ch = gid.x + gid.y * P.wg_x * WG;
    if (ch >= P.c) {
        return;
    }
    let km1 = P.k - 1u;
    for (var r = 0u; r < P.t; r++) {
        var acc = 0.0;
        for (var j = 0u; j < P.k; j++) {
            acc += w[ch * P.k + j] * conv_in(r + j, km1, ch);
        }
        out[(F.row0 + r) * P.c + ch] = silu(acc);
    }
    // The state becomes the sequence's last K-1 values: entry j takes entry T + j, which no
    // earlier step of this ascending loop has overwritten (T + j > j).
    for (var j = 0u; j < km1; j++) {
        state[j * P.c + ch] = conv_in(P.t + j, km1, ch);
    }
}
