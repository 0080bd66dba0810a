//! The machinery q4tp and q2tp share: per-row `(lo, step)` f16 parameters, 5-bit per-group
//! scale codes on a log2 grid, the `exp2q` function that turns a code into a scale, and the
//! error-minimising scale search.
//!
//! A row's 32 possible group scales form a geometric ladder `exp2q(lo + k * step)`. The
//! quantiser fits the ladder to the row (from its smallest to its largest group magnitude, at
//! most [`LADDER_OCTAVES`] octaves), rounds `lo` down and `step` up in f16 so the top rung still
//! covers the largest group, then picks per group the rung with the least squared error.

use crate::float::{f16_bits_to_f32, f32_to_f16_bits};
use crate::{GROUP, Layout};

/// The widest range, in octaves, a row's ladder spans; groups smaller than that share the
/// bottom rung (their absolute error stays below the bottom rung's half step).
pub const LADDER_OCTAVES: f32 = 12.0;

/// Bit patterns of the f32 coefficients of `exp2q`'s polynomial, constant term first.
pub const EXP2Q_COEFFS: [u32; 7] = [
    0x3f80_0000,
    0x3f31_7213,
    0x3e75_feef,
    0x3d63_4140,
    0x3c1e_98cd,
    0x3aa3_06d3,
    0x3963_5e05,
];

/// 2^t as every cortiq decoder computes it (docs/codecs.md, "exp2q"): `t` clamped to
/// [-126, 127] (NaN becomes -126), split as `i + f` with `i = floor(t)`, `2^f` by a degree-6
/// polynomial in Horner form with separately rounded f32 operations, times the exact `2^i`.
/// Within 1.6 ulp of the true value; fixed so that every decoder agrees bit for bit.
#[inline(always)]
pub fn exp2q(t: f32) -> f32 {
    // Straight-line code (no branch) so a table of 32 vectorises.
    #[allow(clippy::manual_clamp)] // clamp() keeps NaN; maxNum/minNum turn it into -126
    let t = t.max(-126.0).min(127.0);
    let i = t.floor();
    let f = t - i;
    let c = EXP2Q_COEFFS.map(f32::from_bits);
    let mut p = c[6];
    p = p * f + c[5];
    p = p * f + c[4];
    p = p * f + c[3];
    p = p * f + c[2];
    p = p * f + c[1];
    p = p * f + c[0];
    // SAFETY: `i` is a whole number in [-126, 127] (clamped above; NaN became -126), so
    // the unchecked conversion is exact: the checked `as` saturates per lane in scalar code
    // and kept the rows' ladders (32 of these per q4tp/q2tp row) from vectorising.
    let i: i32 = unsafe { i.to_int_unchecked() };
    p * f32::from_bits(((i + 127) as u32) << 23)
}

/// What distinguishes q4tp from q2tp.
#[derive(Clone, Copy)]
pub(crate) struct Tier {
    /// Largest level magnitude the ideal scale maps the group maximum to.
    pub qmax: f32,
    /// Code 0 means "the whole group is zero" and rungs start at code 1.
    pub zero_rung: bool,
    /// Element code -> level.
    pub level: fn(u8) -> f32,
    /// Element value / scale -> code.
    pub encode: fn(f32) -> u8,
    /// Bits per element code.
    pub bits: usize,
}

/// The per-row parameters `(lo, step)` as f32.
#[inline(always)]
pub(crate) fn row_params(layout: &Layout, bytes: &[u8], r: usize) -> (f32, f32) {
    let o = layout.second + 4 * r;
    let lo = u16::from_le_bytes([bytes[o], bytes[o + 1]]);
    let step = u16::from_le_bytes([bytes[o + 2], bytes[o + 3]]);
    (f16_bits_to_f32(lo), f16_bits_to_f32(step))
}

