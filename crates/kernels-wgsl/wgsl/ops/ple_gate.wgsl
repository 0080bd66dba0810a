// PLE's gate, one stream of one row per workgroup: `a = <K_k, Q_k> / sqrt(D)`,
// `a = sign(a) sqrt(max(|a|, 1e-6))`, `G_k = sigmoid(a) V`.
struct Params {
    h: u32,
    d: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> key: array<f32>;
@group(0) @binding(3) var<storage, read_write> qn: array<f32>;
@group(0) @binding(4) var<storage, read_write> val: array<f32>;
@group(0) @binding(5) var<storage, read_write> g: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let k = wid.x;
    let r = wid.y;
    let o = r * P.h * P.d + k * P.d;
    var p = 0.0;
    for (var j = li; j < P.d; j += WG) {
        p += key[o + j] * qn[o + j];
    }
    let dot = sum_wg(p, li) / sqrt(f32(P.d));
    let a = sqrt(max(abs(dot), 1e-6)) * sign(dot);
    let s = sigmoid(a);
    for (var j = li; j < P.d; j += WG) {
        g[o + j] = s * val[r * P.d + j];
    }
}
