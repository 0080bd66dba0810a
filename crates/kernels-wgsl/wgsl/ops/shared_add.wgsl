// The gated shared expert, one row per workgroup: `y[t, :] += sigmoid(u[t] . w) * sh[t, :]`.
struct Params {
    d: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read_write> u: array<f32>;
@group(0) @binding(4) var<storage, read_write> w: array<f32>;
@group(0) @binding(5) var<storage, read_write> sh: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let o = wid.x * P.d;
    var p = 0.0;
    for (var j = li; j < P.d; j += WG) {
        p += u[o + j] * w[j];
    }
    let s = sigmoid(sum_wg(p, li));
    for (var j = li; j < P.d; j += WG) {
        y[o + j] = y[o + j] + s * sh[o + j];
    }
}
