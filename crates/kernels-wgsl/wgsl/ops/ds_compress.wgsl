// DeepSeek's KV compressors (CSA, HCA, the indexer's): the entries of the windows this frame
// completes, one workgroup per candidate window. Window `w` (positions `w*rate ..
// (w+1)*rate`) is complete once position `(w+1)*rate - 1` is fed. Per channel, the slots'
// `gate + position_bias` are softmaxed and weight the slots' `kv` (overlapping: the previous
// window's Ca halves, then this window's Cb halves; otherwise this window's rows), in slot
// order as the CPU does; then the entry's RMSNorm (plain weight) and RoPE at position `w*rate`.
// `kvr`/`gr` are the projections' rings (`[ring, width]` by position, `ds_store`). With `raw`
// (V4.1, whose latents leave the compressor before RoPE) the normed latent of the frame's i-th
// candidate window goes to row i of `ent`, without RoPE (`ds_qat` publishes it).
struct Params {
    nt: u32,
    rate: u32,
    hd: u32,
    width: u32,
    overlap: u32,
    ring: u32,
    eps: u32,
    half: u32,
    maxe: u32,
    raw: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> kvr: array<f32>;
@group(0) @binding(3) var<storage, read_write> gr: array<f32>;
@group(0) @binding(4) var<storage, read_write> bias: array<f32>;
@group(0) @binding(5) var<storage, read_write> norm: array<f32>;
@group(0) @binding(6) var<storage, read_write> cs: array<f32>;
@group(0) @binding(7) var<storage, read_write> ent: array<f32>;

fn gate(pos: u32, off: u32, ch: u32) -> f32 {
    return gr[(pos % P.ring) * P.width + off + ch] + bias[(pos % P.rate) * P.width + off + ch];
}

fn kv(pos: u32, off: u32, ch: u32) -> f32 {
    return kvr[(pos % P.ring) * P.width + off + ch];
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let w = F.past / P.rate + wid.x;
    if ((w + 1u) * P.rate > F.past + P.nt || w >= P.maxe) {
        return;
    }
    // Slots: [first, w*rate) are the previous window's Ca halves (channel offset 0), then
    // this window's rows at channel offset `off`.
    var first = w * P.rate;
    var off = 0u;
    if (P.overlap == 1u) {
        off = P.hd;
        if (w > 0u) {
            first = first - P.rate;
        }
    }
    let end = (w + 1u) * P.rate;
    let mid = w * P.rate;
    var dst = w * P.hd;
    if (P.raw == 1u) {
        dst = wid.x * P.hd;
    }
    var ss = 0.0;
    for (var ch = li; ch < P.hd; ch += WG) {
        var m = NEG;
        for (var p = first; p < end; p++) {
            m = max(m, gate(p, select(off, 0u, p < mid), ch));
        }
        var z = 0.0;
        for (var p = first; p < end; p++) {
            z += exp(gate(p, select(off, 0u, p < mid), ch) - m);
        }
        var e = 0.0;
        for (var p = first; p < end; p++) {
            let o = select(off, 0u, p < mid);
            e += exp(gate(p, o, ch) - m) / z * kv(p, o, ch);
        }
        ent[dst + ch] = e;
        ss += e * e;
    }
    let tot = sum_wg(ss, li);
    let r = 1.0 / sqrt(tot / f32(P.hd) + bitcast<f32>(P.eps));
    for (var ch = li; ch < P.hd; ch += WG) {
        ent[dst + ch] = norm[ch] * (ent[dst + ch] * r);
    }
    if (P.raw == 1u) {
        return;
    }
    storageBarrier();
    let t0 = w * P.rate * 2u * P.half;
    for (var i = li; i < P.half; i += WG) {
        let c = cs[t0 + i];
        let s = cs[t0 + P.half + i];
        let at = w * P.hd + P.hd - 2u * P.half + 2u * i;
        let a = ent[at];
        let b = ent[at + 1u];
        ent[at] = a * c - b * s;
        ent[at + 1u] = b * c + a * s;
    }
}
