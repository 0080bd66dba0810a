// Adds one routed expert's output, scaled by each row's routing weight (zero where the row did
// not choose it): `y[t, :] += rw[t, e] * eo[t, :]`; `first` starts the sum from zero. Experts
// are added in expert order, as the CPU executor does.
struct Params {
    n: u32,
    d: u32,
    experts: u32,
    e: u32,
    first: u32,
    wg_x: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read_write> rw: array<f32>;
@group(0) @binding(4) var<storage, read_write> eo: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x + gid.y * P.wg_x * WG;
    if (i >= P.n) {
        return;
    }
    var acc = 0.0;
    if (P.first == 0u) {
        acc = y[i];
    }
    let scaled = rw[(i / P.d) * P.experts + P.e] * eo[i];
    y[i] = acc + scaled;
}
