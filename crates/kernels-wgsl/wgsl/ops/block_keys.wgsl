// The indexer's block keys of the blocks this frame completes (`nb_lo..nb_hi`), one per
// workgroup: `K_b = RoPE(k_layernorm(mean(raw keys of the block)))` at the block's first
// position.
struct Params {
    ratio: u32,
    di: u32,
    half: u32,
    eps: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> raw: array<f32>;
@group(0) @binding(3) var<storage, read_write> w: array<f32>;
@group(0) @binding(4) var<storage, read_write> bk: array<f32>;
@group(0) @binding(5) var<storage, read_write> cosv: array<f32>;
@group(0) @binding(6) var<storage, read_write> sinv: array<f32>;

var<workgroup> v: array<f32, 512>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let b = F.nb_lo + wid.x;
    if (b >= F.nb_hi) {
        return;
    }
    var ss = 0.0;
    for (var i = li; i < P.di; i += WG) {
        var acc = 0.0;
        for (var j = 0u; j < P.ratio; j++) {
            acc += raw[(b * P.ratio + j) * P.di + i];
        }
        let m = acc / f32(P.ratio);
        v[i] = m;
        ss += m * m;
    }
    let rn = 1.0 / sqrt(sum_wg(ss, li) / f32(P.di) + bitcast<f32>(P.eps));
    for (var i = li; i < P.di; i += WG) {
        v[i] = v[i] * rn * (1.0 + w[i]);
    }
    workgroupBarrier();
    let pos = b * P.ratio;
    let half = P.half;
    for (var i = li; i < P.di; i += WG) {
        var o = v[i];
        if (i < half) {
            o = v[i] * cosv[pos * half + i] - v[i + half] * sinv[pos * half + i];
        } else if (i < 2u * half) {
            let k = i - half;
            o = v[i] * cosv[pos * half + k] + v[k] * sinv[pos * half + k];
        }
        bk[b * P.di + i] = o;
    }
}
