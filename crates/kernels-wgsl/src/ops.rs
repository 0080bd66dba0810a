//! The op kernels: the small steps of a model forward between the matvecs (norms, the
//! hyper-connection mixes, the Gated DeltaNet conv and recurrence, attention with the QSA
//! block choice, MoE routing, PLE, greedy argmax; DeepSeek's mHC, router and clamped SwiGLU).
//! Each is one WGSL module (the shared prelude and its file) with entry [`Op::ENTRY`] and the
//! one bind group layout of the prelude: binding 0 the op's parameters ([`Op::PARAM_WORDS`]
//! words), binding 1 the frame's per-token values ([`FRAME_WORDS`] words), bindings 2..=9
//! storage buffers.

const PRELUDE: &str = include_str!("../wgsl/ops/prelude.wgsl");

/// Words of the frame uniform: `past` (tokens before the frame), `nb_lo`, `nb_hi` (complete
/// indexer blocks before and after it), `row0` (the sequence's first activation row: non-zero
/// only in a frame that batches several sequences).
pub const FRAME_WORDS: usize = 4;

/// Lanes per workgroup of every op.
pub const OP_WG: u32 = 128;

/// Lanes that split one value column's state rows in `gdn_recur` (its `L`): a workgroup of
/// [`OP_WG`] lanes takes `OP_WG / GDN_PARTS` columns of a head, each lane `ceil(dk /
/// GDN_PARTS)` rows (the module's `R` override).
pub const GDN_PARTS: u32 = 8;

/// Most token rows a sequence's frame may have for `gdn_step` (the fused prep, recurrence and
/// norm: one workgroup per value head walks the rows in order; longer frames take the three
/// kernels, whose recurrence spreads a head's columns over workgroups).
pub const GDN_STEP_ROWS: usize = 8;

/// Widest key head (`linear_key_head_dim`) and value head `gdn_step` takes (its `MAXK`,
/// `MAXV`).
pub const GDN_STEP_MAX_DIMS: (usize, usize) = (256, 1024);

/// Channels per workgroup of `gdn_conv` (its `CONV_CHANNELS`): each channel's rows are split
/// over `Op::GdnConv.wg()` / this many lanes (16), so the host dispatches one workgroup per
/// this many channels.
pub const GDN_CONV_CHANNELS: u32 = 32;

/// Storage bindings every op's layout has (2..=9).
pub const OP_STORAGE: u32 = 8;

