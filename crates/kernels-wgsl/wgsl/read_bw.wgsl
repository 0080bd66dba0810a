// The read-bandwidth ceiling: a grid-stride walk over vec4<u32> words, one XOR-fold written per
// lane so the loads cannot be optimised away.
struct Params {
    words: u32,
    stride: u32,
}

@group(0) @binding(0) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;
@group(0) @binding(2) var<uniform> P: Params;

override WG: u32 = 256u;

@compute @workgroup_size(WG)
fn read_bw(@builtin(global_invocation_id) gid: vec3<u32>) {
    var acc = vec4<u32>(0u);
    for (var i = gid.x; i < P.words; i = i + P.stride) {
        acc = acc ^ src[i];
    }
    dst[gid.x] = acc.x ^ acc.y ^ acc.z ^ acc.w;
}

// The launch-overhead floor: one lane writes one word.
@compute @workgroup_size(1)
fn tiny(@builtin(global_invocation_id) gid: vec3<u32>) {
    dst[0] = dst[0] + 1u;
}
