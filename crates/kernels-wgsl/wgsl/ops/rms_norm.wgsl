// `Qwen4ExpTextRMSNorm` over consecutive groups of `group` values, one workgroup per group:
// `y = x / sqrt(mean(x^2) + eps) * (1 + w)`, `w` applied with period `w_len` (one weight per
// head, or one per stream).
struct Params {
    groups: u32,
    group: u32,
    w_len: u32,
    eps: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> w: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let g = wid.x;
    if (g >= P.groups) {
        return;
    }
    let base = g * P.group;
    var ss = 0.0;
    for (var i = li; i < P.group; i += WG) {
        let v = x[base + i];
        ss += v * v;
    }
    let total = sum_wg(ss, li);
    let r = 1.0 / sqrt(total / f32(P.group) + bitcast<f32>(P.eps));
    for (var i = li; i < P.group; i += WG) {
        y[base + i] = x[base + i] * r * (1.0 + w[(base + i) % P.w_len]);
    }
}
