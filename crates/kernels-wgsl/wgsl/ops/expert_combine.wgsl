// The routed experts' sum from the grouped kernels' slots: `y[t, :] = sum_i sw[t, i] eo[t k + i, :]`
// over the row's k slots, which `route` wrote in ascending expert order (the CPU executor's
// order), starting from zero.
struct Params {
    n: u32,
    d: u32,
    k: u32,
    wg_x: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read_write> sw: array<f32>;
@group(0) @binding(4) var<storage, read_write> eo: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x + gid.y * P.wg_x * WG;
    if (i >= P.n) {
        return;
    }
    let t = i / P.d;
    let j = i % P.d;
    var acc = 0.0;
    for (var s = 0u; s < P.k; s++) {
        let slot = t * P.k + s;
        acc = acc + sw[slot] * eo[slot * P.d + j];
    }
    y[i] = acc;
}
