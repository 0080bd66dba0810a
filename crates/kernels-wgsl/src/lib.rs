//! cortiq's WGSL kernels: the sources, how each variant is assembled and specialised, and naga
//! validation of every variant under every capability set. No device is needed here.
//!
//! The principal type is [`Matvec`], one codec's matvec/matmat kernel in one reduction variant;
//! [`registry`] lists every module, and [`validate_all`] checks them all the way the GPU runtime
//! will build them.
//!
//! ```
//! use kernels_wgsl::{Caps, Codec, Epilogue, Matvec, Path, Reduce, Specialization, validate};
//!
//! let k = Matvec { codec: Codec::Q4tp, reduce: Reduce::SharedMemory, nt: 8, rows: 4, epilogue: Epilogue::None, path: Path::Int8, grouped: false, segments: kernels_wgsl::Segments::One, lut_copies: 1 };
//! assert_eq!(k.name(), "matvec_q4tp_i8_smem_t8_r4");
//! validate(&k.name(), &k.source(), Caps::LAVAPIPE, &Specialization::matvec(256, 64)).unwrap();
//! ```
#![deny(missing_docs)]

use std::borrow::Cow;

mod generate;
mod grouped_tiled;
mod tiled;

pub use grouped_tiled::{EXPERT_TILE, GroupedTiled, MAX_TILED_EXPERTS};
pub use tiled::{TILE_COLS, TILE_ROWS, TILE_TOKENS, Tiled};

/// WGSL sources, embedded.
mod src {
    pub const DECODE: &str = include_str!("../wgsl/decode.wgsl");
    pub const COMMON: &str = include_str!("../wgsl/common.wgsl");
    pub const MATVEC_COMMON: &str = include_str!("../wgsl/matvec_common.wgsl");
    pub const MATVEC: &str = include_str!("../wgsl/matvec.wgsl");
    pub const MATVEC_I8: &str = include_str!("../wgsl/matvec_i8.wgsl");
    pub const I8_CODES: &str = include_str!("../wgsl/i8_codes.wgsl");
    pub const ACT_QUANT: &str = include_str!("../wgsl/act_quant.wgsl");
    pub const REDUCE_SG: &str = include_str!("../wgsl/reduce_sg.wgsl");
    pub const REDUCE_SMEM: &str = include_str!("../wgsl/reduce_smem.wgsl");
    pub const READ_BW: &str = include_str!("../wgsl/read_bw.wgsl");
    pub const LAUNCH_FLOOR_IMM: &str = include_str!("../wgsl/launch_floor_imm.wgsl");
    pub const F32: &str = include_str!("../wgsl/f32.wgsl");
    pub const F16: &str = include_str!("../wgsl/f16.wgsl");
    pub const F16_HW: &str = include_str!("../wgsl/f16_hw.wgsl");
    pub const BF16: &str = include_str!("../wgsl/bf16.wgsl");
    pub const Q8_2F: &str = include_str!("../wgsl/q8_2f.wgsl");
    pub const Q4TP: &str = include_str!("../wgsl/q4tp.wgsl");
    pub const Q2TP: &str = include_str!("../wgsl/q2tp.wgsl");
    pub const MXFP4: &str = include_str!("../wgsl/mxfp4.wgsl");
    pub const TILED: &str = include_str!("../wgsl/tiled.wgsl");
    pub const TILED_F16: &str = include_str!("../wgsl/tiled_f16.wgsl");
    pub const TILED_F16_8X8: &str = include_str!("../wgsl/tiled_f16_8x8.wgsl");
    pub const TILED_I8_COMMON: &str = include_str!("../wgsl/tiled_i8_common.wgsl");
    pub const TILED_I8: &str = include_str!("../wgsl/tiled_i8.wgsl");
    pub const TILED_I8_8X8: &str = include_str!("../wgsl/tiled_i8_8x8.wgsl");
    pub const GROUPED_TILED: &str = include_str!("../wgsl/grouped_tiled.wgsl");
    pub const GROUPED_TILED_TIERED: &str = include_str!("../wgsl/grouped_tiled_tiered.wgsl");
    pub const GROUPED_TILED_Q4TP: &str = include_str!("../wgsl/grouped_tiled_q4tp.wgsl");
    pub const GROUPED_TILED_Q2TP: &str = include_str!("../wgsl/grouped_tiled_q2tp.wgsl");
    pub const GROUPED_TILED_MXFP4: &str = include_str!("../wgsl/grouped_tiled_mxfp4.wgsl");
}

/// A weight format the GPU kernels read (quant-codecs' dtypes; f32 for exact-weight parity
/// runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
    /// int8 with row and column f16 scales.
    Q8_2f,
    /// 4-bit tiered-precision groups.
    Q4tp,
    /// 2-bit tiered-precision groups with a zero rung.
    Q2tp,
    /// OCP MX FP4.
    Mxfp4,
}

impl Codec {
    /// Every codec.
    pub const ALL: [Codec; 7] = [
        Codec::F32,
        Codec::F16,
        Codec::Bf16,
        Codec::Q8_2f,
        Codec::Q4tp,
        Codec::Q2tp,
        Codec::Mxfp4,
    ];

    /// Whether the codec stores plain floats (no blocks or scales): f32, f16, bf16.
    pub const fn is_float(self) -> bool {
        matches!(self, Codec::F32 | Codec::F16 | Codec::Bf16)
    }

