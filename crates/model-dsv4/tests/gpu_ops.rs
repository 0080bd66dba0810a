//! DeepSeek's device ops (kernels-wgsl's `mhc_pre`, `mhc_post`, `ds_route`, `swiglu_clamp`,
//! `moe_sum`, and `rms_norm`'s plain and unweighted modes), each against this crate's CPU
//! block on a fixture's real weights: the mHC site before and after a block and the head's
//! collapse, and the whole MoE block (router, hash and scored routing, the routed experts
//! through the grouped kernels with the clamped SwiGLU, the shared expert). The first pieces
//! of the deepseek_v4 GPU forward; on lavapipe in CI (`CORTIQ_REQUIRE_GPU=1` makes a missing
//! adapter a failure).

mod common;

use std::sync::{Arc, OnceLock};

use cmf_format::Cmf;
use common::convert_fixture;
use gpu_runtime::ops::graph::{self, Graph};
use gpu_runtime::{Epilogue, GpuContext, GpuOptions};
use kernels_wgsl::Op;
use model_core::device::{Device, Enc};
use model_dsv4::hc::{self, HcDims};
use model_dsv4::moe::{self, Router};
use model_dsv4::weights::Routing;
use model_dsv4::{DeepseekV4Config, Weights};
use test_support::Profile;

fn ctx() -> Option<Arc<GpuContext>> {
    static CTX: OnceLock<Option<Arc<GpuContext>>> = OnceLock::new();
    let c = CTX
        .get_or_init(|| {
            let opts = GpuOptions {
                pipeline_cache_dir: None,
                ..GpuOptions::default()
            };
            GpuContext::new(&opts)
                .map_err(|e| eprintln!("no GPU adapter: {e}"))
                .ok()
                .map(Arc::new)
        })
        .clone();
    if c.is_none() && std::env::var_os("CORTIQ_REQUIRE_GPU").is_some() {
        panic!("CORTIQ_REQUIRE_GPU is set and there is no adapter");
    }
    c
}

fn rng(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Records `g`, then reads each of `bufs` (`(buffer, floats)`) back.
fn run(ctx: &GpuContext, g: &Graph, bufs: &[(&wgpu::Buffer, usize)]) -> Vec<Vec<f32>> {
    let mut enc = ctx
        .device
        .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
    g.record(ctx, &mut enc, None);
    let reads: Vec<wgpu::Buffer> = bufs
        .iter()
        .map(|(b, n)| {
            let r = ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("read"),
                size: (*n * 4) as u64,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            enc.copy_buffer_to_buffer(b, 0, &r, 0, (*n * 4) as u64);
            r
        })
        .collect();
    ctx.queue.submit([enc.finish()]);
    reads
        .iter()
        .zip(bufs)
        .map(|(r, (_, n))| gpu_runtime::readback::read_mapped(ctx, r, *n).unwrap())
        .collect()
}

/// A frame encoder over no scratch (the tests bind their own buffers).
fn enc<'a>(g: &'a mut Graph, dev: &'a Device, frame: &'a wgpu::Buffer, nt: usize) -> Enc<'a, ()> {
    Enc {
        g,
        dev,
        s: &(),
        frame,
        nt,
        traced: false,
    }
}

/// `|got - want| <= tol * max|want|` everywhere.
fn close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * scale,
            "{what}[{i}]: {g} vs {w} (scale {scale})"
        );
    }
}

