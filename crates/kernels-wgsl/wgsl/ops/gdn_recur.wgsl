// The gated delta rule of one value head per workgroup over the frame's T tokens in order, the
// [dk, dv] state held in registers for the whole frame (read once, written once): lane
// (part, j) owns value column j and rows part*R .. part*R + R of it (R = ceil(dk / 4)), so the
// per-token sums over dk are four partial sums added in a fixed order. R is an override set by
// the host to ceil(dk / 4): constant loop bounds let the driver unroll the row loops and keep
// `st` in registers (with runtime bounds it lived in local memory).
// `q, k = l2norm`, `q /= sqrt(dk)`, `S *= exp(g)`, `delta = beta (v - S^T k)`, `S += k delta^T`,
// `o = S^T q`, then the gated RMSNorm `o = w * norm(o) * act(z)`.
//
// Only the state update is sequential in the tokens. Everything that does not read the state
// (the q/k norms, beta and the decay, the v column, the output norm and gate) is done for a
// chunk of up to 8 tokens at once, outside the token loop: the loop is two cross-part sums a
// token. Every sum is added in the order a 512-lane tree over the lanes' values adds it (a
// tree of the smallest power-of-two width that holds the values: the wider rounds only add
// zeros), so a token's results do not depend on the frame it is in.
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
// Key values of a chunk's tokens: 8 tokens of dk <= 128, 4 of dk <= 256.
const KV: u32 = 1024u;
const TMAX: u32 = 8u;

// A chunk's normalised q and k, token t's at t * width.
var<workgroup> qs: array<f32, KV>;
var<workgroup> ks: array<f32, KV>;
// The trees' values (q and k squares, then the outputs' squares).
var<workgroup> tr: array<f32, 2048>;
// A token's v column, then (same place, once read) its output before the norm.
var<workgroup> vo: array<f32, 1024>;
// (beta, decay) per token of the chunk.
var<workgroup> bd: array<vec2<f32>, TMAX>;
var<workgroup> part_sum: array<f32, GW>;

// Sums each of `n` rows of `w` values in `tr` (row a at a * w) by halving: the order of a
// 512-lane tree whose lanes past w hold zeros. The sum of row a ends in tr[a * w].
fn trees(n: u32, w: u32, li: u32) {
    workgroupBarrier();
    for (var h = w / 2u; h > 0u; h = h >> 1u) {
        for (var x = li; x < n * h; x += GW) {
            let a = x / h;
            let i = x - a * h;
            tr[a * w + i] = tr[a * w + i] + tr[a * w + i + h];
        }
        workgroupBarrier();
    }
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

// The smallest power of two >= n (at least 1).
fn pow2(n: u32) -> u32 {
    var w = 1u;
    while (w < n) {
        w = w << 1u;
    }
    return w;
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
    let wk = pow2(P.dk);
    let wv = pow2(P.dv);
    let tc = min(TMAX, KV / wk);
    var st: array<f32, MAXR>;
    if (live) {
        for (var ii = 0u; ii < R; ii++) {
            if (i0 + ii < i1) {
                st[ii] = s[base + (i0 + ii) * P.dv];
            }
        }
    }
    for (var t0 = 0u; t0 < P.t; t0 += tc) {
        let n = min(tc, P.t - t0);
        // The chunk's q, k (their squares into the trees), v, beta and decay, all at once.
        for (var x = li; x < n * wk; x += GW) {
            let t = x / wk;
            let i = x - t * wk;
            var q = 0.0;
            var k = 0.0;
            if (i < P.dk) {
                let r = F.row0 + t0 + t;
                q = conv[r * P.c + kh * P.dk + i];
                k = conv[r * P.c + P.key_dim + kh * P.dk + i];
            }
            qs[x] = q;
            ks[x] = k;
            tr[x] = q * q;
            tr[(n + t) * wk + i] = k * k;
        }
        for (var x = li; x < n * COLS; x += GW) {
            let t = x / COLS;
            let jj = x - t * COLS;
            if (jj < P.dv) {
                let r = F.row0 + t0 + t;
                vo[x] = conv[r * P.c + 2u * P.key_dim + h * P.dv + jj];
            }
        }
        if (li < n) {
            let r = F.row0 + t0 + li;
            let beta = sigmoid(bb[r * P.hv + h]);
            let g = -exp(vecs[h]) * softplus(aa[r * P.hv + h] + vecs[P.hv + h]);
            bd[li] = vec2<f32>(beta, exp(g));
        }
        trees(2u * n, wk, li);
        for (var x = li; x < n * wk; x += GW) {
            let t = x / wk;
            let rq = 1.0 / sqrt(tr[t * wk] + 1e-6);
            let rk = 1.0 / sqrt(tr[(n + t) * wk] + 1e-6);
            qs[x] = qs[x] * rq * qscale;
            ks[x] = ks[x] * rk;
        }
        workgroupBarrier();
        for (var t = 0u; t < n; t++) {
            let beta = bd[t].x;
            let decay = bd[t].y;
            let kq = t * wk + i0;
            var d = 0.0;
            if (live) {
                for (var ii = 0u; ii < R; ii++) {
                    if (i0 + ii < i1) {
                        let v = st[ii] * decay;
                        st[ii] = v;
                        d += v * ks[kq + ii];
                    }
                }
            }
            let dsum = across_parts(d, li, j);
            var delta = 0.0;
            if (live) {
                delta = (vo[t * COLS + j] - dsum) * beta;
            }
            var o = 0.0;
            if (live) {
                for (var ii = 0u; ii < R; ii++) {
                    if (i0 + ii < i1) {
                        let v = st[ii] + ks[kq + ii] * delta;
                        st[ii] = v;
                        o += v * qs[kq + ii];
                    }
                }
            }
            let osum = across_parts(o, li, j);
            // Every part read v before the sum's barriers: its place takes the output.
            if (live && part == 0u) {
                vo[t * COLS + j] = osum;
            }
        }
        workgroupBarrier();
        // The gated RMSNorm of the chunk's outputs.
        for (var x = li; x < n * wv; x += GW) {
            let t = x / wv;
            let jj = x - t * wv;
            var sq = 0.0;
            if (jj < P.dv) {
                let o = vo[t * COLS + jj];
                sq = o * o;
            }
            tr[x] = sq;
        }
        trees(n, wv, li);
        for (var x = li; x < n * COLS; x += GW) {
            let t = x / COLS;
            let jj = x - t * COLS;
            if (jj < P.dv) {
                let rr = 1.0 / sqrt(tr[t * wv] / f32(P.dv) + bitcast<f32>(P.eps));
                let at = (F.row0 + t0 + t) * hvd + h * P.dv + jj;
                let zz = z[at];
                var gate = sigmoid(zz);
                if (P.gate_silu == 1u) {
                    gate = silu(zz);
                }
                out[at] = vecs[2u * P.hv + jj] * (vo[x] * rr) * gate;
            }
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