/// The 32 group scales a row's codes can name.
#[inline(always)]
pub(crate) fn scale_table(tier: &Tier, lo: f32, step: f32) -> [f32; 32] {
    let mut t = [0.0f32; 32];
    for (c, s) in t.iter_mut().enumerate() {
        let k = if tier.zero_rung {
            c as f32 - 1.0
        } else {
            c as f32
        };
        *s = exp2q(lo + k * step);
    }
    if tier.zero_rung {
        t[0] = 0.0;
    }
    t
}

/// One row of a q4tp/q2tp matrix, ready for its groups: the scale ladder and the row's code
/// bytes.
pub(crate) struct TieredRow<'a> {
    pub table: [f32; 32],
    pub plane: &'a [u8],
    pub codes: &'a [u8],
}

#[inline(always)]
pub(crate) fn tiered_row<'a>(tier: &Tier, l: &Layout, bytes: &'a [u8], r: usize) -> TieredRow<'a> {
    let (lo, step) = row_params(l, bytes, r);
    let per_row = l.cols * tier.bits / 8;
    TieredRow {
        table: scale_table(tier, lo, step),
        plane: &bytes[r * per_row..][..per_row],
        codes: &bytes[l.third + r * l.code_stride..][..l.code_stride],
    }
}

/// Group `g`'s 5-bit scale code from a row's packed code bytes (bit `5g`, LSB first).
#[inline(always)]
pub(crate) fn scale_code(row_codes: &[u8], g: usize) -> usize {
    let bit = 5 * g;
    let b = bit >> 3;
    let lo = row_codes[b] as u32;
    let hi = row_codes.get(b + 1).copied().unwrap_or(0) as u32;
    (((lo | (hi << 8)) >> (bit & 7)) & 31) as usize
}

fn put_scale_code(row_codes: &mut [u8], g: usize, code: u8) {
    let bit = 5 * g;
    let b = bit >> 3;
    let v = (code as u32 & 31) << (bit & 7);
    row_codes[b] |= v as u8;
    if v > 0xff {
        row_codes[b + 1] |= (v >> 8) as u8;
    }
}

fn f16_next_up(h: u16) -> u16 {
    match h {
        0x8000 | 0 => 1,
        0x7bff.. if h & 0x8000 == 0 => 0x7bff,
        _ if h & 0x8000 == 0 => h + 1,
        _ => h - 1,
    }
}

fn f16_next_down(h: u16) -> u16 {
    match h {
        0 | 0x8000 => 0x8001,
        _ if h & 0x8000 == 0 => h - 1,
        _ => (h + 1).min(0xfbff),
    }
}

