//! Manifold-constrained hyper-connections (`DeepseekV4HyperConnection`, `DeepseekV4HyperHead`).
//!
//! Per site: `f = UnweightedRMSNorm(flatten(X))` over the `N*D` streams of a token,
//! `m = fn . f`, split `[pre N | post N | comb N*N]`; `pre = sigmoid(m*s0 + b) + hc_eps`,
//! `post = 2 sigmoid(m*s1 + b)`, `C = softmax_row(m*s2 + b) + hc_eps` made doubly stochastic by
//! Sinkhorn-Knopp (a column normalisation, then `iters - 1` row+column rounds). The block input
//! is `sum_k pre_k X_k`; after the block `X'_k = post_k y + sum_j C[j][k] X_j`. The head collapses
//! the streams with `sigmoid(hc_fn . f * scale + base) + hc_eps` and no Sinkhorn.

use crate::ops::rms_norm_unweighted;
use crate::weights::{HcWeights, HeadHcWeights};
use quant_codecs::ops::{linear, sigmoid};

/// The geometry and constants every site shares.
#[derive(Debug, Clone, Copy)]
pub struct HcDims {
    /// Streams N.
    pub n: usize,
    /// Stream width D.
    pub d: usize,
    /// `rms_norm_eps` of the unweighted input norm.
    pub norm_eps: f32,
    /// `hc_eps`.
    pub hc_eps: f32,
    /// `hc_sinkhorn_iters`.
    pub iters: usize,
}

/// What one site computes for `t` tokens.
pub struct Mix {
    /// The collapsed block input `[t, D]`.
    pub input: Vec<f32>,
    /// `post` `[t, N]`.
    pub post: Vec<f32>,
    /// The doubly-stochastic `C` `[t, N, N]` (row-major: `C[j][k]` at `j*N + k`).
    pub comb: Vec<f32>,
}

fn normed(x: &[f32], dims: &HcDims) -> Vec<f32> {
    let mut f = x.to_vec();
    rms_norm_unweighted(&mut f, dims.n * dims.d, dims.norm_eps);
    f
}

/// `sum_k pre_k X_k` per token: `x` `[t, N, D]`, `pre` `[t, N]`, returns `[t, D]`.
pub fn collapse(x: &[f32], pre: &[f32], t: usize, n: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0f32; t * d];
    for r in 0..t {
        let o = &mut out[r * d..(r + 1) * d];
        for k in 0..n {
            let p = pre[r * n + k];
            for (a, b) in o.iter_mut().zip(&x[(r * n + k) * d..(r * n + k + 1) * d]) {
                *a += p * b;
            }
        }
    }
    out
}

/// The embedding rows of `tokens` (ids checked by the caller), each repeated into the `N`
/// streams: `[t, N, D]`.
pub fn embed_streams(embed: &model_core::Mat<'_>, tokens: &[u32], n: usize, d: usize) -> Vec<f32> {
    let mut x = vec![0f32; tokens.len() * n * d];
    let mut row = vec![0f32; d];
    for (r, &id) in tokens.iter().enumerate() {
        embed
            .dequantize_row(id as usize, &mut row)
            .expect("ids are checked before the forward");
        for k in 0..n {
            x[(r * n + k) * d..(r * n + k + 1) * d].copy_from_slice(&row);
        }
    }
    x
}

/// Sinkhorn-Knopp as the reference runs it on `c` (`N x N`, row-major).
pub fn sinkhorn(c: &mut [f32], n: usize, iters: usize, eps: f32) {
    let cols = |c: &mut [f32]| {
        for k in 0..n {
            let s: f32 = (0..n).map(|j| c[j * n + k]).sum();
            for j in 0..n {
                c[j * n + k] /= s + eps;
            }
        }
    };
    cols(c);
    for _ in 0..iters.saturating_sub(1) {
        for row in c.chunks_mut(n) {
            let s: f32 = row.iter().sum();
            for v in row.iter_mut() {
                *v /= s + eps;
            }
        }
        cols(c);
    }
}

/// The three mappings one site computes for `t` tokens.
pub struct Maps {
    /// `pre` `[t, N]` (the collapse weights).
    pub pre: Vec<f32>,
    /// `post` `[t, N]`.
    pub post: Vec<f32>,
    /// The doubly-stochastic `C` `[t, N, N]` (row-major: `C[j][k]` at `j*N + k`).
    pub comb: Vec<f32>,
}

