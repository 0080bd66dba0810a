//! Gated hyper-connections (`Qwen4ExpTextGatedResidual`): H residual streams of width D, mixed
//! into one block input and re-injected after the block. Not mHC: no Sinkhorn, no comb matrix.
//!
//! `Xn = RMSNorm_grouped(X) (1+w)`; `g = sigmoid(W_up silu(W_down Xn / H))`;
//! `u = mean_k g_k Xn_k`; `inj = 2 sigmoid(W_inject Xn / H)`; after the block `X_k += inj_k y`.

use std::sync::Arc;

use crate::device::{Device, Enc};
use crate::ops::rms_norm_1p;
use crate::weights::HcWeights;
use gpu_runtime::ops::matvec::FoldedNorm;
use gpu_runtime::{Epilogue, GpuError, GpuMatrix};
use kernels_wgsl::Op;
use model_core::Mat;
use quant_codecs::MAX_BATCH;
use quant_codecs::ops::{linear, sigmoid, silu};
use quant_codecs::{DType, MatRef};

/// Output of one HC site over `t` tokens.
pub struct HcMix {
    /// Block input `[t, D]`.
    pub input: Vec<f32>,
    /// Injection weights `[t, H]` (empty for the final mixer).
    pub inject: Vec<f32>,
}

/// Runs the site on streams `x` `[t, H*D]`.
pub fn forward_cpu(w: &HcWeights<'_>, x: &[f32], t: usize, h: usize, d: usize, eps: f32) -> HcMix {
    let mut xn = x.to_vec();
    rms_norm_1p(&mut xn, &w.norm, d, eps);
    let mut low = linear(&w.down, &xn, t);
    for v in &mut low {
        *v = silu(*v / h as f32);
    }
    let g = linear(&w.up, &low, t);
    let mut input = vec![0f32; t * d];
    for r in 0..t {
        let out = &mut input[r * d..(r + 1) * d];
        for k in 0..h {
            let base = r * h * d + k * d;
            for j in 0..d {
                out[j] += sigmoid(g[base + j]) * xn[base + j];
            }
        }
        for v in out.iter_mut() {
            *v /= h as f32;
        }
    }
    let inject = match &w.inject {
        Some(m) => linear(m, &xn, t)
            .into_iter()
            .map(|v| 2.0 * sigmoid(v / h as f32))
            .collect(),
        None => Vec::new(),
    };
    HcMix { input, inject }
}

/// `X_k += inj_k * y` for every token and stream.
pub fn inject(x: &mut [f32], y: &[f32], inj: &[f32], t: usize, h: usize, d: usize) {
    for r in 0..t {
        for k in 0..h {
            let wk = inj[r * h + k];
            let xs = &mut x[r * h * d + k * d..r * h * d + (k + 1) * d];
            for (a, b) in xs.iter_mut().zip(&y[r * d..(r + 1) * d]) {
                *a += wk * b;
            }
        }
    }
}

/// One HC site's weights on the device.
pub struct HcGpu {
    norm: (wgpu::Buffer, usize),
    front: Front,
    up: Up,
}

/// The matrices that read the normalised streams.
enum Front {
    /// The low-rank down rows then the H injection rows, one matrix whose epilogue applies
    /// both activations (one dispatch instead of three): float codecs, whose rows concatenate.
    Fused(Arc<GpuMatrix>),
    /// Apart: quantised codecs (q8_2f's column scales are per matrix), or no injection (the
    /// final mixer).
    Split {
        down: Arc<GpuMatrix>,
        inject: Option<Arc<GpuMatrix>>,
    },
}

/// The up matrix.
enum Up {
    /// Rows interleaved by stream (row `j * H + k` is stream `k`'s row `j`), so one row group
    /// holds a column's H gates and the read-out is the matvec's epilogue (one dispatch fewer).
    Readout(Arc<GpuMatrix>),
    /// In checkpoint order, the read-out an op of its own (more than 4 streams, or a matrix
    /// past one binding).
    Plain(Arc<GpuMatrix>),
}

/// Most streams the read-out epilogue takes (one row group's rows).
const READOUT_STREAMS: usize = 4;

impl HcGpu {
    /// Uploads the site's weights (`h` streams).
    pub fn upload(dev: &Device, w: &HcWeights<'_>, h: usize) -> Result<HcGpu, GpuError> {
        let float = |d: DType| matches!(d, DType::F32 | DType::F16 | DType::BF16);
        let front = match &w.inject {
            Some(inj) if inj.dtype() == w.down.dtype() && float(inj.dtype()) => {
                let mut bytes = w.down.mat().bytes().to_vec();
                bytes.extend_from_slice(inj.mat().bytes());
                let rows = w.down.rows() + inj.rows();
                let m = MatRef::new(w.down.dtype(), rows, w.down.cols(), &bytes)?;
                let name = format!("{}+{}", w.down.name(), inj.name());
                let m = dev.mat(&Mat::new(name, usize::MAX, m))?;
                if m.parts.len() == 1 {
                    Front::Fused(m)
                } else {
                    Front::Split {
                        down: dev.mat(&w.down)?,
                        inject: Some(dev.mat(inj)?),
                    }
                }
            }
            inj => Front::Split {
                down: dev.mat(&w.down)?,
                inject: inj.as_ref().map(|m| dev.mat(m)).transpose()?,
            },
        };
        let rows = w.up.rows();
        let up = if (2..=READOUT_STREAMS).contains(&h) && rows.is_multiple_of(h) {
            let d = rows / h;
            let order: Vec<usize> = (0..rows).map(|i| (i % h) * d + i / h).collect();
            let m = w.up.mat();
            let bytes = quant_codecs::gather_rows(m.dtype(), rows, m.cols(), m.bytes(), &order)?;
            let m = MatRef::new(m.dtype(), rows, m.cols(), &bytes)?;
            let name = format!("{} (rows by stream)", w.up.name());
            let m = dev.mat(&Mat::new(name, usize::MAX, m))?;
            if m.parts.len() == 1 {
                Up::Readout(m)
            } else {
                Up::Plain(dev.mat(&w.up)?)
            }
        } else {
            Up::Plain(dev.mat(&w.up)?)
        };
        Ok(HcGpu {
            norm: (dev.vec(w.norm.name(), &w.norm), w.norm.len()),
            front,
            up,
        })
    }
}

