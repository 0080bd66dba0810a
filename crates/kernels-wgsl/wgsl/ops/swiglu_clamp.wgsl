// A clamped SwiGLU (DeepSeek's experts): `y[r, c] = silu(min(g, L)) * min(max(u, -L), L)` for
// `rows * i` values, the gate at `g[r * gs + c]`, the up at `u[r * us + uo + c]` (read from `g`
// when `same` = 1: a gate/up matrix's rows `[gate | up]`).
struct Params {
    n: u32,
    i: u32,
    gs: u32,
    us: u32,
    uo: u32,
    limit: u32,
    same: u32,
    wg_x: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> g: array<f32>;
@group(0) @binding(3) var<storage, read_write> u: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let at = gid.x + gid.y * P.wg_x * WG;
    if (at >= P.n) {
        return;
    }
    let r = at / P.i;
    let c = at % P.i;
    let l = bitcast<f32>(P.limit);
    let gv = g[r * P.gs + c];
    var uv = 0.0;
    if (P.same == 1u) {
        uv = g[r * P.us + P.uo + c];
    } else {
        uv = u[r * P.us + P.uo + c];
    }
    y[at] = silu(min(gv, l)) * min(max(uv, -l), l);
}
