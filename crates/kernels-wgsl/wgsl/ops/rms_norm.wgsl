// `Qwen4ExpTextRMSNorm` over consecutive groups of `group` values, one workgroup per group:
// `y = x / sqrt(mean(x^2) + eps) * (1 + w)`, `w` applied with period `w_len` (one weight per
// head, or one per stream). Few workgroups run (4 for a hyper-connection site), so a lane's
// loop is a chain of memory latencies: each iteration issues four independent loads (a
// 2560-wide group took 20 us with one load per iteration on the H200). The four partial sums
// are added in a fixed order, so the result does not depend on the device.
// With `inject` = 1 (a hyper-connection site's norm of the streams, `h` of them per token row,
// one group each) the previous block's output is injected first, in place:
// `x[g, :] += inj[g] * blk[g / h, :]` (the streams then hold what `hc_inject` would have left),
// so the injection costs no dispatch of its own.
struct Params {
    groups: u32,
    group: u32,
    w_len: u32,
    eps: u32,
    inject: u32,
    h: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> w: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<storage, read_write> blk: array<f32>;
@group(0) @binding(6) var<storage, read_write> inj: array<f32>;

// Element i of the group at `base` (group index g), after the injection; 0 past the group.
fn at(base: u32, i: u32) -> f32 {
    if (i < P.group) {
        return x[base + i];
    }
    return 0.0;
}

fn injected(g: u32, base: u32, i: u32) -> f32 {
    if (i < P.group) {
        return x[base + i] + inj[g] * blk[(g / P.h) * P.group + i];
    }
    return 0.0;
}

fn store_x(base: u32, i: u32, v: f32) {
    if (i < P.group) {
        x[base + i] = v;
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let g = wid.x;
    if (g >= P.groups) {
        return;
    }
    let base = g * P.group;
    if (P.inject == 1u) {
        for (var i = li; i < P.group; i += 4u * WG) {
            let v0 = injected(g, base, i);
            let v1 = injected(g, base, i + WG);
            let v2 = injected(g, base, i + 2u * WG);
            let v3 = injected(g, base, i + 3u * WG);
            store_x(base, i, v0);
            store_x(base, i + WG, v1);
            store_x(base, i + 2u * WG, v2);
            store_x(base, i + 3u * WG, v3);
        }
    }
    var s0 = 0.0;
    var s1 = 0.0;
    var s2 = 0.0;
    var s3 = 0.0;
    for (var i = li; i < P.group; i += 4u * WG) {
        let v0 = at(base, i);
        let v1 = at(base, i + WG);
        let v2 = at(base, i + 2u * WG);
        let v3 = at(base, i + 3u * WG);
        s0 += v0 * v0;
        s1 += v1 * v1;
        s2 += v2 * v2;
        s3 += v3 * v3;
    }
    let total = sum_wg((s0 + s1) + (s2 + s3), li);
    let r = 1.0 / sqrt(total / f32(P.group) + bitcast<f32>(P.eps));
    for (var i = li; i < P.group; i += 4u * WG) {
        let v0 = at(base, i);
        let v1 = at(base, i + WG);
        let v2 = at(base, i + 2u * WG);
        let v3 = at(base, i + 3u * WG);
        let w0 = w[(base + i) % P.w_len];
        let w1 = w[(base + i + WG) % P.w_len];
        let w2 = w[(base + i + 2u * WG) % P.w_len];
        let w3 = w[(base + i + 3u * WG) % P.w_len];
        y[base + i] = v0 * r * (1.0 + w0);
        if (i + WG < P.group) {
            y[base + i + WG] = v1 * r * (1.0 + w1);
        }
        if (i + 2u * WG < P.group) {
            y[base + i + 2u * WG] = v2 * r * (1.0 + w2);
        }
        if (i + 3u * WG < P.group) {
            y[base + i + 3u * WG] = v3 * r * (1.0 + w3);
        }
    }
}