/// Encodes the site over `nt` rows of the streams `x` `[nt, H*D]`: the block input into
/// `e.s.u`, the injection weights (when the site has them) into a slot of `e.s.inj`.
/// `pending`, the previous block's output `[nt, D]` not yet injected (with the weights in slot
/// `*slot`), is injected into `x` on the way; `*slot` is then where this site's weights are.
///
/// Where the front is one float matrix, the up matrix takes the read-out and a frame has up to
/// 8 rows, the norm is folded into the two matvecs (`GpuContext::fold_hc_norm`): the front
/// injects and normalises as it reads the raw streams and writes each stream's `1 / rms`, the
/// read-out injects its columns (writing them back) and normalises them with those: two
/// dependent dispatches a site instead of three. The read-out still reads the previous site's
/// injection weights after the front wrote this site's, so the two alternate between slots.
#[allow(clippy::too_many_arguments)]
pub fn encode(
    e: &mut Enc<'_>,
    w: &HcGpu,
    x: &wgpu::Buffer,
    nt: usize,
    h: usize,
    d: usize,
    eps: f32,
    pending: Option<&wgpu::Buffer>,
    slot: &mut usize,
) -> Result<(), GpuError> {
    let s = e.s;
    let fold = e.dev.ctx.fold_hc_norm
        && nt <= MAX_BATCH
        && h <= READOUT_STREAMS
        && d.is_multiple_of(8)
        && w.norm.1 == h * d;
    if let (Front::Fused(front), Up::Readout(up), true) = (&w.front, &w.up, fold) {
        let (old, new) = (*slot, 1 - *slot);
        let norm = FoldedNorm {
            pending: pending.map(|y| (y, &s.inj[old])),
            weight: &w.norm.0,
            rstd: &s.rstd,
            eps,
        };
        let (inj, ep) = (&s.inj[new], Epilogue::HcFrontNorm);
        e.matvec_norm(front, x, &s.low_act, inj, h, nt, ep, norm)?;
        e.matvec_norm(
            up,
            &s.low_act,
            &s.u,
            x,
            h,
            nt,
            Epilogue::HcReadoutNorm,
            norm,
        )?;
        *slot = new;
        return Ok(());
    }
    let inj = &s.inj[*slot];
    match pending {
        Some(y) => e.rms_norm_injected(x, &w.norm, &s.xn, nt * h, d, eps, y, inj, h)?,
        None => e.rms_norm(x, &w.norm, &s.xn, nt * h, d, eps)?,
    }
    let hf = (h as f32).to_bits();
    match &w.front {
        Front::Fused(m) => e.matvec_aux(m, &s.xn, &s.low_act, inj, h, nt, Epilogue::HcFront)?,
        Front::Split { down, inject } => {
            e.matvec(down, &s.xn, &s.low, nt, Epilogue::None)?;
            e.map(0, hf, &s.low, &s.g, &s.low_act, nt * down.rows)?;
            if let Some(m) = inject {
                e.matvec(m, &s.xn, &s.inj_raw, nt, Epilogue::None)?;
                e.map(1, hf, &s.inj_raw, &s.g, inj, nt * h)?;
            }
        }
    }
    match &w.up {
        Up::Readout(m) => e.matvec_aux(m, &s.low_act, &s.u, &s.xn, h, nt, Epilogue::HcReadout),
        Up::Plain(m) => {
            e.matvec(m, &s.low_act, &s.g, nt, Epilogue::None)?;
            let p = [(nt * d) as u32, h as u32, d as u32];
            e.op_lanes(Op::HcCombine, &p, &[&s.g, &s.xn, &s.u], nt * d)
        }
    }
}

/// Prefetches the site's front and up matrices into the device's L2 (one dispatch per part,
/// `outs` their outputs in turn; see `Graph::prefetch`).
pub fn encode_prefetch(e: &mut Enc<'_>, w: &HcGpu, outs: &[wgpu::Buffer]) -> Result<(), GpuError> {
    let front: Vec<&GpuMatrix> = match &w.front {
        Front::Fused(m) => vec![m],
        Front::Split { down, inject } => {
            std::iter::once(&**down).chain(inject.as_deref()).collect()
        }
    };
    let up: &GpuMatrix = match &w.up {
        Up::Readout(m) | Up::Plain(m) => m,
    };
    let parts = front
        .into_iter()
        .chain([up])
        .flat_map(|m| m.parts.iter().map(|p| &p.buffer));
    for (src, out) in parts.zip(outs) {
        let ctx = &e.dev.ctx;
        e.g.prefetch(ctx, src, out)?;
    }
    Ok(())
}

/// `X_k += inj_k * y` on the device for `nt` rows (the injection weights in slot `slot` of
/// `e.s.inj`).
pub fn encode_inject(
    e: &mut Enc<'_>,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    nt: usize,
    h: usize,
    d: usize,
    slot: usize,
) -> Result<(), GpuError> {
    let p = [(nt * h * d) as u32, h as u32, d as u32];
    let inj = &e.s.inj[slot];
    e.op_lanes(Op::HcInject, &p, &[x, inj, y], nt * h * d)
}
