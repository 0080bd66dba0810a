//! Per-layer n-gram embedding (`Qwen4ExpTextNGramEmbedding` + `Qwen4ExpTextPLELayer`).
//!
//! Hashing, exactly as the reference: head `h` of PLE module `p` has a vocabulary equal to the
//! `(p*n_heads + h + 1)`-th prime above `ngram_vocab_size_base - 1`; multipliers
//! `m_j = 2 (splitmix64(seed + 10007 p + GAMMA (j+1)) mod half) + 1` with
//! `half = ((2^63-1) / vocab_size) / 2`. The context of position `s` is the token `s - j`
//! unless that lies before the start of the current EOS-delimited segment (a segment ends WITH its
//! EOS) or before the sequence, in which case it is `eos_token_id`; the history starts with
//! `ngram_size - 1` EOS tokens. Order `n` mixes `XOR_{j<n} ctx_j m_j`, and head `h` of that order
//! reads row `mixed mod vocab_h + offset_h`.
//!
//! Layer math per token: `K = norm_key(key_proj e)`, `V = value_proj e`,
//! `Q = norm_query(X)`; `a_k = <K_k, Q_k>/sqrt(D)`, `a_k = sign(a_k) sqrt(max(|a_k|, 1e-6))`;
//! `G_k = sigmoid(a_k) V`; `C = silu(dilated_causal_conv(norm_conv(G)))` (dilation `ngram_size`);
//! the streams get `X += G + C`.

use std::sync::Arc;

use crate::config::Qwen4ExpTextConfig;
use crate::device::{Device, Enc, Part};
use crate::ops::rms_norm_1p;
use crate::weights::PleWeights;
use gpu_runtime::{Epilogue, GpuError, GpuMatrix};
use kernels_wgsl::Op;
use quant_codecs::ops::{linear, sigmoid, silu};

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
const M1: u64 = 0xBF58_476D_1CE4_E5B9;
const M2: u64 = 0x94D0_49BB_1331_11EB;
const PRIME_1: u64 = 10007;

/// splitmix64 (the reference's `_splitmix64`).
pub fn splitmix64(v: u64) -> u64 {
    let v = v.wrapping_add(GAMMA);
    let v = (v ^ (v >> 30)).wrapping_mul(M1);
    let v = (v ^ (v >> 27)).wrapping_mul(M2);
    v ^ (v >> 31)
}

fn is_prime(v: u64) -> bool {
    if v < 2 {
        return false;
    }
    if v.is_multiple_of(2) {
        return v == 2;
    }
    let mut d = 3;
    while d * d <= v {
        if v.is_multiple_of(d) {
            return false;
        }
        d += 2;
    }
    true
}

/// The hash constants of one PLE module.
#[derive(Debug, Clone)]
pub struct PleHash {
    /// Prime vocabulary of each head.
    pub vocab_sizes: Vec<u64>,
    /// Row offset of each head (prefix sums).
    pub offsets: Vec<u64>,
    /// Table rows after padding to `make_ngram_vocab_size_divisible_by`.
    pub padded_rows: usize,
    /// One multiplier per look-back position `0..ngram_size`.
    pub multipliers: Vec<u64>,
}

impl PleHash {
    /// The constants of PLE module `ple_index` (position in the sorted `ple_layer_ids`).
    pub fn new(c: &Qwen4ExpTextConfig, ple_index: usize) -> PleHash {
        let nh = c.ngram_heads();
        // Heads take consecutive primes: _find_nth_prime_after(base - 1, global + 1).
        let mut prime = c.ngram_vocab_size_base.saturating_sub(1);
        let mut skip = ple_index * nh;
        let mut next = || {
            prime += 1;
            while !is_prime(prime) {
                prime += 1;
            }
            prime
        };
        while skip > 0 {
            next();
            skip -= 1;
        }
        let vocab_sizes: Vec<u64> = (0..nh).map(|_| next()).collect();
        let mut offsets = Vec::with_capacity(nh);
        let mut total = 0u64;
        for &v in &vocab_sizes {
            offsets.push(total);
            total += v;
        }
        let div = c.make_ngram_vocab_size_divisible_by as u64;
        let padded_rows = total.div_ceil(div) * div;
        let max_long = (1u64 << 63) - 1;
        let multiplier_max = max_long / (c.vocab_size as u64).max(1);
        let half = (multiplier_max / 2).max(1);
        let base_seed = c.seed.wrapping_add(PRIME_1.wrapping_mul(ple_index as u64));
        let multipliers = (0..c.ngram_size as u64)
            .map(|j| 2 * (splitmix64(base_seed.wrapping_add(GAMMA.wrapping_mul(j + 1))) % half) + 1)
            .collect();
        PleHash {
            vocab_sizes,
            offsets,
            padded_rows: padded_rows as usize,
            multipliers,
        }
    }
}

