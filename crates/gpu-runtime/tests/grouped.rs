//! The grouped expert kernels: a token's routed experts computed in a frame of several token
//! rows give, bit for bit, what the same token gives alone (a decode step and the same token
//! in a speculative verify frame must agree exactly), on every int8 codec, through the gate/up
//! + SiLU kernel and the down kernel.

mod common;

use common::{ctx, rng, run_grouped as run};
use gpu_runtime::ops::experts::ExpertBank;
use gpu_runtime::{Epilogue, Path};
use quant_codecs::{DType, MatRef};

#[test]
fn a_token_alone_and_in_a_frame_give_the_same_bits() {
    let Some(ctx) = ctx() else { return };
    let (experts, k) = (12, 10);
    for dtype in [DType::Q8_2f, DType::Q4tp, DType::Q2tp, DType::Mxfp4] {
        for (rows, cols, epilogue) in [
            (2 * 128, 1024, Epilogue::SiluGateUp),
            (256, 128, Epilogue::None),
        ] {
            let payloads = common::expert_payloads(dtype, rows, cols, experts, 40);
            let bank = common::bank_of(ctx, dtype, rows, cols, &payloads);
            let mut r = rng(7);
            // A frame of 8 token rows (80 slots), and its row 3 alone (10 slots).
            let xs: Vec<f32> = (0..8 * cols).map(|_| r()).collect();
            let ids: Vec<u32> = (0..8 * k)
                .map(|i| ((i * 7 + i / k) % experts) as u32)
                .collect();
            let frame = run(ctx, &bank, &xs, &ids, k, epilogue, Path::Int8);
            let alone = run(
                ctx,
                &bank,
                &xs[3 * cols..4 * cols],
                &ids[3 * k..4 * k],
                k,
                epilogue,
                Path::Int8,
            );
            let out = frame.len() / (8 * k);
            let want = &frame[3 * k * out..4 * k * out];
            let same = want
                .iter()
                .zip(&alone)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{dtype} {epilogue:?}: the token alone differs from its frame row"
            );
            assert!(
                alone.iter().all(|v| v.is_finite()),
                "{dtype}: finite outputs"
            );
        }
    }
}

/// `experts` random experts of `dtype`, quantised.
fn payloads(dtype: DType, rows: usize, cols: usize, experts: usize) -> Vec<Vec<u8>> {
    common::expert_payloads(dtype, rows, cols, experts, 90)
}

/// A bank split into segments (a global bank larger than one binding, forced small here)
/// reads the same bytes as the bank of one buffer: the same bits out, on both paths, through
/// the fixed set of bindings and (where the adapter has them) the binding array; slots
/// written one by one land where `slot_at` says.
#[test]
fn a_segmented_bank_gives_the_bits_of_one_buffer() {
    let Some(ctx) = ctx() else { return };
    let (experts, k) = (11, 4);
    let cases = [
        (DType::F16, Path::F32),
        (DType::BF16, Path::F32),
        (DType::Q8_2f, Path::F32),
        (DType::Q4tp, Path::F32),
        (DType::Q4tp, Path::Int8),
        (DType::Q2tp, Path::Int8),
        (DType::Mxfp4, Path::F32),
        (DType::Mxfp4, Path::Int8),
    ];
    for (dtype, path) in cases {
        for (rows, cols, epilogue) in [
            (2 * 64, 256, Epilogue::SiluGateUp),
            (96, 128, Epilogue::None),
        ] {
            let payloads = payloads(dtype, rows, cols, experts);
            let mats: Vec<MatRef<'_>> = payloads
                .iter()
                .map(|p| MatRef::new(dtype, rows, cols, p).unwrap())
                .collect();
            let one = ExpertBank::upload(ctx, &mats).unwrap();
            assert_eq!(one.segments.len(), 1);
            // 11 experts in segments of 3 (4 segments), written in reverse slot order.
            let mut seg = ExpertBank::empty(ctx, dtype, rows, cols, experts, Some(3)).unwrap();
            assert_eq!((seg.segments.len(), seg.segment_slots), (4, 3));
            let mut ring = gpu_runtime::staging::StagingRing::new(ctx);
            for (e, m) in mats.iter().enumerate().rev() {
                seg.write(ctx, &mut ring, e, m).unwrap();
            }
            ring.flush(ctx).unwrap();
            let mut r = rng(11);
            let xs: Vec<f32> = (0..3 * cols).map(|_| r()).collect();
            let ids: Vec<u32> = (0..3 * k).map(|i| ((i * 5 + 2) % experts) as u32).collect();
            let want = run(ctx, &one, &xs, &ids, k, epilogue, path);
            let mut bindings = vec![true];
            if ctx.caps.binding_arrays {
                bindings.push(false);
            }
            for fixed in bindings {
                seg.fixed = fixed;
                let kind = seg.binding(ctx);
                let got = run(ctx, &seg, &xs, &ids, k, epilogue, path);
                assert_eq!(got.len(), want.len());
                let diff = want
                    .iter()
                    .zip(&got)
                    .position(|(a, b)| a.to_bits() != b.to_bits());
                assert!(
                    diff.is_none(),
                    "{dtype} {path:?} {epilogue:?} {kind:?}: output {diff:?} differs from the one-buffer bank"
                );
                assert!(want.iter().any(|v| *v != 0.0), "{dtype}: nonzero outputs");
            }
        }
    }
}

