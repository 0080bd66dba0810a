// The tiled matmat over f16 weights and f32 activations with eight token rows x eight matrix
// rows a lane: 64 lanes compute tiled_f16.wgsl's 64x64 tile (same grid, same `finish`), each
// loading 8 + 8 staged vec4s per 4 columns for 64 dot products, where a lane of the 256-lane
// kernel loads 4 + 4 for 16: half the workgroup-memory loads per multiply-add, and eight
// independent accumulator chains per loaded operand. A lane's sums are added in column order,
// each split's on its own, as the 256-lane kernel adds them.

@group(0) @binding(3) var<storage, read> x: array<vec4<f32>>;

// The staged operands, column-quad major ([TK / 4][64] vec4s, 16 KB in all): token row t at
// slot t, matrix row r at slot ((r / 32) * 4 + r % 4) * 8 + (r % 32) / 4. Lane (tx, ty) =
// (li % 8, li / 8) then finds its token rows ty + 8 i at slots 8 i + ty and its rows
// 4 tx + 32 j + m (two runs of a read-out column's 4 streams) at (4 j + m) * 8 + tx: each
// load of a warp reads consecutive vec4s (one per tx, or per ty) and broadcasts them to the
// lanes that share them: no bank conflicts.
var<workgroup> xt: array<vec4<f32>, 512>;
var<workgroup> wt: array<vec4<f32>, 512>;

fn w_slot(r: u32) -> u32 {
    return ((r / 32u) * 4u + r % 4u) * 8u + (r % 32u) / 4u;
}

