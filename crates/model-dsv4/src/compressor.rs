//! The KV compressors of CSA and HCA layers and of the lightning indexer
//! (`DeepseekV4HCACompressor`, `DeepseekV4CSACompressor`, the compressor half of
//! `DeepseekV4Indexer`), with their incremental state.
//!
//! Every token contributes `kv = kv_proj h` and `gate = gate_proj h` (`h` = the attention input
//! after `input_layernorm`). Windows are aligned to absolute positions that are multiples of the
//! rate; only complete windows emit an entry, the tail waits in a buffer. Entry `w` is
//! `kv_norm(sum_slots softmax_slots(gate + position_bias) * kv)` (softmax per channel),
//! RoPE'd ("compress" set, trailing channels) at position `rate * w`.
//!
//! Non-overlapping (HCA): the slots are the window's `rate` tokens. Overlapping (CSA and the
//! indexer): `kv`/`gate` are twice the head dim, `[Ca | Cb]`; entry `w` pools the Ca halves of
//! window `w-1` and the Cb halves of window `w` (`2 * rate` slots; window 0 has no Ca slots).
//! The previous window's Ca (its gate with `position_bias` added) is carried in the state.

use crate::ops::{Rope, rms_norm, rope_tail};
use crate::weights::CompressorWeights;
use quant_codecs::ops::linear;

/// The incremental state of one compressor for one sequence.
#[derive(Debug, Clone, Default)]
pub struct CompState {
    /// Projected `kv` rows of the incomplete window `[n < rate, W]`.
    pub buffer_kv: Vec<f32>,
    /// Projected `gate` rows (without `position_bias`) of the incomplete window `[n, W]`.
    pub buffer_gate: Vec<f32>,
    /// Overlapping only: the last complete window's Ca `kv` `[rate, head]` (empty before it).
    pub overlap_kv: Vec<f32>,
    /// Overlapping only: the last complete window's Ca `gate + position_bias` `[rate, head]`.
    pub overlap_gate: Vec<f32>,
    /// Emitted entries, normalised and rotated `[count, head]`.
    pub compressed_kv: Vec<f32>,
}

/// What a compressor needs besides its weights.
#[derive(Debug, Clone, Copy)]
pub struct CompDims {
    /// Tokens per entry.
    pub rate: usize,
    /// Entry width (head dim or index head dim).
    pub head: usize,
    /// Two series `[Ca | Cb]` per token (CSA, indexer) or one (HCA).
    pub overlap: bool,
    /// `rms_norm_eps`.
    pub eps: f32,
}

/// Feeds `t` new attention inputs `h` `[t, D]`; emits the entries of the windows they complete.
pub fn update(
    w: &CompressorWeights<'_>,
    dims: &CompDims,
    rope: &Rope,
    h: &[f32],
    t: usize,
    st: &mut CompState,
) {
    let kv = linear(&w.kv, h, t);
    let gate = linear(&w.gate, h, t);
    st.buffer_kv.extend_from_slice(&kv);
    st.buffer_gate.extend_from_slice(&gate);
    let width = w.kv.rows();
    let (rate, hd) = (dims.rate, dims.head);
    while st.buffer_kv.len() >= rate * width {
        let win_kv: Vec<f32> = st.buffer_kv.drain(..rate * width).collect();
        let mut win_gate: Vec<f32> = st.buffer_gate.drain(..rate * width).collect();
        for (g, a) in win_gate.iter_mut().zip(&w.position_bias) {
            *g += a;
        }
        // Slots as (kv row, gate row) slices of width `hd`.
        let mut slots: Vec<(&[f32], &[f32])> = Vec::with_capacity(2 * rate);
        let (prev_kv, prev_gate) = (
            std::mem::take(&mut st.overlap_kv),
            std::mem::take(&mut st.overlap_gate),
        );
        if dims.overlap {
            for j in 0..prev_kv.len() / hd {
                slots.push((
                    &prev_kv[j * hd..(j + 1) * hd],
                    &prev_gate[j * hd..(j + 1) * hd],
                ));
            }
        }
        let off = if dims.overlap { hd } else { 0 };
        for j in 0..rate {
            let at = j * width + off;
            slots.push((&win_kv[at..at + hd], &win_gate[at..at + hd]));
        }
        let mut entry = pool(&slots, hd);
        if dims.overlap {
            let mut ov_kv = Vec::with_capacity(rate * hd);
            let mut ov_gate = Vec::with_capacity(rate * hd);
            for j in 0..rate {
                ov_kv.extend_from_slice(&win_kv[j * width..j * width + hd]);
                ov_gate.extend_from_slice(&win_gate[j * width..j * width + hd]);
            }
            st.overlap_kv = ov_kv;
            st.overlap_gate = ov_gate;
        }
        rms_norm(&mut entry, &w.norm, dims.eps);
        let count = st.compressed_kv.len() / hd;
        let (cos, sin) = rope.at(count * rate);
        rope_tail(&mut entry, &cos, &sin, false);
        st.compressed_kv.extend_from_slice(&entry);
    }
}

