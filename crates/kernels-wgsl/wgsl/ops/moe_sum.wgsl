// A MoE block's output: `y[t, :] = sum_i wts[t, i] * eo[t * k + i, :] + sh[t, :]`, the routed
// slots in slot order and the shared expert's output added last. One lane per value.
struct Params {
    n: u32,
    k: u32,
    d: u32,
    wg_x: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> eo: array<f32>;
@group(0) @binding(3) var<storage, read_write> wts: array<f32>;
@group(0) @binding(4) var<storage, read_write> sh: array<f32>;
@group(0) @binding(5) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let at = gid.x + gid.y * P.wg_x * WG;
    if (at >= P.n) {
        return;
    }
    let t = at / P.d;
    let j = at % P.d;
    var acc = 0.0;
    for (var i = 0u; i < P.k; i++) {
        acc += wts[t * P.k + i] * eo[(t * P.k + i) * P.d + j];
    }
    y[at] = acc + sh[at];
}
