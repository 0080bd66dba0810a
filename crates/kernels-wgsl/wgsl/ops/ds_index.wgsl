// DeepSeek's lightning indexer, one workgroup per token row: the score of every compressed
// entry the row's position sees, `sum_h (w_h / sqrt(nI)) relu(q_I[h] . K_I[s]) / sqrt(dI)` with
// the heads summed in order as the CPU does, then the top `min(topk, visible)` as a mask
// `sel[row, s]` (an entry is kept when fewer than k entries beat it, a tie beaten by the lower
// index: the CPU's order, `-0.0 == +0.0` included). With `restricted` (V4.1's two-level top-k,
// level two) only the entries `cand` `[nt, maxe]` marks compete; the rest score NEG and are
// never kept.
struct Params {
    nt: u32,
    ni: u32,
    di: u32,
    rate: u32,
    topk: u32,
    maxe: u32,
    wscale: u32,
    sscale: u32,
    restricted: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> qi: array<f32>;
@group(0) @binding(3) var<storage, read_write> wts: array<f32>;
@group(0) @binding(4) var<storage, read_write> keys: array<f32>;
@group(0) @binding(5) var<storage, read_write> sc: array<f32>;
@group(0) @binding(6) var<storage, read_write> sel: array<u32>;
@group(0) @binding(7) var<storage, read_write> cand: array<u32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let r = wid.x;
    let vis = min((F.past + r + 1u) / P.rate, P.maxe);
    let wscale = bitcast<f32>(P.wscale);
    let sscale = bitcast<f32>(P.sscale);
    for (var s = li; s < vis; s += WG) {
        var acc = 0.0;
        for (var h = 0u; h < P.ni; h++) {
            let q0 = (r * P.ni + h) * P.di;
            var dot = 0.0;
            for (var i = 0u; i < P.di; i++) {
                dot += qi[q0 + i] * keys[s * P.di + i];
            }
            acc += max(dot, 0.0) * sscale * (wts[r * P.ni + h] * wscale);
        }
        if (P.restricted == 1u && cand[r * P.maxe + s] == 0u) {
            acc = NEG;
        }
        sc[r * P.maxe + s] = acc;
    }
    storageBarrier();
    let k = min(P.topk, vis);
    for (var s = li; s < vis; s += WG) {
        let v = sc[r * P.maxe + s];
        var rank = 0u;
        for (var t = 0u; t < vis; t++) {
            let u = sc[r * P.maxe + t];
            if (u > v || (u == v && t < s)) {
                rank++;
            }
        }
        sel[r * P.maxe + s] = select(0u, 1u, rank < k && v > NEG);
    }
}
