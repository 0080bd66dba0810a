// The tiled matmat over q8_2f weights and int8 activations with eight token rows x eight
// matrix rows a lane: 64 lanes compute tiled_i8.wgsl's 64x64 tile (same grid, same `finish`,
// the same arithmetic: per 32-column block the integer dot product times the activation
// block's scale, added in block order; the row's f16 scale at the end). Per block a lane loads
// 16 weight and 16 activation vec4s and 8 scales from workgroup memory for 64 block products
// (the 256-lane kernel: 8 + 8 and 4 for 16).

// A block's codes as two vec4 halves, [2][64]: token row t at slot t, matrix row r at slot
// ((r / 32) * 4 + r % 4) * 8 + (r % 32) / 4. Lane (tx, ty) = (li % 8, li / 8) finds its token
// rows ty + 8 i at 8 i + ty and its rows 4 tx + 32 j + m at (4 j + m) * 8 + tx: a warp's loads
// read consecutive vec4s and broadcast them to the lanes that share them.
var<workgroup> xt: array<vec4<u32>, 128>;
var<workgroup> wt: array<vec4<u32>, 128>;
var<workgroup> dt: array<f32, 64>;

@compute @workgroup_size(64)
fn tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let n0 = wid.x * TN;
    let t0 = wid.y * TM;
    let tx = li % 8u;
    let ty = li / 8u;
    let nb = P.cols / 32u;
    let s0 = wid.z * P.steps;
    let s1 = min(s0 + P.steps, nb);
    // What this lane stages each block: both halves of token row li's codes and its scale, and
    // both halves of matrix row li's (rows and token rows past the end repeat the last).
    let xrow = min(t0 + li, P.nt - 1u) * nb;
    let wrow = min(n0 + li, P.rows - 1u) * (P.cols / 16u);
    let wpos = ((li / 32u) * 4u + li % 4u) * 8u + (li % 32u) / 4u;
    var a00 = vec4<f32>(0.0);
    var a01 = vec4<f32>(0.0);
    var a10 = vec4<f32>(0.0);
    var a11 = vec4<f32>(0.0);
    var a20 = vec4<f32>(0.0);
    var a21 = vec4<f32>(0.0);
    var a30 = vec4<f32>(0.0);
    var a31 = vec4<f32>(0.0);
    var a40 = vec4<f32>(0.0);
    var a41 = vec4<f32>(0.0);
    var a50 = vec4<f32>(0.0);
    var a51 = vec4<f32>(0.0);
    var a60 = vec4<f32>(0.0);
    var a61 = vec4<f32>(0.0);
    var a70 = vec4<f32>(0.0);
    var a71 = vec4<f32>(0.0);
    // The next block's operands are loaded into registers before this block's products.
    var nx0 = xq[2u * (xrow + s0)];
    var nx1 = xq[2u * (xrow + s0) + 1u];
    var nd = xd[xrow + s0].x;
    var nw0 = wv[wrow + 2u * s0];
    var nw1 = wv[wrow + 2u * s0 + 1u];
    for (var st = s0; st < s1; st++) {
        xt[li] = nx0;
        xt[64u + li] = nx1;
        dt[li] = bitcast<f32>(nd);
        wt[wpos] = nw0;
        wt[64u + wpos] = nw1;
        workgroupBarrier();
        let nx = min(st + 1u, s1 - 1u);
        nx0 = xq[2u * (xrow + nx)];
        nx1 = xq[2u * (xrow + nx) + 1u];
        nd = xd[xrow + nx].x;
        nw0 = wv[wrow + 2u * nx];
        nw1 = wv[wrow + 2u * nx + 1u];
        let w0a = wt[0u + tx];
        let w0b = wt[64u + tx];
        let w1a = wt[8u + tx];
        let w1b = wt[72u + tx];
        let w2a = wt[16u + tx];
        let w2b = wt[80u + tx];
        let w3a = wt[24u + tx];
        let w3b = wt[88u + tx];
        let w4a = wt[32u + tx];
        let w4b = wt[96u + tx];
        let w5a = wt[40u + tx];
        let w5b = wt[104u + tx];
        let w6a = wt[48u + tx];
        let w6b = wt[112u + tx];
        let w7a = wt[56u + tx];
        let w7b = wt[120u + tx];
        {
            let xa = xt[0u + ty];
            let xb = xt[64u + ty];
            let d = dt[0u + ty];
            a00 += vec4<f32>(dot8v(w0a, w0b, xa, xb) * d, dot8v(w1a, w1b, xa, xb) * d, dot8v(w2a, w2b, xa, xb) * d, dot8v(w3a, w3b, xa, xb) * d);
            a01 += vec4<f32>(dot8v(w4a, w4b, xa, xb) * d, dot8v(w5a, w5b, xa, xb) * d, dot8v(w6a, w6b, xa, xb) * d, dot8v(w7a, w7b, xa, xb) * d);
        }
        {
            let xa = xt[8u + ty];
            let xb = xt[72u + ty];
            let d = dt[8u + ty];
            a10 += vec4<f32>(dot8v(w0a, w0b, xa, xb) * d, dot8v(w1a, w1b, xa, xb) * d, dot8v(w2a, w2b, xa, xb) * d, dot8v(w3a, w3b, xa, xb) * d);
            a11 += vec4<f32>(dot8v(w4a, w4b, xa, xb) * d, dot8v(w5a, w5b, xa, xb) * d, dot8v(w6a, w6b, xa, xb) * d, dot8v(w7a, w7b, xa, xb) * d);
        }
        {
            let xa = xt[16u + ty];
            let xb = xt[80u + ty];
            let d = dt[16u + ty];
            a20 += vec4<f32>(dot8v(w0a, w0b, xa, xb) * d, dot8v(w1a, w1b, xa, xb) * d, dot8v(w2a, w2b, xa, xb) * d, dot8v(w3a, w3b, xa, xb) * d);
            a21 += vec4<f32>(dot8v(w4a, w4b, xa, xb) * d, dot8v(w5a, w5b, xa, xb) * d, dot8v(w6a, w6b, xa, xb) * d, dot8v(w7a, w7b, xa, xb) * d);
        }
        {
            let xa = xt[24u + ty];
            let xb = xt[88u + ty];
            let d = dt[24u + ty];
            a30 += vec4<f32>(dot8v(w0a, w0b, xa, xb) * d, dot8v(w1a, w1b, xa, xb) * d, dot8v(w2a, w2b, xa, xb) * d, dot8v(w3a, w3b, xa, xb) * d);
            a31 += vec4<f32>(dot8v(w4a, w4b, xa, xb) * d, dot8v(w5a, w5b, xa, xb) * d, dot8v(w6a, w6b, xa, xb) * d, dot8v(w7a, w7b, xa, xb) * d);
        }
        {
            let xa = xt[32u + ty];
            let xb = xt[96u + ty];
            let d = dt[32u + ty];
            a40 += vec4<f32>(dot8v(w0a, w0b, xa, xb) * d, dot8v(w1a, w1b, xa, xb) * d, dot8v(w2a, w2b, xa, xb) * d, dot8v(w3a, w3b, xa, xb) * d);
            a41 += vec4<f32>(dot8v(w4a, w4b, xa, xb) * d, dot8v(w5a, w5b, xa, xb) * d, dot8v(w6a, w6b, xa, xb) * d, dot8v(w7a, w7b, xa, xb) * d);
        }
        {
            let xa = xt[40u + ty];
            let xb = xt[104u + ty];
            let d = dt[40u + ty];
            a50 += vec4<f32>(dot8v(w0a, w0b, xa, xb) * d, dot8v(w1a, w1b, xa, xb) * d, dot8v(w2a, w2b, xa, xb) * d, dot8v(w3a, w3b, xa, xb) * d);
            a51 += vec4<f32>(dot8v(w4a, w4b, xa, xb) * d, dot8v(w5a, w5b, xa, xb) * d, dot8v(w6a, w6b, xa, xb) * d, dot8v(w7a, w7b, xa, xb) * d);
        }
        {
            let xa = xt[48u + ty];
            let xb = xt[112u + ty];
            let d = dt[48u + ty];
            a60 += vec4<f32>(dot8v(w0a, w0b, xa, xb) * d, dot8v(w1a, w1b, xa, xb) * d, dot8v(w2a, w2b, xa, xb) * d, dot8v(w3a, w3b, xa, xb) * d);
            a61 += vec4<f32>(dot8v(w4a, w4b, xa, xb) * d, dot8v(w5a, w5b, xa, xb) * d, dot8v(w6a, w6b, xa, xb) * d, dot8v(w7a, w7b, xa, xb) * d);
        }
        {
            let xa = xt[56u + ty];
            let xb = xt[120u + ty];
            let d = dt[56u + ty];
            a70 += vec4<f32>(dot8v(w0a, w0b, xa, xb) * d, dot8v(w1a, w1b, xa, xb) * d, dot8v(w2a, w2b, xa, xb) * d, dot8v(w3a, w3b, xa, xb) * d);
            a71 += vec4<f32>(dot8v(w4a, w4b, xa, xb) * d, dot8v(w5a, w5b, xa, xb) * d, dot8v(w6a, w6b, xa, xb) * d, dot8v(w7a, w7b, xa, xb) * d);
        }
        workgroupBarrier();
    }
    // Rows 4 tx + 32 j .. + 3 of token rows ty + 8 i, times the rows' f16 scales (past the
    // end: the last row's; never written).
    let r0 = n0 + tx * 4u;
    let r1 = r0 + 32u;
    let c0 = row_scales(r0);
    let c1 = row_scales(r1);
    finish_one(wid.z, t0 + ty + 0u, r0, a00 * c0);
    finish_one(wid.z, t0 + ty + 0u, r1, a01 * c1);
    finish_one(wid.z, t0 + ty + 8u, r0, a10 * c0);
    finish_one(wid.z, t0 + ty + 8u, r1, a11 * c1);
    finish_one(wid.z, t0 + ty + 16u, r0, a20 * c0);
    finish_one(wid.z, t0 + ty + 16u, r1, a21 * c1);
    finish_one(wid.z, t0 + ty + 24u, r0, a30 * c0);
    finish_one(wid.z, t0 + ty + 24u, r1, a31 * c1);
    finish_one(wid.z, t0 + ty + 32u, r0, a40 * c0);
    finish_one(wid.z, t0 + ty + 32u, r1, a41 * c1);
    finish_one(wid.z, t0 + ty + 40u, r0, a50 * c0);
    finish_one(wid.z, t0 + ty + 40u, r1, a51 * c1);
    finish_one(wid.z, t0 + ty + 48u, r0, a60 * c0);
    finish_one(wid.z, t0 + ty + 48u, r1, a61 * c1);
    finish_one(wid.z, t0 + ty + 56u, r0, a70 * c0);
    finish_one(wid.z, t0 + ty + 56u, r1, a71 * c1);
}
