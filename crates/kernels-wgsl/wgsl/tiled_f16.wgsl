// The tiled matmat over f16 weights and f32 activations (`weight4` decodes a 16-byte chunk
// into 8 f32 weights, in software or through the hardware conversion).

@group(0) @binding(3) var<storage, read> x: array<vec4<f32>>;

// The staged operands, column-quad major ([TK / 4][64] vec4s, 16 KB in all: the portable
// limit): token rows in order, matrix rows in the order (r % 4) * 16 + r / 4, so that lane `tx`
// reads its rows 4 tx .. 4 tx + 3 from four runs of 16 consecutive vec4s (no bank conflicts)
// and the lanes of a half-warp, which share their token rows, read one vec4 (a broadcast).
var<workgroup> xt: array<vec4<f32>, 512>;
var<workgroup> wt: array<vec4<f32>, 512>;

@compute @workgroup_size(256)
fn tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let n0 = wid.x * TN;
    let t0 = wid.y * TM;
    let tx = li % 16u;
    let ty = li / 16u;
    let cols4 = P.cols / 4u;
    let chunks = P.cols / 8u;
    let s0 = wid.z * P.steps;
    let s1 = min(s0 + P.steps, P.cols / TK);
    // What this lane stages: two token rows' vec4 `xq`, one matrix row's chunk `wq` (rows and
    // token rows past the end repeat the last; their sums are never written).
    let xq = li % 8u;
    let xa = li / 8u;
    let xr0 = min(t0 + xa, P.nt - 1u) * cols4 + xq;
    let xr1 = min(t0 + xa + 32u, P.nt - 1u) * cols4 + xq;
    let wq = li % 4u;
    let wl = li / 4u;
    let wr = min(n0 + wl, P.rows - 1u) * chunks + wq;
    let ws = (wq * 2u) * TN + (wl % 4u) * 16u + wl / 4u;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    // The next step's operands are loaded into registers before this step's products, so
    // their memory latency overlaps the arithmetic (a split has one or two workgroups per
    // multiprocessor: too few to hide it by switching).
    var n0x = x[xr0 + s0 * (TK / 4u)];
    var n1x = x[xr1 + s0 * (TK / 4u)];
    var nv = wv[wr + s0 * (TK / 8u)];
    for (var st = s0; st < s1; st++) {
        xt[xq * TM + xa] = n0x;
        xt[xq * TM + xa + 32u] = n1x;
        wt[ws] = weight4(nv, vec2<f32>(1.0), 0u);
        wt[ws + TN] = weight4(nv, vec2<f32>(1.0), 1u);
        workgroupBarrier();
        let nx = min(st + 1u, s1 - 1u);
        n0x = x[xr0 + nx * (TK / 4u)];
        n1x = x[xr1 + nx * (TK / 4u)];
        nv = wv[wr + nx * (TK / 8u)];
        for (var q = 0u; q < TK / 4u; q++) {
            let w0 = wt[q * TN + tx];
            let w1 = wt[q * TN + tx + 16u];
            let w2 = wt[q * TN + tx + 32u];
            let w3 = wt[q * TN + tx + 48u];
            let x0 = xt[q * TM + ty * 4u];
            let x1 = xt[q * TM + ty * 4u + 1u];
            let x2 = xt[q * TM + ty * 4u + 2u];
            let x3 = xt[q * TM + ty * 4u + 3u];
            a0 += vec4<f32>(dot(x0, w0), dot(x0, w1), dot(x0, w2), dot(x0, w3));
            a1 += vec4<f32>(dot(x1, w0), dot(x1, w1), dot(x1, w2), dot(x1, w3));
            a2 += vec4<f32>(dot(x2, w0), dot(x2, w1), dot(x2, w2), dot(x2, w3));
            a3 += vec4<f32>(dot(x3, w0), dot(x3, w1), dot(x3, w2), dot(x3, w3));
        }
        workgroupBarrier();
    }
    let r0 = n0 + tx * 4u;
    let t = t0 + ty * 4u;
    finish4(wid.z, t, r0, a0, a1, a2, a3);
}
