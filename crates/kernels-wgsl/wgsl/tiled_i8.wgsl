// The tiled matmat over q8_2f weights and int8 activations (matvec_i8.wgsl's scheme: per
// 32-column block the integer dot product of the codes, times the activation block's scale
// `d`, in f32; the row's f16 scale once at the end, as the 8-row kernel applies them). A step
// is one block: lanes 0..127 stage the token rows' codes and scales, lanes 128..255 the matrix
// rows' codes.

// A block's codes as two vec4 halves, [2][64]: token rows in order, matrix rows in the order
// (r % 4) * 16 + r / 4 (as tiled_f16.wgsl: lane `tx`'s rows are four runs of 16 consecutive
// vec4s, and a half-warp's lanes share their token rows).
var<workgroup> xt: array<vec4<u32>, 128>;
var<workgroup> wt: array<vec4<u32>, 128>;
var<workgroup> dt: array<f32, 64>;

@compute @workgroup_size(256)
fn tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let n0 = wid.x * TN;
    let t0 = wid.y * TM;
    let tx = li % 16u;
    let ty = li / 16u;
    let nb = P.cols / 32u;
    let s0 = wid.z * P.steps;
    let s1 = min(s0 + P.steps, nb);
    // What this lane stages: half `h` of token row `who`'s codes (and with h = 0 its scale), or
    // of matrix row `who`'s (rows and token rows past the end repeat the last).
    let h = li % 2u;
    let who = (li % 128u) / 2u;
    let xrow = min(t0 + who, P.nt - 1u) * nb;
    let wrow = min(n0 + who, P.rows - 1u) * (P.cols / 16u) + h;
    let wpos = h * 64u + (who % 4u) * 16u + who / 4u;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    // The next step's operands are loaded into registers before this step's products, so
    // their memory latency overlaps the arithmetic.
    var nq = vec4<u32>(0u);
    var nd = 0u;
    if (li < 128u) {
        nq = xq[2u * (xrow + s0) + h];
        nd = xd[xrow + s0].x;
    } else {
        nq = wv[wrow + 2u * s0];
    }
    for (var st = s0; st < s1; st++) {
        if (li < 128u) {
            xt[h * 64u + who] = nq;
            if (h == 0u) {
                dt[who] = bitcast<f32>(nd);
            }
        } else {
            wt[wpos] = nq;
        }
        workgroupBarrier();
        let nx = min(st + 1u, s1 - 1u);
        if (li < 128u) {
            nq = xq[2u * (xrow + nx) + h];
            nd = xd[xrow + nx].x;
        } else {
            nq = wv[wrow + 2u * nx];
        }
        let w0a = wt[tx];
        let w0b = wt[64u + tx];
        let w1a = wt[tx + 16u];
        let w1b = wt[64u + tx + 16u];
        let w2a = wt[tx + 32u];
        let w2b = wt[64u + tx + 32u];
        let w3a = wt[tx + 48u];
        let w3b = wt[64u + tx + 48u];
        let t = ty * 4u;
        {
            let xa = xt[t];
            let xb = xt[64u + t];
            let d = dt[t];
            a0 += vec4<f32>(dot8v(w0a, w0b, xa, xb) * d, dot8v(w1a, w1b, xa, xb) * d, dot8v(w2a, w2b, xa, xb) * d, dot8v(w3a, w3b, xa, xb) * d);
        }
        {
            let xa = xt[t + 1u];
            let xb = xt[64u + t + 1u];
            let d = dt[t + 1u];
            a1 += vec4<f32>(dot8v(w0a, w0b, xa, xb) * d, dot8v(w1a, w1b, xa, xb) * d, dot8v(w2a, w2b, xa, xb) * d, dot8v(w3a, w3b, xa, xb) * d);
        }
        {
            let xa = xt[t + 2u];
            let xb = xt[64u + t + 2u];
            let d = dt[t + 2u];
            a2 += vec4<f32>(dot8v(w0a, w0b, xa, xb) * d, dot8v(w1a, w1b, xa, xb) * d, dot8v(w2a, w2b, xa, xb) * d, dot8v(w3a, w3b, xa, xb) * d);
        }
        {
            let xa = xt[t + 3u];
            let xb = xt[64u + t + 3u];
            let d = dt[t + 3u];
            a3 += vec4<f32>(dot8v(w0a, w0b, xa, xb) * d, dot8v(w1a, w1b, xa, xb) * d, dot8v(w2a, w2b, xa, xb) * d, dot8v(w3a, w3b, xa, xb) * d);
        }
        workgroupBarrier();
    }
    let r0 = n0 + tx * 4u;
    let t = t0 + ty * 4u;
    let sc = row_scales(r0);
    finish4(wid.z, t, r0, a0 * sc, a1 * sc, a2 * sc, a3 * sc);
}
