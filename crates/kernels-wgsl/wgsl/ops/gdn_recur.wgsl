// The gated delta rule of one value head per workgroup, T tokens in order, the [dk, dv] state
// in device memory; lane j owns value columns j, j + WG, ...:
// `q, k = l2norm`, `q /= sqrt(dk)`, `S *= exp(g)`, `delta = beta (v - S^T k)`, `S += k delta^T`,
// `o = S^T q`, then the gated RMSNorm `o = w * norm(o) * act(z)`. Sums over dk run in the
// CPU forward's order.
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

var<workgroup> qs: array<f32, 256>;
var<workgroup> ks: array<f32, 256>;

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

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wid.x;
    let kh = h / (P.hv / P.hk);
    let qscale = 1.0 / sqrt(f32(P.dk));
    let hvd = P.hv * P.dv;
    for (var r = 0u; r < P.t; r++) {
        var pq = 0.0;
        var pk = 0.0;
        for (var i = li; i < P.dk; i += WG) {
            let q = conv[r * P.c + kh * P.dk + i];
            let k = conv[r * P.c + P.key_dim + kh * P.dk + i];
            qs[i] = q;
            ks[i] = k;
            pq += q * q;
            pk += k * k;
        }
        let rq = 1.0 / sqrt(sum_wg(pq, li) + 1e-6);
        let rk = 1.0 / sqrt(sum_wg(pk, li) + 1e-6);
        for (var i = li; i < P.dk; i += WG) {
            qs[i] = qs[i] * rq * qscale;
            ks[i] = ks[i] * rk;
        }
        workgroupBarrier();
        let beta = sigmoid(bb[r * P.hv + h]);
        let g = -exp(vecs[h]) * softplus(aa[r * P.hv + h] + vecs[P.hv + h]);
        let decay = exp(g);
        var po = 0.0;
        for (var j = li; j < P.dv; j += WG) {
            let base = h * P.dk * P.dv + j;
            var d = 0.0;
            for (var i = 0u; i < P.dk; i++) {
                let v = s[base + i * P.dv] * decay;
                s[base + i * P.dv] = v;
                d += v * ks[i];
            }
            let delta = (conv[r * P.c + 2u * P.key_dim + h * P.dv + j] - d) * beta;
            var o = 0.0;
            for (var i = 0u; i < P.dk; i++) {
                let v = s[base + i * P.dv] + ks[i] * delta;
                s[base + i * P.dv] = v;
                o += v * qs[i];
            }
            out[r * hvd + h * P.dv + j] = o;
            po += o * o;
        }
        let rr = 1.0 / sqrt(sum_wg(po, li) / f32(P.dv) + bitcast<f32>(P.eps));
        for (var j = li; j < P.dv; j += WG) {
            let at = r * hvd + h * P.dv + j;
            let zz = z[at];
            var gate = sigmoid(zz);
            if (P.gate_silu == 1u) {
                gate = silu(zz);
            }
            out[at] = vecs[2u * P.hv + j] * (out[at] * rr) * gate;
        }
        workgroupBarrier();
    }
}
