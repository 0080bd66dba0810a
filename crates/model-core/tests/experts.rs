//! The routed-expert executor against f64 math on the dequantised weights: every token row's
//! output is `sum_e w_e * down_e(act(gate_e . u, up_e . u))`, computed here one row and one
//! expert at a time, with no batching and no shared code.

use model_core::Mat;
use model_core::experts::{Activation, Expert, RoutedExperts, Routes, dense_swiglu};
use proptest::prelude::*;
use quant_codecs::{DType, MatRef};

fn silu64(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn matvec64(w: &[f32], rows: usize, cols: usize, x: &[f64]) -> Vec<f64> {
    (0..rows)
        .map(|r| (0..cols).map(|c| w[r * cols + c] as f64 * x[c]).sum())
        .collect()
}

struct Case {
    d: usize,
    i: usize,
    gate_up: Vec<Vec<f32>>,
    down: Vec<Vec<f32>>,
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `seed`-determined values in [-1, 1).
/// The tests that change the process-wide activation path take turns.
static ACT_CHOICE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn reference(
    c: &Case,
    routes: &[(usize, usize, f32)],
    u: &[f32],
    t: usize,
    limit: Option<f64>,
) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0f64; t * c.d];
    // Per output, the sum of its terms' magnitudes (what f32 rounding scales with).
    let mut mag = vec![0f64; t * c.d];
    for &(x, r, w) in routes {
        let ur: Vec<f64> = u[r * c.d..(r + 1) * c.d]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let gu = matvec64(&c.gate_up[x], 2 * c.i, c.d, &ur);
        let h: Vec<f64> = (0..c.i)
            .map(|k| {
                let (g, p) = (gu[k], gu[c.i + k]);
                match limit {
                    None => silu64(g) * p,
                    Some(l) => silu64(g.min(l)) * p.clamp(-l, l),
                }
            })
            .collect();
        let o = matvec64(&c.down[x], c.d, c.i, &h);
        for k in 0..c.d {
            y[r * c.d + k] += w as f64 * o[k];
            let terms: f64 = (0..c.i)
                .map(|j| (c.down[x][k * c.i + j] as f64 * h[j]).abs())
                .sum();
            mag[r * c.d + k] += (w as f64).abs() * terms;
        }
    }
    (y, mag)
}

fn mat(b: &[u8], rows: usize, cols: usize) -> MatRef<'_> {
    MatRef::new(DType::F32, rows, cols, b).unwrap()
}

fn check(n_experts: usize, t: usize, picks: &[(usize, usize, f32)], limit: Option<f32>, seed: u64) {
    let (d, i) = (24, 16);
    let c = Case {
        d,
        i,
        gate_up: (0..n_experts)
            .map(|x| values(2 * i * d, seed + x as u64))
            .collect(),
        down: (0..n_experts)
            .map(|x| values(d * i, seed + 100 + x as u64))
            .collect(),
    };
    let gu_bytes: Vec<Vec<u8>> = c.gate_up.iter().map(|m| bytes(m)).collect();
    let dn_bytes: Vec<Vec<u8>> = c.down.iter().map(|m| bytes(m)).collect();
    let experts = (0..n_experts)
        .map(|x| Expert {
            gate_up: Mat::new(
                format!("experts.{x}.gate_up_proj.weight"),
                2 * x,
                MatRef::new(DType::F32, 2 * i, d, &gu_bytes[x]).unwrap(),
            ),
            down: Mat::new(
                format!("experts.{x}.down_proj.weight"),
                2 * x + 1,
                MatRef::new(DType::F32, d, i, &dn_bytes[x]).unwrap(),
            ),
        })
        .collect();
    let moe = RoutedExperts {
        experts,
        hidden: d,
        intermediate: i,
        activation: Activation::SwiGlu { limit },
    };
    let mut routes = Routes::new(n_experts);
    for &(x, r, w) in picks {
        routes.push(x, r, w);
    }
    let u = values(t * d, seed + 7);
    let got = moe.forward_cpu(&routes, &u, t);
    let (want, mag) = reference(&c, picks, &u, t, limit.map(f64::from));
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        // Relative to the terms' magnitudes, not the sum: a sum that cancels (seen: two picks
        // of one expert summing to 0.26 from larger terms) keeps the terms' absolute rounding.
        assert!(
            (*g as f64 - w).abs() <= 1e-5 * (1.0 + w.abs().max(mag[k])),
            "row {} col {}: {g} vs {w}",
            k / d,
            k % d
        );
    }
    // Rows no expert serves stay zero.
    for r in 0..t {
        if !picks.iter().any(|p| p.1 == r) {
            assert!(got[r * d..(r + 1) * d].iter().all(|&v| v == 0.0));
        }
    }
}

