//! q4tp: 4-bit codes `n` (value `n - 8`) in groups of 32, each group scaled by
//! `exp2q(lo + code * step)` with a 5-bit `code` and per-row f16 `(lo, step)` ("no zero rung").

use crate::kernel::{RowKernel, fold, group_dot, zeroed};
use crate::tiered::{Tier, row_params, scale_code, scale_table};
use crate::{GROUP, Layout};

fn level(n: u8) -> f32 {
    n as f32 - 8.0
}

fn encode(v: f32) -> u8 {
    (v.round().clamp(-8.0, 7.0) + 8.0) as u8
}

pub(crate) const TIER: Tier = Tier {
    qmax: 7.0,
    zero_rung: false,
    level,
    encode,
    bits: 4,
};

/// Decodes row `r` into `out` (`cols` values).
pub(crate) fn dequantize_row(l: &Layout, bytes: &[u8], r: usize, out: &mut [f32]) {
    let (lo, step) = row_params(l, bytes, r);
    let table = scale_table(&TIER, lo, step);
    let plane = &bytes[r * l.cols / 2..][..l.cols / 2];
    let codes = &bytes[l.third + r * l.code_stride..][..l.code_stride];
    for (g, out) in out.chunks_exact_mut(GROUP).enumerate() {
        let s = table[scale_code(codes, g)];
        for (k, &b) in plane[g * 16..][..16].iter().enumerate() {
            out[2 * k] = level(b & 15) * s;
            out[2 * k + 1] = level(b >> 4) * s;
        }
    }
}

/// The matvec kernel over one q4tp matrix.
pub(crate) struct Kernel<'a> {
    pub l: Layout,
    pub bytes: &'a [u8],
}

impl RowKernel for Kernel<'_> {
    #[inline(always)]
    fn row_dot<const NT: usize>(&self, r: usize, xs: &[f32], out: &mut [f32; NT]) {
        let l = &self.l;
        let (lo, step) = row_params(l, self.bytes, r);
        let table = scale_table(&TIER, lo, step);
        let plane = &self.bytes[r * l.cols / 2..][..l.cols / 2];
        let codes = &self.bytes[l.third + r * l.code_stride..][..l.code_stride];
        let mut acc = zeroed::<NT>();
        for g in 0..l.cols / GROUP {
            let s = table[scale_code(codes, g)];
            let b: &[u8; 16] = plane[g * 16..][..16].try_into().expect("16 bytes");
            let mut w = [0.0f32; 32];
            // Lane order: low nibbles (even elements) then high nibbles (odd elements);
            // the activations were permuted to match (`kernel::Permute::Pairs`).
            for k in 0..16 {
                w[k] = ((b[k] & 15) as i32 - 8) as f32 * s;
                w[16 + k] = ((b[k] >> 4) as i32 - 8) as f32 * s;
            }
            group_dot(&mut acc, &w, xs, l.cols, g);
        }
        for (o, a) in out.iter_mut().zip(&acc) {
            *o = fold(a);
        }
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn rows_avx512<const NT: usize>(&self, r0: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
        // SAFETY: the caller guarantees AVX-512 (the trait's contract).
        unsafe { crate::simd512::q4tp_rows::<NT>(&self.l, self.bytes, r0, xs, outs) }
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn rows_avx2<const NT: usize>(&self, r0: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
        // SAFETY: the caller guarantees AVX2 (the trait's contract).
        unsafe { crate::simd256::q4tp_rows::<NT>(&self.l, self.bytes, r0, xs, outs) }
    }
}
