// The grouped experts of a long frame, expert by expert. The one-slot kernels compute each
// (token row, chosen expert) slot on its own, so at 256 rows a layer's 2,560 slots read their
// 512 experts' weights about five times each; here `expert_tiles` sorts the frame's slots by
// expert (counts per expert in workgroup memory, a prefix sum, a scatter: O(slots)) into tiles
// of up to TS slots of one expert, and `grouped_tiled` runs one tile per workgroup row: each
// lane holds two weight rows, decodes each block of them once for the tile's TS slots, and
// takes the slots' int8 activation blocks from workgroup memory, CK blocks staged at a time.
//
// Every slot's sum is its blocks' terms `f32(I) * (s * d)` (the one-slot kernel's terms) added
// in block order, whatever tile or position the slot lands in: the scatter's order within an
// expert (atomic) changes no bits.
//
// Assembled (kernels-wgsl's `GroupedTiled`) as decode.wgsl + common.wgsl + i8_codes.wgsl
// (mxfp4) or grouped_tiled_tiered.wgsl (q4tp, q2tp) + this file + the codec's block decoder
// (`grouped_tiled_<codec>.wgsl`), with every weight load offset by the tile's bank slot.

struct Params {
    // Rows and columns of each expert matrix.
    rows: u32,
    cols: u32,
    // Outputs per slot: rows / 2 for the gate/up pair, else rows.
    half: u32,
    // y's row length per slot.
    y_stride: u32,
    // Slots per activation row (slot s reads row s / x_div).
    x_div: u32,
    // Bytes per bank slot.
    slot_bytes: u32,
    // The expert layout's section offsets (bytes).
    second: u32,
    third: u32,
    code_stride: u32,
    // Slots of the frame, slots of the bank, and entries of the tile table.
    slots: u32,
    experts: u32,
    max_tiles: u32,
}

@group(0) @binding(2) var<uniform> P: Params;
@group(0) @binding(3) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<storage, read> xd: array<vec2<u32>>;
@group(0) @binding(6) var<storage, read> ids: array<u32>;
// The slots sorted by expert, and the tiles: (bank slot, first index into `order`, slots, 0);
// entries past the frame's tiles have 0 slots.
@group(0) @binding(7) var<storage, read_write> order: array<u32>;
@group(0) @binding(8) var<storage, read_write> tiles: array<vec4<u32>>;

var<private> sb4: u32;
var<private> sb16: u32;

// Slots of a tile, blocks staged per step, lanes of the two entries.
const TS: u32 = 8u;
const CK: u32 = 16u;
const KWG: u32 = 128u;
const SORT_WG: u32 = 256u;
// Bank slots the sort counts in workgroup memory (a layer's bank: Qwen3.8-Flash-Next's 512).
const MAX_EXPERTS: u32 = 2048u;

var<workgroup> counts: array<atomic<u32>, MAX_EXPERTS>;
var<workgroup> scan_n: array<u32, SORT_WG>;
var<workgroup> scan_t: array<u32, SORT_WG>;

@compute @workgroup_size(256)
fn expert_tiles(@builtin(local_invocation_index) li: u32) {
    let ne = min(P.experts, MAX_EXPERTS);
    for (var e = li; e < ne; e += SORT_WG) {
        atomicStore(&counts[e], 0u);
    }
    workgroupBarrier();
    for (var s = li; s < P.slots; s += SORT_WG) {
        atomicAdd(&counts[min(ids[s], ne - 1u)], 1u);
    }
    workgroupBarrier();
    // Each lane a run of experts: its slots and tiles, then a scan over the lanes.
    let per = (ne + SORT_WG - 1u) / SORT_WG;
    let e0 = min(li * per, ne);
    let e1 = min(e0 + per, ne);
    var n = 0u;
    var t = 0u;
    for (var e = e0; e < e1; e++) {
        let c = atomicLoad(&counts[e]);
        n += c;
        t += (c + TS - 1u) / TS;
    }
    scan_n[li] = n;
    scan_t[li] = t;
    workgroupBarrier();
    for (var o = 1u; o < SORT_WG; o = o * 2u) {
        var an = 0u;
        var at = 0u;
        if (li >= o) {
            an = scan_n[li - o];
            at = scan_t[li - o];
        }
        workgroupBarrier();
        scan_n[li] += an;
        scan_t[li] += at;
        workgroupBarrier();
    }
    var start = scan_n[li] - n;
    var tile = scan_t[li] - t;
    let used = scan_t[SORT_WG - 1u];
    for (var e = e0; e < e1; e++) {
        let c = atomicLoad(&counts[e]);
        for (var j = 0u; j < c; j += TS) {
            if (tile < P.max_tiles) {
                tiles[tile] = vec4<u32>(e, start + j, min(TS, c - j), 0u);
            }
            tile++;
        }
        // The count becomes the expert's cursor for the scatter.
        atomicStore(&counts[e], start);
        start += c;
    }
    for (var i = used + li; i < P.max_tiles; i += SORT_WG) {
        tiles[i] = vec4<u32>(0u);
    }
    workgroupBarrier();
    for (var s = li; s < P.slots; s += SORT_WG) {
        let at = atomicAdd(&counts[min(ids[s], ne - 1u)], 1u);
        order[at] = s;
    }
}

