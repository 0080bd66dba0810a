// The hyper-connection read-out: `u[t, j] = (sum_k sigmoid(g[t, k, j]) xn[t, k, j]) / H`, one
// lane per (t, j), streams added in order.
struct Params {
    n: u32,
    h: u32,
    d: u32,
    wg_x: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> g: array<f32>;
@group(0) @binding(3) var<storage, read_write> xn: array<f32>;
@group(0) @binding(4) var<storage, read_write> u: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x + gid.y * P.wg_x * WG;
    if (i >= P.n) {
        return;
    }
    let t = i / P.d;
    let j = i % P.d;
    var acc = 0.0;
    for (var k = 0u; k < P.h; k++) {
        let at = t * P.h * P.d + k * P.d + j;
        acc += sigmoid(g[at]) * xn[at];
    }
    u[i] = acc / f32(P.h);
}
