//! Op kernels whose work is split across workgroups or lanes in ways the model fixtures (small
//! vocabularies, few experts) do not reach, against host references: greedy argmax over a
//! release-size vocabulary (two passes, ties across chunks), MoE routing at the release
//! expert count (rank-based top-k against a stable sort in f64, and the shared expert's gate),
//! the gated delta rule at the release head size over frames longer than the kernel's token
//! chunk (and fused for short frames), and the RMSNorm (injecting or not, every weight mode) at
//! and past one pass a lane.

mod common;

use common::{ctx, rng};
use gpu_runtime::GpuContext;
use gpu_runtime::ops::graph::{self, Graph};
use kernels_wgsl::{GDN_PARTS, Op};

/// Runs `g` and reads `count` floats of `buf` back.
fn run_and_read(ctx: &GpuContext, g: &Graph, buf: &wgpu::Buffer, count: usize) -> Vec<f32> {
    let read = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("read"),
        size: (count * 4) as u64,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut enc = ctx
        .device
        .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
    g.record(ctx, &mut enc, None);
    enc.copy_buffer_to_buffer(buf, 0, &read, 0, (count * 4) as u64);
    ctx.queue.submit([enc.finish()]);
    gpu_runtime::readback::read_mapped(ctx, &read, count).unwrap()
}

/// The two-pass argmax as the model records it.
fn argmax(ctx: &GpuContext, logits: &[f32]) -> u32 {
    const CHUNK: usize = 1024;
    let n = logits.len();
    let parts = n.div_ceil(CHUNK);
    let frame = graph::frame_buffer(ctx);
    let l = graph::upload_f32(ctx, "logits", logits);
    let token = graph::storage(ctx, "token", 1);
    let part = graph::storage(ctx, "part", 2 * parts);
    let mut g = Graph::new();
    let bufs = [&l, &token, &part];
    let p = [n as u32, 0, 0, CHUNK as u32];
    g.op(ctx, Op::Argmax, &p, &frame, &bufs, (parts as u32, 1))
        .unwrap();
    g.op(
        ctx,
        Op::Argmax,
        &[parts as u32, 0, 1, 0],
        &frame,
        &bufs,
        (1, 1),
    )
    .unwrap();
    run_and_read(ctx, &g, &token, 1)[0].to_bits()
}

#[test]
fn argmax_over_a_release_vocabulary_takes_the_first_of_equal_maxima() {
    let Some(ctx) = ctx() else { return };
    let n = 248_320;
    let mut r = rng(5);
    let mut logits: Vec<f32> = (0..n).map(|_| 10.0 * r()).collect();
    // A unique maximum in the last, partial chunk.
    logits[n - 3] = 50.0;
    assert_eq!(argmax(ctx, &logits), (n - 3) as u32);
    // Equal maxima in different chunks, and twice within one: the lowest index wins.
    for (i, j) in [(200_000, 3_000), (70_001, 70_000), (1023, 1024)] {
        logits[i] = 60.0;
        logits[j] = 60.0;
        assert_eq!(
            argmax(ctx, &logits),
            i.min(j) as u32,
            "maxima at {i} and {j}"
        );
        logits[i] = 0.0;
        logits[j] = 0.0;
    }
    // Everything equal: index 0.
    assert_eq!(argmax(ctx, &vec![-1e30; 5000]), 0);
}

