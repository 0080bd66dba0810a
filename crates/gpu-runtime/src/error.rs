//! The runtime's error type: what failed, with the numbers that show it.

use quant_codecs::{CodecError, DType};

/// Everything the GPU runtime can refuse or fail at.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// No adapter at all on the enabled backends.
    #[error(
        "no GPU adapter found (backends: {backends}); use --backend cpu or install a Vulkan/Metal/DX12 driver"
    )]
    NoAdapter {
        /// The backends that were searched.
        backends: String,
    },
    /// `CORTIQ_ADAPTER` named an adapter that is not there.
    #[error("no adapter matches {wanted:?}; available: {}", available.join(", "))]
    AdapterNotFound {
        /// The substring asked for.
        wanted: String,
        /// The adapters present.
        available: Vec<String>,
    },
    /// The device could not be opened.
    #[error("requesting a device from {adapter}: {message}")]
    RequestDevice {
        /// The adapter.
        adapter: String,
        /// wgpu's reason.
        message: String,
    },
    /// A bad value for a setting (flag or environment variable).
    #[error("{setting}: {message}")]
    Setting {
        /// The flag or variable.
        setting: &'static str,
        /// What is wrong with its value.
        message: String,
    },
    /// The kernels do not read this dtype.
    #[error("no GPU kernel reads {dtype} matrices")]
    UnsupportedDtype {
        /// The dtype.
        dtype: DType,
    },
    /// The kernels cannot take this shape.
    #[error("GPU {dtype} kernels need cols to be a multiple of {multiple}; got [{rows}, {cols}]")]
    UnsupportedShape {
        /// The dtype.
        dtype: DType,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// The required multiple of columns.
        multiple: usize,
    },
    /// A single row is larger than the largest buffer binding.
    #[error(
        "one {dtype} row of {cols} columns needs {requested} bytes, over the binding limit of {max}"
    )]
    BindingTooLarge {
        /// The dtype.
        dtype: DType,
        /// Columns.
        cols: usize,
        /// Bytes asked for.
        requested: u64,
        /// The device's limit.
        max: u64,
    },
    /// Uploading would pass the VRAM budget even after evicting every unpinned tensor.
    #[error(
        "{name}: {requested} bytes do not fit the VRAM budget ({resident} resident, {pinned} pinned, budget {budget})"
    )]
    OverBudget {
        /// The tensor.
        name: String,
        /// Its bytes.
        requested: u64,
        /// Bytes resident now.
        resident: u64,
        /// Bytes pinned.
        pinned: u64,
        /// The budget.
        budget: u64,
    },
    /// The VRAM budget cannot hold what a model keeps resident whatever its experts do (every
    /// weight but the routed experts).
    #[error(
        "the VRAM budget of {budget_mib} MiB is below the {needed_mib} MiB the model needs besides its routed experts (--vram {needed_mib}M or more, or --backend cpu)"
    )]
    BudgetTooSmall {
        /// The budget.
        budget_mib: u64,
        /// What the weights other than the routed experts take.
        needed_mib: u64,
    },
    /// The driver or the validator turned a pipeline down; the caller runs the CPU kernel.
    #[error("pipeline {name} rejected: {message}")]
    PipelineRejected {
        /// Kernel name and specialisation.
        name: String,
        /// The driver's or validator's message.
        message: String,
    },
    /// A fused kernel cannot take this matrix.
    #[error("fused {epilogue}: {reason}")]
    UnsupportedFusion {
        /// The fused step.
        epilogue: &'static str,
        /// Why not.
        reason: String,
    },
    /// A buffer length that does not match.
    #[error("{what}: expected {expected} values, found {found}")]
    BadLength {
        /// Which buffer.
        what: &'static str,
        /// Expected length.
        expected: usize,
        /// Actual length.
        found: usize,
    },
    /// Mapping a buffer for readback or upload failed.
    #[error("buffer mapping failed: {0}")]
    Map(String),
    /// The device refused an operation (out of memory, a validation error).
    #[error("the device refused {what}: {message}")]
    Refused {
        /// What was asked.
        what: &'static str,
        /// wgpu's reason.
        message: String,
    },
    /// The payload itself is invalid.
    #[error(transparent)]
    Codec(#[from] CodecError),
}
