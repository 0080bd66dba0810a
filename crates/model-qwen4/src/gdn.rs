//! Gated DeltaNet (`Qwen4ExpTextGatedDeltaNet`): causal depthwise conv + SiLU over q|k|v, the
//! gated delta rule per value head (key heads shared by `Hv/Hk` consecutive value heads), and
//! a sigmoid-gated RMSNorm (`Qwen4ExpTextRMSNormGated`, plain weight) before `out_proj`.
//!
//! Per token: `beta = sigmoid(b)`, `g = -exp(A_log) softplus(a + dt_bias)`, `q,k = l2norm`,
//! `q /= sqrt(dk)`; `S *= exp(g)`; `delta = beta (v - S^T k)`; `S += k delta^T`; `o = S^T q`.
//! Prefill runs the recurrence token by token (the reference's chunked form is the same math).

use std::sync::Arc;

use crate::config::{GateAct, Qwen4ExpTextConfig};
use crate::device::{Device, Enc, Part, TwoMats};
use crate::weights::GdnWeights;
use gpu_runtime::ops::graph::{Member, storage};
use gpu_runtime::{Epilogue, GpuError, GpuMatrix};
use kernels_wgsl::{GDN_PARTS, Op};
use quant_codecs::ops::{linear, sigmoid, silu, softplus};
use rayon::prelude::*;

/// Recurrent state of one GDN layer for one sequence.
#[derive(Debug, Clone, Default)]
pub struct GdnState {
    /// Last `K-1` pre-conv inputs `[K-1, C]` (empty = zeros).
    pub conv: Vec<f32>,
    /// `[Hv, dk, dv]` (empty = zeros).
    pub s: Vec<f32>,
}

fn l2norm(x: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let r = 1.0 / (ss + 1e-6).sqrt();
    for v in x {
        *v *= r;
    }
}

/// Runs the block on block inputs `u` `[t, D]`; returns `[t, D]`.
pub fn forward_cpu(
    w: &GdnWeights<'_>,
    c: &Qwen4ExpTextConfig,
    u: &[f32],
    t: usize,
    st: &mut GdnState,
) -> Vec<f32> {
    let p = project(w, u, t);
    let o = recur(w, c, &p, 0, t, st);
    linear(&w.out, &o, t)
}

/// The input projections of `t` rows (row-wise: rows of several sequences project together).
pub struct GdnProj {
    /// `[t, 2*Hk*dk + Hv*dv]`, before the conv.
    pub qkv: Vec<f32>,
    /// Gate `[t, Hv*dv]`.
    pub z: Vec<f32>,
    /// `[t, Hv]`.
    pub b: Vec<f32>,
    /// `[t, Hv]`.
    pub a: Vec<f32>,
}

/// Projects block inputs `u` `[t, D]`.
pub fn project(w: &GdnWeights<'_>, u: &[f32], t: usize) -> GdnProj {
    GdnProj {
        qkv: linear(&w.in_qkv, u, t),
        z: linear(&w.in_z, u, t),
        b: linear(&w.in_b, u, t),
        a: linear(&w.in_a, u, t),
    }
}