    /// The dtype name quant-codecs uses.
    pub const fn name(self) -> &'static str {
        match self {
            Codec::F32 => "f32",
            Codec::F16 => "f16",
            Codec::Bf16 => "bf16",
            Codec::Q8_2f => "q8_2f",
            Codec::Q4tp => "q4tp",
            Codec::Q2tp => "q2tp",
            Codec::Mxfp4 => "mxfp4",
        }
    }

    /// The codec with this dtype name.
    pub fn from_name(name: &str) -> Option<Codec> {
        Codec::ALL.into_iter().find(|c| c.name() == name)
    }

    /// Columns must be a multiple of this for the kernel: a row is whole 16-byte chunks.
    pub const fn col_multiple(self) -> usize {
        match self {
            Codec::F32 => 4,
            Codec::F16 | Codec::Bf16 => 8,
            Codec::Q8_2f => 16,
            Codec::Q4tp | Codec::Mxfp4 => 32,
            Codec::Q2tp => 64,
        }
    }

    /// Activation vec4s per 16-byte weight chunk (the codec's `CHUNK_VEC4`).
    pub const fn chunk_vec4(self) -> u32 {
        match self {
            Codec::F32 => 1,
            Codec::F16 | Codec::Bf16 => 2,
            Codec::Q8_2f => 4,
            Codec::Q4tp | Codec::Mxfp4 => 8,
            Codec::Q2tp => 16,
        }
    }

    /// How the int8 path lays a block's activation codes out for this codec (its weight
    /// unpacking's element order); `None` for the float codecs, which have no int8 path.
    pub const fn act_layout(self) -> Option<ActLayout> {
        match self {
            Codec::F32 | Codec::F16 | Codec::Bf16 => None,
            Codec::Q8_2f | Codec::Mxfp4 => Some(ActLayout::Natural),
            Codec::Q4tp => Some(ActLayout::Pairs),
            Codec::Q2tp => Some(ActLayout::Quads),
        }
    }

    fn source(self) -> &'static str {
        match self {
            Codec::F32 => src::F32,
            Codec::F16 => src::F16,
            Codec::Bf16 => src::BF16,
            Codec::Q8_2f => src::Q8_2F,
            Codec::Q4tp => src::Q4TP,
            Codec::Q2tp => src::Q2TP,
            Codec::Mxfp4 => src::MXFP4,
        }
    }
}

/// The element order of a 32-activation block's 8 code words on the int8 path (act_quant.wgsl).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActLayout {
    /// Word `w` holds elements `4w .. 4w + 3` (q8_2f, mxfp4 through its byte table).
    Natural = 0,
    /// Word `2k + h` holds elements `8k + h + {0, 2, 4, 6}`: a q4tp word's low nibbles, then
    /// its high nibbles.
    Pairs = 1,
    /// Word `4k + j` holds elements `16k + j + {0, 4, 8, 12}`: a q2tp word's 2-bit fields at
    /// shift `2j`.
    Quads = 2,
}

impl ActLayout {
    /// The byte (word * 4 + byte) element `e` (0..32) of a block goes to.
    pub const fn slot(self, e: usize) -> usize {
        match self {
            ActLayout::Natural => e,
            ActLayout::Pairs => (2 * (e >> 3) + (e & 1)) * 4 + ((e & 7) >> 1),
            ActLayout::Quads => (4 * (e >> 4) + (e & 3)) * 4 + ((e & 15) >> 2),
        }
    }
}

/// What the activations are and how the weights meet them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Path {
    /// f32 activations, weights decoded to f32 (every codec; f16 by integer bit construction).
    #[default]
    F32,
    /// f32 activations, f16 weights through the hardware conversion (`unpack2x16float`; needs
    /// [`Caps::f16_in_f32`]). f16 only.
    HwF16,
    /// Activations quantised to int8 per 32-block by [`ACT_QUANT_ENTRY`]'s kernel, integer dot
    /// products (`dot4I8Packed`) with the weight codes (docs/codecs.md, "int8 activations").
    /// q8_2f, q4tp, q2tp and mxfp4.
    Int8,
}

impl Path {
    /// Name suffix.
    pub const fn suffix(self) -> &'static str {
        match self {
            Path::F32 => "",
            Path::HwF16 => "_hw",
            Path::Int8 => "_i8",
        }
    }

    /// Whether `codec` has this path.
    pub const fn supports(self, codec: Codec) -> bool {
        match self {
            Path::F32 => true,
            Path::HwF16 => matches!(codec, Codec::F16),
            Path::Int8 => codec.act_layout().is_some(),
        }
    }
}

/// How a row's lanes are summed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reduce {
    /// One `subgroupAdd` per row group (needs the SUBGROUP feature and a fixed subgroup size,
    /// which LANES must equal).
    Subgroup,
    /// A pairwise tree in workgroup memory (works everywhere).
    SharedMemory,
}

impl Reduce {
    /// Short name used in kernel names.
    pub const fn suffix(self) -> &'static str {
        match self {
            Reduce::Subgroup => "sg",
            Reduce::SharedMemory => "smem",
        }
    }
}

