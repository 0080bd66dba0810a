// The gated delta rule over the frame's T tokens in order, before the output's gated norm
// (`gdn_norm`, the next dispatch): `S *= decay`, `delta = beta (v - S^T k)`, `S += k delta^T`,
// `o = S^T q`, raw `o` into `out`. The normalised q and k, beta and the decay come from
// `gdn_prep` (the dispatch before), computed for every token of the frame at once.
//
// A value column's update reads only its own column of the [dk, dv] state, so a head's
// columns split across workgroups: workgroup `h * G + g` takes columns `g*C .. g*C + C` of
// head h (G = ceil(dv / C)). A head in one workgroup left most of a large GPU idle (32 value
// heads, 32 workgroups) and made every token's sums wait on barriers across 512 lanes. Lane
// (part, c) owns column c and rows part*R .. part*R + R of it (R = ceil(dk / L), an override
// set by the host: constant loop bounds let the driver unroll the row loops and keep the state
// in registers). A token's sums over dk are the L parts' partial sums (each over its rows in
// order) added in part order: its results do not depend on the frame it is in.
//
// Only the state update is sequential in the tokens. A chunk of up to TMAX tokens' q, k, v,
// beta and decay is staged in workgroup memory at once (loads the driver can issue together),
// then the loop is one cross-part sum a token (S^T k, one barrier); the outputs' sums over the
// parts wait for the chunk's end, all of its tokens at once.
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
@group(0) @binding(4) var<storage, read_write> bb: array<f32>;
@group(0) @binding(5) var<storage, read_write> aa: array<f32>;
@group(0) @binding(6) var<storage, read_write> s: array<f32>;
// a_log [hv] | dt_bias [hv] | norm weight [dv]
@group(0) @binding(7) var<storage, read_write> vecs: array<f32>;
@group(0) @binding(8) var<storage, read_write> out: array<f32>;
// gdn_prep's rows: q [key_dim] | k [key_dim] | beta [hv] | decay [hv].
@group(0) @binding(9) var<storage, read_write> qk: array<f32>;

// Parts a column's rows split into, and columns a workgroup takes.
const L: u32 = 8u;
const C: u32 = WG / L;
const MAXR: u32 = 64u;
override R: u32 = 16u;
// Key values of a chunk's tokens: 8 tokens of dk <= 128, 4 of dk <= 256.
const KV: u32 = 1024u;
const TMAX: u32 = 8u;

// A chunk's normalised q and k, token t's at t * width.
var<workgroup> qs: array<f32, KV>;
var<workgroup> ks: array<f32, KV>;
// The chunk's v for the workgroup's columns.
var<workgroup> vo: array<f32, TMAX * C>;
// (beta, decay) per token of the chunk.
var<workgroup> bd: array<vec2<f32>, TMAX>;
// The parts' partial sums of S^T k (two tokens' buffers) and of S^T q (the chunk's tokens).
var<workgroup> pd: array<f32, 2 * WG>;
var<workgroup> po: array<f32, TMAX * WG>;

// The smallest power of two >= n (at least 1; n is a head width, far below 2^31).
fn pow2(n: u32) -> u32 {
    var w = 1u;
    while (w < n && w < 0x80000000u) {
        w = w << 1u;
    }
    return w;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let groups = (P.dv + C - 1u) / C;
    let h = wid.x / groups;
    let j0 = (wid.x - h * groups) * C;
    let kh = h / (P.hv / P.hk);
    let w = 2u * P.key_dim + 2u * P.hv;
    let hvd = P.hv * P.dv;
    let c = li % C;
    let part = li / C;
    let j = j0 + c;
    let i0 = part * R;
    let i1 = min(i0 + R, P.dk);
    let live = j < P.dv;
    let base = h * P.dk * P.dv + j;
    let wk = pow2(P.dk);
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
        // The chunk's q, k, v, beta and decay: a constant count of loads per lane.
        for (var u = 0u; u < KV / WG; u++) {
            let x = li + u * WG;
            let t = x / wk;
            let i = x - t * wk;
            var q = 0.0;
            var k = 0.0;
            if (t < n && i < P.dk) {
                let r = F.row0 + t0 + t;
                q = qk[r * w + kh * P.dk + i];
                k = qk[r * w + P.key_dim + kh * P.dk + i];
            }
            qs[x] = q;
            ks[x] = k;
        }
        for (var u = 0u; u < (TMAX * C + WG - 1u) / WG; u++) {
            let x = li + u * WG;
            let t = x / C;
            let jj = j0 + x - t * C;
            if (t < n && jj < P.dv) {
                let r = F.row0 + t0 + t;
                vo[x] = conv[r * P.c + 2u * P.key_dim + h * P.dv + jj];
            }
        }
        if (li < n) {
            let r = F.row0 + t0 + li;
            bd[li] = vec2<f32>(qk[r * w + 2u * P.key_dim + h], qk[r * w + 2u * P.key_dim + P.hv + h]);
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
            // Two buffers: the next token's sums go to the other, and the barrier between
            // this token's reads and the write after next is the next token's.
            let pb = (t & 1u) * WG;
            pd[pb + li] = d;
            workgroupBarrier();
            var dsum = pd[pb + c];
            for (var p = 1u; p < L; p++) {
                dsum += pd[pb + p * C + c];
            }
            var delta = 0.0;
            if (live) {
                delta = (vo[t * C + c] - dsum) * beta;
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
            // The output's parts wait for the chunk's end: nothing in the loop needs them.
            po[t * WG + li] = o;
        }
        workgroupBarrier();
        for (var x = li; x < n * C; x += WG) {
            let t = x / C;
            let cc = x - t * C;
            let jj = j0 + cc;
            if (jj < P.dv) {
                var osum = po[t * WG + cc];
                for (var p = 1u; p < L; p++) {
                    osum += po[t * WG + p * C + cc];
                }
                out[(F.row0 + t0 + t) * hvd + h * P.dv + jj] = osum;
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
