// Greedy decoding's choice on the device: the index of the largest logit of one row (equal
// logits: the lower id), written as one word. Two dispatches, because one workgroup walking a
// 248k vocabulary waits on ~2000 dependent loads per lane (0.73 ms on the H200): mode 0, one
// workgroup per `chunk` logits, writes each chunk's best (value bits, index) pair into `part`;
// mode 1, one workgroup, reduces the `n` pairs. Ties resolve to the lower index at both levels.
struct Params {
    n: u32,
    offset: u32,
    mode: u32,
    chunk: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> logits: array<f32>;
@group(0) @binding(3) var<storage, read_write> token: array<u32>;
@group(0) @binding(4) var<storage, read_write> part: array<u32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    var bv = NEG;
    var bi = 0xffffffffu;
    if (P.mode == 0u) {
        let lo = wid.x * P.chunk;
        let hi = min(P.n, lo + P.chunk);
        for (var j = lo + li; j < hi; j += WG) {
            let v = logits[P.offset + j];
            if (v > bv || bi == 0xffffffffu) {
                bv = v;
                bi = j;
            }
        }
    } else {
        for (var j = li; j < P.n; j += WG) {
            let v = bitcast<f32>(part[2u * j]);
            let i = part[2u * j + 1u];
            if (v > bv || (v == bv && i < bi)) {
                bv = v;
                bi = i;
            }
        }
    }
    // A lane that saw nothing offers (NEG, u32::MAX): it never beats a real logit.
    let best = argmax_wg(bv, bi, li);
    let best_v = red[0];
    if (li == 0u) {
        if (P.mode == 0u) {
            part[2u * wid.x] = bitcast<u32>(best_v);
            part[2u * wid.x + 1u] = best;
        } else {
            token[0] = best;
        }
    }
}