#[test]
fn routing_at_the_release_expert_count_matches_a_stable_sort_and_the_gate_f64() {
    let Some(ctx) = ctx() else { return };
    let (e, k, rows) = (512usize, 10usize, 4usize);
    let mut r = rng(9);
    let mut logits: Vec<f32> = (0..rows * e).map(|_| 4.0 * r()).collect();
    // Ties in the top k (equal logits give equal probabilities): the lower expert comes first.
    logits[7] = 9.0;
    logits[300] = 9.0;
    logits[e + 44] = 8.0;
    logits[e + 43] = 8.0;
    // A row of equal logits: every expert ties, the first k win.
    logits[3 * e..].fill(0.5);
    // The shared expert's gate inputs: a hidden width past one pass of the lanes' loads.
    let d = 1100usize;
    let u: Vec<f32> = (0..rows * d).map(|_| r()).collect();
    let gw: Vec<f32> = (0..d).map(|_| 0.1 * r()).collect();
    let frame = graph::frame_buffer(ctx);
    let l = graph::upload_f32(ctx, "router logits", &logits);
    let pr = graph::storage(ctx, "pr", rows * e);
    let rw = graph::storage(ctx, "rw", rows * e);
    let ids = graph::storage(ctx, "ids", rows * k);
    // The slots' buffer: their outputs (not written here), weights, gates.
    let (sw_off, g_off) = gpu_runtime::ops::matvec::moe_out_offsets(rows, k, d);
    let tail = graph::storage(ctx, "tail", g_off + rows);
    let ub = graph::upload_f32(ctx, "u", &u);
    let gwb = graph::upload_f32(ctx, "gate weights", &gw);
    type Run = (Vec<u32>, Vec<u32>, Vec<u32>);
    let mut one_high: [Option<Run>; 2] = [None, None];
    // A grid one workgroup high (one workgroup a row routes and sums the gate) and two high
    // (the second sums the gate): the same code, so the same bits.
    for (norm, high) in [(0u32, 1u32), (1, 1), (0, 2), (1, 2)] {
        // NaN everywhere first: nothing a run leaves unwritten passes for an earlier run's.
        for (b, n) in [(&tail, g_off + rows), (&rw, rows * e), (&ids, rows * k)] {
            ctx.queue
                .write_buffer(b, 0, bytemuck::cast_slice(&vec![f32::NAN; n]));
        }
        let mut g = Graph::new();
        let p = [e, k, norm as usize, sw_off, g_off, d].map(|v| v as u32);
        g.op(
            ctx,
            Op::Route,
            &p,
            &frame,
            &[&l, &pr, &rw, &ids, &tail, &ub, &gwb],
            (rows as u32, high),
        )
        .unwrap();
        let got_ids: Vec<u32> = run_and_read(ctx, &g, &ids, rows * k)
            .iter()
            .map(|v| v.to_bits())
            .collect();
        let tail_back = run_and_read(ctx, &g, &tail, g_off + rows);
        let got_w = &tail_back[sw_off..sw_off + rows * k];
        let dense = run_and_read(ctx, &g, &rw, rows * e);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        let run = (got_ids.clone(), bits(&tail_back[sw_off..]), bits(&dense));
        match &one_high[norm as usize] {
            None => one_high[norm as usize] = Some(run),
            Some(first) => assert!(*first == run, "norm {norm}: grids 1 and 2 high differ"),
        }
        for t in 0..rows {
            let (dot, mag) = (0..d).fold((0.0f64, 0.0f64), |(s, a), j| {
                let p = u[t * d + j] as f64 * gw[j] as f64;
                (s + p, a + p.abs())
            });
            let want = 1.0 / (1.0 + (-dot).exp());
            let got = tail_back[g_off + t] as f64;
            // The dot within 2e-6 of its magnitude sum; sigmoid' <= 1/4.
            assert!(
                (got - want).abs() <= 0.25 * 2e-6 * mag + 1e-7,
                "row {t} gate: {got} vs {want}"
            );
            let row = &logits[t * e..(t + 1) * e];
            let mx = row.iter().fold(f64::MIN, |m, &v| m.max(v as f64));
            let z: f64 = row.iter().map(|&v| (v as f64 - mx).exp()).sum();
            let p: Vec<f64> = row.iter().map(|&v| (v as f64 - mx).exp() / z).collect();
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
            let top = &order[..k];
            let sum: f64 = top.iter().map(|&i| p[i]).sum();
            let mut want: Vec<(usize, f64)> = top
                .iter()
                .map(|&i| (i, if norm == 1 { p[i] / sum } else { p[i] }))
                .collect();
            want.sort_by_key(|&(i, _)| i);
            for (s, &(i, w)) in want.iter().enumerate() {
                assert_eq!(
                    got_ids[t * k + s] as usize,
                    i,
                    "row {t} slot {s} (norm {norm})"
                );
                let g = got_w[t * k + s] as f64;
                assert!(
                    (g - w).abs() <= 1e-5 * w.max(1e-3),
                    "row {t} expert {i}: {g} vs {w}"
                );
                assert_eq!(
                    dense[t * e + i],
                    got_w[t * k + s],
                    "dense row {t} expert {i}"
                );
            }
            let chosen = dense[t * e..(t + 1) * e]
                .iter()
                .filter(|&&v| v != 0.0)
                .count();
            assert_eq!(chosen, k, "row {t}: dense weights outside the top k");
        }
    }
}

