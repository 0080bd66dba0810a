// After a block: `x[t, k, :] += inj[t, k] * y[t, :]` for every stream k, one lane per element.
struct Params {
    n: u32,
    h: u32,
    d: u32,
    wg_x: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> inj: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x + gid.y * P.wg_x * WG;
    if (i >= P.n) {
        return;
    }
    let hd = P.h * P.d;
    let t = i / hd;
    let k = (i % hd) / P.d;
    let j = i % P.d;
    x[i] = x[i] + inj[t * P.h + k] * y[t * P.d + j];
}
