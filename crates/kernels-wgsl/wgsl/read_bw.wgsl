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

// `tiny` as a pipeline of its own (adding 1 << 16, so a count tells the two apart):
// dispatches alternating between the two switch pipelines at every step, as a model's chain of
// different kernels does.
@compute @workgroup_size(1)
fn tiny_b(@builtin(global_invocation_id) gid: vec3<u32>) {
    dst[0] = dst[0] + 65536u;
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

// An L2 prefetch: the same walk over `P.words` words of a matrix a later dispatch reads, run
// beside a latency-bound one (its output a buffer the command buffer has not used, so wgpu puts
// no barrier before it), so that the later dispatch finds its weights in the device's L2. The
// fold is stored only if it equals a constant no weight bytes give in practice (the loads must
// happen; the store need not).
@compute @workgroup_size(WG)
fn prefetch(@builtin(global_invocation_id) gid: vec3<u32>) {
    var acc = vec4<u32>(0u);
    for (var i = gid.x; i < P.words; i = i + P.stride) {
        acc = acc ^ src[i];
    }
    if (all(acc == vec4<u32>(0x9e3779b9u, 0x7f4a7c15u, 0x85ebca6bu, 0xc2b2ae35u))) {
        dst[0] = acc.x;
    }
}