/// A bank one slot past [`ExpertBank::capacity`] is refused before anything is allocated, and
/// the capacity is whole segments of as many slots as one binding holds (witness: the
/// adapter's limits, read here).
#[test]
fn a_bank_past_its_capacity_is_refused() {
    let Some(ctx) = ctx() else { return };
    for (dtype, rows, cols) in [(DType::Mxfp4, 8192, 4096), (DType::F32, 1024, 1024)] {
        let cap = ExpertBank::capacity(ctx, dtype, rows, cols);
        let slot = (quant_codecs::Layout::new(dtype, rows, cols).unwrap().nbytes as u64)
            .next_multiple_of(16);
        let per = (ctx.max_binding() / slot) as usize;
        assert!(
            cap >= per && cap.is_multiple_of(per),
            "{dtype:?}: {cap} of {per}"
        );
        assert!(cap / per <= gpu_runtime::ops::experts::MAX_SEGMENTS);
        let e = ExpertBank::empty(ctx, dtype, rows, cols, cap + 1, None).unwrap_err();
        assert!(
            matches!(e, gpu_runtime::GpuError::BindingTooLarge { .. }),
            "{dtype:?}: {e}"
        );
    }
}

/// A layer's down projection right after its gate/up in one graph reuses the gate/up's
/// expert-sorted slots (one sort fewer) and gives, bit for bit, what it gives prepared alone
/// with its own sort.
#[test]
fn the_down_projection_reuses_the_gate_ups_sorted_slots() {
    use gpu_runtime::ops::graph::{Graph, storage, upload_f32};
    let Some(ctx) = ctx() else { return };
    let (dtype, experts, k, nt) = (DType::Q4tp, 9, 8, 20);
    let slots = nt * k;
    assert!(slots >= gpu_runtime::ops::experts_tiled::MIN_SLOTS);
    let (inner, d) = (64, 128);
    let bank = |rows, cols, seed| {
        let p = common::expert_payloads(dtype, rows, cols, experts, seed);
        common::bank_of(ctx, dtype, rows, cols, &p)
    };
    let (gate_up, down) = (bank(2 * inner, d, 300), bank(d, inner, 400));
    let mut r = rng(11);
    let xs: Vec<f32> = (0..nt * d).map(|_| r()).collect();
    let ids: Vec<u32> = (0..slots)
        .map(|s| ((s * 5 + s / 7) % experts) as u32)
        .collect();
    let x = upload_f32(ctx, "x", &xs);
    let idb = upload_f32(ctx, "ids", bytemuck::cast_slice(&ids));
    let mid = storage(ctx, "mid", slots * inner);
    let out = storage(ctx, "out", slots * d);
    let run = |g: &Graph| {
        let mut enc = ctx
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        g.record(ctx, &mut enc, None);
        ctx.queue.submit([enc.finish()]);
        gpu_runtime::readback::read_f32(ctx, &out, 0, slots * d).unwrap()
    };
    let (path, gu) = (Path::Int8, Epilogue::SiluGateUp);
    let down_of = |g: &mut Graph| {
        let e = Epilogue::None;
        g.grouped(ctx, &down, &mid, slots, &idb, &out, slots, 1, path, e)
            .unwrap();
    };
    let mut both = Graph::new();
    both.grouped(ctx, &gate_up, &x, nt, &idb, &mid, slots, k, path, gu)
        .unwrap();
    let after_gate_up = both.dispatches();
    down_of(&mut both);
    let shared = run(&both);
    let mut alone = Graph::new();
    down_of(&mut alone);
    // The down projection alone: its quantiser, the sort and the kernel.
    assert_eq!(alone.dispatches(), 3);
    assert_eq!(both.dispatches() - after_gate_up, 2, "the sort ran again");
    let own = run(&alone);
    let same = shared
        .iter()
        .zip(&own)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same && shared.iter().all(|v| v.is_finite()));
}