/// Table rows `[t, n_heads]` of the tokens `history[history.len()-t..]`; `history` holds the
/// `ngram_size - 1` context tokens before them (EOS at the start of a sequence).
pub fn ngram_rows(
    hash: &PleHash,
    history: &[i64],
    t: usize,
    ngram_size: usize,
    heads_per_ngram: usize,
    eos: i64,
) -> Vec<u64> {
    let n = history.len();
    let mut rows = Vec::with_capacity(t * hash.vocab_sizes.len());
    let mut prev_eos: i64 = -1; // last EOS strictly before `s`
    let mut ctx = vec![0i64; ngram_size];
    for s in 0..n {
        if s >= n - t {
            let pos_in_seg = s as i64 - (prev_eos + 1);
            for (j, c) in ctx.iter_mut().enumerate() {
                let valid = pos_in_seg >= j as i64 && s >= j;
                *c = if valid { history[s - j] } else { eos };
            }
            for order in 2..=ngram_size {
                let mut mixed = ctx[0].wrapping_mul(hash.multipliers[0] as i64);
                for (cj, mj) in ctx.iter().zip(&hash.multipliers).take(order).skip(1) {
                    mixed ^= cj.wrapping_mul(*mj as i64);
                }
                let start = (order - 2) * heads_per_ngram;
                for h in start..start + heads_per_ngram {
                    let v = hash.vocab_sizes[h] as i64;
                    rows.push(mixed.rem_euclid(v) as u64 + hash.offsets[h]);
                }
            }
        }
        if history[s] == eos {
            prev_eos = s as i64;
        }
    }
    rows
}

/// Runs PLE on streams `x` `[t, H*D]` in place (`X += G + C`), for tokens whose n-gram table rows
/// are `rows` `[t, n_heads]`. `conv_hist` holds the last `(K-1)*dilation` normalised gated values
/// `[len, H*D]` before these tokens (zeros at the start) and is updated.
#[allow(clippy::too_many_arguments)]
pub fn forward_cpu(
    w: &PleWeights<'_>,
    c: &Qwen4ExpTextConfig,
    x: &mut [f32],
    rows: &[u64],
    t: usize,
    conv_hist: &mut Vec<f32>,
) {
    let (h, d) = (c.hc_count, c.hidden_size);
    let hd = h * d;
    let eps = c.rms_norm_eps as f32;
    let e = gather(w, c, rows, t);
    let mut key = linear(&w.key, &e, t);
    rms_norm_1p(&mut key, &w.norm_key, d, eps);
    let value = linear(&w.value, &e, t);
    let mut q = x.to_vec();
    rms_norm_1p(&mut q, &w.norm_query, d, eps);
    let mut g = vec![0f32; t * hd];
    for r in 0..t {
        for k in 0..h {
            let base = r * hd + k * d;
            let dot: f32 =
                (0..d).map(|j| key[base + j] * q[base + j]).sum::<f32>() / (d as f32).sqrt();
            let a = dot.abs().max(1e-6).sqrt() * sign(dot);
            let s = sigmoid(a);
            for j in 0..d {
                g[base + j] = s * value[r * d + j];
            }
        }
    }
    let mut gn = g.clone();
    rms_norm_1p(&mut gn, &w.norm_conv, d, eps);
    // Dilated causal depthwise conv over [history | gn].
    let kk = c.ple_conv_kernel_size;
    let dil = c.ngram_size;
    let hist_len = (kk - 1) * dil;
    if conv_hist.len() != hist_len * hd {
        *conv_hist = vec![0f32; hist_len * hd];
    }
    let mut full = conv_hist.clone();
    full.extend_from_slice(&gn);
    for r in 0..t {
        for ch in 0..hd {
            let mut acc = 0f32;
            for j in 0..kk {
                acc += w.conv[ch * kk + j] * full[(r + j * dil) * hd + ch];
            }
            x[r * hd + ch] += g[r * hd + ch] + silu(acc);
        }
    }
    let n = full.len() / hd;
    *conv_hist = full[(n - hist_len) * hd..].to_vec();
}