/// The matvec/matmat kernel of one codec, one reduction variant, `nt` token rows and `rows`
/// rows per row group (entry point `matvec`).
///
/// Bindings: 0 weights as `array<vec4<u32>>`, 1 the same buffer as `array<u32>`, 2 the
/// `Params` uniform (8 u32: rows, cols, row_offset, y_stride, second, third, code_stride, wg_x),
/// 3 activations `array<vec4<f32>>` ([nt, cols]), 4 outputs `array<f32>` ([nt, y_stride]).
/// Override constants: `WG` (lanes per workgroup) and `LANES` (lanes per row group, a power of
/// two not above WG; equal to the subgroup size in the subgroup variant).
///
/// `nt` and `rows` are baked into the source by [`Matvec::source`]'s template step (every
/// accumulator a named scalar, every loop over token rows, rows and a chunk's vec4s unrolled):
/// runtime-indexed private arrays are spilled to memory by some drivers, and an override
/// constant does not make a naga loop unroll.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Matvec {
    /// The weight format.
    pub codec: Codec,
    /// The reduction.
    pub reduce: Reduce,
    /// Token rows, 1..=8: each weight chunk is decoded once and applied to all of them.
    pub nt: u32,
    /// Rows per row group, 1..=4: each activation load is applied to all of them.
    pub rows: u32,
    /// What happens to a finished row sum before it is written.
    pub epilogue: Epilogue,
    /// The activation path.
    pub path: Path,
    /// The grouped-experts variant: one token row per slot, slot `s` (the grid's `y`) reading
    /// the expert `ids[s]` of an expert bank (binding 6; every expert's payload at
    /// `ids[s] * slot_bytes`), activation row `s / x_div`, output row `s`. `nt` must be 1.
    pub grouped: bool,
    /// How the grouped variant's bank is bound (plain kernels: [`Segments::One`]).
    pub segments: Segments,
    /// mxfp4 on the int8 path: copies of the byte -> int8-pair table in workgroup memory
    /// (a power of two, 1..=32), lane `l` reading copy `l % lut_copies` (entry `byte *
    /// lut_copies + copy`, so with 32 copies the 32 lanes of a subgroup read 32 different banks
    /// whatever their bytes). Every other kernel ignores it.
    pub lut_copies: u32,
}

/// The grouped variant's declarations: the slots' expert ids, and the chosen expert's byte
/// offset in words and in 16-byte chunks.
const GROUPED_DECL: &str = "@group(0) @binding(6) var<storage, read> ids: array<u32>;
var<private> sb4: u32;
var<private> sb16: u32;";

/// How a grouped kernel's expert bank is bound: one buffer, or segments of slots (a bank larger
/// than one storage binding, or a global bank shared by every layer; seed-spec.md §5.4).
/// Slot `id` of a segmented bank is local slot `id % P.a` of segment `id / P.a`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Segments {
    /// One buffer at bindings 0 (16-byte chunks) and 1 (words).
    #[default]
    One,
    /// `n` buffers at bindings 8 .. 8 + n, each read as 16-byte chunks, chosen per load by a
    /// switch on the slot's segment (uniform across the workgroup): any adapter, at the cost
    /// of `n` storage bindings.
    Fixed(u32),
    /// `n` buffers as one `binding_array` at binding 8 (adapters with storage binding arrays).
    Array(u32),
}

impl Segments {
    /// The fixed set a bank of `n` (2..=16) segments binds: 8 or 16 (the bindings past its
    /// segments repeat segment 0, never read).
    pub fn bound(n: usize) -> Segments {
        if n <= 8 {
            Segments::Fixed(8)
        } else {
            Segments::Fixed(16)
        }
    }

    /// Segment buffers bound (1 for [`Segments::One`]).
    pub fn count(self) -> u32 {
        match self {
            Segments::One => 1,
            Segments::Fixed(n) | Segments::Array(n) => n,
        }
    }

    fn suffix(self) -> String {
        match self {
            Segments::One => String::new(),
            Segments::Fixed(n) => format!("_seg{n}"),
            Segments::Array(n) => format!("_segarr{n}"),
        }
    }

    /// The declarations of a segmented bank and its loads `wv_seg` (a 16-byte chunk) and
    /// `ww_seg` (a word, taken from its chunk).
    fn declarations(self) -> String {
        let mut d = String::from("var<private> seg: u32;\n");
        match self {
            Segments::One => return String::new(),
            Segments::Fixed(n) => {
                for i in 0..n {
                    d += &format!(
                        "@group(0) @binding({}) var<storage, read> seg{i}: array<vec4<u32>>;\n",
                        8 + i
                    );
                }
                d += "fn wv_seg(i: u32) -> vec4<u32> {\n    switch seg {\n";
                for i in 0..n.saturating_sub(1) {
                    d += &format!("        case {i}u: {{ return seg{i}[i]; }}\n");
                }
                d += &format!(
                    "        default: {{}}\n    }}\n    return seg{}[i];\n}}\n",
                    n.saturating_sub(1)
                );
            }
            Segments::Array(n) => {
                d += "struct Seg { v: array<vec4<u32>>, }\n";
                d += &format!(
                    "@group(0) @binding(8) var<storage, read> segs: binding_array<Seg, {n}>;\n"
                );
                d += "fn wv_seg(i: u32) -> vec4<u32> {\n    return segs[seg].v[i];\n}\n";
            }
        }
        d += "fn ww_seg(i: u32) -> u32 {\n    return wv_seg(i >> 2u)[i & 3u];\n}\n";
        d
    }
}

/// Rewrites every `name[e]` of `src` as `name[base + (e)]` (brackets matched, so nested
/// indexing and any operator precedence inside `e` are kept).
fn offset_index(src: &str, name: &str, base: &str) -> String {
    rewrite_index(src, name, &|e| format!("{name}[{base} + ({e})]"))
}

/// Rewrites every whole `name[e]` of `src` as `f(e)` (brackets matched).
fn rewrite_index(src: &str, name: &str, f: &dyn Fn(&str) -> String) -> String {
    let open = format!("{name}[");
    let mut out = String::with_capacity(src.len() + 256);
    let mut rest = src;
    while let Some(at) = rest.find(&open) {
        // Only a whole identifier: `wv[` must not be the tail of a longer name.
        let whole = rest[..at]
            .chars()
            .last()
            .is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
        if !whole {
            out.push_str(&rest[..at + open.len()]);
            rest = &rest[at + open.len()..];
            continue;
        }
        out.push_str(&rest[..at]);
        rest = &rest[at + open.len()..];
        let mut depth = 1;
        let end = rest
            .char_indices()
            .find(|&(_, c)| {
                match c {
                    '[' => depth += 1,
                    ']' => depth -= 1,
                    _ => {}
                }
                depth == 0
            })
            .map_or(rest.len(), |(i, _)| i);
        out.push_str(&f(&rest[..end]));
        rest = rest.get(end + 1..).unwrap_or("");
    }
    out.push_str(rest);
    out
}