/// f64 reference of the gated delta rule (gdn_recur's contract, the CPU forward's math) for
/// `t` tokens: returns the gated, normalised outputs `[t, hv*dv]` and advances `st`.
#[allow(clippy::too_many_arguments)]
fn gdn_f64(
    conv: &[f32],
    z: &[f32],
    b: &[f32],
    a: &[f32],
    vecs: &[f32],
    st: &mut [f64],
    dims: [usize; 5],
    eps: f64,
) -> Vec<f64> {
    let [t, hk, hv, dk, dv] = dims;
    let key_dim = hk * dk;
    let c = 2 * key_dim + hv * dv;
    let mut out = vec![0f64; t * hv * dv];
    let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
    for h in 0..hv {
        let kh = h / (hv / hk);
        let s = &mut st[h * dk * dv..(h + 1) * dk * dv];
        for r in 0..t {
            let row = &conv[r * c..(r + 1) * c];
            let norm = |x: &[f32]| {
                let n = x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() + 1e-6;
                x.iter().map(|&v| v as f64 / n.sqrt()).collect::<Vec<f64>>()
            };
            let q: Vec<f64> = norm(&row[kh * dk..(kh + 1) * dk])
                .iter()
                .map(|v| v / (dk as f64).sqrt())
                .collect();
            let k = norm(&row[key_dim + kh * dk..key_dim + (kh + 1) * dk]);
            let v = &row[2 * key_dim + h * dv..2 * key_dim + (h + 1) * dv];
            let beta = sig(b[r * hv + h] as f64);
            let x = a[r * hv + h] as f64 + vecs[hv + h] as f64;
            let g = -(vecs[h] as f64).exp() * (1.0 + x.exp()).ln();
            let decay = g.exp();
            s.iter_mut().for_each(|x| *x *= decay);
            let mut o = vec![0f64; dv];
            for j in 0..dv {
                let sk: f64 = (0..dk).map(|i| s[i * dv + j] * k[i]).sum();
                let delta = (v[j] as f64 - sk) * beta;
                for i in 0..dk {
                    s[i * dv + j] += k[i] * delta;
                }
                o[j] = (0..dk).map(|i| s[i * dv + j] * q[i]).sum();
            }
            let rr = 1.0 / (o.iter().map(|v| v * v).sum::<f64>() / dv as f64 + eps).sqrt();
            for j in 0..dv {
                let at = r * hv * dv + h * dv + j;
                let gate = sig(z[at] as f64);
                out[at] = vecs[2 * hv + j] as f64 * o[j] * rr * gate;
            }
        }
    }
    out
}

