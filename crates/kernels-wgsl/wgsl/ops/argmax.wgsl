// Greedy decoding's choice on the device: the index of the largest logit of one row (equal
// logits: the lower id), written as one word.
struct Params {
    n: u32,
    offset: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(2) var<storage, read_write> logits: array<f32>;
@group(0) @binding(3) var<storage, read_write> token: array<u32>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) li: u32) {
    var bv = NEG;
    var bi = 0u;
    for (var j = li; j < P.n; j += WG) {
        let v = logits[P.offset + j];
        if (v > bv) {
            bv = v;
            bi = j;
        }
    }
    let best = argmax_wg(bv, bi, li);
    if (li == 0u) {
        token[0] = best;
    }
}