/// A fused step after the matvec, saving a dispatch and a round trip through memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Epilogue {
    /// `y = W x`.
    #[default]
    None,
    /// `y = silu(W x)`, with `silu(v) = v / (1 + exp(-v))`.
    Silu,
    /// The gate/up pair on one input: the matrix is `[gate; up]` (`2 * half` rows, as the
    /// checkpoints' fused `gate_up_proj` stores it) and `y[r] = silu(gate[r] . x) * (up[r] . x)`
    /// for `r < half`. A row group holds rows `r` and `r + half` (`rows` must be 2).
    SiluGateUp,
    /// [`Epilogue::SiluGateUp`] over two matrices of one shape uploaded as one (`[gate; up]`):
    /// on the int8 path the up rows read the second member of a shared quantiser's
    /// activations (their own column scales), `slot_bytes` and `x_div` blocks and block pairs
    /// after the first's; the f32 paths read one `x` for both (codecs without column scales).
    GateUpTwo,
    /// Two matrices of one shape in one dispatch, uploaded as one (`[a; b]`, `2 * half` rows,
    /// activations as [`Epilogue::GateUpTwo`]): `y[t, r] = a[r] . x` and `aux[t, r] = b[r] . x`.
    PairTwo,
    /// A hyper-connection site's front (its low-rank down rows, then its H injection rows, one
    /// matrix): with `v = (W x)[r] / a` (`a` = H), `y[t, r] = silu(v)` for `r < half` and
    /// `aux[t, r - half] = 2 sigmoid(v)` for the rest: the activations the up matrix and the
    /// injection read, without a dispatch of their own. One part only.
    HcFront,
    /// A hyper-connection site's read-out fused into its up matrix, whose rows are interleaved
    /// so that row group `j` holds column `j` of all `rows` streams (row `j * H + k` is stream
    /// `k`'s): `y[t, j] = (sum_k sigmoid(g_k) aux[t, k * D + j]) / H` with `aux` the normalised
    /// streams `[nt, H * D]`, streams added in order. One part only.
    HcReadout,
    /// [`Epilogue::HcFront`] with the site's norm folded in (its dispatch saved): `x` is the
    /// raw streams `[nt, H * D]`, and each lane first injects the pending block output
    /// (`blk` at binding 5 `[nt, D]` with the weights `inj` at binding 8 `[nt, H]`, when
    /// `P.slot_bytes` is 1), sums each stream's squares and dots each stream's columns times
    /// `1 + w` (`nw` at binding 6 `[H * D]`) apart; the row's value is then
    /// `sum_k dot_k / rms_k`, and the row group of row 0 writes the `1 / rms` (`P.x_div`: eps
    /// bits) to binding 9 `[nt, H]` for the read-out. Float codecs on the f32 paths only.
    HcFrontNorm,
    /// [`Epilogue::HcReadout`] reading the raw streams (`aux`) instead of normalised ones:
    /// each column's row group injects the pending block output into its H stream values (as
    /// [`Epilogue::HcFrontNorm`] does; written back to `aux`), and normalises them with the
    /// front's `1 / rms` (binding 9) and `1 + w` (binding 6).
    HcReadoutNorm,
    /// A MoE block's output from its shared expert's down projection: with `v = (W x)[r]`,
    /// `y[t, r] = sum_s sw[t, s] eo[t K + s, r] + gate[t] v` (the routed slots' weighted sum in
    /// slot order, then the gated shared expert: what `shared_add` computes, in its order).
    /// `aux` holds the routed slots' outputs `eo` `[nt K, rows]`, then their weights `sw`
    /// `[nt, K]` and the shared expert's gates `[nt]` (`route` writes both there). One part
    /// only.
    MoeOut,
}

impl Epilogue {
    /// Name suffix.
    pub const fn suffix(self) -> &'static str {
        match self {
            Epilogue::None => "",
            Epilogue::Silu => "_silu",
            Epilogue::SiluGateUp => "_gateup",
            Epilogue::GateUpTwo => "_gateup2",
            Epilogue::PairTwo => "_pair2",
            Epilogue::HcFront => "_hcfront",
            Epilogue::HcReadout => "_hcread",
            Epilogue::HcFrontNorm => "_hcfrontn",
            Epilogue::HcReadoutNorm => "_hcreadn",
            Epilogue::MoeOut => "_moeout",
        }
    }

    /// Whether the epilogue reads or writes the auxiliary buffer at binding 7.
    pub const fn has_aux(self) -> bool {
        matches!(
            self,
            Epilogue::HcFront
                | Epilogue::HcReadout
                | Epilogue::PairTwo
                | Epilogue::MoeOut
                | Epilogue::HcFrontNorm
                | Epilogue::HcReadoutNorm
        )
    }

    /// Whether the epilogue folds a hyper-connection site's norm in (bindings 5, 6, 8, 9; the
    /// f32 paths only).
    pub const fn folds_norm(self) -> bool {
        matches!(self, Epilogue::HcFrontNorm | Epilogue::HcReadoutNorm)
    }

    /// Whether a row group holds row `r` and row `r + half` of a two-halved matrix.
    pub const fn is_pair(self) -> bool {
        matches!(
            self,
            Epilogue::SiluGateUp | Epilogue::GateUpTwo | Epilogue::PairTwo
        )
    }

    /// Whether the second half's rows read a second member's activations (int8 path).
    pub const fn has_members(self) -> bool {
        matches!(self, Epilogue::GateUpTwo | Epilogue::PairTwo)
    }

    /// Whether only plain (not grouped) matvecs take it.
    pub const fn plain_only(self) -> bool {
        self.has_aux() || self.has_members()
    }
}

