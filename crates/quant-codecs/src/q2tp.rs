//! q2tp: 2-bit codes `c` (value `c - 1.5`) in groups of 32, each group scaled by a 5-bit code:
//! 0 is the zero rung (the group is zero), `k >= 1` is `exp2q(lo + (k - 1) * step)`.

use crate::kernel::{RowKernel, fold, group_dot, zeroed};
use crate::tiered::{Tier, row_params, scale_code, scale_table};
use crate::{GROUP, Layout};

fn level(c: u8) -> f32 {
    c as f32 - 1.5
}

fn encode(v: f32) -> u8 {
    (v + 2.0).floor().clamp(0.0, 3.0) as u8
}

pub(crate) const TIER: Tier = Tier {
    qmax: 1.5,
    zero_rung: true,
    level,
    encode,
    bits: 2,
};

/// Decodes row `r` into `out` (`cols` values).
pub(crate) fn dequantize_row(l: &Layout, bytes: &[u8], r: usize, out: &mut [f32]) {
    let (lo, step) = row_params(l, bytes, r);
    let table = scale_table(&TIER, lo, step);
    let plane = &bytes[r * l.cols / 4..][..l.cols / 4];
    let codes = &bytes[l.third + r * l.code_stride..][..l.code_stride];
    for (g, out) in out.chunks_exact_mut(GROUP).enumerate() {
        let s = table[scale_code(codes, g)];
        for (k, &b) in plane[g * 8..][..8].iter().enumerate() {
            for j in 0..4 {
                out[4 * k + j] = level((b >> (2 * j)) & 3) * s;
            }
        }
    }
}

/// The matvec kernel over one q2tp matrix.
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
        let plane = &self.bytes[r * l.cols / 4..][..l.cols / 4];
        let codes = &self.bytes[l.third + r * l.code_stride..][..l.code_stride];
        let mut acc = zeroed::<NT>();
        for g in 0..l.cols / GROUP {
            let s = table[scale_code(codes, g)];
            let b = &plane[g * 8..][..8];
            let mut w = [0.0f32; 32];
            // Lane order: lanes 8q..8q+7 take bit pair q of bytes 0..7 (elements 4k + q);
            // the activations were permuted to match (`kernel::Permute::Quads`).
            for q in 0..4 {
                for k in 0..8 {
                    w[8 * q + k] = (((b[k] >> (2 * q)) & 3) as f32 - 1.5) * s;
                }
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
        unsafe { crate::simd512::q2tp_rows::<NT>(&self.l, self.bytes, r0, xs, outs) }
    }

    #[cfg(target_arch = "x86_64")]
    unsafe fn rows_avx2<const NT: usize>(&self, r0: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
        // SAFETY: the caller guarantees AVX2 (the trait's contract).
        unsafe { crate::simd256::q2tp_rows::<NT>(&self.l, self.bytes, r0, xs, outs) }
    }
}