#[test]
fn routed_rows_match_f64_per_row_math() {
    // Row 0 -> experts 1 and 3, row 1 -> 3, row 2 -> none, row 3 -> 0 and 1, row 4 -> 1.
    let picks = [
        (1, 0, 0.6),
        (3, 0, 0.4),
        (3, 1, 1.0),
        (0, 3, 0.3),
        (1, 3, 0.7),
        (1, 4, 2.5),
    ];
    check(4, 5, &picks, None, 1);
}

#[test]
fn the_clamp_is_deepseeks() {
    let picks = [(0, 0, 1.0), (1, 0, 0.5), (1, 1, 1.5)];
    // A limit small enough to clamp most gate/up values.
    check(2, 2, &picks, Some(0.25), 2);
}

#[test]
fn unclamped_swiglu_is_silu_times_up() {
    let a = Activation::SwiGlu { limit: None };
    let got = a.apply(&[-2.0, 0.0, 3.0], &[1.5, 4.0, -0.5]);
    for ((g, u), v) in [(-2.0f64, 1.5f64), (0.0, 4.0), (3.0, -0.5)]
        .iter()
        .zip(&got)
    {
        assert!((silu64(*g) * u - *v as f64).abs() < 1e-6);
    }
}

#[test]
fn dense_swiglu_matches_f64() {
    let (d, i, t) = (16, 8, 3);
    let (g, p, dn) = (values(i * d, 1), values(i * d, 2), values(d * i, 3));
    let (gb, pb, db) = (bytes(&g), bytes(&p), bytes(&dn));
    let u = values(t * d, 4);
    let got = dense_swiglu(
        &Mat::new("g", 0, mat(&gb, i, d)),
        &Mat::new("u", 1, mat(&pb, i, d)),
        &Mat::new("d", 2, mat(&db, d, i)),
        Activation::SwiGlu { limit: None },
        &u,
        t,
    );
    for r in 0..t {
        let ur: Vec<f64> = u[r * d..(r + 1) * d].iter().map(|&v| v as f64).collect();
        let (gg, pp) = (matvec64(&g, i, d, &ur), matvec64(&p, i, d, &ur));
        let h: Vec<f64> = gg.iter().zip(&pp).map(|(a, b)| silu64(*a) * b).collect();
        let o = matvec64(&dn, d, i, &h);
        for k in 0..d {
            assert!((got[r * d + k] as f64 - o[k]).abs() < 1e-5 * (1.0 + o[k].abs()));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    /// Any routing (any experts, repeated rows, any weights) matches the per-row witness.
    #[test]
    fn any_routing_matches(picks in prop::collection::vec((0usize..5, 0usize..6, -2.0f32..2.0), 0..20), seed in 0u64..1000) {
        check(5, 6, &picks, None, seed);
    }
}

/// Several experts scheduled together ([`RoutedExperts::experts_rows`]: one parallel region,
/// on rayon and on a spinning thread team) equal each expert alone
/// ([`RoutedExperts::expert_rows`]) bit for bit, on the int8 and f32 activation paths, with
/// quantised experts and row counts past one batch. (`forward_cpu`, tested against f64
/// above, runs on the former.)
#[test]
fn experts_scheduled_together_equal_each_alone() {
    use quant_codecs::ops::{ActChoice, set_act_choice};
    let _act = ACT_CHOICE.lock().unwrap_or_else(|p| p.into_inner());
    let (d, i) = (320, 96);
    for dtype in [DType::Q4tp, DType::Q2tp, DType::F16] {
        let gu: Vec<Vec<u8>> = (0..4)
            .map(|x| quant_codecs::quantize(dtype, 2 * i, d, &values(2 * i * d, x)).unwrap())
            .collect();
        let dn: Vec<Vec<u8>> = (0..4)
            .map(|x| quant_codecs::quantize(dtype, d, i, &values(d * i, 50 + x)).unwrap())
            .collect();
        let experts = (0..4)
            .map(|x| Expert {
                gate_up: Mat::new(
                    format!("e{x}.gate_up"),
                    2 * x,
                    MatRef::new(dtype, 2 * i, d, &gu[x]).unwrap(),
                ),
                down: Mat::new(
                    format!("e{x}.down"),
                    2 * x + 1,
                    MatRef::new(dtype, d, i, &dn[x]).unwrap(),
                ),
            })
            .collect();
        let moe = RoutedExperts {
            experts,
            hidden: d,
            intermediate: i,
            activation: Activation::SwiGlu { limit: Some(7.0) },
        };
        let inputs: Vec<(usize, Vec<f32>)> = [(2, 1), (0, 3), (3, 11), (1, 8)]
            .iter()
            .map(|&(x, n)| (x, values(n * d, 900 + x as u64)))
            .collect();
        for act in [ActChoice::Int8, ActChoice::F32] {
            set_act_choice(act);
            let jobs: Vec<(usize, &[f32])> =
                inputs.iter().map(|(x, v)| (*x, v.as_slice())).collect();
            let team = quant_codecs::team::Team::new(2, std::time::Duration::from_millis(1));
            let got = moe.experts_rows(&jobs);
            let on_team = moe.experts_rows_on(&team, &jobs);
            for (((x, v), g), t) in inputs.iter().zip(&got).zip(&on_team) {
                assert!(
                    g.iter().zip(t).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{dtype} {act:?} expert {x}: team"
                );
                let want = moe.expert_rows(*x, v, v.len() / d);
                assert_eq!(g.len(), want.len());
                assert!(
                    g.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{dtype} {act:?} expert {x}"
                );
            }
        }
        set_act_choice(ActChoice::F32);
    }
}

/// A model whose gate/up and down got different codecs (q4tp beside q8_2f, as the converter
/// does for a width q4tp does not divide) under `--act auto` runs each matrix on its own path
/// (int8 for q4tp, f32 for q8_2f) when the experts are scheduled together, as each expert
/// alone does: the same bits.
#[test]
fn experts_with_mixed_codecs_keep_each_matrix_path() {
    use quant_codecs::ops::{ActChoice, set_act_choice};
    let _act = ACT_CHOICE.lock().unwrap_or_else(|p| p.into_inner());
    let (d, i) = (320, 96);
    let gu: Vec<Vec<u8>> = (0..3)
        .map(|x| quant_codecs::quantize(DType::Q4tp, 2 * i, d, &values(2 * i * d, x)).unwrap())
        .collect();
    let dn: Vec<Vec<u8>> = (0..3)
        .map(|x| quant_codecs::quantize(DType::Q8_2f, d, i, &values(d * i, 70 + x)).unwrap())
        .collect();
    let experts = (0..3)
        .map(|x| Expert {
            gate_up: Mat::new(
                format!("e{x}.gate_up"),
                2 * x,
                MatRef::new(DType::Q4tp, 2 * i, d, &gu[x]).unwrap(),
            ),
            down: Mat::new(
                format!("e{x}.down"),
                2 * x + 1,
                MatRef::new(DType::Q8_2f, d, i, &dn[x]).unwrap(),
            ),
        })
        .collect();
    let moe = RoutedExperts {
        experts,
        hidden: d,
        intermediate: i,
        activation: Activation::SwiGlu { limit: None },
    };
    let inputs: Vec<(usize, Vec<f32>)> = [(1, 1), (0, 2), (2, 9)]
        .iter()
        .map(|&(x, n)| (x, values(n * d, 300 + x as u64)))
        .collect();
    set_act_choice(ActChoice::Auto);
    let jobs: Vec<(usize, &[f32])> = inputs.iter().map(|(x, v)| (*x, v.as_slice())).collect();
    let team = quant_codecs::team::Team::new(2, std::time::Duration::from_millis(1));
    let got = moe.experts_rows(&jobs);
    let on_team = moe.experts_rows_on(&team, &jobs);
    for (((x, v), g), t) in inputs.iter().zip(&got).zip(&on_team) {
        let want = moe.expert_rows(*x, v, v.len() / d);
        for (what, y) in [("rayon", g), ("team", t)] {
            assert!(
                y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "expert {x} on {what}"
            );
        }
    }
    set_act_choice(ActChoice::F32);
}

/// The case a CI run's proptest found against the earlier bound (relative to the sum alone).
#[test]
fn two_picks_of_one_expert_on_one_row() {
    check(5, 6, &[(2, 3, 1.8001595), (2, 3, 0.90202546)], None, 838);
}