/// The auxiliary buffer of the hyper-connection epilogues (the injection weights the front
/// writes, the normalised streams the read-out reads) and of [`Epilogue::MoeOut`] (the routed
/// slots' outputs, weights and gates), and the hyper-connections' sigmoid (the op kernels' own
/// expression, so the fused values are the separate ops' values).
const AUX_DECL: &str = "@group(0) @binding(7) var<storage, read_write> aux: array<f32>;
fn hc_sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}";

/// The folded norm's buffers ([`Epilogue::HcFrontNorm`], [`Epilogue::HcReadoutNorm`]): the
/// pending block output, the norm's weight, the pending injection weights, the `1 / rms` of
/// each token row's streams.
const NORM_DECL: &str = "@group(0) @binding(5) var<storage, read> blk: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> nw: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read> inj_old: array<f32>;
@group(0) @binding(9) var<storage, read_write> rstd: array<f32>;";

/// A row group's sum of four values at once (the folded norm's per-stream sums): the
/// subgroup's, or a pairwise tree in workgroup memory of its own.
const REDUCE4_SG: &str = "fn reduce4(v: vec4<f32>, li: u32, lane: u32) -> vec4<f32> {
    return subgroupAdd(v);
}";
const REDUCE4_SMEM: &str = "var<workgroup> red4: array<vec4<f32>, WG>;
fn reduce4(v: vec4<f32>, li: u32, lane: u32) -> vec4<f32> {
    red4[li] = v;
    workgroupBarrier();
    for (var stride = LANES / 2u; stride > 0u; stride = stride / 2u) {
        if (lane < stride) {
            red4[li] = red4[li] + red4[li + stride];
        }
        workgroupBarrier();
    }
    let total = red4[li - lane];
    workgroupBarrier();
    return total;
}";

impl Matvec {
    /// The entry point.
    pub const ENTRY: &'static str = "matvec";

    /// Systematic name, e.g. `matvec_q4tp_sg_t8_r4`.
    pub fn name(&self) -> String {
        format!(
            "matvec_{}{}_{}_t{}_r{}{}{}{}{}",
            self.codec.name(),
            self.path.suffix(),
            self.reduce.suffix(),
            self.nt,
            self.rows,
            self.epilogue.suffix(),
            if self.grouped { "_grouped" } else { "" },
            self.segments.suffix(),
            if self.has_lut() {
                format!("_lut{}", self.lut_copies)
            } else {
                String::new()
            }
        )
    }

    /// The assembled module: the decoders, the codec's chunk decoder (f32 paths), the
    /// reduction, the skeleton, and the body generated for `nt`, `rows` and the path. (WGSL has
    /// no includes or generics; concatenation plus [`Matvec::body`] is the whole template step.)
    pub fn source(&self) -> String {
        let mut src = self.plain_source();
        if self.epilogue.folds_norm() {
            let reduce4 = match self.reduce {
                Reduce::Subgroup => REDUCE4_SG,
                Reduce::SharedMemory => REDUCE4_SMEM,
            };
            src = format!("{NORM_DECL}\n{reduce4}\n{src}");
        }
        if self.epilogue.has_aux() {
            src = format!("{AUX_DECL}\n{src}");
        }
        if !self.grouped {
            return src;
        }
        // Every weight load goes through `wv` or `ww`; the slot's base offset is added to
        // each, so the codecs' decoders read the chosen expert unchanged.
        if self.segments == Segments::One {
            let src = offset_index(&offset_index(&src, "wv", "sb16"), "ww", "sb4");
            return format!("{GROUPED_DECL}\n{src}");
        }
        // A segmented bank: the loads go to the slot's segment, the one-buffer bindings go.
        let src = src
            .replace(
                "@group(0) @binding(0) var<storage, read> wv: array<vec4<u32>>;",
                "",
            )
            .replace(
                "@group(0) @binding(1) var<storage, read> ww: array<u32>;",
                "",
            );
        let src = rewrite_index(&src, "wv", &|e| format!("wv_seg(sb16 + ({e}))"));
        let src = rewrite_index(&src, "ww", &|e| format!("ww_seg(sb4 + ({e}))"));
        // wgpu refuses a layout with both a binding array and a uniform buffer: beside the
        // array the parameters are a read-only storage buffer.
        let (enable, src) = if matches!(self.segments, Segments::Array(_)) {
            let src = src.replace(
                "@group(0) @binding(2) var<uniform> P: Params;",
                "@group(0) @binding(2) var<storage, read> P: Params;",
            );
            ("enable wgpu_binding_array;\n", src)
        } else {
            ("", src)
        };
        let decl = self.segments.declarations();
        format!("{enable}{GROUPED_DECL}\n{decl}\n{src}")
    }

