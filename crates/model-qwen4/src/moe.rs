//! Sparse MoE (`Qwen4ExpTextSparseMoeBlock`): softmax over ALL experts, top-k, renormalised
//! when `norm_topk_prob`; SwiGLU experts (`gate_up` rows: gate then up) run by model-core's
//! routed-expert executor; plus the shared SwiGLU expert scaled by
//! `sigmoid(shared_expert_gate . u)`. This module owns only the routing.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::config::Qwen4ExpTextConfig;
use crate::device::{Device, Enc, TwoMats};
use crate::expert_cache::{Admission, CachePolicy, LayerCache};
use crate::weights::MoeWeights;
use gpu_runtime::ops::experts::ExpertBank;
use gpu_runtime::ops::graph::Break;
use gpu_runtime::staging::{Staged, StagingRing};
use gpu_runtime::{ActLayout, Epilogue, GpuError, GpuMatrix};
use kernels_wgsl::Op;
use model_core::experts::{Activation, Routes, dense_swiglu};
use quant_codecs::ops::{linear, sigmoid, top_k};

/// The routing of `t` rows of `u` `[t, D]`: per expert, the (row, weight) pairs in row order.
pub fn route(w: &MoeWeights<'_>, c: &Qwen4ExpTextConfig, u: &[f32], t: usize) -> Routes {
    let e = c.num_experts;
    let logits = linear(&w.router, u, t);
    let mut routes = Routes::new(e);
    for r in 0..t {
        let l = &logits[r * e..(r + 1) * e];
        let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let ex: Vec<f32> = l.iter().map(|x| (x - m).exp()).collect();
        let z: f32 = ex.iter().sum();
        let p: Vec<f32> = ex.iter().map(|x| x / z).collect();
        let top = top_k(&p, c.num_experts_per_tok);
        let sum: f32 = top.iter().map(|&x| p[x]).sum();
        for &x in &top {
            let wgt = if c.norm_topk_prob { p[x] / sum } else { p[x] };
            routes.push(x, r, wgt);
        }
    }
    routes
}

/// Runs the block on `u` `[t, D]`; returns `[t, D]`.
pub fn forward_cpu(w: &MoeWeights<'_>, c: &Qwen4ExpTextConfig, u: &[f32], t: usize) -> Vec<f32> {
    let d = c.hidden_size;
    let routes = route(w, c, u, t);
    let mut y = w.routed.forward_cpu(&routes, u, t);
    let sh = dense_swiglu(
        &w.sh_gate,
        &w.sh_up,
        &w.sh_down,
        Activation::SwiGlu { limit: None },
        u,
        t,
    );
    for r in 0..t {
        let ur = &u[r * d..(r + 1) * d];
        let s = sigmoid(ur.iter().zip(w.sh_scale.iter()).map(|(a, b)| a * b).sum());
        for k in 0..d {
            y[r * d + k] += s * sh[r * d + k];
        }
    }
    y
}

/// How a layer's routed experts sit on the device.
pub(crate) enum Routed {
    /// Two banks (gate/up, down): the grouped kernels read the chosen experts only.
    Banks(Box<(ExpertBank, ExpertBank)>),
    /// Some (or none) of the experts in VRAM, the rest computed on the CPU (a model larger
    /// than the VRAM budget): the resident experts' banks, and the device's expert -> bank
    /// slot map (`NONE_SLOT` for a cold expert).
    Partial {
        /// The resident experts' banks (`None` when none is resident).
        banks: Option<Box<(ExpertBank, ExpertBank)>>,
        /// `[E]` u32: each expert's bank slot.
        slot_of: wgpu::Buffer,
        /// The host's side: the map, and what the policy knows.
        cache: Mutex<LayerCache>,
    },
    /// One matrix per expert (a bank larger than one binding): every expert runs over the
    /// frame's rows, weighted zero where a row did not choose it.
    Each(Vec<(Arc<GpuMatrix>, Arc<GpuMatrix>)>),
}

/// The device's mark of an expert without a bank slot (and of a resident slot in a frame's
/// cold list).
pub const NONE_SLOT: u32 = u32::MAX;

