// The QSA indexer's block choice for one query row per workgroup: over the complete blocks the
// row sees, `score_b = sum_h relu(q_I[h] . K_b) / sqrt(d_I)`, then the `topk` best blocks
// (equal scores: the lower block) are flagged in `sel`. A row that sees no more than `topk`
// blocks attends to all of them and is left alone (`attend` knows).
struct Params {
    ratio: u32,
    ni: u32,
    di: u32,
    topk: u32,
    maxb: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> qi: array<f32>;
@group(0) @binding(3) var<storage, read_write> bk: array<f32>;
@group(0) @binding(4) var<storage, read_write> sc: array<f32>;
@group(0) @binding(5) var<storage, read_write> sel: array<u32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let r = wid.x;
    let nb = (F.past + r + 1u) / P.ratio;
    if (nb <= P.topk) {
        return;
    }
    let q0 = (F.row0 + r) * P.ni * P.di;
    let s0 = (F.row0 + r) * P.maxb;
    let inv = 1.0 / sqrt(f32(P.di));
    for (var b = li; b < nb; b += WG) {
        var s = 0.0;
        for (var h = 0u; h < P.ni; h++) {
            var d = 0.0;
            for (var i = 0u; i < P.di; i++) {
                d += qi[q0 + h * P.di + i] * bk[b * P.di + i];
            }
            s += max(d, 0.0);
        }
        sc[s0 + b] = s * inv;
        sel[s0 + b] = 0u;
    }
    storageBarrier();
    for (var it = 0u; it < P.topk; it++) {
        var bv = NEG;
        var bi = 0u;
        for (var b = li; b < nb; b += WG) {
            let v = sc[s0 + b];
            if (v > bv) {
                bv = v;
                bi = b;
            }
        }
        let best = argmax_wg(bv, bi, li);
        if (li == 0u) {
            sel[s0 + best] = 1u;
            // Taken: below every score (scores are >= 0).
            sc[s0 + best] = -1.0;
        }
        storageBarrier();
    }
}