/// The conv and the recurrence of one sequence over rows `r0..r0+t` of `p` (its tokens, in
/// order), advancing `st`; returns the gated, normalised heads `[t, Hv*dv]` (`out_proj`'s input).
pub fn recur(
    w: &GdnWeights<'_>,
    c: &Qwen4ExpTextConfig,
    p: &GdnProj,
    r0: usize,
    t: usize,
    st: &mut GdnState,
) -> Vec<f32> {
    let (hk, hv) = (c.linear_num_key_heads, c.linear_num_value_heads);
    let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
    let key_dim = hk * dk;
    let cdim = 2 * key_dim + hv * dv;
    let kk = c.linear_conv_kernel_dim;
    let eps = c.rms_norm_eps as f32;
    let qkv = &p.qkv[r0 * cdim..(r0 + t) * cdim];
    let z = &p.z[r0 * hv * dv..(r0 + t) * hv * dv];
    let b = &p.b[r0 * hv..(r0 + t) * hv];
    let a = &p.a[r0 * hv..(r0 + t) * hv];
    // Causal depthwise conv with the state as left context.
    if st.conv.len() != (kk - 1) * cdim {
        st.conv = vec![0f32; (kk - 1) * cdim];
    }
    let mut full = st.conv.clone();
    full.extend_from_slice(qkv);
    let mut conv = vec![0f32; t * cdim];
    for r in 0..t {
        for ch in 0..cdim {
            let mut acc = 0f32;
            for j in 0..kk {
                acc += w.conv[ch * kk + j] * full[(r + j) * cdim + ch];
            }
            conv[r * cdim + ch] = silu(acc);
        }
    }
    let n = full.len() / cdim;
    st.conv = full[(n - (kk - 1)) * cdim..].to_vec();
    if st.s.len() != hv * dk * dv {
        st.s = vec![0f32; hv * dk * dv];
    }
    let rep = hv / hk;
    let qscale = 1.0 / (dk as f32).sqrt();
    let gate_act = c.gate_act();
    // Value heads are independent: each runs its own recurrence over the t tokens.
    let per_head: Vec<Vec<f32>> =
        st.s.par_chunks_mut(dk * dv)
            .enumerate()
            .map(|(h, s)| {
                let kh = h / rep;
                let mut out_h = vec![0f32; t * dv];
                let mut delta = vec![0f32; dv];
                for r in 0..t {
                    let row = &conv[r * cdim..(r + 1) * cdim];
                    let mut q = row[kh * dk..(kh + 1) * dk].to_vec();
                    let mut k = row[key_dim + kh * dk..key_dim + (kh + 1) * dk].to_vec();
                    let v = &row[2 * key_dim + h * dv..2 * key_dim + (h + 1) * dv];
                    l2norm(&mut q);
                    l2norm(&mut k);
                    for x in &mut q {
                        *x *= qscale;
                    }
                    let beta = sigmoid(b[r * hv + h]);
                    let g = -w.a_log[h].exp() * softplus(a[r * hv + h] + w.dt_bias[h]);
                    let decay = g.exp();
                    for x in s.iter_mut() {
                        *x *= decay;
                    }
                    delta.fill(0.0);
                    for i in 0..dk {
                        for j in 0..dv {
                            delta[j] += s[i * dv + j] * k[i];
                        }
                    }
                    for j in 0..dv {
                        delta[j] = (v[j] - delta[j]) * beta;
                    }
                    for i in 0..dk {
                        for j in 0..dv {
                            s[i * dv + j] += k[i] * delta[j];
                        }
                    }
                    let out = &mut out_h[r * dv..(r + 1) * dv];
                    for i in 0..dk {
                        for j in 0..dv {
                            out[j] += s[i * dv + j] * q[i];
                        }
                    }
                    // Gated RMSNorm: norm, plain weight, act(z).
                    let ms = out.iter().map(|x| x * x).sum::<f32>() / dv as f32;
                    let rr = 1.0 / (ms + eps).sqrt();
                    let zz = &z[r * hv * dv + h * dv..r * hv * dv + (h + 1) * dv];
                    for j in 0..dv {
                        let gate = match gate_act {
                            GateAct::Sigmoid => sigmoid(zz[j]),
                            GateAct::Silu => silu(zz[j]),
                        };
                        out[j] = w.norm[j] * (out[j] * rr) * gate;
                    }
                }
                out_h
            })
            .collect();
    let mut o = vec![0f32; t * hv * dv];
    for (h, out_h) in per_head.iter().enumerate() {
        for r in 0..t {
            o[r * hv * dv + h * dv..r * hv * dv + (h + 1) * dv]
                .copy_from_slice(&out_h[r * dv..(r + 1) * dv]);
        }
    }
    o
}

