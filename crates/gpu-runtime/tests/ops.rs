//! Op kernels whose work is split across workgroups or lanes in ways the model fixtures (small
//! vocabularies, few experts) do not reach, against host references: greedy argmax over a
//! release-size vocabulary (two passes, ties across chunks) and MoE routing at the release
//! expert count (rank-based top-k against a stable sort in f64).

mod common;

use common::{ctx, rng};
use gpu_runtime::GpuContext;
use gpu_runtime::ops::graph::{self, Graph};
use kernels_wgsl::Op;

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
fn routing_at_the_release_expert_count_matches_a_stable_sort() {
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
    let frame = graph::frame_buffer(ctx);
    let l = graph::upload_f32(ctx, "router logits", &logits);
    let pr = graph::storage(ctx, "pr", rows * e);
    let rw = graph::storage(ctx, "rw", rows * e);
    let ids = graph::storage(ctx, "ids", rows * k);
    let sw = graph::storage(ctx, "sw", rows * k);
    for norm in [0u32, 1] {
        let mut g = Graph::new();
        let p = [e as u32, k as u32, norm];
        g.op(
            ctx,
            Op::Route,
            &p,
            &frame,
            &[&l, &pr, &rw, &ids, &sw],
            (rows as u32, 1),
        )
        .unwrap();
        let got_ids: Vec<u32> = run_and_read(ctx, &g, &ids, rows * k)
            .iter()
            .map(|v| v.to_bits())
            .collect();
        let got_w = run_and_read(ctx, &g, &sw, rows * k);
        let dense = run_and_read(ctx, &g, &rw, rows * e);
        for t in 0..rows {
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
