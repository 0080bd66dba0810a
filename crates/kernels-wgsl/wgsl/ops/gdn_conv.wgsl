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

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let ch = gid.x + gid.y * P.wg_x * WG;
    if (ch >= P.c) {
        return;
    }
    var full: array<f32, 48>;
    let km1 = P.k - 1u;
    for (var j = 0u; j < km1; j++) {
        full[j] = state[j * P.c + ch];
    }
    for (var r = 0u; r < P.t; r++) {
        full[km1 + r] = qkv[(F.row0 + r) * P.c + ch];
    }
    for (var r = 0u; r < P.t; r++) {
        var acc = 0.0;
        for (var j = 0u; j < P.k; j++) {
            acc += w[ch * P.k + j] * full[r + j];
        }
        out[(F.row0 + r) * P.c + ch] = silu(acc);
    }
    for (var j = 0u; j < km1; j++) {
        state[j * P.c + ch] = full[P.t + j];
    }
}
