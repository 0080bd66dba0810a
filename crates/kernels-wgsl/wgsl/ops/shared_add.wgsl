// The MoE block's output for token row t = wid.y: `y[t, :] = sum_i sw[t, i] eo[t k + i, :] +
// sigmoid(u[t] . w) * sh[t, :]` — the routed experts' weighted sum from the grouped kernels'
// slots (which `route` wrote in ascending expert order: the CPU executor's order), then the
// gated shared expert. With k = 0 the routed sum is already in y (the per-expert path) and
// only the shared expert is added. Each workgroup covers 4 * WG columns (wid.x) and computes
// the row's gate itself (the dot product is re-read from the cache by each), so a row is not
// one workgroup's chain of dependent loads; loops issue four independent loads per iteration.
struct Params {
    d: u32,
    k: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read_write> u: array<f32>;
@group(0) @binding(4) var<storage, read_write> w: array<f32>;
@group(0) @binding(5) var<storage, read_write> sh: array<f32>;
@group(0) @binding(6) var<storage, read_write> sw: array<f32>;
@group(0) @binding(7) var<storage, read_write> eo: array<f32>;

fn prod(o: u32, j: u32) -> f32 {
    if (j < P.d) {
        return u[o + j] * w[j];
    }
    return 0.0;
}

// The new y of column j of row t (offset o), or 0 past the row.
fn value(t: u32, o: u32, j: u32, s: f32) -> f32 {
    if (j >= P.d) {
        return 0.0;
    }
    var acc = 0.0;
    if (P.k == 0u) {
        acc = y[o + j];
    } else {
        for (var i = 0u; i < P.k; i++) {
            let slot = t * P.k + i;
            acc = acc + sw[slot] * eo[slot * P.d + j];
        }
    }
    return acc + s * sh[o + j];
}

fn put(o: u32, j: u32, v: f32) {
    if (j < P.d) {
        y[o + j] = v;
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wid.y;
    let o = t * P.d;
    var p0 = 0.0;
    var p1 = 0.0;
    var p2 = 0.0;
    var p3 = 0.0;
    for (var j = li; j < P.d; j += 4u * WG) {
        p0 += prod(o, j);
        p1 += prod(o, j + WG);
        p2 += prod(o, j + 2u * WG);
        p3 += prod(o, j + 3u * WG);
    }
    let s = sigmoid(sum_wg((p0 + p1) + (p2 + p3), li));
    let j = wid.x * 4u * WG + li;
    let v0 = value(t, o, j, s);
    let v1 = value(t, o, j + WG, s);
    let v2 = value(t, o, j + 2u * WG, s);
    let v3 = value(t, o, j + 3u * WG, s);
    put(o, j, v0);
    put(o, j + WG, v1);
    put(o, j + 2u * WG, v2);
    put(o, j + 3u * WG, v3);
}