impl Routed {
    /// Uploads a layer's routed experts: all of them as banks (`resident` = the expert
    /// count, `banks`), else one matrix each when they do not fit a binding; with fewer
    /// `resident`, the first `resident` experts by id as banks and the rest left to the CPU.
    pub(crate) fn upload(
        dev: &Device,
        w: &MoeWeights<'_>,
        banks: bool,
        resident: Option<(&[u32], Option<&[f32]>)>,
    ) -> Result<Routed, GpuError> {
        let ex = &w.routed.experts;
        if let Some((hot, scores)) = resident {
            let banks = if hot.is_empty() {
                None
            } else {
                let gate_up: Vec<_> = hot.iter().map(|&x| &ex[x as usize].gate_up).collect();
                let down: Vec<_> = hot.iter().map(|&x| &ex[x as usize].down).collect();
                Some(Box::new((dev.bank(&gate_up)?, dev.bank(&down)?)))
            };
            let cache = LayerCache::new(ex.len(), hot, scores);
            let words: Vec<u32> = cache
                .slots()
                .iter()
                .map(|s| s.unwrap_or(NONE_SLOT))
                .collect();
            let slot_of = dev.words("expert slots", &words);
            return Ok(Routed::Partial {
                banks,
                slot_of,
                cache: Mutex::new(cache),
            });
        }
        let gate_up: Vec<_> = ex.iter().map(|x| &x.gate_up).collect();
        let down: Vec<_> = ex.iter().map(|x| &x.down).collect();
        let banks = if banks {
            dev.bank(&gate_up)
                .and_then(|g| Ok(Routed::Banks(Box::new((g, dev.bank(&down)?)))))
        } else {
            Err(GpuError::UnsupportedFusion {
                epilogue: "expert bank",
                reason: "banks not asked for".into(),
            })
        };
        Ok(match banks {
            Ok(b) => b,
            Err(e) => {
                tracing::info!("routed experts one matrix each: {e}");
                Routed::Each(
                    ex.iter()
                        .map(|x| Ok((dev.mat(&x.gate_up)?, dev.mat(&x.down)?)))
                        .collect::<Result<_, GpuError>>()?,
                )
            }
        })
    }

    /// Experts a bank of one binding holds (gate/up and down each in their own).
    pub(crate) fn bank_cap(dev: &Device, w: &MoeWeights<'_>) -> usize {
        let pad = |m: &model_core::bind::Mat<'_>| (m.bytes().len() as u64).next_multiple_of(16);
        w.routed.experts.first().map_or(0, |x| {
            let widest = pad(&x.gate_up).max(pad(&x.down)).max(1);
            (dev.ctx.max_binding() / widest) as usize
        })
    }

    /// Bytes one expert's gate/up and down take in a bank (16-byte padded slots).
    pub(crate) fn slot_bytes(w: &MoeWeights<'_>) -> u64 {
        w.routed.experts.first().map_or(0, |x| {
            let pad = |m: &model_core::bind::Mat<'_>| (m.bytes().len() as u64).next_multiple_of(16);
            pad(&x.gate_up) + pad(&x.down)
        })
    }
}

/// A layer's expert -> slot map on the device and on the host.
pub type SlotMaps = (Vec<u32>, Vec<u32>);

/// One MoE layer's weights on the device.
pub struct MoeGpu {
    router: Arc<GpuMatrix>,
    routed: Routed,
    sh_gate_up: TwoMats,
    sh_down: Arc<GpuMatrix>,
    sh_scale: wgpu::Buffer,
    /// Where the routed experts' int8 activations (their own layout, no column scales) and the
    /// shared expert's two q8_2f members come from one quantiser: a row of unit scales, then
    /// the shared expert's gate and up column scales.
    shared_quant: Option<(ActLayout, wgpu::Buffer)>,
}

