// DeepSeek's hyper-connection after a block: `X'_k = post_k y + sum_j C[j][k] X_j` in place on
// the streams `x` `[nt, N, D]`, with the block output `y` `[nt, D]` and the site's `maps`
// (`mhc_pre`'s layout: pre, post, C per token row). One lane per (row, column): it reads the
// column of every stream before writing any, so in place is safe; the sum over j runs in order.
struct Params {
    count: u32,
    n: u32,
    d: u32,
    wg_x: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read_write> maps: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x + gid.y * P.wg_x * WG;
    if (i >= P.count) {
        return;
    }
    let n = P.n;
    let d = P.d;
    let t = i / d;
    let j = i % d;
    let m = (2u + n) * n;
    let mp = t * m;
    var col: array<f32, 8>;
    for (var k = 0u; k < n; k++) {
        col[k] = x[(t * n + k) * d + j];
    }
    let yv = y[t * d + j];
    for (var k = 0u; k < n; k++) {
        var mixed = 0.0;
        for (var s = 0u; s < n; s++) {
            mixed += maps[mp + 2u * n + s * n + k] * col[s];
        }
        x[(t * n + k) * d + j] = maps[mp + n + k] * yv + mixed;
    }
}
