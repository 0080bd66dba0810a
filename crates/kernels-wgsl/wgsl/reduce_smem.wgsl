// Row reduction through workgroup memory: a fixed pairwise tree over the row's LANES lanes.
var<workgroup> red: array<f32, WG>;

fn reduce(v: f32, li: u32, lane: u32, sg_size: u32, sg_lane: u32) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var stride = LANES / 2u; stride > 0u; stride = stride / 2u) {
        if (lane < stride) {
            red[li] = red[li] + red[li + stride];
        }
        workgroupBarrier();
    }
    let total = red[li - lane];
    workgroupBarrier();
    return total;
}

@compute @workgroup_size(WG)
fn matvec(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    matvec_body(wid, li, 0u, 0u);
}