    fn plain_source(&self) -> String {
        let reduce = match self.reduce {
            Reduce::Subgroup => src::REDUCE_SG,
            Reduce::SharedMemory => src::REDUCE_SMEM,
        };
        let body = self.body();
        match self.path {
            Path::F32 | Path::HwF16 => {
                let codec = if self.path == Path::HwF16 {
                    src::F16_HW
                } else {
                    self.codec.source()
                };
                [
                    src::DECODE,
                    src::COMMON,
                    codec,
                    reduce,
                    src::MATVEC_COMMON,
                    src::MATVEC,
                    &body,
                ]
                .join("\n")
            }
            Path::Int8 => [
                src::DECODE,
                src::COMMON,
                src::I8_CODES,
                reduce,
                src::MATVEC_COMMON,
                src::MATVEC_I8,
                &body,
            ]
            .join("\n"),
        }
    }

    /// The generated `matvec_body` (see the `generate` module): on the f32 paths lane `l` of a
    /// row group walks chunks `l, l + LANES, ...` of its `rows` rows, decoding each 16-byte
    /// chunk once for all `nt` token rows; on the int8 path it unpacks each block's weight
    /// codes once and takes one integer dot product per token row.
    ///
    /// # Panics
    /// On the int8 path with a float codec (the registry never builds one).
    pub fn body(&self) -> String {
        match self.path {
            Path::F32 | Path::HwF16 if self.epilogue == Epilogue::HcFrontNorm => {
                generate::body_front_norm(self)
            }
            Path::F32 | Path::HwF16 => generate::body_f32(self),
            Path::Int8 => generate::body_i8(self),
        }
    }

    /// Whether the kernel reads a byte table in workgroup memory (mxfp4 on the int8 path).
    pub fn has_lut(&self) -> bool {
        self.codec == Codec::Mxfp4 && self.path == Path::Int8
    }

    /// Bytes of workgroup memory the kernel declares for `wg` lanes per workgroup: the byte
    /// table's copies and, in the shared-memory reduction, one f32 per lane.
    pub fn workgroup_bytes(&self, wg: u32) -> u32 {
        let lut = if self.has_lut() {
            256 * 4 * self.lut_copies.clamp(1, 32).next_power_of_two()
        } else {
            0
        };
        let red = match (self.reduce, self.epilogue.folds_norm()) {
            (Reduce::SharedMemory, false) => 4 * wg,
            // The folded norm's four-wide tree beside the scalar one.
            (Reduce::SharedMemory, true) => 20 * wg,
            (Reduce::Subgroup, _) => 0,
        };
        lut + red
    }

    /// Whether the module needs the SUBGROUP capability.
    pub fn needs_subgroups(&self) -> bool {
        self.reduce == Reduce::Subgroup
    }

    /// The capabilities the module needs beyond the baseline.
    pub fn needs(&self) -> Caps {
        Caps {
            subgroups: self.needs_subgroups(),
            binding_arrays: matches!(self.segments, Segments::Array(_)),
            shader_f16: false,
            f16_in_f32: self.path == Path::HwF16,
        }
    }
}

/// The activation quantiser's entry point (module [`act_quant_source`]): bindings 0 f32
/// activations `[nt, cols]`, 1 the weight payload as words (q8_2f's column scales), 2 `QParams`
/// (8 u32: cols, nt, mode = [`ActLayout`] as u32, col_scales byte offset or 0xffffffff, wg_x),
/// 3 the codes (8 words per block), 4 per block `(bits of d, code sum)`. Workgroups of 256
/// lanes, 32 a block: workgroup `w = x + y * wg_x` quantises blocks `w * ACT_QUANT_BLOCKS ..`
/// of the `[nt, cols / 32]` blocks ([`ACT_QUANT_BLOCKS`]).
pub const ACT_QUANT_ENTRY: &str = "act_quant";

/// Blocks of 32 activations each workgroup of the quantiser's entries quantises (32 lanes a
/// block): the host dispatches `ceil(blocks / ACT_QUANT_BLOCKS)` workgroups.
pub const ACT_QUANT_BLOCKS: u32 = 8;

#[cfg(test)]
mod act_quant_tests {
    /// The host's grid and the module agree on the blocks of a workgroup.
    #[test]
    fn the_quantiser_takes_act_quant_blocks_a_workgroup() {
        let s = super::act_quant_source();
        assert!(s.contains(&format!(
            "const BLOCKS: u32 = {}u;",
            super::ACT_QUANT_BLOCKS
        )));
        assert!(s.contains(&format!(
            "@workgroup_size({})",
            32 * super::ACT_QUANT_BLOCKS
        )));
    }
}

/// The grouped experts' quantiser in the same module (binding 5 the slots' expert ids; each
/// slot's activation row scaled by its expert's q8_2f column scales).
pub const ACT_QUANT_GROUPED_ENTRY: &str = "act_quant_grouped";

/// The activation quantiser module.
pub fn act_quant_source() -> String {
    [src::DECODE, src::ACT_QUANT].join("\n")
}

/// The bandwidth-ceiling module: entry points `read_bw` (grid-stride read of `array<vec4<u32>>`
/// at binding 0, one word per lane to binding 1, `Params {words, stride}` at binding 2) and
/// `tiny` (one lane, one word: the launch-overhead floor), and the floor's variants `tiny_u`
/// (its index from the uniform) and `tiny_wg` (4 KiB of workgroup memory, 256 lanes). Override
/// constant `WG`.
pub const READ_BW: &str = src::READ_BW;

/// The launch floor with its index in immediates (entry `tiny_i`; storage at binding 0, 16
/// bytes of immediates): a device with wgpu's `IMMEDIATES` feature only.
pub const LAUNCH_FLOOR_IMM: &str = src::LAUNCH_FLOOR_IMM;

pub mod ops;
pub use ops::{
    FRAME_WORDS, GDN_CONV_CHANNELS, GDN_PARTS, GDN_STEP_MAX_DIMS, GDN_STEP_ROWS, OP_STORAGE, OP_WG,
    Op,
};

