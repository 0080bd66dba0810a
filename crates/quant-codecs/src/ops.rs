//! CPU math the model crates share: batched projections through [`MatRef::matmat_path`] on the
//! process's activation path, the scalar activations (`sigmoid`, `silu`, torch's `softplus`) and
//! top-k selection. Everything else is f32, computed the way the PyTorch references compute it.
//!
//! The activation path is a process-wide setting, like the thread pool: a front end chooses it
//! once ([`set_act_choice`]; cortiq's `--act`), and it is [`ActChoice::F32`] unless set, so
//! library users and the parity tests get the exact path.

use std::sync::atomic::{AtomicU8, Ordering};

use crate::{ActPath, DType, MAX_BATCH, MatRef};

static ACT_CHOICE: AtomicU8 = AtomicU8::new(0);

/// Which activation path the projections take, per matrix dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ActChoice {
    /// Exact f32 activations everywhere (the reference; the library's default).
    #[default]
    F32,
    /// int8 activations for every quantised matrix.
    Int8,
    /// int8 where it is faster: q4tp, q2tp and mxfp4, whose f32 kernels decode each weight to
    /// f32 and are compute-bound; f32 for q8_2f, whose f32 kernel already reads near the
    /// bandwidth ceiling and whose int8 calls cost more than they save at decode sizes
    /// (docs/perf.md, the model-level CPU benches). On a CPU without hand-written integer
    /// kernels (ARM, x86 before AVX2) f32 for every format: there the int8 path is the
    /// portable reference, about 10x slower per weight than the f32 kernels.
    Auto,
}

/// Sets the activation path every later [`linear`] takes (float matrices always take f32).
pub fn set_act_choice(choice: ActChoice) {
    ACT_CHOICE.store(choice as u8, Ordering::Relaxed);
}

/// The current setting.
pub fn act_choice() -> ActChoice {
    match ACT_CHOICE.load(Ordering::Relaxed) {
        0 => ActChoice::F32,
        1 => ActChoice::Int8,
        _ => ActChoice::Auto,
    }
}

/// Whether this CPU runs hand-written int8 kernels (AVX-512 VNNI or AVX2, within
/// `CORTIQ_ISA`); elsewhere (ARM, x86 before AVX2) the int8 path is the portable reference,
/// exact but about 10x slower per weight than the f32 kernels (docs/perf.md), so
/// [`ActChoice::Auto`] takes f32 there.
pub fn fast_int8() -> bool {
    crate::int8::has_fast_kernels(crate::Isa::detect())
}

/// The path [`linear`] takes for a matrix of `dtype`.
pub fn act_path(dtype: DType) -> ActPath {
    match act_choice() {
        ActChoice::F32 => ActPath::F32,
        // No integer kernel to take (float dtypes, mxfp8): say so rather than ask for one.
        _ if !dtype.has_int8_kernel() => ActPath::F32,
        ActChoice::Int8 => ActPath::Int8,
        ActChoice::Auto if dtype == DType::Q8_2f => ActPath::F32,
        ActChoice::Auto if !fast_int8() => ActPath::F32,
        ActChoice::Auto => ActPath::Int8,
    }
}

/// `y = x W^T` for `t` rows: `x` is `[t, cols]`, the result `[t, rows]`. Rows go through
/// [`MatRef::matmat_path`] on [`act_path`] of its dtype, in chunks of up to [`MAX_BATCH`].
///
/// # Panics
/// If `x.len() != t * w.cols()` (a caller's shape bug: the model crates check every matrix's
/// shape when they bind the weights).
pub fn linear(w: &MatRef<'_>, x: &[f32], t: usize) -> Vec<f32> {
    let (rows, cols) = (w.rows(), w.cols());
    debug_assert_eq!(x.len(), t * cols);
    let mut y = vec![0f32; t * rows];
    let path = act_path(w.dtype());
    for (xs, ys) in x
        .chunks(MAX_BATCH * cols)
        .zip(y.chunks_mut(MAX_BATCH * rows))
    {
        w.matmat_path(path, xs, ys)
            .expect("shapes checked at bind time");
    }
    y
}

