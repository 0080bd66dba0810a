// MoE routing of one row per workgroup: softmax over all experts, the top k (equal
// probabilities: the lower expert), renormalised when `norm` (summed in top-k order, as the CPU
// does); writes the dense weight row (zero for the experts not chosen) and the row's k slots,
// ids and weights in ascending expert order: the order the CPU executor adds experts in. Also
// the row's shared-expert gate `sigmoid(u . w)` (for `d` > 0), so the block's output can be the
// shared expert's epilogue (kernels-wgsl's `Epilogue::MoeOut`) or `shared_add` without a
// reduction of its own. The weights and gates go to the slots' buffer `tail`, after the slots'
// outputs (at `sw_off` and `g_off`). With a grid two workgroups high, the row's second
// workgroup computes the gate while the first routes (a decode step's routing is one
// workgroup, a chain of latencies the gate's loads and reduction no longer add to); with one,
// the one workgroup does both. The same code sums the gate either way.
struct Params {
    e: u32,
    k: u32,
    norm: u32,
    sw_off: u32,
    g_off: u32,
    d: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> logits: array<f32>;
@group(0) @binding(3) var<storage, read_write> pr: array<f32>;
@group(0) @binding(4) var<storage, read_write> rw: array<f32>;
@group(0) @binding(5) var<storage, read_write> ids: array<u32>;
@group(0) @binding(6) var<storage, read_write> tail: array<f32>;
@group(0) @binding(7) var<storage, read_write> u: array<f32>;
@group(0) @binding(8) var<storage, read_write> gw: array<f32>;

fn prod(o: u32, j: u32) -> f32 {
    if (j < P.d) {
        return u[o + j] * gw[j];
    }
    return 0.0;
}

var<workgroup> chosen: array<f32, 64>;
var<workgroup> chosen_i: array<u32, 64>;
// The row's probabilities (at most MAX_E experts; the host checks), padded with NEG to a
// multiple of 4.
const MAX_E: u32 = 1024u;
var<workgroup> sp: array<f32, MAX_E>;
// The candidates that can be in the top k, and how many.
var<workgroup> cand: array<u32, MAX_E>;
var<workgroup> ncand: atomic<u32>;
var<workgroup> tau: f32;
// The maxima of groups of lanes.
var<workgroup> gm: array<f32, WG>;
var<workgroup> gm_i: array<u32, WG>;

// Whether expert i (probability u) comes before expert j (probability v) in the CPU's stable
// descending order.
fn before(u: f32, i: u32, v: f32, j: u32) -> bool {
    return u > v || (u == v && i < j);
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let r = wid.x;
    let o = r * P.e;
    let e4 = (P.e + 3u) / 4u * 4u;
    if (li == 0u) {
        atomicStore(&ncand, 0u);
    }
    if (nwg.y == 1u || wid.y == 1u) {
        // The gate: eight partial sums a lane, eight independent loads an iteration, then the
        // workgroup's tree (the order shared_add summed it in, on as many lanes).
        var p0 = 0.0;
        var p1 = 0.0;
        var p2 = 0.0;
        var p3 = 0.0;
        var p4 = 0.0;
        var p5 = 0.0;
        var p6 = 0.0;
        var p7 = 0.0;
        let ou = r * P.d;
        for (var j = li; j < P.d; j += 8u * WG) {
            p0 += prod(ou, j);
            p1 += prod(ou, j + WG);
            p2 += prod(ou, j + 2u * WG);
            p3 += prod(ou, j + 3u * WG);
            p4 += prod(ou, j + 4u * WG);
            p5 += prod(ou, j + 5u * WG);
            p6 += prod(ou, j + 6u * WG);
            p7 += prod(ou, j + 7u * WG);
        }
        let gate = sigmoid(sum_wg(((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)), li));
        if (li == 0u && P.d > 0u) {
            tail[P.g_off + r] = gate;
        }
    }
    if (wid.y == 1u) {
        return;
    }
    var m = NEG;
    for (var j = li; j < e4; j += WG) {
        var v = NEG;
        if (j < P.e) {
            v = logits[o + j];
        }
        sp[j] = v;
        m = max(m, v);
    }
    let mx = max_wg(m, li);
    var z = 0.0;
    for (var j = li; j < P.e; j += WG) {
        let e = exp(sp[j] - mx);
        sp[j] = e;
        z += e;
    }
    let zt = sum_wg(z, li);
    // Each lane's largest probability (and the expert it belongs to).
    var lm = NEG;
    var lj = 0xffffffffu;
    for (var j = li; j < P.e; j += WG) {
        let p = sp[j] / zt;
        sp[j] = p;
        pr[o + j] = p;
        rw[o + j] = 0.0;
        if (before(p, j, lm, lj)) {
            lm = p;
            lj = j;
        }
    }
    // tau = the k-th largest of the maxima of groups of `gs` lanes: k distinct experts are
    // >= tau, so every expert of the top k is, and only those >= tau (a few dozen at most)
    // need an exact rank. Groups of up to 8 lanes (16 maxima to rank for 512 experts), as
    // long as at least k groups hold experts (lane l holds some iff l < e), so the k-th
    // largest is a real one.
    red[li] = lm;
    red_i[li] = lj;
    let live = min(P.e, WG);
    var gs = 1u;
    while (gs < 8u && 2u * gs <= WG && (live + 2u * gs - 1u) / (2u * gs) >= P.k) {
        gs = 2u * gs;
    }
    let ng = WG / gs;
    // (The storage barrier orders the dense row's zeros before lane 0's weights.)
    storageBarrier();
    workgroupBarrier();
    if (li < ng) {
        var bm = NEG;
        var bj = 0xffffffffu;
        for (var l = li * gs; l < li * gs + gs; l++) {
            if (before(red[l], red_i[l], bm, bj)) {
                bm = red[l];
                bj = red_i[l];
            }
        }
        gm[li] = bm;
        gm_i[li] = bj;
    }
    workgroupBarrier();
    if (li < ng) {
        let bm = gm[li];
        let bj = gm_i[li];
        var lr = 0u;
        for (var g = 0u; g < ng; g++) {
            lr += u32(before(gm[g], gm_i[g], bm, bj));
        }
        if (lr == P.k - 1u) {
            tau = bm;
        }
    }
    workgroupBarrier();
    let t = tau;
    for (var j = li; j < P.e; j += WG) {
        if (sp[j] >= t) {
            cand[atomicAdd(&ncand, 1u)] = j;
        }
    }
    workgroupBarrier();
    // The candidates' ranks in the CPU's order over all experts: ranks below k are the chosen,
    // in top-k order (k rounds of a workgroup argmax took 29 us on the H200). An expert ranked
    // before a candidate is >= it, so >= tau, so itself a candidate: ranking among the
    // candidates gives the rank among all experts.
    let n = atomicLoad(&ncand);
    for (var c = li; c < n; c += WG) {
        let j = cand[c];
        let v = sp[j];
        var rank = 0u;
        for (var i = 0u; i < n; i++) {
            let u = cand[i];
            rank += u32(before(sp[u], u, v, j));
        }
        if (rank < P.k) {
            chosen[rank] = v;
            chosen_i[rank] = j;
        }
    }
    workgroupBarrier();
    // The weights' sum in top-k order (the CPU's), by one lane; then lane s < k places pick s:
    // its weight, and its slot among the picks in ascending expert order (its id's rank among
    // them: ids are distinct), all k at once (an insertion sort on one lane was a chain of
    // ~100 dependent workgroup-memory steps).
    if (li == 0u) {
        var sum = 0.0;
        for (var it = 0u; it < P.k; it++) {
            sum += chosen[it];
        }
        tau = sum;
    }
    workgroupBarrier();
    if (li < P.k) {
        var wgt = chosen[li];
        if (P.norm == 1u) {
            wgt = wgt / tau;
        }
        let id = chosen_i[li];
        rw[o + id] = wgt;
        var slot = 0u;
        for (var it = 0u; it < P.k; it++) {
            slot += u32(chosen_i[it] < id);
        }
        ids[r * P.k + slot] = id;
        tail[P.sw_off + r * P.k + slot] = wgt;
    }
}