/// The `pre` / `post` / `comb` of site `w` on the streams `x` `[t, N, D]`. V4 collapses with
/// this site's `pre` ([`pre`]); V4.1 hands it to the next site (single-pass mHC).
pub fn maps(w: &HcWeights<'_>, x: &[f32], t: usize, dims: &HcDims) -> Maps {
    let n = dims.n;
    let m = (2 + n) * n;
    let mixes = linear(&w.fn_, &normed(x, dims), t);
    let (mut pre, mut post, mut comb) =
        (vec![0f32; t * n], vec![0f32; t * n], vec![0f32; t * n * n]);
    let (s0, s1, s2) = (w.scale[0], w.scale[1], w.scale[2]);
    for r in 0..t {
        let mr = &mixes[r * m..(r + 1) * m];
        for k in 0..n {
            pre[r * n + k] = sigmoid(mr[k] * s0 + w.base[k]) + dims.hc_eps;
            post[r * n + k] = 2.0 * sigmoid(mr[n + k] * s1 + w.base[n + k]);
        }
        let c = &mut comb[r * n * n..(r + 1) * n * n];
        for (j, row) in c.chunks_mut(n).enumerate() {
            for (k, v) in row.iter_mut().enumerate() {
                let at = 2 * n + j * n + k;
                *v = mr[at] * s2 + w.base[at];
            }
            crate::ops::softmax(row);
            for v in row.iter_mut() {
                *v += dims.hc_eps;
            }
        }
        sinkhorn(c, n, dims.iters, dims.hc_eps);
    }
    Maps { pre, post, comb }
}

/// Runs the mixing of site `w` on the streams `x` `[t, N, D]`, collapsing with its own `pre`.
pub fn pre(w: &HcWeights<'_>, x: &[f32], t: usize, dims: &HcDims) -> Mix {
    let Maps { pre, post, comb } = maps(w, x, t, dims);
    Mix {
        input: collapse(x, &pre, t, dims.n, dims.d),
        post,
        comb,
    }
}

/// `X'_k = post_k y + sum_j C[j][k] X_j` in place on `x` `[t, N, D]`, with `y` `[t, D]`,
/// `post` `[t, N]` and `comb` `[t, N, N]` of the site.
pub fn post(x: &mut [f32], y: &[f32], post: &[f32], comb: &[f32], t: usize, dims: &HcDims) {
    let (n, d) = (dims.n, dims.d);
    let mut out = vec![0f32; n * d];
    for r in 0..t {
        let xr = &mut x[r * n * d..(r + 1) * n * d];
        let yr = &y[r * d..(r + 1) * d];
        let c = &comb[r * n * n..(r + 1) * n * n];
        for k in 0..n {
            let o = &mut out[k * d..(k + 1) * d];
            let p = post[r * n + k];
            for (a, b) in o.iter_mut().zip(yr) {
                *a = p * b;
            }
            let mut mixed = vec![0f32; d];
            for j in 0..n {
                let cjk = c[j * n + k];
                for (a, b) in mixed.iter_mut().zip(&xr[j * d..(j + 1) * d]) {
                    *a += cjk * b;
                }
            }
            for (a, b) in o.iter_mut().zip(&mixed) {
                *a += b;
            }
        }
        xr.copy_from_slice(&out);
    }
}

/// The head's collapse of `x` `[t, N, D]` to `[t, D]`.
pub fn head(w: &HeadHcWeights<'_>, x: &[f32], t: usize, dims: &HcDims) -> Vec<f32> {
    let n = dims.n;
    let mixes = linear(&w.fn_, &normed(x, dims), t);
    let pre: Vec<f32> = (0..t * n)
        .map(|at| sigmoid(mixes[at] * w.scale + w.base[at % n]) + dims.hc_eps)
        .collect();
    collapse(x, &pre, t, n, dims.d)
}

/// An mHC site on the device (a layer's `attn_hc`/`ffn_hc` with the block's norm after it, or
/// the head's collapse with the final norm): `mhc_pre` computes the maps with Sinkhorn, the
/// collapse and the norm in one workgroup per row; `mhc_post` updates the streams. V4.1's
/// single pass collapses with the previous site's `pre` ([`Prev`]).
pub struct HcGpu {
    fn_: Option<std::sync::Arc<gpu_runtime::GpuMatrix>>,
    base: wgpu::Buffer,
    norm: wgpu::Buffer,
    /// `mhc_pre`'s parameters after the row count.
    params: [u32; 9],
}

/// Where a V4.1 site's collapse takes its `pre` from: the maps of the site before it (row
/// stride `(2+N)N`, `pre` first), or a one-hot row per token before the first layer.
#[derive(Clone, Copy)]
pub struct Prev<'b> {
    /// The buffer.
    pub maps: &'b wgpu::Buffer,
    /// Its row stride in words.
    pub stride: usize,
}

