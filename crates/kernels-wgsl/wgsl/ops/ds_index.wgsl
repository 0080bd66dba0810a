// DeepSeek's lightning indexer, one workgroup per token row: the score of every compressed
// entry the row's position sees (entry by entry, the heads' dot products split across the
// lanes), `sum_h (w_h / sqrt(nI)) relu(q_I[h] . K_I[s]) / sqrt(dI)` with
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

// Lanes per head: the workgroup splits each head's `dI`-long dot product (a lane walking all
// of `nI * dI` per entry alone was a chain of dependent loads: 486 us a call on an H100 at
// the release's 64 x 128).
fn lanes_per_head() -> u32 {
    if (P.ni <= WG && WG % P.ni == 0u) {
        return WG / P.ni;
    }
    return 1u;
}

const MAXS: u32 = 512u;
var<workgroup> part: array<f32, MAXS>;
var<workgroup> head_v: array<f32, MAXS>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let r = wid.x;
    let vis = min((F.past + r + 1u) / P.rate, P.maxe);
    let wscale = bitcast<f32>(P.wscale);
    let sscale = bitcast<f32>(P.sscale);
    let lph = lanes_per_head();
    let slices = min(P.ni * lph, MAXS);
    for (var s = 0u; s < vis; s++) {
        // Slice j: head j / lph, channels j % lph, + lph, ...
        for (var j = li; j < slices; j += WG) {
            let h = j / lph;
            let q0 = (r * P.ni + h) * P.di;
            var dot = 0.0;
            for (var i = j % lph; i < P.di; i += lph) {
                dot += qi[q0 + i] * keys[s * P.di + i];
            }
            part[j] = dot;
        }
        workgroupBarrier();
        for (var h = li; h < P.ni; h += WG) {
            var dot = 0.0;
            for (var k = 0u; k < lph; k++) {
                dot += part[h * lph + k];
            }
            head_v[h] = max(dot, 0.0) * sscale * (wts[r * P.ni + h] * wscale);
        }
        workgroupBarrier();
        if (li == 0u) {
            var acc = 0.0;
            for (var h = 0u; h < P.ni; h++) {
                acc += head_v[h];
            }
            if (P.restricted == 1u && cand[r * P.maxe + s] == 0u) {
                acc = NEG;
            }
            sc[r * P.maxe + s] = acc;
        }
        workgroupBarrier();
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