#[test]
fn the_gated_delta_rule_over_long_frames_matches_f64_and_a_token_at_a_time_bit_for_bit_fused_or_not()
 {
    let Some(ctx) = ctx() else { return };
    // Release heads (128) and the widest key heads the kernel takes (256, half the tokens
    // per chunk); 12 tokens: more than one chunk either way. Value widths that leave the
    // last workgroup of a head part of its columns (40) and take more than one workgroup's
    // lanes in the norm (136).
    for (dk, dv) in [(128usize, 128usize), (256, 128), (24, 40), (32, 136)] {
        let (t, hk, hv) = (12usize, 2usize, 4usize);
        let key_dim = hk * dk;
        let c = 2 * key_dim + hv * dv;
        let eps = 1e-6f32;
        let mut r = rng(dk as u64 + 17);
        let conv: Vec<f32> = (0..t * c).map(|_| r()).collect();
        let z: Vec<f32> = (0..t * hv * dv).map(|_| 2.0 * r()).collect();
        let b: Vec<f32> = (0..t * hv).map(|_| 2.0 * r()).collect();
        let a: Vec<f32> = (0..t * hv).map(|_| r()).collect();
        let mut vecs: Vec<f32> = (0..2 * hv).map(|_| 0.5 * r()).collect();
        vecs.extend((0..dv).map(|_| 1.0 + 0.2 * r()));
        let s0: Vec<f32> = (0..hv * dk * dv).map(|_| 0.1 * r()).collect();
        let frame = graph::frame_buffer(ctx);
        let bufs: Vec<wgpu::Buffer> = [
            ("conv", &conv),
            ("z", &z),
            ("b", &b),
            ("a", &a),
            ("vecs", &vecs),
        ]
        .iter()
        .map(|(l, d)| graph::upload_f32(ctx, l, d))
        .collect();
        let run = |rows: usize, fused: bool| -> (Vec<f32>, Vec<f32>) {
            let s = graph::upload_f32(ctx, "state", &s0);
            let out = graph::storage(ctx, "out", t * hv * dv);
            let p = [
                rows as u32,
                hk as u32,
                hv as u32,
                dk as u32,
                dv as u32,
                c as u32,
                key_dim as u32,
                0,
                eps.to_bits(),
            ];
            let qk = graph::storage(ctx, "qk", t * (2 * key_dim + 2 * hv));
            let ops = [
                &bufs[0], &bufs[1], &bufs[2], &bufs[3], &s, &bufs[4], &out, &qk,
            ];
            let mut g = Graph::new();
            let r = [("R", dk.div_ceil(GDN_PARTS as usize) as f64)];
            if fused {
                let grid = (hv as u32, 1);
                g.op_with(ctx, Op::GdnStep, &r, &p, &frame, &ops, grid)
                    .unwrap();
            } else {
                g.op(ctx, Op::GdnPrep, &p, &frame, &ops, (hk as u32, rows as u32))
                    .unwrap();
                let groups = dv.div_ceil((Op::GdnRecur.wg() / GDN_PARTS) as usize);
                let grid = ((hv * groups) as u32, 1);
                g.op_with(ctx, Op::GdnRecur, &r, &p, &frame, &ops, grid)
                    .unwrap();
                g.op(ctx, Op::GdnNorm, &p, &frame, &ops, (hv as u32, rows as u32))
                    .unwrap();
            }
            for row0 in (0..t).step_by(rows) {
                graph::write_frame(ctx, &frame, 0, (0, 0), row0 as u32);
                run_and_read(ctx, &g, &out, 1);
            }
            (
                run_and_read_no_run(ctx, &out, t * hv * dv),
                run_and_read_no_run(ctx, &s, hv * dk * dv),
            )
        };
        let (whole, s_whole) = run(t, false);
        let (one, s_one) = run(1, false);
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same(&whole, &one),
            "dk {dk}: a frame of {t} differs from {t} frames of one token"
        );
        assert!(same(&s_whole, &s_one), "dk {dk}: states differ");
        // gdn_step (decode steps and short frames) adds the same sums in the same order.
        for rows in [1, 4] {
            let (fused, s_fused) = run(rows, true);
            assert!(
                same(&whole, &fused),
                "dk {dk}: gdn_step over frames of {rows} differs from the three kernels"
            );
            assert!(
                same(&s_whole, &s_fused),
                "dk {dk}: gdn_step's states differ"
            );
        }
        let mut st: Vec<f64> = s0.iter().map(|&v| v as f64).collect();
        let want = gdn_f64(&conv, &z, &b, &a, &vecs, &mut st, [t, hk, hv, dk, dv], 1e-6);
        for (i, (&g, &w)) in whole.iter().zip(&want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= 2e-4 * (1.0 + w.abs()),
                "dk {dk}: output {i}: {g} vs {w}"
            );
        }
        for (i, (&g, &w)) in s_whole.iter().zip(&st).enumerate() {
            assert!(
                (g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()),
                "dk {dk}: state {i}: {g} vs {w}"
            );
        }
    }
}

