// The Gated DeltaNet output's gated RMSNorm, in place: `o = w * norm(o) * act(z)` per token and
// value head (workgroup (h, t)), after `gdn_recur` (which splits a head's columns across
// workgroups, so no one workgroup has a head's whole output to norm).
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
@group(0) @binding(3) var<storage, read_write> z: array<f32>;
// a_log [hv] | dt_bias [hv] | norm weight [dv]
@group(0) @binding(7) var<storage, read_write> vecs: array<f32>;
@group(0) @binding(8) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wid.x;
    let at0 = (F.row0 + wid.y) * P.hv * P.dv + h * P.dv;
    var sq = 0.0;
    for (var j = li; j < P.dv; j += WG) {
        let o = out[at0 + j];
        sq += o * o;
    }
    let rr = 1.0 / sqrt(sum_wg(sq, li) / f32(P.dv) + bitcast<f32>(P.eps));
    for (var j = li; j < P.dv; j += WG) {
        let zz = z[at0 + j];
        var gate = sigmoid(zz);
        if (P.gate_silu == 1u) {
            gate = silu(zz);
        }
        out[at0 + j] = vecs[2u * P.hv + j] * (out[at0 + j] * rr) * gate;
    }
}
