// Activations to int8 (docs/codecs.md, "int8 activations"): 32 lanes per 32-element block of
// one token row, a lane per element, BLOCKS blocks a workgroup (the block's amax, code words and
// code sum gathered with workgroup atomics: a block costs three barriers, not a serial loop).
// The codes are computed from the f32 bits with integer arithmetic only (this device's f32
// division need not be correctly rounded), so they equal quant-codecs' act8
// codes. Output per block: 8 words of codes in the layout `Q.mode` names (0 natural: word w =
// elements 4w..4w+3; 1 pairs: word 2k+h = elements 8k+h, 8k+h+2, 8k+h+4, 8k+h+6, the order
// q4tp's nibble unpacking produces; 2 quads: word 4k+j = elements 16k+j, +4, +8, +12, q2tp's
// order), and (bits of d, sum of the codes).
//
// q8_2f's activations are multiplied by the matrix's f16 column scales first (`Q.col_scales`
// is their byte offset in binding 1, or 0xffffffff for none).
//
// Several q8_2f matrices that read the same activations are quantised by one dispatch: member
// m (the workgroups past the first nt * cols / 32 blocks) takes its column scales at
// `col_scales + m * cs_stride` bytes of binding 1 (a table of the members' scales) and writes
// its codes `m * q_stride` words and its block pairs `m * d_stride` pairs into the outputs.
// Member 0's codes may take a layout of their own (`mode0`'s low bits) and skip the column
// scales (`mode0`'s bit 31: the table's first row is then not read): a MoE block's routed
// experts (q4tp, q2tp, mxfp4: their layout, no column scales) and its shared expert's two
// q8_2f matrices quantised in one dispatch, member 0's codes those of a quantiser of its own
// (no multiplication by 1, whatever the device does with subnormals).

struct QParams {
    cols: u32,
    nt: u32,
    mode: u32,
    col_scales: u32,
    wg_x: u32,
    cs_stride: u32,
    q_stride: u32,
    d_stride: u32,
    members: u32,
    // The grouped entry: slots per activation row, and bytes per expert in the bank.
    x_div: u32,
    slot_bytes: u32,
    // Member 0's layout (the others': `mode`), and in bit 31 whether it skips the scales.
    mode0: u32,
}

@group(0) @binding(0) var<storage, read> xin: array<f32>;
@group(0) @binding(1) var<storage, read> ww: array<u32>;
@group(0) @binding(2) var<uniform> Q: QParams;
@group(0) @binding(3) var<storage, read_write> xq_out: array<u32>;
@group(0) @binding(4) var<storage, read_write> xd_out: array<vec2<u32>>;
// The grouped entry only: the slots' expert ids.
@group(0) @binding(5) var<storage, read> ids: array<u32>;

// Blocks per workgroup (a block's 32 lanes each): workgroups of one block left an H100 at a
// fraction of its lanes (its multiprocessors hold at most 32 workgroups each).
const BLOCKS: u32 = 8u;

var<workgroup> w_amax: array<atomic<u32>, BLOCKS>;
var<workgroup> w_sum: array<atomic<i32>, BLOCKS>;
var<workgroup> w_words: array<atomic<u32>, 64>;

fn byte_at(off: u32) -> u32 {
    return (ww[off >> 2u] >> ((off & 3u) * 8u)) & 0xffu;
}

fn col_scale(base: u32, i: u32) -> f32 {
    let off = base + 2u * i;
    return f16_bits(byte_at(off) | (byte_at(off + 1u) << 8u));
}

// (exponent, significand) of magnitude bits: subnormals take exponent 1, normals gain the
// implicit bit.
fn split_mag(v: u32) -> vec2<u32> {
    let e = v >> 23u;
    let m = v & 0x7fffffu;
    if (e == 0u) {
        return vec2<u32>(1u, m);
    }
    return vec2<u32>(e, m | 0x800000u);
}

// round_half_away(127 * |x| / amax) with x's sign, as a byte (two's complement).
fn code(xb: u32, a: vec2<u32>) -> u32 {
    let xs = split_mag(xb & 0x7fffffffu);
    let k = min(a.x - min(xs.x, a.x), 31u);
    let n = 127u * xs.y;
    let q = n / a.y;
    let r = n - q * a.y;
    var mag = 0u;
    if (k == 0u) {
        mag = q + select(0u, 1u, 2u * r >= a.y);
    } else {
        mag = (q + (1u << (k - 1u))) >> k;
    }
    var c = i32(mag);
    if ((xb >> 31u) != 0u) {
        c = -c;
    }
    return u32(c) & 0xffu;
}

