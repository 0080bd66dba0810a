// `Qwen4ExpTextRMSNorm` over consecutive groups of `group` values, one workgroup per group:
// `y = x / sqrt(mean(x^2) + eps) * (1 + w)`, `w` applied with period `w_len` (one weight per
// head, or one per stream). Few workgroups run (4 for a hyper-connection site), so a lane's
// loop is a chain of memory latencies: each iteration issues eight independent loads (a
// 2560-wide group took 20 us with one load per iteration on the H200, ~18 with four). The
// eight partial sums are added in a fixed order, so the result does not depend on the device.
// With `inject` = 1 (a hyper-connection site's norm of the streams, `h` of them per token row,
// one group each) the previous block's output is injected first, in place:
// `x[g, :] += inj[g] * blk[g / h, :]` (the streams then hold what `hc_inject` would have left),
// so the injection costs no dispatch of its own. `wmode` picks the weight: 0 `(1 + w)` (Qwen's
// norms), 1 `w` (DeepSeek's), 2 none (DeepSeek's unweighted norms; `w` is bound but not read).
struct Params {
    groups: u32,
    group: u32,
    w_len: u32,
    eps: u32,
    inject: u32,
    h: u32,
    wmode: u32,
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

// The factor of weight `v` under `wmode` (a uniform branch).
fn wt(v: f32) -> f32 {
    if (P.wmode == 0u) {
        return 1.0 + v;
    }
    if (P.wmode == 1u) {
        return v;
    }
    return 1.0;
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
    var s0 = 0.0;
    var s1 = 0.0;
    var s2 = 0.0;
    var s3 = 0.0;
    var s4 = 0.0;
    var s5 = 0.0;
    var s6 = 0.0;
    var s7 = 0.0;
    if (P.inject == 1u) {
        // The squares are summed as the injected values are stored, in the order the other
        // branch sums them (same lanes, same partial sums), saving its loads.
        for (var i = li; i < P.group; i += 8u * WG) {
            let v0 = injected(g, base, i + 0u * WG);
            let v1 = injected(g, base, i + 1u * WG);
            let v2 = injected(g, base, i + 2u * WG);
            let v3 = injected(g, base, i + 3u * WG);
            let v4 = injected(g, base, i + 4u * WG);
            let v5 = injected(g, base, i + 5u * WG);
            let v6 = injected(g, base, i + 6u * WG);
            let v7 = injected(g, base, i + 7u * WG);
            store_x(base, i + 0u * WG, v0);
            store_x(base, i + 1u * WG, v1);
            store_x(base, i + 2u * WG, v2);
            store_x(base, i + 3u * WG, v3);
            store_x(base, i + 4u * WG, v4);
            store_x(base, i + 5u * WG, v5);
            store_x(base, i + 6u * WG, v6);
            store_x(base, i + 7u * WG, v7);
            s0 += v0 * v0;
            s1 += v1 * v1;
            s2 += v2 * v2;
            s3 += v3 * v3;
            s4 += v4 * v4;
            s5 += v5 * v5;
            s6 += v6 * v6;
            s7 += v7 * v7;
        }
    } else {
        for (var i = li; i < P.group; i += 8u * WG) {
            let v0 = at(base, i + 0u * WG);
            let v1 = at(base, i + WG);
            let v2 = at(base, i + 2u * WG);
            let v3 = at(base, i + 3u * WG);
            let v4 = at(base, i + 4u * WG);
            let v5 = at(base, i + 5u * WG);
            let v6 = at(base, i + 6u * WG);
            let v7 = at(base, i + 7u * WG);
            s0 += v0 * v0;
            s1 += v1 * v1;
            s2 += v2 * v2;
            s3 += v3 * v3;
            s4 += v4 * v4;
            s5 += v5 * v5;
            s6 += v6 * v6;
            s7 += v7 * v7;
        }
    }
    let total = sum_wg(((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), li);
    let r = 1.0 / sqrt(total / f32(P.group) + bitcast<f32>(P.eps));
    for (var i = li; i < P.group; i += 8u * WG) {
        let v0 = at(base, i + 0u * WG);
        let w0 = w[(base + i + 0u * WG) % P.w_len];
        let v1 = at(base, i + 1u * WG);
        let w1 = w[(base + i + 1u * WG) % P.w_len];
        let v2 = at(base, i + 2u * WG);
        let w2 = w[(base + i + 2u * WG) % P.w_len];
        let v3 = at(base, i + 3u * WG);
        let w3 = w[(base + i + 3u * WG) % P.w_len];
        let v4 = at(base, i + 4u * WG);
        let w4 = w[(base + i + 4u * WG) % P.w_len];
        let v5 = at(base, i + 5u * WG);
        let w5 = w[(base + i + 5u * WG) % P.w_len];
        let v6 = at(base, i + 6u * WG);
        let w6 = w[(base + i + 6u * WG) % P.w_len];
        let v7 = at(base, i + 7u * WG);
        let w7 = w[(base + i + 7u * WG) % P.w_len];
        if (i + 0u * WG < P.group) {
            y[base + i + 0u * WG] = v0 * r * wt(w0);
        }
        if (i + 1u * WG < P.group) {
            y[base + i + 1u * WG] = v1 * r * wt(w1);
        }
        if (i + 2u * WG < P.group) {
            y[base + i + 2u * WG] = v2 * r * wt(w2);
        }
        if (i + 3u * WG < P.group) {
            y[base + i + 3u * WG] = v3 * r * wt(w3);
        }
        if (i + 4u * WG < P.group) {
            y[base + i + 4u * WG] = v4 * r * wt(w4);
        }
        if (i + 5u * WG < P.group) {
            y[base + i + 5u * WG] = v5 * r * wt(w5);
        }
        if (i + 6u * WG < P.group) {
            y[base + i + 6u * WG] = v6 * r * wt(w6);
        }
        if (i + 7u * WG < P.group) {
            y[base + i + 7u * WG] = v7 * r * wt(w7);
        }
    }
}
