// Row reduction with subgroup operations: each subgroup sums its lanes, then the row's subgroup
// sums are added in order through workgroup memory. Needs LANES to be a multiple of the
// subgroup size and subgroups laid out along local_invocation_index.
fn reduce(v: f32, li: u32, lane: u32, sg_size: u32, sg_lane: u32) -> f32 {
    let s = subgroupAdd(v);
    if (sg_lane == 0u) {
        red[li / sg_size] = s;
    }
    workgroupBarrier();
    let first = (li - lane) / sg_size;
    var total = 0.0;
    for (var k = 0u; k < LANES / sg_size; k = k + 1u) {
        total = total + red[first + k];
    }
    workgroupBarrier();
    return total;
}

@compute @workgroup_size(WG)
fn matvec(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_size) sg_size: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
) {
    matvec_body(wid, li, sg_size, sg_lane);
}
