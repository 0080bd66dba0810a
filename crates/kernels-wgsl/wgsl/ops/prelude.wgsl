// Shared by every op kernel (kernels-wgsl's `Op`): the small per-block steps of a forward that
// sit between the matvecs. Every op has one bind group layout: binding 0 its parameters (16
// words; floats as bits), binding 1 the frame's per-token values, bindings 2..=9 storage
// buffers. Storage is declared read_write throughout because wgpu matches a binding's access
// exactly and one layout serves every op. Workgroups have WG lanes.

struct Frame {
    // Tokens before this frame: the position of its first row.
    past: u32,
    // Complete indexer blocks before and after this frame.
    nb_lo: u32,
    nb_hi: u32,
    // The frame's first row in the activation buffers: 0, or where this sequence's rows
    // start when the rows of several sequences share a frame (a batched decode step).
    row0: u32,
}

@group(0) @binding(1) var<uniform> F: Frame;

const WG: u32 = 128u;
// Below every value a max-reduction sees (scores are sums of ReLUs, probabilities >= 0).
const NEG: f32 = -3.0e38;

var<workgroup> red: array<f32, WG>;
var<workgroup> red_i: array<u32, WG>;

fn sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}

fn silu(v: f32) -> f32 {
    return v * sigmoid(v);
}

// torch's softplus (threshold 20) with an accurate log1p (GDN's decay).
fn softplus(x: f32) -> f32 {
    if (x > 20.0) {
        return x;
    }
    let e = exp(x);
    let u = 1.0 + e;
    if (u == 1.0) {
        return e;
    }
    return log(u) * e / (u - 1.0);
}

// The workgroup's sum of `v` (tree order); every lane gets it.
fn sum_wg(v: f32, li: u32) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s >> 1u) {
        if (li < s) {
            red[li] = red[li] + red[li + s];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

// The workgroup's max of `v`; every lane gets it.
fn max_wg(v: f32, li: u32) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s >> 1u) {
        if (li < s) {
            red[li] = max(red[li], red[li + s]);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

// The index of the workgroup's largest `v`, the lowest index among equals (what the CPU's
// stable descending sort puts first); every lane gets it.
fn argmax_wg(v: f32, i: u32, li: u32) -> u32 {
    red[li] = v;
    red_i[li] = i;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s >> 1u) {
        if (li < s) {
            let a = red[li];
            let b = red[li + s];
            if (b > a || (b == a && red_i[li + s] < red_i[li])) {
                red[li] = b;
                red_i[li] = red_i[li + s];
            }
        }
        workgroupBarrier();
    }
    let r = red_i[0];
    workgroupBarrier();
    return r;
}