impl MoeGpu {
    /// Uploads the layer's weights: the router and the shared expert, and the routed experts
    /// as `routed` placed them ([`Routed::upload`], after every other weight of the model).
    pub(crate) fn upload(
        dev: &Device,
        w: &MoeWeights<'_>,
        routed: Routed,
    ) -> Result<MoeGpu, GpuError> {
        let sh_gate_up = dev.two(&w.sh_gate, &w.sh_up)?;
        // One quantiser for both: routed banks on the int8 path in a codec without column
        // scales, and the shared pair on one quantiser of its own (q8_2f, int8).
        let layout = match &routed {
            Routed::Banks(b) if dev.path(b.0.dtype) == gpu_runtime::Path::Int8 => {
                gpu_runtime::arena::kernel_codec(b.0.dtype)
                    .filter(|c| *c != kernels_wgsl::Codec::Q8_2f)
                    .and_then(|c| c.act_layout())
                    .filter(|_| b.0.cols.is_multiple_of(32))
            }
            _ => None,
        };
        let shared_quant = match (&sh_gate_up, layout) {
            (TwoMats::One { table: Some(_), .. }, Some(l)) => {
                let mats = [w.sh_gate.mat(), w.sh_up.mat()];
                gpu_runtime::ops::act8::col_scale_table_host_units(&dev.ctx, 1, &mats)
                    .map(|t| (l, t))
            }
            _ => None,
        };
        Ok(MoeGpu {
            router: dev.mat(&w.router)?,
            routed,
            sh_gate_up,
            sh_down: dev.mat(&w.sh_down)?,
            sh_scale: dev.vec(w.sh_scale.name(), &w.sh_scale),
            shared_quant,
        })
    }
}

impl MoeGpu {
    /// Whether the routed experts run through the grouped kernels.
    pub fn grouped(&self) -> bool {
        matches!(
            self.routed,
            Routed::Banks(..) | Routed::Partial { banks: Some(_), .. }
        )
    }

