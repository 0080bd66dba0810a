// The tiled matmat over f16 weights and f32 activations with eight token rows x eight matrix
// rows a lane: 64 lanes compute tiled_f16.wgsl's 64x64 tile (same grid, same `finish`). For
// every 4 columns a lane loads 8 weight and 8 activation vec4s from workgroup memory for 256
// multiply-adds (the 256-lane kernel: 4 + 4 for 64), and its sums are vec4 `fma`s of a column's
// 4 rows by one activation (one instruction a multiply-add, where `dot` and an add take five
// for four). A lane adds a row's columns one at a time, in column order, each split on its own.

@group(0) @binding(3) var<storage, read> x: array<vec4<f32>>;

// The staged activations, column-quad major ([TK / 4][64] vec4s, 8 KB): token row t at slot t.
// Lane (tx, ty) = (li % 8, li / 8) reads its token rows ty + 8 i at slots 8 i + ty.
var<workgroup> xt: array<vec4<f32>, 512>;
// The staged weights, column major ([TK][2][8] vec4s, 8 KB): the vec4 at (c, j, tx) holds
// column c of rows 4 tx + 32 j .. + 3, lane tx's rows (two runs of a read-out column's 4
// streams). A warp's loads read 8 consecutive vec4s (one per tx) and broadcast them to the
// lanes that share them: no bank conflicts.
var<workgroup> wt: array<vec4<f32>, 512>;

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
    // the weights is matrix row 16 k + li / 4's chunk li % 4 (columns 8 (li % 4) ..), its
    // values stored column by column at the row's (j, tx) and component. Rows and token rows
    // past the end repeat the last; their sums are never written.
    let xq = li % 8u;
    let wq = li % 4u;
    let xr0 = min(t0 + 0u + li / 8u, P.nt - 1u) * cols4 + xq;
    let xr1 = min(t0 + 8u + li / 8u, P.nt - 1u) * cols4 + xq;
    let xr2 = min(t0 + 16u + li / 8u, P.nt - 1u) * cols4 + xq;
    let xr3 = min(t0 + 24u + li / 8u, P.nt - 1u) * cols4 + xq;
    let xr4 = min(t0 + 32u + li / 8u, P.nt - 1u) * cols4 + xq;
    let xr5 = min(t0 + 40u + li / 8u, P.nt - 1u) * cols4 + xq;
    let xr6 = min(t0 + 48u + li / 8u, P.nt - 1u) * cols4 + xq;
    let xr7 = min(t0 + 56u + li / 8u, P.nt - 1u) * cols4 + xq;
    let xs = xq * TM + li / 8u;
    let wr0 = min(n0 + 0u + li / 4u, P.rows - 1u) * chunks + wq;
    let wrow0 = 0u + li / 4u;
    let ws0 = (wq * 16u + wrow0 / 32u) * 8u + (wrow0 % 32u) / 4u;
    let wm0 = wrow0 % 4u;
    let wr1 = min(n0 + 16u + li / 4u, P.rows - 1u) * chunks + wq;
    let wrow1 = 16u + li / 4u;
    let ws1 = (wq * 16u + wrow1 / 32u) * 8u + (wrow1 % 32u) / 4u;
    let wm1 = wrow1 % 4u;
    let wr2 = min(n0 + 32u + li / 4u, P.rows - 1u) * chunks + wq;
    let wrow2 = 32u + li / 4u;
    let ws2 = (wq * 16u + wrow2 / 32u) * 8u + (wrow2 % 32u) / 4u;
    let wm2 = wrow2 % 4u;
    let wr3 = min(n0 + 48u + li / 4u, P.rows - 1u) * chunks + wq;
    let wrow3 = 48u + li / 4u;
    let ws3 = (wq * 16u + wrow3 / 32u) * 8u + (wrow3 % 32u) / 4u;
    let wm3 = wrow3 % 4u;
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
        xt[xs + 0u] = nx0;
        xt[xs + 8u] = nx1;
        xt[xs + 16u] = nx2;
        xt[xs + 24u] = nx3;
        xt[xs + 32u] = nx4;
        xt[xs + 40u] = nx5;
        xt[xs + 48u] = nx6;
        xt[xs + 56u] = nx7;
        stage_chunk(ws0, wm0, nw0);
        stage_chunk(ws1, wm1, nw1);
        stage_chunk(ws2, wm2, nw2);
        stage_chunk(ws3, wm3, nw3);
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
            let wb = q * 64u + tx;
            let p0 = wt[wb + 0u];
            let h0 = wt[wb + 8u];
            let p1 = wt[wb + 16u];
            let h1 = wt[wb + 24u];
            let p2 = wt[wb + 32u];
            let h2 = wt[wb + 40u];
            let p3 = wt[wb + 48u];
            let h3 = wt[wb + 56u];
            let xb = q * TM + ty;
            let x0 = xt[xb + 0u];
            let x1 = xt[xb + 8u];
            let x2 = xt[xb + 16u];
            let x3 = xt[xb + 24u];
            let x4 = xt[xb + 32u];
            let x5 = xt[xb + 40u];
            let x6 = xt[xb + 48u];
            let x7 = xt[xb + 56u];
            a00 = fma(vec4<f32>(x0.x), p0, a00);
            a00 = fma(vec4<f32>(x0.y), p1, a00);
            a00 = fma(vec4<f32>(x0.z), p2, a00);
            a00 = fma(vec4<f32>(x0.w), p3, a00);
            a01 = fma(vec4<f32>(x0.x), h0, a01);
            a01 = fma(vec4<f32>(x0.y), h1, a01);
            a01 = fma(vec4<f32>(x0.z), h2, a01);
            a01 = fma(vec4<f32>(x0.w), h3, a01);
            a10 = fma(vec4<f32>(x1.x), p0, a10);
            a10 = fma(vec4<f32>(x1.y), p1, a10);
            a10 = fma(vec4<f32>(x1.z), p2, a10);
            a10 = fma(vec4<f32>(x1.w), p3, a10);
            a11 = fma(vec4<f32>(x1.x), h0, a11);
            a11 = fma(vec4<f32>(x1.y), h1, a11);
            a11 = fma(vec4<f32>(x1.z), h2, a11);
            a11 = fma(vec4<f32>(x1.w), h3, a11);
            a20 = fma(vec4<f32>(x2.x), p0, a20);
            a20 = fma(vec4<f32>(x2.y), p1, a20);
            a20 = fma(vec4<f32>(x2.z), p2, a20);
            a20 = fma(vec4<f32>(x2.w), p3, a20);
            a21 = fma(vec4<f32>(x2.x), h0, a21);
            a21 = fma(vec4<f32>(x2.y), h1, a21);
            a21 = fma(vec4<f32>(x2.z), h2, a21);
            a21 = fma(vec4<f32>(x2.w), h3, a21);
            a30 = fma(vec4<f32>(x3.x), p0, a30);
            a30 = fma(vec4<f32>(x3.y), p1, a30);
            a30 = fma(vec4<f32>(x3.z), p2, a30);
            a30 = fma(vec4<f32>(x3.w), p3, a30);
            a31 = fma(vec4<f32>(x3.x), h0, a31);
            a31 = fma(vec4<f32>(x3.y), h1, a31);
            a31 = fma(vec4<f32>(x3.z), h2, a31);
            a31 = fma(vec4<f32>(x3.w), h3, a31);
            a40 = fma(vec4<f32>(x4.x), p0, a40);
            a40 = fma(vec4<f32>(x4.y), p1, a40);
            a40 = fma(vec4<f32>(x4.z), p2, a40);
            a40 = fma(vec4<f32>(x4.w), p3, a40);
            a41 = fma(vec4<f32>(x4.x), h0, a41);
            a41 = fma(vec4<f32>(x4.y), h1, a41);
            a41 = fma(vec4<f32>(x4.z), h2, a41);
            a41 = fma(vec4<f32>(x4.w), h3, a41);
            a50 = fma(vec4<f32>(x5.x), p0, a50);
            a50 = fma(vec4<f32>(x5.y), p1, a50);
            a50 = fma(vec4<f32>(x5.z), p2, a50);
            a50 = fma(vec4<f32>(x5.w), p3, a50);
            a51 = fma(vec4<f32>(x5.x), h0, a51);
            a51 = fma(vec4<f32>(x5.y), h1, a51);
            a51 = fma(vec4<f32>(x5.z), h2, a51);
            a51 = fma(vec4<f32>(x5.w), h3, a51);
            a60 = fma(vec4<f32>(x6.x), p0, a60);
            a60 = fma(vec4<f32>(x6.y), p1, a60);
            a60 = fma(vec4<f32>(x6.z), p2, a60);
            a60 = fma(vec4<f32>(x6.w), p3, a60);
            a61 = fma(vec4<f32>(x6.x), h0, a61);
            a61 = fma(vec4<f32>(x6.y), h1, a61);
            a61 = fma(vec4<f32>(x6.z), h2, a61);
            a61 = fma(vec4<f32>(x6.w), h3, a61);
            a70 = fma(vec4<f32>(x7.x), p0, a70);
            a70 = fma(vec4<f32>(x7.y), p1, a70);
            a70 = fma(vec4<f32>(x7.z), p2, a70);
            a70 = fma(vec4<f32>(x7.w), p3, a70);
            a71 = fma(vec4<f32>(x7.x), h0, a71);
            a71 = fma(vec4<f32>(x7.y), h1, a71);
            a71 = fma(vec4<f32>(x7.z), h2, a71);
            a71 = fma(vec4<f32>(x7.w), h3, a71);
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

// A 16-byte chunk (8 columns from 8 wq of the step) of one row into the staged weights: column
// 8 wq + e at vec4 `base + 16 e`, component `m`.
fn stage_chunk(base: u32, m: u32, v: vec4<u32>) {
    let lo = weight4(v, vec2<f32>(1.0), 0u);
    let hi = weight4(v, vec2<f32>(1.0), 1u);
    wt[base][m] = lo.x;
    wt[base + 16u][m] = lo.y;
    wt[base + 32u][m] = lo.z;
    wt[base + 48u][m] = lo.w;
    wt[base + 64u][m] = hi.x;
    wt[base + 80u][m] = hi.y;
    wt[base + 96u][m] = hi.z;
    wt[base + 112u][m] = hi.w;
}
