// The gated delta rule's per-token inputs for every token of a frame at once, so that the
// sequential recurrence (`gdn_recur`, the next dispatch) only loads them: per row and key head
// the l2-normalised q (times 1/sqrt(dk)) and k, per value head beta = sigmoid(b) and the decay
// exp(g), g = -exp(a_log) softplus(a + dt_bias). Row r of `qk` (F.row0 + t, as the conv's):
// q [key_dim] | k [key_dim] | beta [hv] | decay [hv].
//
// Workgroup (kh, t): key head kh of token row t, lane i holding elements i and i + WG of the
// head (dk <= 2 WG). The squares are summed by halving over the lanes, which for dk = 2^m adds
// what the recurrence's own tree added before this op existed, in the same order.
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
// a_log [hv] | dt_bias [hv] | norm weight [dv]
@group(0) @binding(7) var<storage, read_write> vecs: array<f32>;
@group(0) @binding(9) var<storage, read_write> qk: array<f32>;


@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let kh = wid.x;
    let r = F.row0 + wid.y;
    let w = 2u * P.key_dim + 2u * P.hv;
    let src = r * P.c + kh * P.dk;
    let dst = r * w + kh * P.dk;
    var q0 = 0.0;
    var k0 = 0.0;
    var q1 = 0.0;
    var k1 = 0.0;
    if (li < P.dk) {
        q0 = conv[src + li];
        k0 = conv[src + P.key_dim + li];
    }
    if (li + WG < P.dk) {
        q1 = conv[src + li + WG];
        k1 = conv[src + P.key_dim + li + WG];
    }
    let rq = 1.0 / sqrt(sum_wg(q0 * q0 + q1 * q1, li) + 1e-6);
    let rk = 1.0 / sqrt(sum_wg(k0 * k0 + k1 * k1, li) + 1e-6);
    let qscale = 1.0 / sqrt(f32(P.dk));
    if (li < P.dk) {
        qk[dst + li] = q0 * rq * qscale;
        qk[dst + P.key_dim + li] = k0 * rk;
    }
    if (li + WG < P.dk) {
        qk[dst + li + WG] = q1 * rq * qscale;
        qk[dst + P.key_dim + li + WG] = k1 * rk;
    }
    // The value heads that read this key head.
    let per = P.hv / P.hk;
    for (var j = li; j < per; j += WG) {
        let h = kh * per + j;
        let beta = sigmoid(bb[r * P.hv + h]);
        let g = -exp(vecs[h]) * softplus(aa[r * P.hv + h] + vecs[P.hv + h]);
        qk[r * w + 2u * P.key_dim + h] = beta;
        qk[r * w + 2u * P.key_dim + P.hv + h] = exp(g);
    }
}
