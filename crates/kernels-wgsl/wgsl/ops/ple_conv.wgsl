// PLE's dilated causal depthwise conv, one lane per channel of H*D: the last (K-1) dil
// normalised gated values (the history) are the left context of this frame's T rows; the
// streams get `x += g + silu(conv)`, and the history becomes the last (K-1) dil values.
struct Params {
    t: u32,
    hd: u32,
    k: u32,
    dil: u32,
    wg_x: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> gn: array<f32>;
@group(0) @binding(3) var<storage, read_write> w: array<f32>;
@group(0) @binding(4) var<storage, read_write> hist: array<f32>;
@group(0) @binding(5) var<storage, read_write> x: array<f32>;
@group(0) @binding(6) var<storage, read_write> g: array<f32>;

// Value `i` of the sequence [history ((K-1) dil values) | the frame's T rows] of channel `ch`,
// read where it lives (no private copy: a frame may have any number of rows).
fn conv_in(i: u32, hl: u32, ch: u32) -> f32 {
    if (i < hl) {
        return hist[i * P.hd + ch];
    }
    return gn[(F.row0 + i - hl) * P.hd + ch];
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let ch = gid.x + gid.y * P.wg_x * WG;
    if (ch >= P.hd) {
        return;
    }
    let hl = (P.k - 1u) * P.dil;
    for (var r = 0u; r < P.t; r++) {
        var acc = 0.0;
        for (var j = 0u; j < P.k; j++) {
            acc += w[ch * P.k + j] * conv_in(r + j * P.dil, hl, ch);
        }
        let at = (F.row0 + r) * P.hd + ch;
        x[at] = x[at] + (g[at] + silu(acc));
    }
    // The history becomes the sequence's last (K-1) dil values: entry j takes entry T + j,
    // which no earlier step of this ascending loop has overwritten (T + j > j).
    for (var j = 0u; j < hl; j++) {
        hist[j * P.hd + ch] = conv_in(P.t + j, hl, ch);
    }
}