@compute @workgroup_size(64)
fn tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let n0 = wid.x * TN;
    let t0 = wid.y * TM;
    let tx = li % 8u;
    let ty = li / 8u;
    let cols4 = P.cols / 4u;
    let chunks = P.cols / 8u;
    let s0 = wid.z * P.steps;
    let s1 = min(s0 + P.steps, P.cols / TK);
    // What this lane stages each step: load k (0..7) of the activations is token row
    // 8 k + li / 8's column quad li % 8 (eight lanes read a row's 128 bytes); load k (0..3) of
    // the weights is matrix row 16 k + li / 4's chunk li % 4. Rows and token rows past the end
    // repeat the last; their sums are never written.
    let xq = li % 8u;
    let wq = li % 4u;
    let xr0 = min(t0 + 0u + li / 8u, P.nt - 1u) * cols4 + xq;
    let xs0 = xq * TM + 0u + li / 8u;
    let xr1 = min(t0 + 8u + li / 8u, P.nt - 1u) * cols4 + xq;
    let xs1 = xq * TM + 8u + li / 8u;
    let xr2 = min(t0 + 16u + li / 8u, P.nt - 1u) * cols4 + xq;
    let xs2 = xq * TM + 16u + li / 8u;
    let xr3 = min(t0 + 24u + li / 8u, P.nt - 1u) * cols4 + xq;
    let xs3 = xq * TM + 24u + li / 8u;
    let xr4 = min(t0 + 32u + li / 8u, P.nt - 1u) * cols4 + xq;
    let xs4 = xq * TM + 32u + li / 8u;
    let xr5 = min(t0 + 40u + li / 8u, P.nt - 1u) * cols4 + xq;
    let xs5 = xq * TM + 40u + li / 8u;
    let xr6 = min(t0 + 48u + li / 8u, P.nt - 1u) * cols4 + xq;
    let xs6 = xq * TM + 48u + li / 8u;
    let xr7 = min(t0 + 56u + li / 8u, P.nt - 1u) * cols4 + xq;
    let xs7 = xq * TM + 56u + li / 8u;
    let wr0 = min(n0 + 0u + li / 4u, P.rows - 1u) * chunks + wq;
    let ws0 = (wq * 2u) * TN + w_slot(0u + li / 4u);
    let wr1 = min(n0 + 16u + li / 4u, P.rows - 1u) * chunks + wq;
    let ws1 = (wq * 2u) * TN + w_slot(16u + li / 4u);
    let wr2 = min(n0 + 32u + li / 4u, P.rows - 1u) * chunks + wq;
    let ws2 = (wq * 2u) * TN + w_slot(32u + li / 4u);
    let wr3 = min(n0 + 48u + li / 4u, P.rows - 1u) * chunks + wq;
    let ws3 = (wq * 2u) * TN + w_slot(48u + li / 4u);
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
    // The next step's operands are loaded into registers before this step's products.
    var nx0 = x[xr0 + s0 * (TK / 4u)];
    var nx1 = x[xr1 + s0 * (TK / 4u)];
    var nx2 = x[xr2 + s0 * (TK / 4u)];
    var nx3 = x[xr3 + s0 * (TK / 4u)];
    var nx4 = x[xr4 + s0 * (TK / 4u)];
    var nx5 = x[xr5 + s0 * (TK / 4u)];
    var nx6 = x[xr6 + s0 * (TK / 4u)];
    var nx7 = x[xr7 + s0 * (TK / 4u)];
    var nw0 = wv[wr0 + s0 * (TK / 8u)];
    var nw1 = wv[wr1 + s0 * (TK / 8u)];
    var nw2 = wv[wr2 + s0 * (TK / 8u)];
    var nw3 = wv[wr3 + s0 * (TK / 8u)];
    for (var st = s0; st < s1; st++) {
        xt[xs0] = nx0;
        xt[xs1] = nx1;
        xt[xs2] = nx2;
        xt[xs3] = nx3;
        xt[xs4] = nx4;
        xt[xs5] = nx5;
        xt[xs6] = nx6;
        xt[xs7] = nx7;
        wt[ws0] = weight4(nw0, vec2<f32>(1.0), 0u);
        wt[ws0 + TN] = weight4(nw0, vec2<f32>(1.0), 1u);
        wt[ws1] = weight4(nw1, vec2<f32>(1.0), 0u);
        wt[ws1 + TN] = weight4(nw1, vec2<f32>(1.0), 1u);
        wt[ws2] = weight4(nw2, vec2<f32>(1.0), 0u);
        wt[ws2 + TN] = weight4(nw2, vec2<f32>(1.0), 1u);
        wt[ws3] = weight4(nw3, vec2<f32>(1.0), 0u);
        wt[ws3 + TN] = weight4(nw3, vec2<f32>(1.0), 1u);
        workgroupBarrier();
        let nx = min(st + 1u, s1 - 1u);
        nx0 = x[xr0 + nx * (TK / 4u)];
        nx1 = x[xr1 + nx * (TK / 4u)];
        nx2 = x[xr2 + nx * (TK / 4u)];
        nx3 = x[xr3 + nx * (TK / 4u)];
        nx4 = x[xr4 + nx * (TK / 4u)];
        nx5 = x[xr5 + nx * (TK / 4u)];
        nx6 = x[xr6 + nx * (TK / 4u)];
        nx7 = x[xr7 + nx * (TK / 4u)];
        nw0 = wv[wr0 + nx * (TK / 8u)];
        nw1 = wv[wr1 + nx * (TK / 8u)];
        nw2 = wv[wr2 + nx * (TK / 8u)];
        nw3 = wv[wr3 + nx * (TK / 8u)];
        for (var q = 0u; q < TK / 4u; q++) {
            let wb = q * TN + tx;
            let w0 = wt[wb + 0u];
            let w1 = wt[wb + 8u];
            let w2 = wt[wb + 16u];
            let w3 = wt[wb + 24u];
            let w4 = wt[wb + 32u];
            let w5 = wt[wb + 40u];
            let w6 = wt[wb + 48u];
            let w7 = wt[wb + 56u];
            let xb = q * TM + ty;
            let x0 = xt[xb + 0u];
            let x1 = xt[xb + 8u];
            let x2 = xt[xb + 16u];
            let x3 = xt[xb + 24u];
            let x4 = xt[xb + 32u];
            let x5 = xt[xb + 40u];
            let x6 = xt[xb + 48u];
            let x7 = xt[xb + 56u];
            a00 += vec4<f32>(dot(x0, w0), dot(x0, w1), dot(x0, w2), dot(x0, w3));
            a01 += vec4<f32>(dot(x0, w4), dot(x0, w5), dot(x0, w6), dot(x0, w7));
            a10 += vec4<f32>(dot(x1, w0), dot(x1, w1), dot(x1, w2), dot(x1, w3));
            a11 += vec4<f32>(dot(x1, w4), dot(x1, w5), dot(x1, w6), dot(x1, w7));
            a20 += vec4<f32>(dot(x2, w0), dot(x2, w1), dot(x2, w2), dot(x2, w3));
            a21 += vec4<f32>(dot(x2, w4), dot(x2, w5), dot(x2, w6), dot(x2, w7));
            a30 += vec4<f32>(dot(x3, w0), dot(x3, w1), dot(x3, w2), dot(x3, w3));
            a31 += vec4<f32>(dot(x3, w4), dot(x3, w5), dot(x3, w6), dot(x3, w7));
            a40 += vec4<f32>(dot(x4, w0), dot(x4, w1), dot(x4, w2), dot(x4, w3));
            a41 += vec4<f32>(dot(x4, w4), dot(x4, w5), dot(x4, w6), dot(x4, w7));
            a50 += vec4<f32>(dot(x5, w0), dot(x5, w1), dot(x5, w2), dot(x5, w3));
            a51 += vec4<f32>(dot(x5, w4), dot(x5, w5), dot(x5, w6), dot(x5, w7));
            a60 += vec4<f32>(dot(x6, w0), dot(x6, w1), dot(x6, w2), dot(x6, w3));
            a61 += vec4<f32>(dot(x6, w4), dot(x6, w5), dot(x6, w6), dot(x6, w7));
            a70 += vec4<f32>(dot(x7, w0), dot(x7, w1), dot(x7, w2), dot(x7, w3));
            a71 += vec4<f32>(dot(x7, w4), dot(x7, w5), dot(x7, w6), dot(x7, w7));
        }
        workgroupBarrier();
    }
    // Rows 4 tx + 32 j .. + 3 of token rows ty + 8 i.
    let r0 = n0 + tx * 4u;
    let r1 = r0 + 32u;
    finish_one(wid.z, t0 + ty + 0u, r0, a00);
    finish_one(wid.z, t0 + ty + 0u, r1, a01);
    finish_one(wid.z, t0 + ty + 8u, r0, a10);
    finish_one(wid.z, t0 + ty + 8u, r1, a11);
    finish_one(wid.z, t0 + ty + 16u, r0, a20);
    finish_one(wid.z, t0 + ty + 16u, r1, a21);
    finish_one(wid.z, t0 + ty + 24u, r0, a30);
    finish_one(wid.z, t0 + ty + 24u, r1, a31);
    finish_one(wid.z, t0 + ty + 32u, r0, a40);
    finish_one(wid.z, t0 + ty + 32u, r1, a41);
    finish_one(wid.z, t0 + ty + 40u, r0, a50);
    finish_one(wid.z, t0 + ty + 40u, r1, a51);
    finish_one(wid.z, t0 + ty + 48u, r0, a60);
    finish_one(wid.z, t0 + ty + 48u, r1, a61);
    finish_one(wid.z, t0 + ty + 56u, r0, a70);
    finish_one(wid.z, t0 + ty + 56u, r1, a71);
}

// A lane's sums of token row t, rows r0 .. r0 + 3 (past the frame's or the matrix's end:
// dropped, as `finish4` drops them).
fn finish_one(z: u32, t: u32, r0: u32, v: vec4<f32>) {
    if (r0 < P.rows && t < P.nt) {
        finish(z, t, r0, v);
    }
}
