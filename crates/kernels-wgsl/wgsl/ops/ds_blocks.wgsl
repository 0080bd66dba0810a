// DeepSeek-V4.1's two-level top-k, level one (model-dsv4's `v41::indexer::candidate_mask`),
// one workgroup per token row of the candidate source: its indexer scores `sc` `[nt, maxe]`
// (entries the row sees: `min((past + r + 1) / rate, maxe)`) in blocks of `size`; a block
// scores its best entry, the block of the newest visible entry is pinned first, and the top
// `top` blocks (ties to the lower block) mark their entries in `cand` `[nt, maxe]`, which the
// later index sources of the group restrict their top-k to (`ds_index`). `bsc` holds the block
// scores `[nt, maxe]`.
struct Params {
    rate: u32,
    maxe: u32,
    size: u32,
    top: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> sc: array<f32>;
@group(0) @binding(3) var<storage, read_write> bsc: array<f32>;
@group(0) @binding(4) var<storage, read_write> cand: array<u32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let r = wid.x;
    let vis = min((F.past + r + 1u) / P.rate, P.maxe);
    let nb = (vis + P.size - 1u) / P.size;
    let row = r * P.maxe;
    for (var b = li; b < nb; b += WG) {
        var m = NEG;
        for (var s = b * P.size; s < min((b + 1u) * P.size, vis); s++) {
            m = max(m, sc[row + s]);
        }
        if (vis > 0u && b == (vis - 1u) / P.size) {
            m = 3.4e38;
        }
        bsc[row + b] = m;
    }
    storageBarrier();
    for (var b = li; b < nb; b += WG) {
        let v = bsc[row + b];
        var rank = 0u;
        for (var o = 0u; o < nb; o++) {
            let u = bsc[row + o];
            if (u > v || (u == v && o < b)) {
                rank++;
            }
        }
        let keep = select(0u, 1u, rank < P.top && v > NEG);
        for (var s = b * P.size; s < min((b + 1u) * P.size, vis); s++) {
            cand[row + s] = keep;
        }
    }
}
