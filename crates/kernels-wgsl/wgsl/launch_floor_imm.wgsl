// read_bw.wgsl's `tiny_u` with its index in immediates (pushed with the dispatch) rather than
// a uniform buffer: a module of its own, its pipeline layout declaring them.

@group(0) @binding(0) var<storage, read_write> dst: array<u32>;
var<immediate> I: vec4<u32>;

@compute @workgroup_size(1)
fn tiny_i() {
    dst[I.x] = dst[I.x] + 1u;
}
