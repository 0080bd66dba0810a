// Attention of one query head of one row per workgroup over the tokens it sees that the
// indexer selected (all of them when the row sees no more than `topk` blocks; always the
// incomplete tail block), softmax, values summed, times sigmoid(gate). Heads are read as
// vec4s (`head_dim` a multiple of 4: qsa's device_limits). The values' sum: a lane takes 4
// dimensions and every `groups`-th token (groups = WG / (head_dim / 4) key groups), the groups'
// sums added in group order: one lane walking every token for its dimensions was a chain of
// ~512 dependent steps at a 512-token prompt (1,041 us a call at 256 rows on an H100).
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
@group(0) @binding(2) var<storage, read_write> q: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> kc: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> vc: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> sel: array<u32>;
@group(0) @binding(6) var<storage, read_write> lg: array<f32>;
@group(0) @binding(7) var<storage, read_write> gate: array<f32>;
@group(0) @binding(8) var<storage, read_write> out: array<f32>;

// The key groups' value sums, [groups][head_dim / 4].
var<workgroup> part4: array<vec4<f32>, WG>;

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
    let quads = P.hd / 4u;
    let qb = q0 / 4u;
    var m = NEG;
    for (var s = li; s < visible; s += WG) {
        if (selected(F.row0 + r, s, nb)) {
            let kb = (s * kvd + kh * P.hd) / 4u;
            var d = 0.0;
            for (var i = 0u; i < quads; i++) {
                d += dot(q[qb + i], kc[kb + i]);
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
    // Heads wider than WG quads: one group, each lane several quads.
    let groups = max(WG / quads, 1u);
    let kg = li / quads;
    if (kg < groups) {
        for (var qd = li % quads; qd < quads; qd += WG) {
            var acc = vec4<f32>(0.0);
            for (var s = kg; s < visible; s += groups) {
                if (selected(F.row0 + r, s, nb)) {
                    acc += lg[l0 + s] / zt * vc[(s * kvd + kh * P.hd) / 4u + qd];
                }
            }
            if (groups == 1u) {
                emit(q0 + 4u * qd, acc);
            } else {
                part4[kg * quads + qd] = acc;
            }
        }
    }
    workgroupBarrier();
    if (groups > 1u && li < quads) {
        var acc = part4[li];
        for (var g = 1u; g < groups; g++) {
            acc += part4[g * quads + li];
        }
        emit(q0 + 4u * li, acc);
    }
}

fn emit(o: u32, acc: vec4<f32>) {
    out[o] = acc.x * sigmoid(gate[o]);
    out[o + 1u] = acc.y * sigmoid(gate[o + 1u]);
    out[o + 2u] = acc.z * sigmoid(gate[o + 2u]);
    out[o + 3u] = acc.w * sigmoid(gate[o + 3u]);
}
