// DeepSeek's interleaved RoPE on the trailing `2 * half` channels of every `dh`-wide head of
// `x` `[nt, heads, dh]` in place, at the row's position `past + row` (`inverse`: by the negated
// angle, what undoes V's rotation on the attention output). `cs` is the host's table
// `[positions, 2 * half]`: cos then sin of each position, attention scale folded in, the same
// f32 values the CPU forward computes. One lane per rotated pair.
struct Params {
    count: u32,
    heads: u32,
    dh: u32,
    half: u32,
    inverse: u32,
    wg_x: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> cs: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x + gid.y * P.wg_x * WG;
    if (i >= P.count) {
        return;
    }
    let pair = i % P.half;
    let head = i / P.half;
    let row = head / P.heads;
    let t0 = (F.past + row) * 2u * P.half;
    let c = cs[t0 + pair];
    var s = cs[t0 + P.half + pair];
    if (P.inverse == 1u) {
        s = -s;
    }
    let at = head * P.dh + P.dh - 2u * P.half + 2u * pair;
    let a = x[at];
    let b = x[at + 1u];
    x[at] = a * c - b * s;
    x[at + 1u] = b * c + a * s;
}