impl HcGpu {
    /// A layer's site `w` followed by the norm `norm`.
    pub fn site(
        dev: &crate::device::Device,
        w: &HcWeights<'_>,
        norm: &[f32],
        dims: &HcDims,
    ) -> Result<HcGpu, gpu_runtime::GpuError> {
        let s = &w.scale;
        Ok(HcGpu {
            fn_: Some(dev.mat(&w.fn_)?),
            base: dev.vec("mhc base", &w.base),
            norm: dev.vec("block norm", norm),
            params: [
                dims.n as u32,
                dims.d as u32,
                0,
                dims.iters as u32,
                dims.hc_eps.to_bits(),
                dims.norm_eps.to_bits(),
                s[0].to_bits(),
                s[1].to_bits(),
                s[2].to_bits(),
            ],
        })
    }

    /// The head's collapse `w` followed by the final norm `norm`.
    pub fn head(
        dev: &crate::device::Device,
        w: &HeadHcWeights<'_>,
        norm: &[f32],
        dims: &HcDims,
    ) -> Result<HcGpu, gpu_runtime::GpuError> {
        Ok(HcGpu {
            fn_: Some(dev.mat(&w.fn_)?),
            base: dev.vec("mhc head base", &w.base),
            norm: dev.vec("final norm", norm),
            params: Self::head_params(1, w.scale, dims),
        })
    }

    /// V4.1's head: no maps of its own, the collapse with the last site's `pre`
    /// ([`HcGpu::encode_pre_from`]) and the final norm `norm`.
    pub fn collapse_head(dev: &crate::device::Device, norm: &[f32], dims: &HcDims) -> HcGpu {
        HcGpu {
            fn_: None,
            base: dev.vec("mhc head base", &[0.0]),
            norm: dev.vec("final norm", norm),
            params: Self::head_params(2, 0.0, dims),
        }
    }

    fn head_params(mode: u32, scale: f32, dims: &HcDims) -> [u32; 9] {
        [
            dims.n as u32,
            dims.d as u32,
            mode,
            0,
            dims.hc_eps.to_bits(),
            dims.norm_eps.to_bits(),
            scale.to_bits(),
            0,
            0,
        ]
    }

    /// The site on the streams `x` `[nt, N*D]`: the block's (normed) input into `e.s.u`, the
    /// maps into `e.s.maps` for [`HcGpu::encode_post`].
    pub fn encode_pre(
        &self,
        e: &mut crate::device::Enc<'_>,
        x: &wgpu::Buffer,
        nt: usize,
    ) -> Result<(), gpu_runtime::GpuError> {
        let maps = &e.s.maps;
        self.encode_pre_from(e, x, nt, maps, None)
    }

    /// [`HcGpu::encode_pre`] with the maps into `maps` and, with `prev`, the collapse
    /// by the previous site's `pre` (V4.1).
    pub fn encode_pre_from(
        &self,
        e: &mut crate::device::Enc<'_>,
        x: &wgpu::Buffer,
        nt: usize,
        maps: &wgpu::Buffer,
        prev: Option<Prev<'_>>,
    ) -> Result<(), gpu_runtime::GpuError> {
        let (n, d) = (self.params[0] as usize, self.params[1] as usize);
        let eps = f32::from_bits(self.params[5]);
        let s = e.s;
        if let Some(fn_) = &self.fn_ {
            e.rms_norm_unweighted(x, &s.xn, nt, n * d, eps)?;
            e.matvec(fn_, &s.xn, &s.mix, nt, gpu_runtime::Epilogue::None)?;
        }
        let mut p = vec![nt as u32];
        p.extend(self.params);
        p.push(prev.map_or(0, |p| p.stride as u32));
        let pm = prev.map_or(&s.mix, |p| p.maps);
        let bufs = [&s.mix, &self.base, maps, x, &self.norm, &s.u, pm];
        e.op(kernels_wgsl::Op::MhcPre, &p, &bufs, (nt as u32, 1))
    }

    /// The streams' update after the block: `x` `[nt, N*D]` in place with the block output
    /// `e.s.y`, from the maps [`HcGpu::encode_pre`] left.
    pub fn encode_post(
        &self,
        e: &mut crate::device::Enc<'_>,
        x: &wgpu::Buffer,
        nt: usize,
    ) -> Result<(), gpu_runtime::GpuError> {
        let maps = &e.s.maps;
        self.encode_post_from(e, x, nt, maps)
    }

    /// [`HcGpu::encode_post`] with the maps from `maps`.
    pub fn encode_post_from(
        &self,
        e: &mut crate::device::Enc<'_>,
        x: &wgpu::Buffer,
        nt: usize,
        maps: &wgpu::Buffer,
    ) -> Result<(), gpu_runtime::GpuError> {
        let (n, d) = (self.params[0], self.params[1]);
        let s = e.s;
        let p = [nt as u32 * d, n, d];
        e.op_lanes(
            kernels_wgsl::Op::MhcPost,
            &p,
            &[x, &s.y, maps],
            nt * d as usize,
        )
    }
}