/// One shader module of the registry.
#[derive(Debug, Clone)]
pub struct ModuleSpec {
    /// Systematic name.
    pub name: String,
    /// Full WGSL source.
    pub source: Cow<'static, str>,
    /// Entry points.
    pub entries: &'static [&'static str],
    /// The capabilities it needs (the runtime never builds it on a device without them).
    pub needs: Caps,
    /// Override values each pipeline will be created with (every one is validated).
    pub specializations: Vec<Specialization>,
}

/// Every module the runtime builds, with every specialisation it uses: each codec's matvec on
/// every path it has, both reductions, 1..=8 token rows and the grouped-experts variant, every
/// row-group shape and epilogue;
/// the tiled matmat of long frames (f16, and q8_2f on int8); the activation quantiser; the
/// bandwidth probes.
pub fn registry() -> Vec<ModuleSpec> {
    let mut out = Vec::new();
    for codec in Codec::ALL {
        for path in [Path::F32, Path::HwF16, Path::Int8] {
            if !path.supports(codec) {
                continue;
            }
            for reduce in [Reduce::Subgroup, Reduce::SharedMemory] {
                let shapes = [
                    (1, Epilogue::None),
                    (2, Epilogue::None),
                    (4, Epilogue::None),
                    (1, Epilogue::Silu),
                    (4, Epilogue::Silu),
                    (2, Epilogue::SiluGateUp),
                    (2, Epilogue::GateUpTwo),
                    (2, Epilogue::PairTwo),
                    (1, Epilogue::HcFront),
                    (2, Epilogue::HcFront),
                    (4, Epilogue::HcFront),
                    (2, Epilogue::HcReadout),
                    (3, Epilogue::HcReadout),
                    (4, Epilogue::HcReadout),
                    (1, Epilogue::MoeOut),
                    (2, Epilogue::MoeOut),
                    (4, Epilogue::MoeOut),
                    (1, Epilogue::HcFrontNorm),
                    (2, Epilogue::HcFrontNorm),
                    (4, Epilogue::HcFrontNorm),
                    (2, Epilogue::HcReadoutNorm),
                    (3, Epilogue::HcReadoutNorm),
                    (4, Epilogue::HcReadoutNorm),
                ];
                // 1..=8 token rows, and the grouped-experts variant (one row per slot).
                let variants = (1..=8).map(|nt| (nt, false)).chain([(1, true)]);
                for (nt, grouped) in variants {
                    // mxfp4's int8 table: one copy, and the interleaved copies.
                    let copies: &[u32] = if codec == Codec::Mxfp4 && path == Path::Int8 {
                        &[1, 16, 32]
                    } else {
                        &[1]
                    };
                    for ((rows, epilogue), &lut_copies) in shapes
                        .into_iter()
                        // The hyper-connection and two-matrix epilogues: plain matvecs only.
                        .filter(|(_, e)| !(grouped && e.plain_only()))
                        // The folded norm: float codecs on the f32 paths.
                        .filter(|(_, e)| {
                            !e.folds_norm() || (path != Path::Int8 && codec.is_float())
                        })
                        .flat_map(|s| copies.iter().map(move |c| (s, c)))
                    {
                        let k = Matvec {
                            codec,
                            reduce,
                            nt,
                            rows,
                            epilogue,
                            path,
                            grouped,
                            segments: Segments::One,
                            lut_copies,
                        };
                        let specializations = match reduce {
                            // One subgroup per row group: LANES is the device's subgroup size.
                            Reduce::Subgroup => [(64, 8), (64, 16), (64, 32), (64, 64), (128, 128)]
                                .map(|(wg, lanes)| Specialization::matvec(wg, lanes))
                                .to_vec(),
                            Reduce::SharedMemory => vec![
                                Specialization::matvec(128, 64),
                                Specialization::matvec(256, 64),
                            ],
                        };
                        // A grouped kernel over a segmented bank, both bindings (q8_2f's
                        // int8 path quantises per slot from the bank: one buffer only).
                        // Only the shapes the experts run (the chunked gate/up and the plain
                        // down projection; mxfp4's table in the grouped kernels' 16 copies).
                        let segmented = grouped
                            && !(codec == Codec::Q8_2f && path == Path::Int8)
                            && matches!(epilogue, Epilogue::None | Epilogue::SiluGateUp)
                            && (lut_copies == 1 || lut_copies == 16);
                        let banks: &[Segments] = if segmented {
                            &[
                                Segments::One,
                                Segments::Fixed(8),
                                Segments::Fixed(16),
                                Segments::Array(8),
                                Segments::Array(16),
                            ]
                        } else {
                            &[Segments::One]
                        };
                        for &segments in banks {
                            let k = Matvec { segments, ..k };
                            out.push(ModuleSpec {
                                name: k.name(),
                                source: Cow::Owned(k.source()),
                                entries: &[Matvec::ENTRY],
                                needs: k.needs(),
                                specializations: specializations.clone(),
                            });
                        }
                    }
                }
            }
        }
    }
    for k in Tiled::all() {
        out.push(ModuleSpec {
            name: k.name(),
            source: Cow::Owned(k.source()),
            entries: k.entries(),
            needs: k.needs(),
            specializations: vec![Specialization(vec![])],
        });
    }
    for k in GroupedTiled::all() {
        out.push(ModuleSpec {
            name: k.name(),
            source: Cow::Owned(k.source()),
            entries: &[GroupedTiled::ENTRY, GroupedTiled::SORT_ENTRY],
            needs: Caps::MINIMAL,
            specializations: vec![Specialization(vec![])],
        });
    }
    out.push(ModuleSpec {
        name: "act_quant".into(),
        source: Cow::Owned(act_quant_source()),
        entries: &[ACT_QUANT_ENTRY, ACT_QUANT_GROUPED_ENTRY],
        needs: Caps::MINIMAL,
        specializations: vec![Specialization(vec![])],
    });
    for &op in Op::ALL {
        out.push(ModuleSpec {
            name: format!("op_{}", op.name()),
            source: Cow::Owned(op.source()),
            entries: &[Op::ENTRY],
            needs: Caps::MINIMAL,
            specializations: vec![Specialization(vec![])],
        });
    }
    out.push(ModuleSpec {
        name: "read_bw".into(),
        source: Cow::Borrowed(READ_BW),
        entries: &["read_bw", "tiny", "tiny_u", "tiny_wg"],
        needs: Caps::MINIMAL,
        specializations: vec![Specialization(vec![("WG".into(), 256.0)])],
    });
    out
}