/// Reads `count` floats of `buf` back without running anything.
fn run_and_read_no_run(ctx: &GpuContext, buf: &wgpu::Buffer, count: usize) -> Vec<f32> {
    run_and_read(ctx, &Graph::new(), buf, count)
}

/// The grouped RMSNorm at a hyper-connection site's width (one pass of a lane's eight
/// elements, kept in registers across the reduction) and past it (groups walked twice),
/// against f64: with the previous block's output injected first (the streams after the
/// injection and the normalised values), and without, under each weight mode ((1 + w), w,
/// none).
#[test]
fn the_rms_norm_matches_f64_in_one_pass_and_in_two() {
    let Some(ctx) = ctx() else { return };
    let wg = Op::RmsNorm.wg() as usize;
    let modes = [(1usize, 0usize), (0, 0), (0, 1), (0, 2)];
    for (group, (inject, wmode)) in [2560usize, 8 * wg + 300]
        .into_iter()
        .flat_map(|g| modes.map(|m| (g, m)))
    {
        let (h, rows) = (2usize, 2usize);
        let groups = rows * h;
        let eps = 1e-6f32;
        let mut r = rng(group as u64);
        let x: Vec<f32> = (0..groups * group).map(|_| r()).collect();
        let w: Vec<f32> = (0..group).map(|_| 0.3 * r()).collect();
        let blk: Vec<f32> = (0..rows * group).map(|_| r()).collect();
        let inj: Vec<f32> = (0..groups).map(|_| 1.0 + r()).collect();
        let frame = graph::frame_buffer(ctx);
        let xb = graph::upload_f32(ctx, "x", &x);
        let wb = graph::upload_f32(ctx, "w", &w);
        let y = graph::storage(ctx, "y", groups * group);
        let bb = graph::upload_f32(ctx, "blk", &blk);
        let ib = graph::upload_f32(ctx, "inj", &inj);
        let mut g = Graph::new();
        let p = [
            groups,
            group,
            group,
            eps.to_bits() as usize,
            inject,
            h,
            wmode,
        ]
        .map(|v| v as u32);
        g.op(
            ctx,
            Op::RmsNorm,
            &p,
            &frame,
            &[&xb, &wb, &y, &bb, &ib],
            (groups as u32, 1),
        )
        .unwrap();
        let got = run_and_read(ctx, &g, &y, groups * group);
        let streams = run_and_read_no_run(ctx, &xb, groups * group);
        for gi in 0..groups {
            let v: Vec<f64> = (0..group)
                .map(|i| {
                    let add = inj[gi] as f64 * blk[(gi / h) * group + i] as f64;
                    x[gi * group + i] as f64 + if inject == 1 { add } else { 0.0 }
                })
                .collect();
            let ms = v.iter().map(|a| a * a).sum::<f64>() / group as f64;
            let rr = 1.0 / (ms + eps as f64).sqrt();
            for i in 0..group {
                let at = gi * group + i;
                assert!(
                    (streams[at] as f64 - v[i]).abs() <= 1e-6 * (1.0 + v[i].abs()),
                    "group {group} inject {inject}: stream {gi} element {i}: {} vs {}",
                    streams[at],
                    v[i]
                );
                let f = [1.0 + w[i] as f64, w[i] as f64, 1.0][wmode];
                let want = v[i] * rr * f;
                assert!(
                    (got[at] as f64 - want).abs() <= 2e-5 * (1.0 + want.abs()),
                    "group {group} mode {wmode} inject {inject}: row {gi} element {i}: {} vs {want}",
                    got[at]
                );
            }
        }
    }
}