/// Quantises one row into its element codes (packed into `plane`, this row's part of the code
/// plane), its 4 parameter bytes and its packed scale codes.
pub(crate) fn quantize_row(
    tier: &Tier,
    w: &[f32],
    plane: &mut [u8],
    params: &mut [u8],
    codes: &mut [u8],
) {
    let gpr = w.len() / GROUP;
    let ideal: Vec<f32> = w
        .chunks_exact(GROUP)
        .map(|g| g.iter().fold(0.0f32, |m, v| m.max(v.abs())) / tier.qmax)
        .collect();
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    for &s in ideal.iter().filter(|&&s| s > 0.0) {
        let l = (s as f64).log2() as f32;
        lo = lo.min(l);
        hi = hi.max(l);
    }
    let rungs = if tier.zero_rung { 31.0 } else { 32.0 };
    let (lo16, step16) = if hi.is_finite() {
        let lo = lo.max(hi - LADDER_OCTAVES);
        let mut lo16 = f32_to_f16_bits(lo);
        if f16_bits_to_f32(lo16) > lo {
            lo16 = f16_next_down(lo16);
        }
        // The step is fitted to the stored (rounded-down) lo, then rounded up.
        let step = (hi - f16_bits_to_f32(lo16)) / (rungs - 1.0);
        let mut step16 = f32_to_f16_bits(step);
        if f16_bits_to_f32(step16) < step {
            step16 = f16_next_up(step16);
        }
        let smax = ideal.iter().fold(0.0f32, |m, &s| m.max(s));
        // Bump step until the top rung covers the largest group despite exp2q's last-ulp error
        // (one or two f16 ulps at most).
        for _ in 0..64 {
            let table = scale_table(tier, f16_bits_to_f32(lo16), f16_bits_to_f32(step16));
            if table[31] >= smax {
                break;
            }
            step16 = f16_next_up(step16);
        }
        (lo16, step16)
    } else {
        (0, 0)
    };
    params[0..2].copy_from_slice(&lo16.to_le_bytes());
    params[2..4].copy_from_slice(&step16.to_le_bytes());
    let table = scale_table(tier, f16_bits_to_f32(lo16), f16_bits_to_f32(step16));
    let first = usize::from(tier.zero_rung);
    let per_byte = 8 / tier.bits;
    for g in 0..gpr {
        let gw = &w[g * GROUP..(g + 1) * GROUP];
        let (code, levels) = if ideal[g] == 0.0 && tier.zero_rung {
            (0, [(tier.encode)(0.0); GROUP])
        } else {
            let up = (first..32).find(|&c| table[c] >= ideal[g]).unwrap_or(31);
            let mut best = (up, encode_group(tier, gw, table[up]));
            let mut best_err = group_sse(tier, gw, &best.1, table[up]);
            let cands = (up.saturating_sub(3).max(first)..=(up + 1).min(31))
                .chain(tier.zero_rung.then_some(0));
            for c in cands.filter(|&c| c != up) {
                let lv = encode_group(tier, gw, table[c]);
                let e = group_sse(tier, gw, &lv, table[c]);
                if e < best_err {
                    best_err = e;
                    best = (c, lv);
                }
            }
            best
        };
        put_scale_code(codes, g, code as u8);
        for (j, &l) in levels.iter().enumerate() {
            let idx = g * GROUP + j;
            plane[idx / per_byte] |= l << (tier.bits * (idx % per_byte));
        }
    }
}

fn encode_group(tier: &Tier, w: &[f32], scale: f32) -> [u8; GROUP] {
    let mut out = [(tier.encode)(0.0); GROUP];
    if scale > 0.0 {
        for (o, &v) in out.iter_mut().zip(w) {
            *o = (tier.encode)(v / scale);
        }
    }
    out
}

fn group_sse(tier: &Tier, w: &[f32], levels: &[u8; GROUP], scale: f32) -> f32 {
    w.iter()
        .zip(levels)
        .map(|(&v, &l)| {
            let e = v - (tier.level)(l) * scale;
            e * e
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp2q_is_within_two_ulp_of_2_to_the_t() {
        let mut t = -126.0f32;
        while t < 127.0 {
            let exact = (t as f64).exp2();
            let got = exp2q(t) as f64;
            let ulp = ((exact as f32).next_up() as f64 - exact as f32 as f64).abs();
            assert!(
                (got - exact).abs() <= 2.0 * ulp,
                "t={t} got {got} exact {exact}"
            );
            t += 0.0137;
        }
        assert_eq!(exp2q(0.0), 1.0);
        assert_eq!(exp2q(3.0), 8.0);
        assert_eq!(exp2q(f32::NAN), exp2q(-126.0));
        assert!(exp2q(1000.0).is_finite());
    }

    #[test]
    fn scale_codes_pack_lsb_first_across_bytes() {
        let mut row = [0u8; 10]; // 16 groups * 5 bits
        for g in 0..16 {
            put_scale_code(&mut row, g, (g * 7 % 32) as u8);
        }
        for g in 0..16 {
            assert_eq!(scale_code(&row, g), g * 7 % 32);
        }
        // Group 1 straddles bytes 0 and 1: bits 5..9.
        let mut row = [0u8; 2];
        put_scale_code(&mut row, 1, 0b10111);
        assert_eq!(row, [0b1110_0000, 0b0000_0010]);
    }

    #[test]
    fn f16_neighbours() {
        assert_eq!(f16_next_up(0x3c00), 0x3c01);
        assert_eq!(f16_next_up(0xbc00), 0xbbff);
        assert_eq!(f16_next_down(0), 0x8001);
        assert_eq!(f16_next_down(0xbc00), 0xbc01);
    }
}
