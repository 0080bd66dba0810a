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

// The weight factor of element i of the group at `base`, or 1 past the group.
fn wf(base: u32, i: u32) -> f32 {
    if (i < P.group) {
        return wt(w[(base + i) % P.w_len]);
    }
    return 1.0;
}

fn store_y(base: u32, i: u32, v: f32) {
    if (i < P.group) {
        y[base + i] = v;
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let g = wid.x;
    if (g >= P.groups) {
        return;
    }
    let base = g * P.group;
    // One pass of eight elements a lane (groups up to 8 WG wide) keeps them and their weight
    // factors in registers across the reduction: the output is written without loading them
    // again (a memory latency saved; the weights' loads overlap the first pass's). Wider
    // groups walk the group again.
    let one = P.group <= 8u * WG;
    var v0 = 0.0;
    var v1 = 0.0;
    var v2 = 0.0;
    var v3 = 0.0;
    var v4 = 0.0;
    var v5 = 0.0;
    var v6 = 0.0;
    var v7 = 0.0;
    var s0 = 0.0;
    var s1 = 0.0;
    var s2 = 0.0;
    var s3 = 0.0;
    var s4 = 0.0;
    var s5 = 0.0;
    var s6 = 0.0;
    var s7 = 0.0;
    for (var i = li; i < P.group; i += 8u * WG) {
        if (P.inject == 1u) {
            // The squares are summed as the injected values are stored, in the order the
            // other branch sums them (same lanes, same partial sums).
            v0 = injected(g, base, i + 0u * WG);
            v1 = injected(g, base, i + 1u * WG);
            v2 = injected(g, base, i + 2u * WG);
            v3 = injected(g, base, i + 3u * WG);
            v4 = injected(g, base, i + 4u * WG);
            v5 = injected(g, base, i + 5u * WG);
            v6 = injected(g, base, i + 6u * WG);
            v7 = injected(g, base, i + 7u * WG);
            store_x(base, i + 0u * WG, v0);
            store_x(base, i + 1u * WG, v1);
            store_x(base, i + 2u * WG, v2);
            store_x(base, i + 3u * WG, v3);
            store_x(base, i + 4u * WG, v4);
            store_x(base, i + 5u * WG, v5);
            store_x(base, i + 6u * WG, v6);
            store_x(base, i + 7u * WG, v7);
        } else {
            v0 = at(base, i + 0u * WG);
            v1 = at(base, i + 1u * WG);
            v2 = at(base, i + 2u * WG);
            v3 = at(base, i + 3u * WG);
            v4 = at(base, i + 4u * WG);
            v5 = at(base, i + 5u * WG);
            v6 = at(base, i + 6u * WG);
            v7 = at(base, i + 7u * WG);
        }
        s0 += v0 * v0;
        s1 += v1 * v1;
        s2 += v2 * v2;
        s3 += v3 * v3;
        s4 += v4 * v4;
        s5 += v5 * v5;
        s6 += v6 * v6;
        s7 += v7 * v7;
    }
    var f0 = 1.0;
    var f1 = 1.0;
    var f2 = 1.0;
    var f3 = 1.0;
    var f4 = 1.0;
    var f5 = 1.0;
    var f6 = 1.0;
    var f7 = 1.0;
    if (one) {
        f0 = wf(base, li + 0u * WG);
        f1 = wf(base, li + 1u * WG);
        f2 = wf(base, li + 2u * WG);
        f3 = wf(base, li + 3u * WG);
        f4 = wf(base, li + 4u * WG);
        f5 = wf(base, li + 5u * WG);
        f6 = wf(base, li + 6u * WG);
        f7 = wf(base, li + 7u * WG);
    }
    let total = sum_wg(((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), li);
    let r = 1.0 / sqrt(total / f32(P.group) + bitcast<f32>(P.eps));
    if (one) {
        store_y(base, li + 0u * WG, v0 * r * f0);
        store_y(base, li + 1u * WG, v1 * r * f1);
        store_y(base, li + 2u * WG, v2 * r * f2);
        store_y(base, li + 3u * WG, v3 * r * f3);
        store_y(base, li + 4u * WG, v4 * r * f4);
        store_y(base, li + 5u * WG, v5 * r * f5);
        store_y(base, li + 6u * WG, v6 * r * f6);
        store_y(base, li + 7u * WG, v7 * r * f7);
        return;
    }
    for (var i = li; i < P.group; i += 8u * WG) {
        store_y(base, i + 0u * WG, at(base, i + 0u * WG) * r * wf(base, i + 0u * WG));
        store_y(base, i + 1u * WG, at(base, i + 1u * WG) * r * wf(base, i + 1u * WG));
        store_y(base, i + 2u * WG, at(base, i + 2u * WG) * r * wf(base, i + 2u * WG));
        store_y(base, i + 3u * WG, at(base, i + 3u * WG) * r * wf(base, i + 3u * WG));
        store_y(base, i + 4u * WG, at(base, i + 4u * WG) * r * wf(base, i + 4u * WG));
        store_y(base, i + 5u * WG, at(base, i + 5u * WG) * r * wf(base, i + 5u * WG));
        store_y(base, i + 6u * WG, at(base, i + 6u * WG) * r * wf(base, i + 6u * WG));
        store_y(base, i + 7u * WG, at(base, i + 7u * WG) * r * wf(base, i + 7u * WG));
    }
}
