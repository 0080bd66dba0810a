// The activations of a hyper-connection site's fused front matvec, whose rows are the low-rank
// down projection (R) then the injection logits (H), per token row `[nt, R + H]`:
// `low[t, c] = silu(x / a)` for c < R, `inj[t, c - R] = 2 sigmoid(x / a)` for the rest.
struct Params {
    n: u32,
    r: u32,
    h: u32,
    a: u32,
    wg_x: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> low: array<f32>;
@group(0) @binding(4) var<storage, read_write> inj: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x + gid.y * P.wg_x * WG;
    if (i >= P.n) {
        return;
    }
    let w = P.r + P.h;
    let t = i / w;
    let c = i % w;
    let v = x[i] / bitcast<f32>(P.a);
    if (c < P.r) {
        low[t * P.r + c] = silu(v);
    } else {
        inj[t * P.h + c - P.r] = 2.0 * sigmoid(v);
    }
}