    /// The layer's expert cache when some experts are computed on the CPU (`None` when all
    /// are resident).
    pub(crate) fn cache(&self) -> Option<std::sync::MutexGuard<'_, LayerCache>> {
        match &self.routed {
            Routed::Partial { cache, .. } => Some(cache.lock().unwrap_or_else(|p| p.into_inner())),
            _ => None,
        }
    }

    /// The device's expert -> slot map (`NONE_SLOT`: cold) beside the host cache's, when the
    /// layer has a bank of which some experts are not resident.
    pub(crate) fn slot_maps(
        &self,
        ctx: &gpu_runtime::GpuContext,
    ) -> Option<Result<SlotMaps, gpu_runtime::GpuError>> {
        let Routed::Partial {
            banks: Some(_),
            slot_of,
            cache,
        } = &self.routed
        else {
            return None;
        };
        let host: Vec<u32> = (cache.lock().unwrap_or_else(|p| p.into_inner()))
            .slots()
            .iter()
            .map(|s| s.unwrap_or(NONE_SLOT))
            .collect();
        let device = gpu_runtime::readback::read_f32(ctx, slot_of, 0, host.len())
            .map(|v| v.iter().map(|x| x.to_bits()).collect());
        Some(device.map(|d| (d, host)))
    }

    /// Records a frame's routing (`routed`, and `cold`: the slots computed on the CPU) in the
    /// layer's cache and returns what `policy` admits (at most `max` experts), already in the
    /// host's map; the device's map changes when the upload is committed.
    pub(crate) fn decide(
        &self,
        routed: &[u32],
        cold: &[u32],
        policy: CachePolicy,
        max: usize,
    ) -> Vec<Admission> {
        match &self.routed {
            Routed::Partial {
                banks: Some(_),
                cache,
                ..
            } => cache
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .frame(routed, cold, policy, max),
            Routed::Partial { cache, .. } => {
                // Nothing resident, nothing to admit into: the scores still learn.
                let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
                c.frame(routed, cold, policy, max);
                Vec::new()
            }
            _ => Vec::new(),
        }
    }

    /// Prefetches up to `m` of the experts `likely` rates highest into this layer's bank
    /// ([`LayerCache::prefetch`]; nothing without a bank).
    pub(crate) fn prefetch(&self, likely: &[u32], m: usize) -> Vec<Admission> {
        let banked = matches!(&self.routed, Routed::Partial { banks: Some(_), .. });
        match self.cache() {
            Some(mut c) if banked => c.prefetch(likely, m),
            _ => Vec::new(),
        }
    }

    /// Writes each admitted expert's bytes (from `w`, the mapped file) into a slot of `ring`,
    /// without waiting for the GPU: an admission finding no ready slot comes back with `None`.
    pub(crate) fn stage(
        &self,
        w: &MoeWeights<'_>,
        ring: &StagingRing,
        admitted: Vec<Admission>,
    ) -> Vec<Upload> {
        admitted
            .into_iter()
            .map(|a| {
                let x = &w.routed.experts[a.expert as usize];
                // The expert's bytes, then its map entries' words (the evicted expert's
                // `NONE_SLOT`, its own slot), copied by the same command buffer: a queued
                // write of 4 bytes would cost a staging buffer of its own.
                let (none, slot) = (NONE_SLOT.to_le_bytes(), a.slot.to_le_bytes());
                let staged = ring.try_stage(&[x.gate_up.bytes(), x.down.bytes(), &none, &slot]);
                (a, staged)
            })
            .collect()
    }

    /// Commits staged admissions: each one's copies into its bank slot go into `cbs` (for
    /// the next submission, ahead of its frame) and its map entries into queued writes, so
    /// the work already submitted reads the slot's old expert and everything later the new
    /// one. An admission without staging room is taken back (the slot keeps its expert); one
    /// whose copies the device refuses retires its slot, and both experts stay cold, so the
    /// CPU computes them and the token is still right. `fault` counts copies to aim past
    /// their bank on purpose (what the tests use to make the device refuse one). Returns the
    /// staged slots to release after that submission, and (committed, failed).
    pub(crate) fn commit(
        &self,
        dev: &Device,
        ring: &StagingRing,
        uploads: Vec<Upload>,
        fault: &AtomicUsize,
        cbs: &mut Vec<wgpu::CommandBuffer>,
    ) -> (Vec<Staged>, usize, usize) {
        let Routed::Partial {
            banks: Some(banks),
            slot_of,
            cache,
        } = &self.routed
        else {
            return (Vec::new(), 0, 0);
        };
        let (gate_up, down) = &**banks;
        let ctx = &dev.ctx;
        let mut cache = cache.lock().unwrap_or_else(|p| p.into_inner());
        let (mut release, mut ok, mut failed) = (Vec::new(), 0, 0);
        for (a, staged) in uploads {
            let Some(staged) = staged else {
                cache.undo(&a);
                continue;
            };
            let faulty = fault
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok();
            let slot = u64::from(a.slot);
            let cb = ctx.checked("expert admission", || {
                let mut enc = ctx
                    .device
                    .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                        label: Some("expert admission"),
                    });
                let (gu_buf, gu_at) = gate_up.slot_at(slot as usize);
                let at = if faulty { gu_buf.size() } else { gu_at };
                ring.record(&mut enc, &staged, 0, gu_buf, at);
                let (dn_buf, dn_at) = down.slot_at(slot as usize);
                ring.record(&mut enc, &staged, 1, dn_buf, dn_at);
                ring.record(&mut enc, &staged, 2, slot_of, u64::from(a.evicted) * 4);
                ring.record(&mut enc, &staged, 3, slot_of, u64::from(a.expert) * 4);
                enc.finish()
            });
            match cb {
                Ok(cb) => {
                    cbs.push(cb);
                    ok += 1;
                }
                Err(e) => {
                    // Nothing of the refused buffer runs: the evicted expert's entry still
                    // names the slot, which from here on holds nothing valid.
                    ctx.queue.write_buffer(
                        slot_of,
                        u64::from(a.evicted) * 4,
                        &NONE_SLOT.to_le_bytes(),
                    );
                    tracing::warn!(
                        "expert {} could not go into bank slot {}; it and expert {} stay on the CPU: {e}",
                        a.expert,
                        a.slot,
                        a.evicted
                    );
                    cache.retire(&a);
                    failed += 1;
                }
            }
            release.push(staged);
        }
        (release, ok, failed)
    }
}

/// An admission on its way into a bank: its bytes in a staging slot (`None`: no room).
pub(crate) type Upload = (Admission, Option<Staged>);