/// One GDN layer's weights on the device.
pub struct GdnGpu {
    in_qkv: Arc<GpuMatrix>,
    in_z: Arc<GpuMatrix>,
    /// `in_proj_b` and `in_proj_a` (one shape): one dispatch where they are one matrix.
    ba: TwoMats,
    /// The four projections' column scales, in the order qkv, z, b, a (q8_2f on the int8
    /// path, `ba` one matrix): one quantiser for all four.
    table: Option<wgpu::Buffer>,
    conv: wgpu::Buffer,
    /// `a_log [Hv] | dt_bias [Hv] | norm [dv]`.
    vecs: wgpu::Buffer,
    out: Arc<GpuMatrix>,
}

impl GdnGpu {
    /// Uploads the layer's weights.
    pub fn upload(dev: &Device, w: &GdnWeights<'_>) -> Result<GdnGpu, GpuError> {
        let mut vecs = w.a_log.to_vec();
        vecs.extend_from_slice(&w.dt_bias);
        vecs.extend_from_slice(&w.norm);
        let ba = dev.two(&w.in_b, &w.in_a)?;
        let table = match &ba {
            TwoMats::One { table: Some(_), .. } => gpu_runtime::ops::act8::col_scale_table_host(
                &dev.ctx,
                &[w.in_qkv.mat(), w.in_z.mat(), w.in_b.mat(), w.in_a.mat()],
            ),
            _ => None,
        };
        Ok(GdnGpu {
            in_qkv: dev.mat(&w.in_qkv)?,
            in_z: dev.mat(&w.in_z)?,
            ba,
            table,
            conv: dev.vec(w.conv.name(), &w.conv),
            vecs: dev.vec("gdn vectors", &vecs),
            out: dev.mat(&w.out)?,
        })
    }
}

/// A GDN layer's sequence state on the device: the conv ring `[K-1, C]` and the recurrent
/// state `[Hv, dk, dv]`, both zero at the start (as the CPU state's empty vectors).
pub struct GdnDeviceState {
    /// Conv ring.
    pub conv: wgpu::Buffer,
    /// Recurrent state.
    pub s: wgpu::Buffer,
}

impl GdnDeviceState {
    /// Zeroed state for `c`.
    pub fn new(ctx: &gpu_runtime::GpuContext, c: &Qwen4ExpTextConfig) -> GdnDeviceState {
        let (hk, hv) = (c.linear_num_key_heads, c.linear_num_value_heads);
        let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
        let cdim = 2 * hk * dk + hv * dv;
        GdnDeviceState {
            conv: storage(ctx, "gdn conv state", (c.linear_conv_kernel_dim - 1) * cdim),
            s: storage(ctx, "gdn state", hv * dk * dv),
        }
    }
}

/// Whether the device kernels take this geometry (their workgroup arrays are fixed).
pub fn device_limits(c: &Qwen4ExpTextConfig) -> Result<(), String> {
    if c.linear_key_head_dim > 256 {
        return Err(format!(
            "linear_key_head_dim {} > 256 (the device recurrence keeps a chunk's keys in \
             workgroup memory and a column's rows in the registers of 8 lanes)",
            c.linear_key_head_dim
        ));
    }
    Ok(())
}

