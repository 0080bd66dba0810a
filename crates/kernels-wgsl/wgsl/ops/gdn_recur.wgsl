// The gated delta rule of one value head per workgroup over the frame's T tokens in order, the
// [dk, dv] state held in registers for the whole frame (read once, written once): lane
// (part, j) owns value column j and rows part*R .. part*R + R of it (R = ceil(dk / 4)), so the
// per-token sums over dk are four partial sums added in a fixed order. R is an override set by
// the host to ceil(dk / 4): constant loop bounds let the driver unroll the row loops and keep
// `st` in registers (with runtime bounds it lived in local memory).
// `q, k = l2norm`, `q /= sqrt(dk)`, `S *= exp(g)`, `delta = beta (v - S^T k)`, `S += k delta^T`,
// `o = S^T q`, then the gated RMSNorm `o = w * norm(o) * act(z)`.
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

// Lanes: 4 parts of up to 128 value columns.
const GW: u32 = 512u;
const COLS: u32 = 128u;
const MAXR: u32 = 64u;
override R: u32 = 32u;

var<workgroup> qs: array<f32, 256>;
var<workgroup> ks: array<f32, 256>;
var<workgroup> part_sum: array<f32, GW>;
var<workgroup> red512: array<f32, GW>;

fn sum512(v: f32, li: u32) -> f32 {
    red512[li] = v;
    workgroupBarrier();
    for (var w = GW / 2u; w > 0u; w = w >> 1u) {
        if (li < w) {
            red512[li] = red512[li] + red512[li + w];
        }
        workgroupBarrier();
    }
    let r = red512[0];
    workgroupBarrier();
    return r;
}

// The four parts' partial sums of column j, added in part order; every lane gets its column's.
fn across_parts(v: f32, li: u32, j: u32) -> f32 {
    part_sum[li] = v;
    workgroupBarrier();
    let r = ((part_sum[j] + part_sum[COLS + j]) + part_sum[2u * COLS + j]) + part_sum[3u * COLS + j];
    workgroupBarrier();
    return r;
}

// torch's softplus (threshold 20) with an accurate log1p.
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

@compute @workgroup_size(512)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wid.x;
    let kh = h / (P.hv / P.hk);
    let qscale = 1.0 / sqrt(f32(P.dk));
    let hvd = P.hv * P.dv;
    let j = li % COLS;
    let part = li / COLS;
    let i0 = part * R;
    let i1 = min(i0 + R, P.dk);
    let live = j < P.dv;
    let base = h * P.dk * P.dv + j;
    var st: array<f32, MAXR>;
    if (live) {
        for (var ii = 0u; ii < R; ii++) {
            if (i0 + ii < i1) {
                st[ii] = s[base + (i0 + ii) * P.dv];
            }
        }
    }
    for (var t = 0u; t < P.t; t++) {
        // Rows of the activation buffers (this sequence's, in a batched frame).
        let r = F.row0 + t;
        var pq = 0.0;
        var pk = 0.0;
        for (var i = li; i < P.dk; i += GW) {
            let q = conv[r * P.c + kh * P.dk + i];
            let k = conv[r * P.c + P.key_dim + kh * P.dk + i];
            qs[i] = q;
            ks[i] = k;
            pq += q * q;
            pk += k * k;
        }
        let rq = 1.0 / sqrt(sum512(pq, li) + 1e-6);
        let rk = 1.0 / sqrt(sum512(pk, li) + 1e-6);
        for (var i = li; i < P.dk; i += GW) {
            qs[i] = qs[i] * rq * qscale;
            ks[i] = ks[i] * rk;
        }
        workgroupBarrier();
        let beta = sigmoid(bb[r * P.hv + h]);
        let g = -exp(vecs[h]) * softplus(aa[r * P.hv + h] + vecs[P.hv + h]);
        let decay = exp(g);
        var d = 0.0;
        if (live) {
            for (var ii = 0u; ii < R; ii++) {
                if (i0 + ii < i1) {
                    let v = st[ii] * decay;
                    st[ii] = v;
                    d += v * ks[i0 + ii];
                }
            }
        }
        let dsum = across_parts(d, li, j);
        var delta = 0.0;
        if (live) {
            delta = (conv[r * P.c + 2u * P.key_dim + h * P.dv + j] - dsum) * beta;
        }
        var o = 0.0;
        if (live) {
            for (var ii = 0u; ii < R; ii++) {
                if (i0 + ii < i1) {
                    let v = st[ii] + ks[i0 + ii] * delta;
                    st[ii] = v;
                    o += v * qs[i0 + ii];
                }
            }
        }
        let osum = across_parts(o, li, j);
        var sq = 0.0;
        if (live && part == 0u) {
            sq = osum * osum;
        }
        let rr = 1.0 / sqrt(sum512(sq, li) / f32(P.dv) + bitcast<f32>(P.eps));
        if (live && part == 0u) {
            let at = r * hvd + h * P.dv + j;
            let zz = z[at];
            var gate = sigmoid(zz);
            if (P.gate_silu == 1u) {
                gate = silu(zz);
            }
            out[at] = vecs[2u * P.hv + j] * (osum * rr) * gate;
        }
        workgroupBarrier();
    }
    if (live) {
        for (var ii = 0u; ii < R; ii++) {
            if (i0 + ii < i1) {
                s[base + (i0 + ii) * P.dv] = st[ii];
            }
        }
    }
}
