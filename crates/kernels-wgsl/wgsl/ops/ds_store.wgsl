// DeepSeek's rings: rows of `src` `[nt, w]` (the frame's token rows) into the ring `ring`
// `[r, w]` at slot `(past + row) % r`, so a cache keeps the last `r` positions with no shift.
struct Params {
    count: u32,
    w: u32,
    r: u32,
    wg_x: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> src: array<f32>;
@group(0) @binding(3) var<storage, read_write> ring: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x + gid.y * P.wg_x * WG;
    if (i >= P.count) {
        return;
    }
    let row = i / P.w;
    ring[((F.past + row) % P.r) * P.w + i % P.w] = src[i];
}