macro_rules! ops {
    ($($(#[$doc:meta])* $v:ident => $file:literal,)*) => {
        /// An op kernel.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Op {
            $($(#[$doc])* $v,)*
        }

        impl Op {
            /// Every op.
            pub const ALL: &'static [Op] = &[$(Op::$v,)*];

            /// The module's name (its file under `wgsl/ops/`).
            pub const fn name(self) -> &'static str {
                match self {
                    $(Op::$v => $file,)*
                }
            }

            fn body(self) -> &'static str {
                match self {
                    $(Op::$v => include_str!(concat!("../wgsl/ops/", $file, ".wgsl")),)*
                }
            }
        }
    };
}

ops! {
    /// Grouped (1+w) RMSNorm.
    RmsNorm => "rms_norm",
    /// Elementwise activations.
    Map => "map",
    /// The hyper-connection read-out.
    HcCombine => "hc_combine",
    /// The hyper-connection injection.
    HcInject => "hc_inject",
    /// GDN causal conv.
    GdnConv => "gdn_conv",
    /// GDN's per-token recurrence inputs (normalised q and k, beta, the decay).
    GdnPrep => "gdn_prep",
    /// GDN gated delta rule.
    GdnRecur => "gdn_recur",
    /// GDN output's gated norm.
    GdnNorm => "gdn_norm",
    /// GDN's prep, recurrence and gated norm of a few tokens, a workgroup per value head.
    GdnStep => "gdn_step",
    /// Per-head norm / RoPE / copy into a cache.
    HeadPrep => "head_prep",
    /// QSA block keys.
    BlockKeys => "block_keys",
    /// QSA block scoring and top-k.
    QsaSelect => "qsa_select",
    /// Sparse attention over the KV cache.
    Attend => "attend",
    /// MoE softmax + top-k.
    Route => "route",
    /// One routed expert's weighted add.
    ExpertAdd => "expert_add",
    /// The routed experts' weighted sum from the grouped slots and the gated shared expert.
    SharedAdd => "shared_add",
    /// The routed slots split between the VRAM bank and the CPU.
    ColdSplit => "cold_split",
    /// PLE's gate.
    PleGate => "ple_gate",
    /// PLE's dilated conv and stream update.
    PleConv => "ple_conv",
    /// Greedy argmax.
    Argmax => "argmax",
    /// DeepSeek's mHC maps and collapse, and the block's norm (or the head's collapse).
    MhcPre => "mhc_pre",
    /// DeepSeek's mHC after a block.
    MhcPost => "mhc_post",
    /// DeepSeek's router: scores, hash or top-k, weights.
    DsRoute => "ds_route",
    /// A clamped SwiGLU.
    SwigluClamp => "swiglu_clamp",
    /// A MoE block's weighted routed slots plus the shared expert.
    MoeSum => "moe_sum",
    /// DeepSeek's caches: token rows into a ring by position.
    DsStore => "ds_store",
    /// DeepSeek's interleaved trailing RoPE (and its inverse) from a host table.
    DsRope => "ds_rope",
    /// DeepSeek's KV compressors: the entries of the windows a frame completes.
    DsCompress => "ds_compress",
    /// DeepSeek's lightning indexer: entry scores and the top-k mask.
    DsIndex => "ds_index",
    /// DeepSeek's attention over the sliding window, the compressed entries and the sink.
    DsAttend => "ds_attend",
    /// DeepSeek-V4.1's FP8/FP4 fake quantisers (and a KV source's publish of its groups).
    DsQat => "ds_qat",
    /// DeepSeek-V4.1's two-level top-k: the candidate blocks.
    DsBlocks => "ds_blocks",
    /// DeepSeek-V4.1's Engram gate and stream update.
    EngramGate => "engram_gate",
}

impl Op {
    /// The entry point of every op module.
    pub const ENTRY: &'static str = "main";

    /// Words of the parameter uniform.
    pub const PARAM_WORDS: usize = 16;

    /// Lanes per workgroup: [`OP_WG`], but 512 for `rms_norm`, whose few workgroups (4 for a
    /// hyper-connection site's 2560-wide streams) each walk a whole group: with 128 lanes a
    /// group took three rounds of loads per pass, each a memory latency.
    pub const fn wg(self) -> u32 {
        match self {
            Op::RmsNorm | Op::GdnConv => 512,
            // A value head of up to 128 columns in one pass of its 8 parts (docs/perf.md):
            // the state stays in registers, and a token pays one round of loads.
            Op::GdnStep => 1024,
            _ => OP_WG,
        }
    }

    /// The full WGSL source.
    pub fn source(self) -> String {
        let prelude = PRELUDE.replace(
            &format!("const WG: u32 = {OP_WG}u;"),
            &format!("const WG: u32 = {}u;", self.wg()),
        );
        format!("{prelude}\n{}", self.body())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each op's source declares the lanes its dispatches are sized for.
    #[test]
    fn every_op_declares_its_workgroup_size() {
        for &op in Op::ALL {
            let want = format!("const WG: u32 = {}u;", op.wg());
            assert!(op.source().contains(&want), "{op:?} lacks `{want}`");
        }
        assert_eq!(Op::RmsNorm.wg(), 512);
    }

    /// The host sizes `gdn_recur`'s grid and rows from [`GDN_PARTS`].
    #[test]
    fn gdn_recur_splits_columns_in_gdn_parts() {
        let want = format!("const L: u32 = {GDN_PARTS}u;");
        assert!(Op::GdnRecur.source().contains(&want));
    }

    /// `gdn_step`'s lanes split a column in `GDN_PARTS` parts as `gdn_recur`'s do (the same
    /// sums), and its widest heads are the host's.
    #[test]
    fn gdn_step_matches_the_recurrences_parts_and_the_hosts_widths() {
        let src = Op::GdnStep.source();
        assert!(src.contains(&format!("const L: u32 = {GDN_PARTS}u;")));
        let (k, v) = GDN_STEP_MAX_DIMS;
        assert!(src.contains("const MAXV: u32 = WG;"));
        assert_eq!(v, Op::GdnStep.wg() as usize);
        // Its reductions run on as many lanes as gdn_prep's and gdn_norm's workgroups.
        let rl = Op::GdnPrep.wg();
        assert_eq!(rl, Op::GdnNorm.wg());
        assert_eq!(k, 2 * rl as usize);
        assert!(src.contains(&format!("const RL: u32 = {rl}u;")));
        assert!(src.contains(&format!("const MAXR: u32 = {}u;", k / GDN_PARTS as usize)));
    }

    /// The host sizes `gdn_conv`'s grid from [`GDN_CONV_CHANNELS`].
    #[test]
    fn gdn_conv_takes_gdn_conv_channels_a_workgroup() {
        let want = format!("const CONV_CHANNELS: u32 = {GDN_CONV_CHANNELS}u;");
        assert!(Op::GdnConv.source().contains(&want));
        assert!(Op::GdnConv.wg().is_multiple_of(GDN_CONV_CHANNELS));
    }
}
