// Attention of one query head of one row per workgroup over the tokens it sees that the
// indexer selected (all of them when the row sees no more than `topk` blocks; always the
// incomplete tail block), softmax, values summed in token order, times sigmoid(gate).
struct Params {
    hq: u32,
    hkv: u32,
    hd: u32,
    ratio: u32,
    topk: u32,
    maxb: u32,
    ctx: u32,
    scale: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> q: array<f32>;
@group(0) @binding(3) var<storage, read_write> kc: array<f32>;
@group(0) @binding(4) var<storage, read_write> vc: array<f32>;
@group(0) @binding(5) var<storage, read_write> sel: array<u32>;
@group(0) @binding(6) var<storage, read_write> lg: array<f32>;
@group(0) @binding(7) var<storage, read_write> gate: array<f32>;
@group(0) @binding(8) var<storage, read_write> out: array<f32>;

fn selected(r: u32, s: u32, nb: u32) -> bool {
    return nb <= P.topk || s >= nb * P.ratio || sel[r * P.maxb + s / P.ratio] == 1u;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wid.x;
    let r = wid.y;
    let visible = F.past + r + 1u;
    let nb = visible / P.ratio;
    let kh = h / (P.hq / P.hkv);
    let kvd = P.hkv * P.hd;
    let q0 = ((F.row0 + r) * P.hq + h) * P.hd;
    let l0 = ((F.row0 + r) * P.hq + h) * P.ctx;
    let scale = bitcast<f32>(P.scale);
    var m = NEG;
    for (var s = li; s < visible; s += WG) {
        if (selected(F.row0 + r, s, nb)) {
            var d = 0.0;
            for (var i = 0u; i < P.hd; i++) {
                d += q[q0 + i] * kc[s * kvd + kh * P.hd + i];
            }
            let l = d * scale;
            lg[l0 + s] = l;
            m = max(m, l);
        }
    }
    let mx = max_wg(m, li);
    var z = 0.0;
    for (var s = li; s < visible; s += WG) {
        if (selected(F.row0 + r, s, nb)) {
            let e = exp(lg[l0 + s] - mx);
            lg[l0 + s] = e;
            z += e;
        }
    }
    let zt = sum_wg(z, li);
    storageBarrier();
    for (var i = li; i < P.hd; i += WG) {
        var acc = 0.0;
        for (var s = 0u; s < visible; s++) {
            if (selected(F.row0 + r, s, nb)) {
                acc += lg[l0 + s] / zt * vc[s * kvd + kh * P.hd + i];
            }
        }
        out[q0 + i] = acc * sigmoid(gate[q0 + i]);
    }
}
