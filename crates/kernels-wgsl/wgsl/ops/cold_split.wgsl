// Splits a frame's routed slots between the layer's VRAM bank and the CPU (a model whose
// routed experts do not all fit in VRAM): slot i's expert x = ids[i] is resident when
// slot_of[x] names a bank slot; the grouped kernels then read that slot. A cold slot's expert
// is named in `cold` (NONE for a resident one) for the host, which computes it and writes its
// output over what the grouped kernels computed there (bank slot 0: a valid read, never used).
struct Params {
    n: u32,
    wg_x: u32,
}

const NONE: u32 = 0xffffffffu;

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> slot_of: array<u32>;
@group(0) @binding(4) var<storage, read_write> bank_ids: array<u32>;
@group(0) @binding(5) var<storage, read_write> cold: array<u32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x + gid.y * P.wg_x * WG;
    if (i >= P.n) {
        return;
    }
    let x = ids[i];
    let s = slot_of[x];
    let hot = s != NONE;
    bank_ids[i] = select(0u, s, hot);
    cold[i] = select(x, NONE, hot);
}
