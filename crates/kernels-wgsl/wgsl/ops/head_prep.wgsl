// One head of one row per workgroup: read `hd` values (row stride, offset, head stride), an
// optional (1+w) RMSNorm over the head, optional rotate-half RoPE of the first `2 half` dims at
// position `past + row`, write to a row of `dst` (row `past + row` when `at_past`: a cache).
// Serves q (norm + rope), the attention gate (copy), k and v into the KV cache, the indexer
// queries, and the raw indexer keys. The grid's heads past `heads_a` are a second member, a
// plain copy to `dst_b` with its own strides, from `src_b` (`b_own_src`) or from `src` (a
// buffer is not bound writable twice): q and the gate, k and v, the indexer queries and raw
// keys each in one dispatch (a decode step's preps were six dispatches of a few microseconds
// each).
struct Params {
    src_stride: u32,
    src_off: u32,
    src_hstride: u32,
    hd: u32,
    dst_stride: u32,
    heads_a: u32,
    at_past: u32,
    norm: u32,
    half: u32,
    eps: u32,
    b_src_stride: u32,
    b_src_off: u32,
    b_src_hstride: u32,
    b_dst_stride: u32,
    b_at_past: u32,
    b_own_src: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> src: array<f32>;
@group(0) @binding(3) var<storage, read_write> w: array<f32>;
@group(0) @binding(4) var<storage, read_write> dst: array<f32>;
@group(0) @binding(5) var<storage, read_write> cosv: array<f32>;
@group(0) @binding(6) var<storage, read_write> sinv: array<f32>;
@group(0) @binding(7) var<storage, read_write> dst_b: array<f32>;
@group(0) @binding(8) var<storage, read_write> src_b: array<f32>;

var<workgroup> v: array<f32, 512>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let r = wid.y;
    if (wid.x >= P.heads_a) {
        // The second member: a copy (the branch is uniform in the workgroup: no barrier).
        let h = wid.x - P.heads_a;
        let s0 = (F.row0 + r) * P.b_src_stride + P.b_src_off + h * P.b_src_hstride;
        var row = F.row0 + r;
        if (P.b_at_past == 1u) {
            row = F.past + r;
        }
        let d0 = row * P.b_dst_stride + h * P.hd;
        for (var i = li; i < P.hd; i += WG) {
            var a = 0.0;
            if (P.b_own_src == 1u) {
                a = src_b[s0 + i];
            } else {
                a = src[s0 + i];
            }
            dst_b[d0 + i] = a;
        }
        return;
    }
    let h = wid.x;
    let s0 = (F.row0 + r) * P.src_stride + P.src_off + h * P.src_hstride;
    var ss = 0.0;
    for (var i = li; i < P.hd; i += WG) {
        let a = src[s0 + i];
        v[i] = a;
        ss += a * a;
    }
    if (P.norm == 1u) {
        let rn = 1.0 / sqrt(sum_wg(ss, li) / f32(P.hd) + bitcast<f32>(P.eps));
        for (var i = li; i < P.hd; i += WG) {
            v[i] = v[i] * rn * (1.0 + w[i]);
        }
    }
    workgroupBarrier();
    var row = F.row0 + r;
    if (P.at_past == 1u) {
        row = F.past + r;
    }
    let d0 = row * P.dst_stride + h * P.hd;
    let pos = F.past + r;
    let half = P.half;
    for (var i = li; i < P.hd; i += WG) {
        var o = v[i];
        if (i < half) {
            o = v[i] * cosv[pos * half + i] - v[i + half] * sinv[pos * half + i];
        } else if (i < 2u * half) {
            let k = i - half;
            o = v[i] * cosv[pos * half + k] + v[k] * sinv[pos * half + k];
        }
        dst[d0 + i] = o;
    }
}
