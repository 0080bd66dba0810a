// DeepSeek's attention, one workgroup per (head, token row): the one K = V latent of the
// sliding window (positions `max(p + 1 - win, 0) ..= p` from the ring `kr` `[ring, dh]`),
// then the compressed entries the row sees (`mode` 1, HCA: all visible; 2, CSA: those the
// indexer kept in `sel`; 0: none); `softmax(q . k * scale)` with the head's sink logit in the
// denominator only, the rows weighted in key order as the CPU does. V's RoPE is undone
// afterwards (`ds_rope`, inverse).
struct Params {
    nh: u32,
    dh: u32,
    win: u32,
    ring: u32,
    mode: u32,
    rate: u32,
    maxe: u32,
    maxk: u32,
    scale: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> q: array<f32>;
@group(0) @binding(3) var<storage, read_write> kr: array<f32>;
@group(0) @binding(4) var<storage, read_write> ent: array<f32>;
@group(0) @binding(5) var<storage, read_write> sel: array<u32>;
@group(0) @binding(6) var<storage, read_write> sinks: array<f32>;
@group(0) @binding(7) var<storage, read_write> lg: array<f32>;
@group(0) @binding(8) var<storage, read_write> out: array<f32>;

// Whether key `k` of row `r` (window keys first, `nw` of them) is attended.
fn used(r: u32, k: u32, nw: u32) -> bool {
    return P.mode != 2u || k < nw || sel[r * P.maxe + k - nw] == 1u;
}

// Where key `k`'s row starts: in the window ring, or among the entries.
fn key_at(k: u32, nw: u32, lo: u32) -> u32 {
    if (k < nw) {
        return ((lo + k) % P.ring) * P.dh;
    }
    return (k - nw) * P.dh;
}

fn key(k: u32, nw: u32, at: u32, i: u32) -> f32 {
    if (k < nw) {
        return kr[at + i];
    }
    return ent[at + i];
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wid.x;
    let r = wid.y;
    let p = F.past + r;
    var lo = 0u;
    if (p + 1u > P.win) {
        lo = p + 1u - P.win;
    }
    let nw = p + 1u - lo;
    var ne = 0u;
    if (P.mode != 0u) {
        ne = min((p + 1u) / P.rate, P.maxe);
    }
    let nk = nw + ne;
    let q0 = (r * P.nh + h) * P.dh;
    let l0 = (r * P.nh + h) * P.maxk;
    let scale = bitcast<f32>(P.scale);
    // The logits: `lpk` lanes per key split its `dh`-long dot product (one lane walking all
    // 512 channels of a key was a chain of dependent loads: 86 us a call on an H100), as many
    // lanes as leave every key a group in one pass (a power of two, at most 32).
    var lpk = 1u;
    loop {
        if (lpk >= 32u || WG / (lpk * 2u) < nk) {
            break;
        }
        lpk = lpk * 2u;
    }
    let groups = WG / lpk;
    let g = li / lpk;
    let part = li % lpk;
    var m = NEG;
    let passes = (nk + groups - 1u) / groups;
    for (var ps = 0u; ps < passes; ps++) {
        let k = ps * groups + g;
        let live = k < nk && used(r, k, nw);
        var d = 0.0;
        if (live) {
            let at = key_at(k, nw, lo);
            for (var i = part; i < P.dh; i += lpk) {
                d += q[q0 + i] * key(k, nw, at, i);
            }
        }
        red[li] = d;
        workgroupBarrier();
        if (live && part == 0u) {
            var s = 0.0;
            for (var j = 0u; j < lpk; j++) {
                s += red[li + j];
            }
            let l = s * scale;
            lg[l0 + k] = l;
            m = max(m, l);
        }
        workgroupBarrier();
    }
    // Key k's logit was written by its group's first lane, and lane k % WG reads it next.
    storageBarrier();
    let sink = sinks[h];
    let mx = max(max_wg(m, li), sink);
    var z = 0.0;
    for (var k = li; k < nk; k += WG) {
        if (used(r, k, nw)) {
            let e = exp(lg[l0 + k] - mx);
            lg[l0 + k] = e;
            z += e;
        }
    }
    let zt = sum_wg(z, li) + exp(sink - mx);
    storageBarrier();
    for (var i = li; i < P.dh; i += WG) {
        var acc = 0.0;
        for (var k = 0u; k < nk; k++) {
            if (used(r, k, nw)) {
                acc += lg[l0 + k] / zt * key(k, nw, key_at(k, nw, lo), i);
            }
        }
        out[q0 + i] = acc;
    }
}
