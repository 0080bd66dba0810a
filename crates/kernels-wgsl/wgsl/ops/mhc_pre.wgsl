// DeepSeek's manifold-constrained hyper-connection before a block (`DeepseekV4HyperConnection`),
// and the head's collapse (`DeepseekV4HyperHead`), one workgroup per token row. `mix` holds the
// site's `fn` projection of the normalised streams `[nt, m]`. Site (`head` = 0, m = (2+N)N):
// `pre = sigmoid(mix * s0 + base) + eps`, `post = 2 sigmoid(mix * s1 + base)`,
// `C = softmax_row(mix * s2 + base) + eps`, made doubly stochastic by Sinkhorn-Knopp (a column
// normalisation, then `iters - 1` row + column rounds), all written to `maps` `[nt, m]` in the
// layout of `mix` (pre, post, C row-major). Head (`head` = 1, m = N): `pre = sigmoid(mix * s0 +
// base) + eps` only. Then the collapse `u = sum_k pre_k X_k` over the streams `x` `[nt, N, D]`
// (streams added in order, from 0) and the block's RMSNorm with weight `w` (`y = w * (u / rms)`),
// into `y` `[nt, D]`. The gates are one lane's work, the comb matrix N lanes' (N <= 8); the
// collapse and the norm are the workgroup's. V4.1's single-pass mHC collapses with the
// PREVIOUS site's `pre`: with `prev` > 0 the collapse reads `pre` from `prev_maps` `[nt, prev]`
// (that site's maps, or a one-hot row before the first layer) instead of this site's; `head` = 2
// computes no maps at all (V4.1's head: the last site's `pre`, then the final norm).
struct Params {
    nt: u32,
    n: u32,
    d: u32,
    head: u32,
    iters: u32,
    hc_eps: u32,
    norm_eps: u32,
    s0: u32,
    s1: u32,
    s2: u32,
    prev: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> mix: array<f32>;
@group(0) @binding(3) var<storage, read_write> base: array<f32>;
@group(0) @binding(4) var<storage, read_write> maps: array<f32>;
@group(0) @binding(5) var<storage, read_write> x: array<f32>;
@group(0) @binding(6) var<storage, read_write> w: array<f32>;
@group(0) @binding(7) var<storage, read_write> y: array<f32>;
@group(0) @binding(8) var<storage, read_write> prev_maps: array<f32>;

const MAXN: u32 = 8u;
var<workgroup> pre_w: array<f32, 8>;

// The comb matrix while Sinkhorn-Knopp runs, in workgroup memory: lane j < N normalises row
// j, lane k < N column k, each summing in order as the CPU does (one lane doing all of it
// through a storage buffer took 140 us a call on an H100).
var<workgroup> cm: array<f32, 64>;

// `pre` (and for a site `post`), one lane's work.
fn gates(t: u32) {
    let n = P.n;
    let eps = bitcast<f32>(P.hc_eps);
    let m = select((2u + n) * n, n, P.head == 1u);
    let src = t * m;
    let s0 = bitcast<f32>(P.s0);
    for (var k = 0u; k < n; k++) {
        let p = sigmoid(mix[src + k] * s0 + base[k]) + eps;
        maps[src + k] = p;
        pre_w[k] = p;
    }
    if (P.head == 1u) {
        return;
    }
    let s1 = bitcast<f32>(P.s1);
    for (var k = 0u; k < n; k++) {
        maps[src + n + k] = 2.0 * sigmoid(mix[src + n + k] * s1 + base[n + k]);
    }
}

// Row `j` of the comb matrix: the row's softmax (as the CPU's: max from -inf, exponentials
// summed in order) plus eps.
fn comb_row(t: u32, j: u32) {
    let n = P.n;
    let eps = bitcast<f32>(P.hc_eps);
    let src = t * (2u + n) * n;
    let s2 = bitcast<f32>(P.s2);
    var mx = -3.4028235e38;
    for (var k = 0u; k < n; k++) {
        let at = 2u * n + j * n + k;
        mx = max(mx, mix[src + at] * s2 + base[at]);
    }
    var z = 0.0;
    for (var k = 0u; k < n; k++) {
        let at = 2u * n + j * n + k;
        let e = exp(mix[src + at] * s2 + base[at] - mx);
        cm[j * n + k] = e;
        z += e;
    }
    for (var k = 0u; k < n; k++) {
        cm[j * n + k] = cm[j * n + k] / z + eps;
    }
}

fn norm_row(j: u32, n: u32, eps: f32) {
    var s = 0.0;
    for (var k = 0u; k < n; k++) {
        s += cm[j * n + k];
    }
    for (var k = 0u; k < n; k++) {
        cm[j * n + k] = cm[j * n + k] / (s + eps);
    }
}

fn norm_col(k: u32, n: u32, eps: f32) {
    var s = 0.0;
    for (var j = 0u; j < n; j++) {
        s += cm[j * n + k];
    }
    for (var j = 0u; j < n; j++) {
        cm[j * n + k] = cm[j * n + k] / (s + eps);
    }
}

// The site's maps: `pre`, `post`, and the comb matrix made doubly stochastic (a column
// normalisation, then `iters - 1` row + column rounds), written to `maps`.
fn site_maps(t: u32, li: u32) {
    let n = P.n;
    let eps = bitcast<f32>(P.hc_eps);
    if (li == 0u) {
        gates(t);
    }
    if (P.head == 1u) {
        return;
    }
    if (li < n) {
        comb_row(t, li);
    }
    workgroupBarrier();
    if (li < n) {
        norm_col(li, n, eps);
    }
    workgroupBarrier();
    for (var it = 1u; it < P.iters; it++) {
        if (li < n) {
            norm_row(li, n, eps);
        }
        workgroupBarrier();
        if (li < n) {
            norm_col(li, n, eps);
        }
        workgroupBarrier();
    }
    let c = t * (2u + n) * n + 2u * n;
    if (li < n * n) {
        maps[c + li] = cm[li];
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wid.x;
    if (t >= P.nt) {
        return;
    }
    if (P.head != 2u) {
        site_maps(t, li);
    }
    workgroupBarrier();
    let n = P.n;
    if (P.prev != 0u && li < n) {
        pre_w[li] = prev_maps[t * P.prev + li];
    }
    workgroupBarrier();
    let d = P.d;
    let xs = t * n * d;
    var ss = 0.0;
    for (var j = li; j < d; j += WG) {
        var u = 0.0;
        for (var k = 0u; k < n; k++) {
            u += pre_w[k] * x[xs + k * d + j];
        }
        y[t * d + j] = u;
        ss += u * u;
    }
    let total = sum_wg(ss, li);
    let r = 1.0 / sqrt(total / f32(d) + bitcast<f32>(P.norm_eps));
    for (var j = li; j < d; j += WG) {
        y[t * d + j] = w[j] * (y[t * d + j] * r);
    }
}