/// `1 / (1 + e^-x)`.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `x * sigmoid(x)`.
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// torch's softplus (beta 1, threshold 20): `x` above 20, else `ln(1 + e^x)`.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// Indices of the `k` largest values of `v`, largest first (all of them when `k >= v.len()`).
/// Equal values keep the lower index first, and zeros of either sign are equal: `relu`-clipped
/// scores make exact zeros common, and `total_cmp` alone would rank `-0.0` below `+0.0`. Apart
/// from that, values are ordered by [`f32::total_cmp`] (a NaN ranks by its sign bit).
pub fn top_k(v: &[f32], k: usize) -> Vec<usize> {
    let key = |x: f32| if x == 0.0 { 0.0 } else { x };
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| key(v[b]).total_cmp(&key(v[a])).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, quantize};

    /// `x W^T` in f64 over the dequantised matrix, with `sum |x_c w_c|` per output (the scale
    /// of f32 summation error).
    fn reference(w: &MatRef<'_>, x: &[f32], t: usize) -> Vec<(f64, f64)> {
        let (rows, cols) = (w.rows(), w.cols());
        let mut wd = vec![0f32; rows * cols];
        w.dequantize(&mut wd).unwrap();
        let mut y = Vec::with_capacity(t * rows);
        for r in 0..t {
            for o in 0..rows {
                let terms = (0..cols).map(|c| x[r * cols + c] as f64 * wd[o * cols + c] as f64);
                y.push((terms.clone().sum(), terms.map(f64::abs).sum()));
            }
        }
        y
    }

    #[test]
    fn linear_matches_an_f64_reference_across_batch_chunks() {
        let (rows, cols) = (5, 64);
        let wf: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
            .collect();
        for dtype in DType::ALL {
            let bytes = quantize(dtype, rows, cols, &wf).unwrap();
            let w = MatRef::new(dtype, rows, cols, &bytes).unwrap();
            // 0 rows, fewer than one chunk, exactly one, and more than two chunks.
            for t in [0, 3, MAX_BATCH, 2 * MAX_BATCH + 3] {
                let x: Vec<f32> = (0..t * cols)
                    .map(|i| ((i * 13 % 29) as f32 - 14.0) / 8.0)
                    .collect();
                let y = linear(&w, &x, t);
                let want = reference(&w, &x, t);
                assert_eq!(y.len(), t * rows);
                for (r, (a, (b, mag))) in y.iter().zip(&want).enumerate() {
                    assert!(
                        (*a as f64 - b).abs() <= 1e-5 * mag + 1e-30,
                        "{dtype:?} t={t} [{r}]: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn activations_match_f64_formulas() {
        for i in -400..=400 {
            let x = i as f32 / 10.0;
            let xd = x as f64;
            let sig = 1.0 / (1.0 + (-xd).exp());
            assert!(
                (sigmoid(x) as f64 - sig).abs() <= 1e-6 * sig.max(1e-30) + 1e-7,
                "{x}"
            );
            assert!(
                (silu(x) as f64 - xd * sig).abs() <= 1e-5 * (xd * sig).abs() + 1e-7,
                "{x}"
            );
            let sp = if xd > 20.0 { xd } else { xd.exp().ln_1p() };
            assert!((softplus(x) as f64 - sp).abs() <= 1e-6 * sp + 1e-7, "{x}");
        }
        // torch's threshold: the identity above 20, ln(1 + e^x) up to and including it.
        assert_eq!(softplus(20.5), 20.5);
        assert_eq!(softplus(20.0), 20f32.exp().ln_1p());
        assert_eq!(sigmoid(0.0), 0.5);
        assert_eq!(silu(0.0), 0.0);
    }

    #[test]
    fn top_k_orders_largest_first_with_lower_index_on_ties() {
        assert_eq!(top_k(&[0.1, 0.5, 0.3, -1.0, 0.3, 0.9], 3), vec![5, 1, 2]);
        assert_eq!(top_k(&[0.1, 0.5, 0.3, -1.0, 0.3, 0.9], 4), vec![5, 1, 2, 4]);
        assert_eq!(top_k(&[2.0; 5], 2), vec![0, 1]);
        // Fewer values than k: all of them; k = 0: none.
        assert_eq!(top_k(&[0.2, 0.7], 3), vec![1, 0]);
        assert!(top_k(&[0.2, 0.7], 0).is_empty());
        assert!(top_k(&[], 2).is_empty());
        // Infinities rank at the ends.
        assert_eq!(
            top_k(&[1.0, f32::NEG_INFINITY, f32::INFINITY, -3.0], 4),
            vec![2, 0, 3, 1]
        );
    }

    #[test]
    fn top_k_treats_signed_zeros_as_equal() {
        // All-zero scores (every relu clipped): the first k entries.
        assert_eq!(top_k(&[0.0; 6], 3), vec![0, 1, 2]);
        // -0.0 ties with +0.0: index 0 wins over index 1 although its sign bit is set.
        assert_eq!(top_k(&[-0.0, 0.0, 0.0, 1.0], 2), vec![3, 0]);
        assert_eq!(top_k(&[0.0, -0.0, -0.0, 0.0], 4), vec![0, 1, 2, 3]);
        // Negative values stay below both zeros.
        assert_eq!(top_k(&[-1e-30, -0.0, 0.0], 3), vec![1, 2, 0]);
    }

    #[test]
    fn top_k_agrees_with_a_brute_force_witness() {
        // The witness: repeatedly take the first index of the maximum among those left, with
        // `>` comparisons (which already treat -0.0 == +0.0).
        let mut seed = 0x2545_f491u32;
        for trial in 0..200 {
            let n = trial % 17;
            let v: Vec<f32> = (0..n)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 17;
                    seed ^= seed << 5;
                    // Few distinct values, both zeros among them, so ties are common.
                    [-0.0, 0.0, 1.0, -1.0, 0.5][(seed % 5) as usize]
                })
                .collect();
            let k = (seed as usize / 7) % (n + 2);
            let mut left: Vec<usize> = (0..n).collect();
            let mut want = Vec::new();
            while want.len() < k && !left.is_empty() {
                let mut best = 0;
                for j in 1..left.len() {
                    if v[left[j]] > v[left[best]] {
                        best = j;
                    }
                }
                want.push(left.remove(best));
            }
            assert_eq!(top_k(&v, k), want, "{v:?} k={k}");
        }
    }
}