/// Encodes the block on `e.s.u` `[nt, D]` into `out` `[nt, D]`: router, softmax and top-k on
/// the device; the chosen experts through the grouped kernels (their ids never leave the
/// device) and summed per row in expert order, as the CPU executor adds them (without banks:
/// every expert over the frame's rows with a zero weight where not chosen); then the gated
/// shared expert. With experts on the CPU the frame breaks after the routing (the host reads
/// layer `il`'s cold slots and the block's input back and computes them while the GPU computes
/// the resident ones and the shared expert) and before the sum (the host's outputs go up into
/// the cold slots' rows of the expert outputs): the sum is the same, in the same order.
pub fn encode(
    e: &mut Enc<'_>,
    w: &MoeGpu,
    c: &Qwen4ExpTextConfig,
    out: &wgpu::Buffer,
    nt: usize,
    il: usize,
) -> Result<(), GpuError> {
    let (d, ne, k) = (c.hidden_size, c.num_experts, c.num_experts_per_tok);
    let s = e.s;
    let [rl, pr, rw, hm, eo, sg, su, _] = &s.w;
    // The routed experts' and the shared expert's activations from one quantiser.
    let quantise = |e: &mut Enc<'_>| -> Result<_, GpuError> {
        Ok(match (&w.shared_quant, &w.sh_gate_up) {
            (Some((layout, table)), TwoMats::One { m, .. }) if e.dev.ctx.fused_ops => {
                let layouts = [*layout, ActLayout::Natural, ActLayout::Natural];
                let ctx = &e.dev.ctx;
                let acts =
                    e.g.quantise_shared(ctx, &s.u, nt, d, &layouts, table, true)?;
                Some((&**m, acts))
            }
            _ => None,
        })
    };
    // A short frame with its experts in banks runs the quantiser beside the router and the
    // shared expert's gate/up beside the routed experts' (the layer's own outputs:
    // `crate::device::LayerOuts`); the same dispatches, reordered.
    let shared_fused = e.dev.ctx.fused_ops
        && matches!(
            (&w.shared_quant, &w.sh_gate_up),
            (Some(_), TwoMats::One { .. })
        );
    let own = s
        .outs(il, nt)
        .filter(|_| shared_fused && matches!(w.routed, Routed::Banks(_)));
    let early = match own {
        Some(_) => quantise(e)?,
        None => None,
    };
    let rl = own.map_or(rl, |o| &o.router);
    e.matvec(&w.router, &s.u, rl, nt, Epilogue::None)?;
    // The route kernel holds a row's probabilities and its picks in workgroup memory.
    for (what, max, found) in [
        ("experts (route kernel)", 1024, ne),
        ("top-k (route kernel)", 64, k),
    ] {
        if found > max {
            return Err(GpuError::BadLength {
                what,
                expected: max,
                found,
            });
        }
    }
    // The slots' weights and the shared expert's gates follow the slots' outputs.
    let (sw_off, g_off) = gpu_runtime::ops::matvec::moe_out_offsets(nt, k, d);
    let p = [
        ne as u32,
        k as u32,
        u32::from(c.norm_topk_prob),
        sw_off as u32,
        g_off as u32,
        d as u32,
    ];
    // Two workgroups a row: the second computes the shared expert's gate beside the routing.
    e.op(
        Op::Route,
        &p,
        &[rl, pr, rw, &s.slot_ids, &s.expert_out, &s.u, &w.sh_scale],
        (nt as u32, 2),
    )?;
    let shared = match own {
        Some(_) => early,
        None => quantise(e)?,
    };
    // The shared expert's gate and up (one dispatch where they are one matrix) into `hm`.
    let shared_gate_up = |e: &mut Enc<'_>, hm: &wgpu::Buffer| -> Result<(), GpuError> {
        match &w.sh_gate_up {
            _ if shared.is_some() => {
                let (m, acts) = shared.as_ref().expect("matched");
                let two = [&acts[1], &acts[2]];
                let ctx = &e.dev.ctx;
                e.g.matvec_two_acts(ctx, m, &s.u, two, hm, None, nt, Epilogue::GateUpTwo)
            }
            TwoMats::One { m, table } => {
                e.matvec_two(m, table.as_ref(), &s.u, hm, None, nt, Epilogue::GateUpTwo)
            }
            TwoMats::Apart(gate, up) => {
                e.matvecs(&[(&**gate, sg), (&**up, su)], &s.u, nt)?;
                e.map(2, 0, sg, su, hm, nt * gate.rows)
            }
        }
    };
    match &w.routed {
        Routed::Banks(banks) => {
            let (gate_up, down) = &**banks;
            let slots = nt * k;
            let (ids, mid, xo) = (&s.slot_ids, &s.expert_mid, &s.expert_out);
            if let Some((_, acts)) = &shared {
                let path = e.dev.path(gate_up.dtype);
                let (ctx, epi) = (&e.dev.ctx, Epilogue::SiluGateUp);
                e.g.grouped_acts(ctx, gate_up, &s.u, &acts[0], ids, mid, slots, k, path, epi)?;
            } else {
                e.grouped(gate_up, &s.u, nt, ids, mid, slots, k, Epilogue::SiluGateUp)?;
            }
            if let Some(o) = own {
                // Its activations are read as the routed gate/up read them: no barrier.
                shared_gate_up(e, &o.shared)?;
            }
            e.grouped(down, mid, slots, ids, xo, slots, 1, Epilogue::None)?;
        }
        Routed::Partial { banks, slot_of, .. } => {
            let slots = nt * k;
            let bufs = [&s.slot_ids, slot_of, &s.bank_ids, &s.cold];
            e.op_lanes(Op::ColdSplit, &[slots as u32], &bufs, slots)?;
            e.g.brk(Break::Read(il));
            if let Some(banks) = banks {
                let (gate_up, down) = &**banks;
                let (ids, mid, xo) = (&s.bank_ids, &s.expert_mid, &s.expert_out);
                e.grouped(gate_up, &s.u, nt, ids, mid, slots, k, Epilogue::SiluGateUp)?;
                e.grouped(down, mid, slots, ids, xo, slots, 1, Epilogue::None)?;
            }
        }
        Routed::Each(experts) => {
            for (x, (gate_up, down)) in experts.iter().enumerate() {
                e.matvec(gate_up, &s.u, hm, nt, Epilogue::SiluGateUp)?;
                e.matvec(down, hm, eo, nt, Epilogue::None)?;
                let p = [
                    (nt * d) as u32,
                    d as u32,
                    ne as u32,
                    x as u32,
                    u32::from(x == 0),
                ];
                e.op_lanes(Op::ExpertAdd, &p, &[out, rw, eo], nt * d)?;
            }
        }
    }
    let hm = match own {
        Some(o) => &o.shared,
        None => {
            shared_gate_up(e, hm)?;
            hm
        }
    };
    // A decode step or a short frame with every routed expert resident: the block's output is
    // the shared expert's down projection's epilogue (the routed slots' sum, then the gated
    // shared expert), one dispatch fewer. Longer frames keep the tiled matmat and the op.
    let fuse = e.dev.ctx.fused_ops
        && nt <= FUSED_OUT_ROWS
        && matches!(w.routed, Routed::Banks(_))
        && w.sh_down.parts.len() == 1
        && w.sh_down.rows == d;
    if fuse {
        return e.matvec_aux(&w.sh_down, hm, out, &s.expert_out, k, nt, Epilogue::MoeOut);
    }
    e.matvec(&w.sh_down, hm, eo, nt, Epilogue::None)?;
    // The routed sum from the slots (grouped banks) and the gated shared expert, one op.
    let slots_k = match &w.routed {
        Routed::Banks(_) => k,
        Routed::Partial { .. } => {
            e.g.brk(Break::Write(il));
            k
        }
        Routed::Each(_) => 0,
    };
    let grid = (d.div_ceil(kernels_wgsl::OP_WG as usize) as u32, nt as u32);
    e.op(
        Op::SharedAdd,
        &[d as u32, slots_k as u32, sw_off as u32, g_off as u32],
        &[out, eo, &s.expert_out],
        grid,
    )
}

/// Most token rows of a frame whose MoE output is its shared expert's epilogue
/// ([`Epilogue::MoeOut`]): the 8-row kernel's frames (longer ones run the tiled matmat).
const FUSED_OUT_ROWS: usize = 8;
