// The MoE block's output for token row t = wid.y: `y[t, :] = sum_i sw[t, i] eo[t k + i, :] +
// sigmoid(u[t] . w) * sh[t, :]` — the routed experts' weighted sum from the grouped kernels'
// slots (which `route` wrote in ascending expert order: the CPU executor's order), then the
// gated shared expert. With k = 0 the routed sum is already in y (the per-expert path) and
// only the shared expert is added. Each workgroup covers WG columns (wid.x), one per lane, and
// computes the row's gate itself (the dot product is re-read from the cache by each), so a row
// is not one workgroup's chain of dependent loads; the gate's loop issues eight independent
// loads per iteration (H200: 4 columns a lane and one slot load at a time took ~22 us a call).
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

// The routed part of column j of row t (offset o), or 0 past the row. The slots are added
// one at a time in slot order (the CPU executor's order), their loads issued four at a time
// so a column waits for ceil(k / 4) memory latencies, not k.
fn routed(t: u32, o: u32, j: u32) -> f32 {
    if (j >= P.d) {
        return 0.0;
    }
    var acc = 0.0;
    if (P.k == 0u) {
        acc = y[o + j];
    } else {
        let s0 = t * P.k;
        var i = 0u;
        for (; i + 4u <= P.k; i += 4u) {
            let w0 = sw[s0 + i];
            let w1 = sw[s0 + i + 1u];
            let w2 = sw[s0 + i + 2u];
            let w3 = sw[s0 + i + 3u];
            let e0 = eo[(s0 + i) * P.d + j];
            let e1 = eo[(s0 + i + 1u) * P.d + j];
            let e2 = eo[(s0 + i + 2u) * P.d + j];
            let e3 = eo[(s0 + i + 3u) * P.d + j];
            acc = acc + w0 * e0;
            acc = acc + w1 * e1;
            acc = acc + w2 * e2;
            acc = acc + w3 * e3;
        }
        for (; i < P.k; i++) {
            acc = acc + sw[s0 + i] * eo[(s0 + i) * P.d + j];
        }
    }
    return acc;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wid.y;
    let o = t * P.d;
    // The column's routed sum and shared-expert value do not depend on the gate: loaded
    // before the gate's reduction (whose barriers no load moves across), so their memory
    // latencies overlap it.
    let col = wid.x * WG + li;
    let acc = routed(t, o, col);
    var shv = 0.0;
    if (col < P.d) {
        shv = sh[o + col];
    }
    var p0 = 0.0;
    var p1 = 0.0;
    var p2 = 0.0;
    var p3 = 0.0;
    var p4 = 0.0;
    var p5 = 0.0;
    var p6 = 0.0;
    var p7 = 0.0;
    for (var j = li; j < P.d; j += 8u * WG) {
        p0 += prod(o, j);
        p1 += prod(o, j + WG);
        p2 += prod(o, j + 2u * WG);
        p3 += prod(o, j + 3u * WG);
        p4 += prod(o, j + 4u * WG);
        p5 += prod(o, j + 5u * WG);
        p6 += prod(o, j + 6u * WG);
        p7 += prod(o, j + 7u * WG);
    }
    let s = sigmoid(sum_wg(((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)), li));
    if (col < P.d) {
        y[o + col] = acc + s * shv;
    }
}