// A block of a weight row as the codec decodes it: its 32 codes as int8 (two halves of four
// words, in the activation layout's order) and its factor.
struct Blk {
    a: vec4<u32>,
    b: vec4<u32>,
    s: f32,
}

// A tile's staged activation blocks, entry `b * TS + j` = block b of the chunk for slot j:
// the codes' two halves, and (bits of d, the codec's offset term).
var<workgroup> sxa: array<vec4<u32>, 128>;
var<workgroup> sxb: array<vec4<u32>, 128>;
var<workgroup> sxe: array<vec2<u32>, 128>;
var<workgroup> wtile: vec4<u32>;

fn dot8i(wa: vec4<u32>, wb: vec4<u32>, xa: vec4<u32>, xb: vec4<u32>) -> i32 {
    return ((dot4I8Packed(wa.x, xa.x) + dot4I8Packed(wa.y, xa.y)) + (dot4I8Packed(wa.z, xa.z) + dot4I8Packed(wa.w, xa.w)))
        + ((dot4I8Packed(wb.x, xb.x) + dot4I8Packed(wb.y, xb.y)) + (dot4I8Packed(wb.z, xb.z) + dot4I8Packed(wb.w, xb.w)));
}

// Staged entry `e`'s term against a block's codes and factor (the one-slot kernel's term).
fn term(w: Blk, e: u32) -> f32 {
    let x = sxe[e];
    return f32(dot8i(w.a, w.b, sxa[e], sxb[e]) * W_MUL - bitcast<i32>(x.y)) * (w.s * bitcast<f32>(x.x));
}

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

fn pick(lo: vec4<f32>, hi: vec4<f32>, j: u32) -> f32 {
    if (j < 4u) {
        return lo[j];
    }
    return hi[j - 4u];
}

@compute @workgroup_size(128)
fn grouped_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    // The tile through workgroup memory, so the code proves it uniform: an empty table entry
    // leaves before any barrier.
    if (li == 0u) {
        wtile = tiles[wid.y];
    }
    let tile = workgroupUniformLoad(&wtile);
    let cnt = tile.z;
    if (cnt == 0u) {
        return;
    }
    sb4 = min(tile.x, P.experts - 1u) * (P.slot_bytes / 4u);
    sb16 = sb4 / 4u;
    let nb = P.cols / 32u;
    // This lane's rows: the pair's gate row o and up row o + half, or rows o and o + 1.
    var o: u32;
    var row0: u32;
    var row1: u32;
    if (PAIR) {
        o = wid.x * KWG + li;
        row0 = min(o, P.half - 1u);
        row1 = row0 + P.half;
    } else {
        o = (wid.x * KWG + li) * 2u;
        row0 = min(o, P.rows - 1u);
        row1 = min(o + 1u, P.rows - 1u);
    }
    prologue(li);
    let r0 = row_params(row0);
    let r1 = row_params(row1);
    // What this lane stages: block li / TS of each chunk for the tile's slot li % TS (slots
    // past the tile's repeat its last; their sums are never written).
    let sj = min(li % TS, cnt - 1u);
    let xrow = (order[tile.y + sj] / P.x_div) * nb;
    let sbk = li / TS;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    // The next chunk's blocks are loaded into registers before this chunk's products.
    var xi = xrow + min(sbk, nb - 1u);
    var na = xq[2u * xi];
    var nbv = xq[2u * xi + 1u];
    var nd = xd[xi];
    for (var c0 = 0u; c0 < nb; c0 += CK) {
        sxa[li] = na;
        sxb[li] = nbv;
        sxe[li] = vec2<u32>(nd.x, bitcast<u32>(X_OFF * bitcast<i32>(nd.y)));
        workgroupBarrier();
        xi = xrow + min(c0 + CK + sbk, nb - 1u);
        na = xq[2u * xi];
        nbv = xq[2u * xi + 1u];
        nd = xd[xi];
        for (var b = 0u; b < CK; b++) {
            let c = c0 + b;
            if (c < nb) {
                let w0 = block(row0, r0, c);
                let w1 = block(row1, r1, c);
                let e = b * TS;
                a0 += vec4<f32>(term(w0, e), term(w0, e + 1u), term(w0, e + 2u), term(w0, e + 3u));
                a2 += vec4<f32>(term(w1, e), term(w1, e + 1u), term(w1, e + 2u), term(w1, e + 3u));
                // A tile of at most 4 slots (about half of them at 5 slots an expert) skips
                // the second half: the branch is the same for the whole workgroup.
                if (cnt > 4u) {
                    a1 += vec4<f32>(term(w0, e + 4u), term(w0, e + 5u), term(w0, e + 6u), term(w0, e + 7u));
                    a3 += vec4<f32>(term(w1, e + 4u), term(w1, e + 5u), term(w1, e + 6u), term(w1, e + 7u));
                }
            }
        }
        workgroupBarrier();
    }
    for (var j = 0u; j < cnt; j++) {
        let yb = order[tile.y + j] * P.y_stride;
        let g = pick(a0, a1, j);
        let u = pick(a2, a3, j);
        if (PAIR) {
            if (o < P.half) {
                y[yb + o] = silu(row_finish(g, row0)) * row_finish(u, row1);
            }
        } else {
            if (o < P.rows) {
                y[yb + o] = row_finish(g, row0);
            }
            if (o + 1u < P.rows) {
                y[yb + o + 1u] = row_finish(u, row1);
            }
        }
    }
}