fn with_model(f: impl FnOnce(&DeepseekV4Config, &Weights<'_>)) {
    let dir = tempfile::tempdir().unwrap();
    let path = convert_fixture("deepseek_v4_a", dir.path(), Profile::F32);
    let cmf = Cmf::open(&path).unwrap();
    let (c, w) = Weights::bind(&cmf).unwrap();
    f(&c, &w);
}

/// f32 summation-order noise through a norm, 20 Sinkhorn rounds and a few sums.
const TOL: f32 = 1e-5;

#[test]
fn mhc_sites_and_the_head_match_the_cpu() {
    let Some(ctx) = ctx() else { return };
    with_model(|c, w| {
        let (n, d, t) = (c.hc_mult, c.hidden_size, 5usize);
        let eps = c.rms_norm_eps as f32;
        let dims = HcDims {
            n,
            d,
            norm_eps: eps,
            hc_eps: c.hc_eps as f32,
            iters: c.hc_sinkhorn_iters,
        };
        let dev = Device::new(ctx.clone(), 1);
        let mut r = rng(3);
        let x0: Vec<f32> = (0..t * n * d).map(|_| 2.0 * r()).collect();
        let y0: Vec<f32> = (0..t * d).map(|_| r()).collect();
        let m = (2 + n) * n;
        let frame = graph::frame_buffer(&ctx);
        let buf = |l: &str, len: usize| graph::storage(&ctx, l, len);
        let (xn, mix, maps, u) = (
            buf("xn", t * n * d),
            buf("mix", t * m),
            buf("maps", t * m),
            buf("u", t * d),
        );
        for (il, lw) in w.layers.iter().enumerate() {
            let site = &lw.attn_hc;
            let x = graph::upload_f32(&ctx, "x", &x0);
            let y = graph::upload_f32(&ctx, "y", &y0);
            let fn_ = dev.mat(&site.fn_).unwrap();
            let base = dev.vec("base", &site.base);
            let norm = dev.vec("norm", &lw.input_layernorm);
            let mut g = Graph::new();
            let mut e = enc(&mut g, &dev, &frame, t);
            e.rms_norm_unweighted(&x, &xn, t, n * d, eps).unwrap();
            e.matvec(&fn_, &xn, &mix, t, Epilogue::None).unwrap();
            let s = &site.scale;
            let p = [
                t as u32,
                n as u32,
                d as u32,
                0,
                dims.iters as u32,
                dims.hc_eps.to_bits(),
                eps.to_bits(),
                s[0].to_bits(),
                s[1].to_bits(),
                s[2].to_bits(),
            ];
            e.op(
                Op::MhcPre,
                &p,
                &[&mix, &base, &maps, &x, &norm, &u],
                (t as u32, 1),
            )
            .unwrap();
            let got = run(&ctx, &g, &[(&u, t * d)]).remove(0);
            let mix_cpu = hc::pre(site, &x0, t, &dims);
            let mut want = mix_cpu.input.clone();
            model_dsv4::ops::rms_norm(&mut want, &lw.input_layernorm, eps);
            close(&format!("layer {il} block input"), &got, &want, TOL);

            let mut g = Graph::new();
            let mut e = enc(&mut g, &dev, &frame, t);
            let p = [(t * d) as u32, n as u32, d as u32];
            e.op_lanes(Op::MhcPost, &p, &[&x, &y, &maps], t * d)
                .unwrap();
            let got = run(&ctx, &g, &[(&x, t * n * d)]).remove(0);
            let mut want = x0.clone();
            hc::post(&mut want, &y0, &mix_cpu.post, &mix_cpu.comb, t, &dims);
            close(&format!("layer {il} streams after"), &got, &want, TOL);
        }

        // The head: its collapse and the final norm.
        let hw = &w.hc_head;
        let x = graph::upload_f32(&ctx, "x", &x0);
        let fn_ = dev.mat(&hw.fn_).unwrap();
        let base = dev.vec("base", &hw.base);
        let norm = dev.vec("norm", &w.norm);
        let mut g = Graph::new();
        let mut e = enc(&mut g, &dev, &frame, t);
        e.rms_norm_unweighted(&x, &xn, t, n * d, eps).unwrap();
        e.matvec(&fn_, &xn, &mix, t, Epilogue::None).unwrap();
        let p = [
            t as u32,
            n as u32,
            d as u32,
            1,
            0,
            dims.hc_eps.to_bits(),
            eps.to_bits(),
            hw.scale.to_bits(),
        ];
        e.op(
            Op::MhcPre,
            &p,
            &[&mix, &base, &maps, &x, &norm, &u],
            (t as u32, 1),
        )
        .unwrap();
        let got = run(&ctx, &g, &[(&u, t * d)]).remove(0);
        let mut want = hc::head(hw, &x0, t, &dims);
        model_dsv4::ops::rms_norm(&mut want, &w.norm, eps);
        close("head", &got, &want, TOL);
    });
}

#[test]
fn moe_blocks_match_the_cpu_with_hash_and_scored_routing() {
    let Some(ctx) = ctx() else { return };
    with_model(|c, w| {
        let (d, e_n, k, i) = (
            c.hidden_size,
            c.n_routed_experts,
            c.num_experts_per_tok,
            c.moe_intermediate_size,
        );
        let t = 6usize;
        let rt = Router::of(c);
        let dev = Device::new(ctx.clone(), 2);
        let frame = graph::frame_buffer(&ctx);
        let buf = |l: &str, len: usize| graph::storage(&ctx, l, len);
        let mut r = rng(5);
        let u0: Vec<f32> = (0..t * d).map(|_| 40.0 * r()).collect();
        let tokens: Vec<u32> = (0..t as u32)
            .map(|j| (j * 7 + 3) % c.vocab_size as u32)
            .collect();
        let (logits, ids, wts) = (buf("logits", t * e_n), buf("ids", t * k), buf("wts", t * k));
        let (mid2, mid, eo) = (
            buf("mid2", t * k * 2 * i),
            buf("mid", t * k * i),
            buf("eo", t * k * d),
        );
        let (sg, su, sm, so, y) = (
            buf("sg", t * i),
            buf("su", t * i),
            buf("sm", t * i),
            buf("so", t * d),
            buf("y", t * d),
        );
        let (mut hashed, mut scored) = (0, 0);
        for (il, lw) in w.layers.iter().enumerate() {
            let mw = &lw.moe;
            let (hash, table, bias) = match &mw.routing {
                Routing::Hash(tab) => {
                    hashed += 1;
                    (1u32, dev.words("tid2eid", tab), dev.vec("bias", &[0.0]))
                }
                Routing::Scored(b) => {
                    scored += 1;
                    (0u32, dev.words("tid2eid", &[0]), dev.vec("bias", b))
                }
            };
            let u = graph::upload_f32(&ctx, "u", &u0);
            let tok = dev.words("tokens", &tokens);
            let router = dev.mat(&mw.gate).unwrap();
            let gu: Vec<_> = mw.routed.experts.iter().map(|x| &x.gate_up).collect();
            let dn: Vec<_> = mw.routed.experts.iter().map(|x| &x.down).collect();
            let (gu, dn) = (dev.bank(&gu).unwrap(), dev.bank(&dn).unwrap());
            let (shg, shu, shd) = (
                dev.mat(&mw.sh_gate).unwrap(),
                dev.mat(&mw.sh_up).unwrap(),
                dev.mat(&mw.sh_down).unwrap(),
            );
            let mut g = Graph::new();
            let mut e = enc(&mut g, &dev, &frame, t);
            e.matvec(&router, &u, &logits, t, Epilogue::None).unwrap();
            let scoring = match c.scoring_func {
                model_dsv4::ScoringFunc::Softmax => 0u32,
                model_dsv4::ScoringFunc::Sigmoid => 1,
                model_dsv4::ScoringFunc::SqrtSoftplus => 2,
            };
            let p = [
                e_n as u32,
                k as u32,
                scoring,
                hash,
                rt.temp.to_bits(),
                rt.scale.to_bits(),
            ];
            let bufs = [&logits, &bias, &table, &tok, &ids, &wts];
            e.op(Op::DsRoute, &p, &bufs, (t as u32, 1)).unwrap();
            let slots = t * k;
            let lim = rt.swiglu_limit.to_bits();
            e.grouped(&gu, &u, t, &ids, &mid2, slots, k, Epilogue::None)
                .unwrap();
            let p = [
                (slots * i) as u32,
                i as u32,
                (2 * i) as u32,
                (2 * i) as u32,
                i as u32,
                lim,
                1,
            ];
            e.op_lanes(Op::SwigluClamp, &p, &[&mid2, &sg, &mid], slots * i)
                .unwrap();
            e.grouped(&dn, &mid, slots, &ids, &eo, slots, 1, Epilogue::None)
                .unwrap();
            e.matvec(&shg, &u, &sg, t, Epilogue::None).unwrap();
            e.matvec(&shu, &u, &su, t, Epilogue::None).unwrap();
            let p = [(t * i) as u32, i as u32, i as u32, i as u32, 0, lim, 0];
            e.op_lanes(Op::SwigluClamp, &p, &[&sg, &su, &sm], t * i)
                .unwrap();
            e.matvec(&shd, &sm, &so, t, Epilogue::None).unwrap();
            let p = [(t * d) as u32, k as u32, d as u32];
            e.op_lanes(Op::MoeSum, &p, &[&eo, &wts, &so, &y], t * d)
                .unwrap();
            let out = run(&ctx, &g, &[(&ids, t * k), (&wts, t * k), (&y, t * d)]);

            // The routing: the same experts with the same weights per row.
            let routes = moe::route(mw, &rt, &u0, &tokens, t);
            for row in 0..t {
                let mut want: Vec<(usize, f32)> = (0..e_n)
                    .flat_map(|x| {
                        routes
                            .rows(x)
                            .iter()
                            .filter(|(rr, _)| *rr == row)
                            .map(move |&(_, wt)| (x, wt))
                    })
                    .collect();
                let mut got: Vec<(usize, f32)> = (0..k)
                    .map(|s| (out[0][row * k + s].to_bits() as usize, out[1][row * k + s]))
                    .collect();
                want.sort_by_key(|p| p.0);
                got.sort_by_key(|p| p.0);
                let ge: Vec<usize> = got.iter().map(|p| p.0).collect();
                let we: Vec<usize> = want.iter().map(|p| p.0).collect();
                assert_eq!(ge, we, "layer {il} row {row}: experts");
                for ((_, a), (_, b)) in got.iter().zip(&want) {
                    assert!(
                        (a - b).abs() <= 1e-5 * b.abs().max(1e-3),
                        "layer {il} row {row}: {a} vs {b}"
                    );
                }
            }
            let want = moe::forward_cpu(mw, &rt, &u0, &tokens, t);
            close(&format!("layer {il} moe out"), &out[2], &want, TOL);
        }
        assert!(
            hashed > 0 && scored > 0,
            "the fixture has both kinds of MoE layer"
        );
    });
}

/// V4.1's fake quantisers on the device (`ds_qat`) against the CPU's (`v41::qat`, whose own
/// tests hold them to the f64 grids): rows of every magnitude, with exact midpoints of the
/// E2M1 and E4M3 grids (ties to even) and values past the clamp, equal value for value.
/// Exact where the adapter divides as IEEE does (lavapipe); the E4M3-scaled mode divides by
/// a scale that is not a power of two.
#[test]
fn v41_fake_quantisers_match_the_cpu() {
    use model_dsv4::v41::qat::{self, Fp4Scale};
    let Some(ctx) = ctx() else { return };
    let dev = Device::new(ctx.clone(), 1);
    let (rows, width) = (8usize, 64usize);
    let mut r = rng(11);
    let mut x: Vec<f32> = (0..rows * width)
        .map(|i| r() * 10f32.powi((i / width) as i32 - 4))
        .collect();
    // Row 7: amax 6 (scale 1 for the power-of-two FP4 scale): the E2M1 midpoints exactly.
    let mids = [
        0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 6.0, 0.0, -0.0,
    ];
    x[7 * width..7 * width + mids.len()].copy_from_slice(&mids);
    let frame = graph::frame_buffer(&ctx);
    let cases: [(u32, usize, f32, f32); 3] = [
        (0, 32, 1e-4, 1.0 / 448.0),
        (1, 32, 6.0 * 2f32.powi(-126), 1.0 / 6.0),
        (2, 16, 6.0 * 2f32.powi(-9), 1.0 / 6.0),
    ];
    for (mode, block, floor, inv) in cases {
        let buf = graph::upload_f32(&ctx, "qat", &x);
        let dummy = graph::storage(&ctx, "dummy", 1);
        let mut g = Graph::new();
        let mut e = enc(&mut g, &dev, &frame, rows);
        let p = [
            rows as u32,
            width as u32,
            block as u32,
            mode,
            0,
            1,
            1,
            0,
            floor.to_bits(),
            inv.to_bits(),
        ];
        e.op(Op::DsQat, &p, &[&dummy, &buf], (rows as u32, 1))
            .unwrap();
        let got = &run(&ctx, &g, &[(&buf, rows * width)])[0];
        let mut want = x.clone();
        for row in want.chunks_exact_mut(width) {
            match mode {
                0 => qat::fp8_ue8m0(row, block),
                1 => qat::fp4(row, block, Fp4Scale::Ue8m0),
                _ => qat::fp4(row, block, Fp4Scale::E4m3),
            }
        }
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g == w, "mode {mode} [{i}]: {g} vs {w} (from {})", x[i]);
        }
        assert!(
            got.iter().zip(&x).any(|(g, x)| g != x),
            "mode {mode}: nothing was rounded"
        );
    }
}
