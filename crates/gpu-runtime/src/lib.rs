//! cortiq's wgpu runtime: the device context, the weight arena, uploads and readback,
//! pipelines under error scopes, and the codec kernels as device ops.
//!
//! The principal type is [`GpuContext`], opened by [`select`] (which honours `--backend` /
//! `CORTIQ_GPU` and falls back to the CPU when there is no adapter) and passed explicitly to
//! everything that needs the device: there is no global.
//!
//! ```no_run
//! use gpu_runtime::{GpuOptions, Selected, WeightArena, ops::matvec};
//! use quant_codecs::{DType, MatRef, quantize};
//!
//! let Selected::Gpu(ctx) = gpu_runtime::select(&GpuOptions::from_env()?)? else { return Ok(()) };
//! let w = quantize(DType::Q4tp, 64, 128, &vec![0.25; 64 * 128])?;
//! let arena = WeightArena::new(&ctx);
//! let m = arena.get_or_upload(&ctx, 0, "w", &MatRef::new(DType::Q4tp, 64, 128, &w)?)?;
//! let y = matvec::matmat(&ctx, &m, &vec![1.0; 128], matvec::Plan::for_matrix(&ctx, 64))?;
//! assert_eq!(y.len(), 64);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]

pub mod arena;
pub mod bench;
mod context;
mod error;
pub mod ops;
mod pipelines;
pub mod readback;
pub mod report;
pub mod staging;

pub use arena::{GpuMatrix, WeightArena};
pub use context::{
    BackendChoice, DeviceCaps, GpuContext, GpuOptions, MatvecSplit, Selected, default_budget,
    parse_size, select,
};
pub use error::GpuError;
pub use kernels_wgsl::{ActLayout, Epilogue, Op, Path};

impl GpuContext {
    pub(crate) fn matvec_layout(&self) -> &(wgpu::BindGroupLayout, wgpu::PipelineLayout) {
        self.matvec_layout.get_or_init(|| ops::matvec::layout(self))
    }

    pub(crate) fn i8_layout(&self) -> &(wgpu::BindGroupLayout, wgpu::PipelineLayout) {
        self.i8_layout.get_or_init(|| ops::matvec::i8_layout(self))
    }

    /// The folded norm's layout (`ops::matvec::norm_layout`).
    pub(crate) fn norm_layout(&self) -> &(wgpu::BindGroupLayout, wgpu::PipelineLayout) {
        self.norm_layout
            .get_or_init(|| ops::matvec::norm_layout(self))
    }

    /// The layouts of the epilogues with an auxiliary buffer (binding 7): f32 paths, int8.
    pub(crate) fn aux_layout(&self, int8: bool) -> &(wgpu::BindGroupLayout, wgpu::PipelineLayout) {
        &self
            .aux_layouts
            .get_or_init(|| [false, true].map(|i8| ops::matvec::aux_layout(self, i8)))
            [usize::from(int8)]
    }

    pub(crate) fn grouped_layout(&self) -> &(wgpu::BindGroupLayout, wgpu::PipelineLayout) {
        self.grouped_layout
            .get_or_init(|| ops::experts::layout(self, false))
    }

    pub(crate) fn grouped_i8_layout(&self) -> &(wgpu::BindGroupLayout, wgpu::PipelineLayout) {
        self.grouped_i8_layout
            .get_or_init(|| ops::experts::layout(self, true))
    }

    /// The expert-major grouped kernels' layout (`ops::experts_tiled`).
    pub(crate) fn grouped_tiled_layout(&self) -> &(wgpu::BindGroupLayout, wgpu::PipelineLayout) {
        self.grouped_tiled_layout
            .get_or_init(|| ops::experts_tiled::layout(self))
    }

    /// The grouped kernels' layout over a bank bound as `segments` ([`kernels_wgsl::Segments`]
    /// other than `One`).
    pub(crate) fn segmented_layout(
        &self,
        int8: bool,
        segments: kernels_wgsl::Segments,
    ) -> (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
        self.segmented_layouts
            .lock()
            .entry((int8, segments))
            .or_insert_with(|| ops::experts::segmented_layout(self, int8, segments))
            .clone()
    }

    /// The tiled matmat's layouts: on the int8 path (the codes' scales at binding 5) or not,
    /// with the auxiliary buffer (binding 7) or not, split (the partial sums at binding 6) or
    /// not.
    pub(crate) fn tiled_layout(
        &self,
        int8: bool,
        aux: bool,
        split: bool,
    ) -> &(wgpu::BindGroupLayout, wgpu::PipelineLayout) {
        &self.tiled_layouts.get_or_init(|| {
            (0..8)
                .map(|i| ops::tiled::layout(self, i & 4 != 0, i & 2 != 0, i & 1 != 0))
                .collect()
        })[usize::from(int8) * 4 + usize::from(aux) * 2 + usize::from(split)]
    }

    pub(crate) fn op_layout(&self) -> &(wgpu::BindGroupLayout, wgpu::PipelineLayout) {
        self.op_layout.get_or_init(|| ops::graph::op_layout(self))
    }

    pub(crate) fn op_dummies(&self) -> &[wgpu::Buffer] {
        self.op_dummies.get_or_init(|| ops::graph::op_dummies(self))
    }

    pub(crate) fn act_quant_layout(&self) -> &(wgpu::BindGroupLayout, wgpu::PipelineLayout) {
        self.act_quant_layout
            .get_or_init(|| ops::act8::layout(self))
    }

    pub(crate) fn act_quant_grouped_layout(
        &self,
    ) -> &(wgpu::BindGroupLayout, wgpu::PipelineLayout) {
        self.act_quant_grouped_layout
            .get_or_init(|| ops::act8::grouped_layout(self))
    }
}
