// Gated DeltaNet's causal depthwise conv + SiLU over q|k|v, a channel's rows split over
// WG / CONV_CHANNELS lanes of one workgroup: the layer's last K-1 inputs (the state) are the
// left context of this frame's T rows, and the state then becomes the last K-1 of those. The
// host dispatches one workgroup per CONV_CHANNELS channels (kernels-wgsl's `GDN_CONV_CHANNELS`).
struct Params {
    t: u32,
    c: u32,
    k: u32,
    wg_x: u32,
}

@group(0) @binding(0) var<uniform> P: Params;

const CONV_CHANNELS: u32 = 32u;
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
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    // A workgroup takes CONV_CHANNELS consecutive channels (coalesced loads) and splits each
    // channel's rows over WG / CONV_CHANNELS lanes: at 256 rows one lane per channel walked
    // its rows in sequence, on a grid too small to fill the device (208 us a call on an H100;
    // 127 us with 4 lanes a channel).
    let ch = (wid.x + wid.y * P.wg_x) * CONV_CHANNELS + li % CONV_CHANNELS;
    let part = li / CONV_CHANNELS;
    let km1 = P.k - 1u;
    if (ch < P.c) {
        for (var r = part; r < P.t; r += WG / CONV_CHANNELS) {
            var acc = 0.0;
            for (var j = 0u; j < P.k; j++) {
                acc += w[ch * P.k + j] * conv_in(r + j, km1, ch);
            }
            out[(F.row0 + r) * P.c + ch] = silu(acc);
        }
    }
    // Every lane that reads this channel's state is in this workgroup: after the barrier the
    // state becomes the sequence's last K-1 values (entry j takes entry T + j).
    workgroupBarrier();
    if (ch < P.c && part == 0u) {
        for (var j = 0u; j < km1; j++) {
            state[j * P.c + ch] = conv_in(P.t + j, km1, ch);
        }
    }
}
