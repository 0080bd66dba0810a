// MoE routing of one row per workgroup: softmax over all experts, the top k (equal
// probabilities: the lower expert), renormalised when `norm` (summed in top-k order, as the CPU
// does); writes the dense weight row (zero for the experts not chosen) and the row's k slots,
// ids and weights in ascending expert order: the order the CPU executor adds experts in.
struct Params {
    e: u32,
    k: u32,
    norm: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> logits: array<f32>;
@group(0) @binding(3) var<storage, read_write> pr: array<f32>;
@group(0) @binding(4) var<storage, read_write> rw: array<f32>;
@group(0) @binding(5) var<storage, read_write> ids: array<u32>;
@group(0) @binding(6) var<storage, read_write> sw: array<f32>;

var<workgroup> chosen: array<f32, 64>;
var<workgroup> chosen_i: array<u32, 64>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let r = wid.x;
    let o = r * P.e;
    var m = NEG;
    for (var j = li; j < P.e; j += WG) {
        m = max(m, logits[o + j]);
    }
    let mx = max_wg(m, li);
    var z = 0.0;
    for (var j = li; j < P.e; j += WG) {
        let e = exp(logits[o + j] - mx);
        pr[o + j] = e;
        z += e;
    }
    let zt = sum_wg(z, li);
    for (var j = li; j < P.e; j += WG) {
        pr[o + j] = pr[o + j] / zt;
        rw[o + j] = 0.0;
    }
    storageBarrier();
    for (var it = 0u; it < P.k; it++) {
        var bv = NEG;
        var bi = 0u;
        for (var j = li; j < P.e; j += WG) {
            let v = pr[o + j];
            if (v > bv) {
                bv = v;
                bi = j;
            }
        }
        let best = argmax_wg(bv, bi, li);
        if (li == 0u) {
            chosen[it] = pr[o + best];
            chosen_i[it] = best;
            pr[o + best] = -1.0;
        }
        storageBarrier();
    }
    if (li == 0u) {
        var sum = 0.0;
        for (var it = 0u; it < P.k; it++) {
            sum += chosen[it];
        }
        for (var it = 0u; it < P.k; it++) {
            var wgt = chosen[it];
            if (P.norm == 1u) {
                wgt = wgt / sum;
            }
            chosen[it] = wgt;
            rw[o + chosen_i[it]] = wgt;
        }
        // Insertion sort of the k slots by expert id.
        for (var i = 1u; i < P.k; i++) {
            let wi = chosen[i];
            let ei = chosen_i[i];
            var j = i;
            while (j > 0u && chosen_i[j - 1u] > ei) {
                chosen[j] = chosen[j - 1u];
                chosen_i[j] = chosen_i[j - 1u];
                j -= 1u;
            }
            chosen[j] = wi;
            chosen_i[j] = ei;
        }
        for (var it = 0u; it < P.k; it++) {
            ids[r * P.k + it] = chosen_i[it];
            sw[r * P.k + it] = chosen[it];
        }
    }
}