/// Values for a module's override constants.
#[derive(Debug, Clone, PartialEq)]
pub struct Specialization(pub Vec<(String, f64)>);

impl Specialization {
    /// A matvec pipeline's constants.
    pub fn matvec(wg: u32, lanes: u32) -> Self {
        Specialization(vec![
            ("WG".into(), wg as f64),
            ("LANES".into(), lanes as f64),
        ])
    }

    /// Looks one constant up.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.0.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }
}

/// A device's shader capabilities, as far as validation cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Subgroup operations (wgpu `Features::SUBGROUP`).
    pub subgroups: bool,
    /// `binding_array` of storage buffers (wgpu `Features::STORAGE_RESOURCE_BINDING_ARRAY`).
    pub binding_arrays: bool,
    /// Shader f16 (wgpu `Features::SHADER_F16`).
    pub shader_f16: bool,
    /// `unpack2x16float` and friends (wgpu `DownlevelFlags::SHADER_F16_IN_F32`).
    pub f16_in_f32: bool,
}

impl Caps {
    /// Debian 12's lavapipe (Mesa 22.3): subgroups (size 8) and f16, no binding arrays; wgpu
    /// does not grant it the f16-in-f32 conversions.
    pub const LAVAPIPE: Caps = Caps {
        subgroups: true,
        binding_arrays: false,
        shader_f16: true,
        f16_in_f32: false,
    };
    /// Everything the kernels can use (the H200 through Vulkan has all of it).
    pub const FULL: Caps = Caps {
        subgroups: true,
        binding_arrays: true,
        shader_f16: true,
        f16_in_f32: true,
    };
    /// No optional capability at all.
    pub const MINIMAL: Caps = Caps {
        subgroups: false,
        binding_arrays: false,
        shader_f16: false,
        f16_in_f32: false,
    };

    fn naga(self) -> naga::valid::Capabilities {
        use naga::valid::Capabilities as C;
        let mut c = C::empty();
        if self.subgroups {
            c |= C::SUBGROUP;
        }
        if self.binding_arrays {
            c |= C::STORAGE_BUFFER_BINDING_ARRAY
                | C::BUFFER_BINDING_ARRAY
                | C::STORAGE_BUFFER_BINDING_ARRAY_NON_UNIFORM_INDEXING;
        }
        if self.shader_f16 {
            c |= C::SHADER_FLOAT16;
        }
        if self.f16_in_f32 {
            c |= C::SHADER_FLOAT16_IN_FLOAT32;
        }
        c
    }

    /// Whether every capability `need` asks for is here.
    pub fn covers(self, need: Caps) -> bool {
        (self.subgroups || !need.subgroups)
            && (self.binding_arrays || !need.binding_arrays)
            && (self.shader_f16 || !need.shader_f16)
            && (self.f16_in_f32 || !need.f16_in_f32)
    }
}

/// A module naga refused, with the message rendered against its source.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{module}: {message}")]
pub struct ShaderError {
    /// The module's name.
    pub module: String,
    /// naga's diagnostic, rendered with source context.
    pub message: String,
}

/// Parses and validates one module, then specialises and re-validates it with `spec` for each
/// entry point, as pipeline creation will.
pub fn validate(
    name: &str,
    source: &str,
    caps: Caps,
    spec: &Specialization,
) -> Result<(), ShaderError> {
    let err = |message: String| ShaderError {
        module: name.to_string(),
        message,
    };
    let path = format!("{name}.wgsl");
    let module = naga::front::wgsl::parse_str(source)
        .map_err(|e| err(e.emit_to_string_with_path(source, &path)))?;
    let mut validator =
        naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps.naga());
    let info = validator
        .validate(&module)
        .map_err(|e| err(e.emit_to_string_with_path(source, &path)))?;
    let mut constants = naga::back::PipelineConstants::default();
    for (k, v) in &spec.0 {
        constants.insert(k.clone(), *v);
    }
    for ep in &module.entry_points {
        naga::back::pipeline_constants::process_overrides(
            &module,
            &info,
            Some((ep.stage, ep.name.as_str())),
            &constants,
        )
        .map_err(|e| err(format!("entry {} with {:?}: {e}", ep.name, spec.0)))?;
    }
    Ok(())
}

/// Validates every module of the registry and every specialisation under `caps`; modules that
/// need a capability `caps` lacks are skipped (the runtime never builds them there). Returns
/// every failure.
pub fn validate_all(caps: Caps) -> Vec<ShaderError> {
    let mut errors = Vec::new();
    for m in registry() {
        if !caps.covers(m.needs) {
            continue;
        }
        for spec in &m.specializations {
            if let Err(e) = validate(&m.name, &m.source, caps, spec) {
                errors.push(e);
                break;
            }
        }
    }
    errors
}