/// Encodes the layer on block inputs `e.s.u` `[nt, D]` into `e.s.y`: the projections over
/// every row, the conv and recurrence per sequence (`parts`, their rows in order).
pub fn encode<'a>(
    e: &mut Enc<'a>,
    w: &GdnGpu,
    c: &Qwen4ExpTextConfig,
    parts: &[Part<'a, GdnDeviceState>],
    nt: usize,
    il: usize,
) -> Result<(), GpuError> {
    let (hk, hv) = (c.linear_num_key_heads, c.linear_num_value_heads);
    let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
    let key_dim = hk * dk;
    let cdim = 2 * key_dim + hv * dv;
    let s = e.s;
    let [qkv, z, b, a, conv, o, qk, _] = &s.w;
    // A short frame's projections write the layer's own buffers, so they run side by side
    // (`crate::device::LayerOuts`).
    let (qkv, z, b, a) = match s.outs(il, nt).and_then(|o| o.gdn.as_ref()) {
        Some([q, zz, bb, aa]) => (q, zz, bb, aa),
        None => (qkv, z, b, a),
    };
    // b and a in one dispatch where they are one matrix; with q8_2f on the int8 path one
    // quantiser makes all four projections' activations.
    match (&w.ba, &w.table) {
        (TwoMats::One { m, .. }, Some(table)) => {
            let one = |m, y| Member {
                m,
                y,
                aux: None,
                epilogue: Epilogue::None,
            };
            let items = [
                one(&*w.in_qkv, qkv),
                one(&*w.in_z, z),
                Member {
                    m,
                    y: b,
                    aux: Some(a),
                    epilogue: Epilogue::PairTwo,
                },
            ];
            e.matvecs_members(&items, &s.u, nt, table)?;
        }
        (TwoMats::One { m, table }, None) => {
            e.matvecs(&[(&*w.in_qkv, qkv), (&*w.in_z, z)], &s.u, nt)?;
            e.matvec_two(m, table.as_ref(), &s.u, b, Some(a), nt, Epilogue::PairTwo)?;
        }
        (TwoMats::Apart(in_b, in_a), _) => {
            let projections = [(&*w.in_qkv, qkv), (&*w.in_z, z), (&**in_b, b), (&**in_a, a)];
            e.matvecs(&projections, &s.u, nt)?;
        }
    }
    let gate_silu = u32::from(c.gate_act() == GateAct::Silu);
    // The state rows each lane holds, as a constant: the driver unrolls the loops over them
    // and keeps the state in registers.
    let rows = c.linear_key_head_dim.div_ceil(GDN_PARTS as usize) as f64;
    let groups = dv.div_ceil((Op::GdnRecur.wg() / GDN_PARTS) as usize);
    let (max_dk, max_dv) = kernels_wgsl::GDN_STEP_MAX_DIMS;
    for part in parts {
        let st = part.state;
        let lim = &e.dev.ctx.limits;
        let step = e.dev.ctx.fused_ops
            && lim.max_compute_invocations_per_workgroup >= Op::GdnStep.wg()
            && lim.max_compute_workgroup_size_x >= Op::GdnStep.wg()
            && part.rows <= kernels_wgsl::GDN_STEP_ROWS
            && dk <= max_dk
            && dv <= max_dv;
        e.with_frame(part.frame, |e| {
            let p = [
                part.rows as u32,
                cdim as u32,
                c.linear_conv_kernel_dim as u32,
            ];
            // One workgroup per GDN_CONV_CHANNELS channels (`op_lanes` counts workgroups of
            // OP_WG lanes; the conv's own are wider, each channel's rows split over its lanes).
            let conv_lanes = cdim.div_ceil(kernels_wgsl::GDN_CONV_CHANNELS as usize)
                * kernels_wgsl::OP_WG as usize;
            e.op_lanes(Op::GdnConv, &p, &[qkv, &w.conv, &st.conv, conv], conv_lanes)?;
            let p = [
                part.rows as u32,
                hk as u32,
                hv as u32,
                dk as u32,
                dv as u32,
                cdim as u32,
                key_dim as u32,
                gate_silu,
                (c.rms_norm_eps as f32).to_bits(),
            ];
            // gdn_prep's rows in the work buffer GDN leaves free.
            let bufs = [conv, z, b, a, &st.s, &w.vecs, o, qk];
            if step {
                // A few tokens: prep, recurrence and norm in one dispatch (the same sums).
                let grid = (hv as u32, 1);
                return e.op_with(Op::GdnStep, &[("R", rows)], &p, &bufs, grid);
            }
            e.op(Op::GdnPrep, &p, &bufs, (hk as u32, part.rows as u32))?;
            e.op_with(
                Op::GdnRecur,
                &[("R", rows)],
                &p,
                &bufs,
                ((hv * groups) as u32, 1),
            )?;
            e.op_with(Op::GdnNorm, &[], &p, &bufs, (hv as u32, part.rows as u32))
        })?;
    }
    e.matvec(&w.out, o, &s.y, nt, Epilogue::None)
}
