// Elementwise steps: mode 0 `y = silu(x / a)` (the HC down projection's activation), mode 1
// `y = 2 sigmoid(x / a)` (the HC injection weights), mode 2 `y = silu(x) * x2` (a SwiGLU),
// mode 3 `y = x[i + a]` (`a` a word offset: rows copied out), mode 4 `y[i + a] = x[i]` (rows
// copied in).
struct Params {
    n: u32,
    mode: u32,
    a: u32,
    wg_x: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> x2: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x + gid.y * P.wg_x * WG;
    if (i >= P.n) {
        return;
    }
    let a = bitcast<f32>(P.a);
    switch P.mode {
        case 0u: {
            y[i] = silu(x[i] / a);
        }
        case 1u: {
            y[i] = 2.0 * sigmoid(x[i] / a);
        }
        case 2u: {
            y[i] = silu(x[i]) * x2[i];
        }
        case 3u: {
            y[i] = x[i + P.a];
        }
        default: {
            y[i + P.a] = x[i];
        }
    }
}