fn sign(v: f32) -> f32 {
    if v > 0.0 {
        1.0
    } else if v < 0.0 {
        -1.0
    } else {
        0.0
    }
}

/// One PLE layer's weights on the device (the n-gram table stays on the host: its rows are
/// gathered there and only they go up).
pub struct PleGpu {
    key: Arc<GpuMatrix>,
    value: Arc<GpuMatrix>,
    norm_key: (wgpu::Buffer, usize),
    norm_query: (wgpu::Buffer, usize),
    norm_conv: (wgpu::Buffer, usize),
    conv: wgpu::Buffer,
}

impl PleGpu {
    /// Uploads the layer's weights.
    pub fn upload(dev: &Device, w: &PleWeights<'_>) -> Result<PleGpu, GpuError> {
        let v = |x: &model_core::bind::Vector| (dev.vec(x.name(), x), x.len());
        Ok(PleGpu {
            key: dev.mat(&w.key)?,
            value: dev.mat(&w.value)?,
            norm_key: v(&w.norm_key),
            norm_query: v(&w.norm_query),
            norm_conv: v(&w.norm_conv),
            conv: dev.vec(w.conv.name(), &w.conv),
        })
    }
}

/// The gathered n-gram rows `[t, ple_embed_dim]` of `t` tokens whose table rows are `rows`
/// (host side: the table is memory-mapped).
pub fn gather(w: &PleWeights<'_>, c: &Qwen4ExpTextConfig, rows: &[u64], t: usize) -> Vec<f32> {
    let nh = c.ngram_heads();
    let pdim = c.ple_embed_dim();
    let head_dim = pdim / nh;
    let mut e = vec![0f32; t * pdim];
    for (i, &r) in rows.iter().enumerate() {
        let r = r as usize;
        w.shards[r / w.shard_rows]
            .dequantize_row(r % w.shard_rows, &mut e[i * head_dim..(i + 1) * head_dim])
            .expect("row within shard");
    }
    e
}

/// Encodes PLE on the streams `x` `[nt, H*D]` in place, from the gathered rows `e_in`
/// `[nt, ple_embed_dim]`: the gate over every row, the conv per sequence (`parts`: their
/// conv histories on the device, their rows in order).
#[allow(clippy::too_many_arguments)]
pub fn encode<'a>(
    e: &mut Enc<'a>,
    w: &PleGpu,
    c: &Qwen4ExpTextConfig,
    x: &wgpu::Buffer,
    e_in: &wgpu::Buffer,
    parts: &[Part<'a, wgpu::Buffer>],
    nt: usize,
) -> Result<(), GpuError> {
    let (h, d) = (c.hc_count, c.hidden_size);
    let eps = c.rms_norm_eps as f32;
    let s = e.s;
    let [key, keyn, val, qn, g, gn, ..] = &s.w;
    e.matvec(&w.key, e_in, key, nt, Epilogue::None)?;
    let key_groups = nt * w.key.rows / d;
    e.rms_norm(key, &w.norm_key, keyn, key_groups, d, eps)?;
    e.matvec(&w.value, e_in, val, nt, Epilogue::None)?;
    e.rms_norm(x, &w.norm_query, qn, nt * h, d, eps)?;
    e.op(
        Op::PleGate,
        &[h as u32, d as u32],
        &[keyn, qn, val, g],
        (h as u32, nt as u32),
    )?;
    e.rms_norm(g, &w.norm_conv, gn, nt * h, d, eps)?;
    for part in parts {
        let p = [
            part.rows as u32,
            (h * d) as u32,
            c.ple_conv_kernel_size as u32,
            c.ngram_size as u32,
        ];
        let hist = part.state;
        e.with_frame(part.frame, |e| {
            e.op_lanes(Op::PleConv, &p, &[gn, &w.conv, hist, x, g], h * d)
        })?;
    }
    Ok(())
}
