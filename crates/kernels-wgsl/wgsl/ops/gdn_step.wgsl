// The gated delta rule of a few tokens (a decode step, a verify window) in one dispatch: what
// `gdn_prep`, `gdn_recur` and `gdn_norm` do in three, for one value head per workgroup. A
// decoded token's three were each a chain of a few memory latencies and barriers on a handful
// of workgroups, and the GPU drained between them; one workgroup per head holds the head's
// whole output, so its gated norm needs no second dispatch.
//
// Every sum is the three kernels' own, in their order, so each output and state bit equals
// theirs: q's and k's squares summed by halving over 128 lanes (lane i holding elements i and
// i + 128: `gdn_prep` with its 128 lanes); S^T k and S^T q as L = 8 parts of R rows each, in
// row order, the parts added in order (`gdn_recur`); the output's squares over 128 lanes,
// lane i holding elements i, i + 128, .., then halved (`gdn_norm`). The lanes here are
// (part, column) pairs, C = WG / L columns a pass, so a head of dv columns takes
// ceil(dv / C) passes; its state is loaded and stored per token and pass (a token reads each
// state value once either way).
//
// A decode step's workgroup is a chain of memory latencies and barriers, so every global load
// of a token is issued first, before any reduction: q and k, the head's scalars, v, the gate's
// z and the norm's weights, and (where a pass covers the whole head: `WG / L` >= dv) the state
// itself, which then stays in registers across the frame's tokens (a store and a load of the
// same f32 give it back unchanged, so the bits are the reloading path's). q's and k's sums of
// squares share one tree (each component's additions the same as alone).
struct Params {
    t: u32,
    hk: u32,
    hv: u32,
    dk: u32,
    dv: u32,
    c: u32,
    key_dim: u32,
    gate_silu: u32,
    eps: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> conv: array<f32>;
@group(0) @binding(3) var<storage, read_write> z: array<f32>;
@group(0) @binding(4) var<storage, read_write> bb: array<f32>;
@group(0) @binding(5) var<storage, read_write> aa: array<f32>;
@group(0) @binding(6) var<storage, read_write> s: array<f32>;
// a_log [hv] | dt_bias [hv] | norm weight [dv]
@group(0) @binding(7) var<storage, read_write> vecs: array<f32>;
@group(0) @binding(8) var<storage, read_write> out: array<f32>;

// The lanes the other kernels' reductions ran on (gdn_prep's and gdn_norm's workgroups).
const RL: u32 = 128u;
// Parts a column's rows split into (gdn_recur's L, kernels-wgsl's GDN_PARTS).
const L: u32 = 8u;
const C: u32 = WG / L;
const MAXR: u32 = 32u;
override R: u32 = 16u;
// Widest key head (two elements a reduction lane) and value head (at most one value a lane).
const MAXK: u32 = 2u * RL;
const MAXV: u32 = WG;

var<workgroup> qs: array<f32, MAXK>;
var<workgroup> ks: array<f32, MAXK>;
var<workgroup> oh: array<f32, MAXV>;
var<workgroup> pd: array<f32, WG>;
var<workgroup> bd: vec2<f32>;
var<workgroup> red2: array<vec2<f32>, RL>;


// The sum of `v` over lanes 0..RL (sum_wg's tree on RL lanes); every lane gets it. Called by
// every lane (the barriers), lanes past RL contribute nothing.
fn sum_rl(v: f32, li: u32) -> f32 {
    if (li < RL) {
        red[li] = v;
    }
    workgroupBarrier();
    for (var h = RL / 2u; h > 0u; h = h >> 1u) {
        if (li < h) {
            red[li] = red[li] + red[li + h];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

// `sum_rl` of two values at once: each component summed in `sum_rl`'s order.
fn sum_rl2(v: vec2<f32>, li: u32) -> vec2<f32> {
    if (li < RL) {
        red2[li] = v;
    }
    workgroupBarrier();
    for (var h = RL / 2u; h > 0u; h = h >> 1u) {
        if (li < h) {
            red2[li] = red2[li] + red2[li + h];
        }
        workgroupBarrier();
    }
    let r = red2[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wid.x;
    let kh = h / (P.hv / P.hk);
    let hvd = P.hv * P.dv;
    let c = li % C;
    let part = li / C;
    let i0 = part * R;
    let i1 = min(i0 + R, P.dk);
    let passes = (P.dv + C - 1u) / C;
    // One pass a token: this lane's column of the state is loaded once for the frame.
    let one = passes == 1u;
    let live0 = c < P.dv;
    let base0 = h * P.dk * P.dv + c;
    var st: array<f32, MAXR>;
    if (one && live0) {
        for (var ii = 0u; ii < R; ii++) {
            if (i0 + ii < i1) {
                st[ii] = s[base0 + (i0 + ii) * P.dv];
            }
        }
    }
    for (var t = 0u; t < P.t; t++) {
        let r = F.row0 + t;
        // Every load of the token before the first barrier.
        let src = r * P.c + kh * P.dk;
        var q0 = 0.0;
        var k0 = 0.0;
        var q1 = 0.0;
        var k1 = 0.0;
        if (li < RL && li < P.dk) {
            q0 = conv[src + li];
            k0 = conv[src + P.key_dim + li];
        }
        if (li < RL && li + RL < P.dk) {
            q1 = conv[src + li + RL];
            k1 = conv[src + P.key_dim + li + RL];
        }
        var vv = 0.0;
        if (one && live0) {
            vv = conv[r * P.c + 2u * P.key_dim + h * P.dv + c];
        }
        let at0 = r * hvd + h * P.dv;
        var zz = 0.0;
        var wn = 0.0;
        if (li < P.dv) {
            zz = z[at0 + li];
            wn = vecs[2u * P.hv + li];
        }
        if (li == 0u) {
            let beta = sigmoid(bb[r * P.hv + h]);
            let g = -exp(vecs[h]) * softplus(aa[r * P.hv + h] + vecs[P.hv + h]);
            bd = vec2<f32>(beta, exp(g));
        }
        // gdn_prep: the head's normalised q and k, beta and the decay.
        let sums = sum_rl2(vec2<f32>(q0 * q0 + q1 * q1, k0 * k0 + k1 * k1), li);
        let rq = 1.0 / sqrt(sums.x + 1e-6);
        let rk = 1.0 / sqrt(sums.y + 1e-6);
        let qscale = 1.0 / sqrt(f32(P.dk));
        if (li < RL && li < P.dk) {
            qs[li] = q0 * rq * qscale;
            ks[li] = k0 * rk;
        }
        if (li < RL && li + RL < P.dk) {
            qs[li + RL] = q1 * rq * qscale;
            ks[li + RL] = k1 * rk;
        }
        workgroupBarrier();
        let beta = bd.x;
        let decay = bd.y;
        // gdn_recur, a pass of C columns at a time.
        for (var p = 0u; p < passes; p++) {
            let j = p * C + c;
            let live = j < P.dv;
            let base = h * P.dk * P.dv + j;
            var d = 0.0;
            if (live) {
                for (var ii = 0u; ii < R; ii++) {
                    if (i0 + ii < i1) {
                        var raw = st[ii];
                        if (!one) {
                            raw = s[base + (i0 + ii) * P.dv];
                        }
                        let v = raw * decay;
                        st[ii] = v;
                        d += v * ks[i0 + ii];
                    }
                }
            }
            pd[li] = d;
            workgroupBarrier();
            var dsum = pd[c];
            for (var q = 1u; q < L; q++) {
                dsum += pd[q * C + c];
            }
            var delta = 0.0;
            if (live) {
                var x = vv;
                if (!one) {
                    x = conv[r * P.c + 2u * P.key_dim + h * P.dv + j];
                }
                delta = (x - dsum) * beta;
            }
            var o = 0.0;
            if (live) {
                for (var ii = 0u; ii < R; ii++) {
                    if (i0 + ii < i1) {
                        let v = st[ii] + ks[i0 + ii] * delta;
                        s[base + (i0 + ii) * P.dv] = v;
                        st[ii] = v;
                        o += v * qs[i0 + ii];
                    }
                }
            }
            // Every lane has read this pass's sums of S^T k: the buffer takes S^T q's.
            workgroupBarrier();
            pd[li] = o;
            workgroupBarrier();
            if (part == 0u && live) {
                var osum = pd[c];
                for (var q = 1u; q < L; q++) {
                    osum += pd[q * C + c];
                }
                oh[j] = osum;
            }
            workgroupBarrier();
        }
        // gdn_norm: the head's gated RMSNorm.
        var sq = 0.0;
        if (li < RL) {
            for (var j = li; j < P.dv; j += RL) {
                let o = oh[j];
                sq += o * o;
            }
        }
        let rr = 1.0 / sqrt(sum_rl(sq, li) / f32(P.dv) + bitcast<f32>(P.eps));
        if (li < P.dv) {
            var gate = sigmoid(zz);
            if (P.gate_silu == 1u) {
                gate = silu(zz);
            }
            out[at0 + li] = wn * (oh[li] * rr) * gate;
        }
        // The next token's prep overwrites qs, ks and bd, its recurrence oh.
        workgroupBarrier();
    }
}
