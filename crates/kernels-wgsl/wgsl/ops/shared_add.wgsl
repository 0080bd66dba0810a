// The gated shared expert, one row per workgroup: `y[t, :] += sigmoid(u[t] . w) * sh[t, :]`.
// One workgroup per token row: its loops issue four independent loads per iteration, as
// rms_norm's do (the same latency chain).
struct Params {
    d: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read_write> u: array<f32>;
@group(0) @binding(4) var<storage, read_write> w: array<f32>;
@group(0) @binding(5) var<storage, read_write> sh: array<f32>;

fn prod(o: u32, j: u32) -> f32 {
    if (j < P.d) {
        return u[o + j] * w[j];
    }
    return 0.0;
}

// `y[o + j] + s * sh[o + j]`, 0 past the row (loaded before any store, so an iteration's
// loads are independent).
fn upd(o: u32, j: u32, s: f32) -> f32 {
    if (j < P.d) {
        return y[o + j] + s * sh[o + j];
    }
    return 0.0;
}

fn put(o: u32, j: u32, v: f32) {
    if (j < P.d) {
        y[o + j] = v;
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let o = wid.x * P.d;
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
    for (var j = li; j < P.d; j += 4u * WG) {
        let v0 = upd(o, j, s);
        let v1 = upd(o, j + WG, s);
        let v2 = upd(o, j + 2u * WG, s);
        let v3 = upd(o, j + 3u * WG, s);
        put(o, j, v0);
        put(o, j + WG, v1);
        put(o, j + 2u * WG, v2);
        put(o, j + 3u * WG, v3);
    }
}
