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

// The floor with one thing more that a real kernel has (what a dispatch step of a chain costs
// beyond its work): `tiny_u` takes its index from the uniform (0 there: each dispatch binds its
// own, as each of a model's kernels reads its own parameters, which the device's constant
// cache has not seen); `tiny_wg` declares 4 KiB of workgroup memory in a workgroup of 256
// lanes (which the pipeline may have zeroed first).
@compute @workgroup_size(1)
fn tiny_u() {
    dst[P.stride] = dst[P.stride] + 1u;
}

var<workgroup> wg_words: array<u32, 1024>;

@compute @workgroup_size(256)
fn tiny_wg(@builtin(local_invocation_index) li: u32) {
    wg_words[li] = li;
    workgroupBarrier();
    if (li == 0u) {
        dst[0] = dst[0] + wg_words[5];
    }
}
