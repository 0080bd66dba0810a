// The MoE block's output for token row t = wid.y: `y[t, :] = sum_i sw[t, i] eo[t k + i, :] +
// gate[t] * sh[t, :]` — the routed experts' weighted sum from the grouped kernels' slots
// (which `route` wrote in ascending expert order: the CPU executor's order), then the gated
// shared expert, its gate `sigmoid(u . w)` from `route`. With k = 0 the routed sum is already
// in y (the per-expert path) and only the shared expert is added. The slots' weights and the
// gates follow the slots' outputs in `eo` (at `sw_off`, `g_off`). A decode step or a short
// frame with every routed expert resident computes this in its shared expert's down
// projection instead (`Epilogue::MoeOut`, the same expression).
struct Params {
    d: u32,
    k: u32,
    sw_off: u32,
    g_off: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read_write> sh: array<f32>;
@group(0) @binding(4) var<storage, read_write> eo: array<f32>;

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
            let w0 = eo[P.sw_off + s0 + i];
            let w1 = eo[P.sw_off + s0 + i + 1u];
            let w2 = eo[P.sw_off + s0 + i + 2u];
            let w3 = eo[P.sw_off + s0 + i + 3u];
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
            acc = acc + eo[P.sw_off + s0 + i] * eo[(s0 + i) * P.d + j];
        }
    }
    return acc;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wid.y;
    let o = t * P.d;
    let col = wid.x * WG + li;
    if (col < P.d) {
        y[o + col] = routed(t, o, col) + eo[P.g_off + t] * sh[o + col];
    }
}
