//! The trace callback: every forward can report its named intermediates, so a CPU forward and
//! a GPU forward (or two architectures' forwards) compare block by block under one harness.
//!
//! The same step has the same name in every architecture; an architecture-only step (PLE) has
//! its own. Names are reported with the layer index (`num_hidden_layers` for the head steps)
//! and the data `[t, width]`.

/// Called with every named intermediate: `(name, layer index, data [t, width])`.
pub type Trace<'t> = dyn FnMut(&str, usize, &[f32]) + 't;

/// qwen4_exp only: the residual streams after the per-layer n-gram embedding.
pub const PLE_STREAMS: &str = "ple_streams";
/// The token mixer's input: the hyper-connection read-out (after the input norm where the
/// architecture has one).
pub const ATTN_INPUT: &str = "attn_input";
/// The token mixer's output (attention, CSA/HCA, or Gated DeltaNet).
pub const ATTN_OUT: &str = "attn_out";
/// The residual streams after the mixer's output is written back.
pub const ATTN_STREAMS: &str = "attn_streams";
/// The MoE block's input (hyper-connection read-out, and norm where there is one).
pub const MLP_INPUT: &str = "mlp_input";
/// The MoE block's output (routed + shared experts).
pub const MOE_OUT: &str = "moe_out";
/// The residual streams at the end of the layer.
pub const LAYER_OUT: &str = "layer_out";
/// The hidden state the `lm_head` reads (after the final stream collapse and norm).
pub const HEAD_OUT: &str = "head_out";
/// The logits.
pub const LOGITS: &str = "logits";

/// Every name above, in forward order.
pub const ALL: [&str; 9] = [
    PLE_STREAMS,
    ATTN_INPUT,
    ATTN_OUT,
    ATTN_STREAMS,
    MLP_INPUT,
    MOE_OUT,
    LAYER_OUT,
    HEAD_OUT,
    LOGITS,
];
