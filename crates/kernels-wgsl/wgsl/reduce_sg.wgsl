// Row-group reduction with one subgroup per row group (LANES equals the subgroup size, which
// the runtime only chooses when the adapter reports one fixed size): a single subgroupAdd,
// no workgroup memory, no barrier.
fn reduce(v: f32, li: u32, lane: u32, sg_size: u32, sg_lane: u32) -> f32 {
    return subgroupAdd(v);
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