/// The gated pooling of one window: per channel, `sum_slots softmax_slots(gate) * kv` over the
/// `(kv, gate)` slot rows (each `hd` wide).
pub fn pool(slots: &[(&[f32], &[f32])], hd: usize) -> Vec<f32> {
    let mut entry = vec![0f32; hd];
    for (ch, e) in entry.iter_mut().enumerate() {
        let m = slots
            .iter()
            .map(|s| s.1[ch])
            .fold(f32::NEG_INFINITY, f32::max);
        let z: f32 = slots.iter().map(|(_, g)| (g[ch] - m).exp()).sum();
        // `kv * softmax(gate)` summed: each weight normalised first, as the reference does.
        *e = slots
            .iter()
            .map(|(k, g)| (g[ch] - m).exp() / z * k[ch])
            .sum();
    }
    entry
}

/// Entries a query at position `p` may see: those of windows complete at `p`.
pub fn visible(p: usize, rate: usize) -> usize {
    (p + 1) / rate
}

/// A compressor on the device: its kv/gate projections go into rings by position
/// (`ds_store`), and `ds_compress` emits the entries of the windows each frame completes.
pub struct CompGpu {
    kv: std::sync::Arc<gpu_runtime::GpuMatrix>,
    gate: std::sync::Arc<gpu_runtime::GpuMatrix>,
    bias: wgpu::Buffer,
    norm: wgpu::Buffer,
    dims: CompDims,
    width: usize,
}

/// A compressor's cache for one sequence on the device.
pub struct CompDeviceState {
    /// The kv projections of the last positions `[ring, width]` (by position).
    pub kv: wgpu::Buffer,
    /// Their gate projections (without `position_bias`).
    pub gate: wgpu::Buffer,
    /// The entries `[max entries, head]`.
    pub entries: wgpu::Buffer,
}

impl CompGpu {
    /// Uploads `w` for `dims`.
    pub fn new(
        dev: &crate::device::Device,
        w: &CompressorWeights<'_>,
        dims: CompDims,
    ) -> Result<CompGpu, gpu_runtime::GpuError> {
        Ok(CompGpu {
            kv: dev.mat(&w.kv)?,
            gate: dev.mat(&w.gate)?,
            bias: dev.vec("position bias", &w.position_bias),
            norm: dev.vec("compressor norm", &w.norm),
            dims,
            width: w.kv.rows(),
        })
    }

    /// Tokens per entry.
    pub fn rate(&self) -> usize {
        self.dims.rate
    }

    /// An empty cache for contexts of `ctx_len`.
    pub fn state(&self, ctx: &gpu_runtime::GpuContext, ctx_len: usize) -> CompDeviceState {
        let ring = crate::device::comp_ring(self.dims.rate);
        let maxe = crate::device::max_entries(ctx_len, self.dims.rate).max(1);
        let s = |l: &str, n: usize| gpu_runtime::ops::graph::storage(ctx, l, n);
        CompDeviceState {
            kv: s("compressor kv ring", ring * self.width),
            gate: s("compressor gate ring", ring * self.width),
            entries: s("compressed entries", maxe * self.dims.head),
        }
    }

    /// Feeds the frame's attention inputs `e.s.u` (`nt` rows) and emits the entries they
    /// complete into `st.entries`; `cs` is the "compress" RoPE table and its pairs.
    pub fn encode(
        &self,
        e: &mut crate::device::Enc<'_>,
        st: &CompDeviceState,
        (cs, pairs): (&wgpu::Buffer, usize),
        nt: usize,
        ctx_len: usize,
    ) -> Result<(), gpu_runtime::GpuError> {
        use kernels_wgsl::Op;
        let s = e.s;
        let (rate, w) = (self.dims.rate, self.width);
        let ring = crate::device::comp_ring(rate);
        e.matvec(&self.kv, &s.u, &s.ckv, nt, gpu_runtime::Epilogue::None)?;
        e.matvec(&self.gate, &s.u, &s.cgate, nt, gpu_runtime::Epilogue::None)?;
        let p = [(nt * w) as u32, w as u32, ring as u32];
        e.op_lanes(Op::DsStore, &p, &[&s.ckv, &st.kv], nt * w)?;
        e.op_lanes(Op::DsStore, &p, &[&s.cgate, &st.gate], nt * w)?;
        let maxe = crate::device::max_entries(ctx_len, rate).max(1);
        let p = [
            nt as u32,
            rate as u32,
            self.dims.head as u32,
            w as u32,
            self.dims.overlap as u32,
            ring as u32,
            self.dims.eps.to_bits(),
            pairs as u32,
            maxe as u32,
        ];
        let bufs = [&st.kv, &st.gate, &self.bias, &self.norm, cs, &st.entries];
        // A frame of `nt` rows completes at most `nt / rate + 1` windows.
        e.op(Op::DsCompress, &p, &bufs, ((nt / rate + 1) as u32, 1))
    }
}