// Where element e (0..31) of a block goes in layout `mode`: word * 4 + byte.
fn slot(e: u32, mode: u32) -> u32 {
    if (mode == 1u) {
        // pairs: element 8k + 2j + h -> word 2k + h, byte j
        let k = e >> 3u;
        let h = e & 1u;
        let j = (e & 7u) >> 1u;
        return (2u * k + h) * 4u + j;
    }
    if (mode == 2u) {
        // quads: element 16k + 4j + jj -> word 4k + jj, byte j
        let k = e >> 4u;
        let jj = e & 3u;
        let j = (e & 15u) >> 2u;
        return (4u * k + jj) * 4u + j;
    }
    return e;
}

@compute @workgroup_size(256)
fn act_quant(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let blocks = Q.cols / 32u;
    let e = li % 32u;
    let k = li / 32u;
    let flat = (wid.x + wid.y * Q.wg_x) * BLOCKS + k;
    let member = flat / max(blocks * Q.nt, 1u);
    let id = flat - member * blocks * Q.nt;
    // Blocks past the members (the grid's last workgroups) only skip their loads and stores:
    // every lane reaches every barrier.
    let valid = member < max(Q.members, 1u);
    let t = id / max(blocks, 1u);
    let b = id - t * blocks;
    var base = 0xffffffffu;
    let unscaled = member == 0u && (Q.mode0 >> 31u) == 1u;
    if (Q.col_scales != 0xffffffffu && !unscaled) {
        base = Q.col_scales + member * Q.cs_stride;
    }
    let mode = select(Q.mode, Q.mode0 & 0x7fffffffu, member == 0u);
    quantise(e, k, valid, t, b, base, member * Q.q_stride + id * 8u, member * Q.d_stride + id, mode);
}

// The grouped experts' q8_2f activations: slot s (`Q.members` of them) quantises activation
// row s / x_div with the column scales of its expert `ids[s]` (at `ids[s] * slot_bytes +
// col_scales` bytes of binding 1, the expert bank) into code row s.
@compute @workgroup_size(256)
fn act_quant_grouped(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let blocks = Q.cols / 32u;
    let e = li % 32u;
    let k = li / 32u;
    let flat = (wid.x + wid.y * Q.wg_x) * BLOCKS + k;
    let s = flat / max(blocks, 1u);
    let b = flat - s * blocks;
    let valid = s < max(Q.members, 1u);
    let expert = ids[min(s, max(Q.members, 1u) - 1u)];
    quantise(
        e,
        k,
        valid,
        s / max(Q.x_div, 1u),
        b,
        expert * Q.slot_bytes + Q.col_scales,
        flat * 8u,
        flat,
        Q.mode,
    );
}

// Block b of activation row t, the workgroup's k-th (scaled by the column scales at byte `base` unless it is
// 0xffffffff) into 8 code words at word `oq` of xq_out and its (d, sum) at pair `od` of xd_out.
fn quantise(e: u32, k: u32, valid: bool, t: u32, b: u32, base: u32, oq: u32, od: u32, mode: u32) {
    if (e == 0u) {
        atomicStore(&w_amax[k], 0u);
        atomicStore(&w_sum[k], 0i);
    }
    if (e < 8u) {
        atomicStore(&w_words[k * 8u + e], 0u);
    }
    workgroupBarrier();
    var bits = 0u;
    if (valid) {
        var v = xin[t * Q.cols + b * 32u + e];
        if (base != 0xffffffffu) {
            v = v * col_scale(base, b * 32u + e);
        }
        bits = bitcast<u32>(v);
        atomicMax(&w_amax[k], bits & 0x7fffffffu);
    }
    workgroupBarrier();
    let amax = atomicLoad(&w_amax[k]);
    var c = 0u;
    if (valid && amax != 0u && amax < 0x7f800000u) {
        c = code(bits, split_mag(amax));
    }
    let s = slot(e, mode);
    atomicOr(&w_words[k * 8u + (s >> 2u)], c << ((s & 3u) * 8u));
    atomicAdd(&w_sum[k], bitcast<i32>(c << 24u) >> 24u);
    workgroupBarrier();
    if (valid && e < 8u) {
        xq_out[oq + e] = atomicLoad(&w_words[k * 8u + e]);
    }
    if (valid && e == 0u) {
        var d = 0.0;
        if (amax >= 0x7f800000u) {
            d = bitcast<f32>(0x7fc00000u);
        } else if (amax != 0u) {
            d = bitcast<f32>(amax) / 127.0;
        }
        xd_out[od] = vec2<u32>(bitcast<u32>(d), bitcast<u32>(atomicLoad(&w_sum[k])));
    }
}
