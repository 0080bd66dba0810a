//! A sequence's state on the device ([`GpuState`]): its caches, frame uniform, readback
//! buffers and recorded frame graphs, and the copies a rollback restores ([`GpuRecurrent`]).

use super::*;

/// A layer's cache on the device.
pub enum LayerDeviceState {
    /// GDN conv ring + recurrent state.
    Gdn(GdnDeviceState),
    /// KV + indexer caches.
    Attn(AttnDeviceState),
}

/// A sequence on the device: the caches preallocated for the model's context, the host's
/// position and n-gram context, the frame uniform and readback buffer, and the frame graphs
/// recorded against these buffers. `Clone` copies the device buffers (a snapshot);
/// [`GpuState::restore`] copies a snapshot back into this state's own buffers, so its recorded
/// graphs stay valid.
pub struct GpuState {
    pub(super) ctx: Arc<GpuContext>,
    pub(super) model: u64,
    /// Tokens seen so far.
    pub pos: usize,
    pub(super) ngram_ctx: Vec<i64>,
    pub(super) layers: Vec<LayerDeviceState>,
    /// Per layer: the gathered n-gram rows `[frame rows, ple_embed_dim]` and the conv history.
    pub(super) ple: Vec<Option<(wgpu::Buffer, wgpu::Buffer)>>,
    pub(super) frame: wgpu::Buffer,
    pub(super) stage: wgpu::Buffer,
    pub(super) graphs: HashMap<FrameKey, Graph>,
    /// Where a frame's final streams are read back through (`[rows, H*D]`, for the MTP head).
    pub(super) hs_stage: wgpu::Buffer,
    /// The floats `stage` and `hs_stage` start with (8 rows' worth).
    pub(super) small: (usize, usize),
    /// The next frame's command buffer, encoded while the last one (of the same shape) ran
    /// (keyed by its graph and whether it copies the streams out).
    pub(super) next: Option<(NextKey, wgpu::CommandBuffer)>,
    pub(super) recorded: usize,
    /// Names the sequence in the batched steps it takes part in.
    pub(super) uid: u64,
    /// The model's batched-step graphs (this state's drop removes those that bind it).
    pub(super) batches: BatchGraphs,
}

impl GpuState {
    /// Grows the readback buffers to hold `read` logits and `hs` stream values (a frame longer
    /// than 8 rows that reads every row). A command buffer encoded ahead copies into the old
    /// ones, so it is dropped.
    pub(super) fn fit_stages(&mut self, read: usize, hs: usize) {
        let fits = |b: &wgpu::Buffer, n: usize| (n * 4) as u64 <= b.size();
        if fits(&self.stage, read) && fits(&self.hs_stage, hs) {
            return;
        }
        if !fits(&self.stage, read) {
            self.stage = readback_buffer(&self.ctx, read);
        }
        if !fits(&self.hs_stage, hs) {
            self.hs_stage = readback_buffer(&self.ctx, hs);
        }
        self.next = None;
    }

    /// Moves the sequence past `nt` fed tokens whose n-gram history (with the context before
    /// them) is `history`.
    pub(super) fn advance(&mut self, history: &[i64], nt: usize) {
        let keep = self.ngram_ctx.len();
        self.ngram_ctx = history[history.len() - keep..].to_vec();
        self.pos += nt;
    }
}

impl Drop for GpuState {
    fn drop(&mut self) {
        let mut batches = self.batches.lock().unwrap_or_else(|p| p.into_inner());
        batches.retain(|b| !b.uids.contains(&self.uid));
    }
}

impl std::fmt::Debug for GpuState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuState").field("pos", &self.pos).finish()
    }
}

impl GpuState {
    pub(super) fn new(m: &GpuModel<'_>) -> GpuState {
        let c = &m.model.config;
        let ctx = &m.res.dev.ctx;
        let layers = (0..c.num_hidden_layers)
            .map(|il| match c.layer_type(il) {
                LayerType::LinearAttention => LayerDeviceState::Gdn(GdnDeviceState::new(ctx, c)),
                LayerType::IndexedAttention => {
                    LayerDeviceState::Attn(AttnDeviceState::new(ctx, c, m.res.ctx_len))
                }
            })
            .collect();
        let hd = c.hc_count * c.hidden_size;
        let small = (MAX_BATCH * c.vocab_size, MAX_BATCH * hd);
        let rows = m.res.frame_rows;
        let ple = m
            .model
            .weights
            .layers
            .iter()
            .map(|lw| {
                lw.ple.as_ref().map(|_| {
                    (
                        graph::storage(ctx, "ple rows", rows * c.ple_embed_dim()),
                        graph::storage(
                            ctx,
                            "ple conv history",
                            (c.ple_conv_kernel_size - 1) * c.ngram_size * hd,
                        ),
                    )
                })
            })
            .collect();
        let eos = c.eos_id().unwrap_or(0);
        GpuState {
            ctx: ctx.clone(),
            model: m.res.uid,
            pos: 0,
            ngram_ctx: vec![eos; c.ngram_size.saturating_sub(1)],
            layers,
            ple,
            frame: graph::frame_buffer(ctx),
            // Sized for a frame of 8 rows; a longer frame that reads every row grows them
            // ([`GpuState::fit_stages`]), so states and snapshots that never do stay small.
            stage: readback_buffer(ctx, small.0),
            hs_stage: readback_buffer(ctx, small.1),
            small,
            graphs: HashMap::new(),
            next: None,
            recorded: 0,
            uid: NEXT_UID.fetch_add(1, Ordering::Relaxed),
            batches: m.res.batches.clone(),
        }
    }

    /// Frames recorded so far: every buffer and bind group a forward creates is made when a
    /// frame of a new (rows, head) shape is first recorded, so a steady decode loop leaves
    /// this unchanged.
    pub fn recorded_frames(&self) -> usize {
        self.recorded
    }

    /// Device memory a snapshot of the sequence takes (what [`Clone`] allocates).
    pub fn bytes(&self) -> u64 {
        let gathered: u64 = self.ple.iter().flatten().map(|(rows, _)| rows.size()).sum();
        let stages = 4 * (self.small.0 + self.small.1) as u64;
        self.buffers().iter().map(|b| b.size()).sum::<u64>() + gathered + stages
    }

    /// A snapshot ([`Clone`]), or the device's refusal (out of device memory) as an error.
    pub fn try_clone(&self) -> Result<GpuState, ForwardError> {
        Ok(self.ctx.checked("a sequence snapshot", || self.clone())?)
    }

    /// The buffers that make up the sequence, in a fixed order (what a snapshot copies).
    pub(super) fn buffers(&self) -> Vec<&wgpu::Buffer> {
        let mut out = Vec::new();
        for l in &self.layers {
            match l {
                LayerDeviceState::Gdn(g) => out.extend([&g.conv, &g.s]),
                LayerDeviceState::Attn(a) => out.extend([&a.k, &a.v, &a.raw, &a.block_keys]),
            }
        }
        for (_, hist) in self.ple.iter().flatten() {
            out.push(hist);
        }
        out
    }

    /// Copies `snap` (a snapshot of a sequence of the same model) into this state's buffers.
    pub fn restore(&mut self, snap: &GpuState) -> Result<(), ForwardError> {
        if snap.model != self.model {
            return Err(ForwardError::StateMismatch(0));
        }
        let mut enc = self
            .ctx
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("restore"),
            });
        for (dst, src) in self.buffers().into_iter().zip(snap.buffers()) {
            enc.copy_buffer_to_buffer(src, 0, dst, 0, src.size());
        }
        self.ctx.checked("a state restore", || {
            self.ctx.queue.submit([enc.finish()]);
        })?;
        self.pos = snap.pos;
        self.ngram_ctx = snap.ngram_ctx.clone();
        Ok(())
    }
}

/// The recurrent part of a [`GpuState`] at one position ([`GpuState::save_recurrent`]): device
/// copies of its GDN conv and recurrent states and PLE conv histories, with the position and
/// n-gram context. What a rollback restores; the attention caches need nothing (entries past
/// the position are overwritten by later frames and never read before).
pub struct GpuRecurrent {
    pub(super) model: u64,
    pub(super) pos: usize,
    pub(super) ngram_ctx: Vec<i64>,
    pub(super) bufs: Vec<wgpu::Buffer>,
}

impl std::fmt::Debug for GpuRecurrent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuRecurrent")
            .field("pos", &self.pos)
            .finish()
    }
}

impl GpuState {
    /// The buffers a rollback restores, in a fixed order.
    pub(super) fn recurrent_buffers(&self) -> Vec<&wgpu::Buffer> {
        let mut out = Vec::new();
        for l in &self.layers {
            if let LayerDeviceState::Gdn(g) = l {
                out.extend([&g.conv, &g.s]);
            }
        }
        out.extend(self.ple.iter().flatten().map(|(_, hist)| hist));
        out
    }

    /// Copies the recurrent part at the current position into `snap` (its buffers made the
    /// first time, then reused: a drafting loop saves before every check).
    pub fn save_recurrent(&self, snap: &mut Option<GpuRecurrent>) -> Result<(), ForwardError> {
        let srcs = self.recurrent_buffers();
        let fits = snap.as_ref().is_some_and(|s| {
            s.model == self.model
                && s.bufs.len() == srcs.len()
                && s.bufs.iter().zip(&srcs).all(|(a, b)| a.size() == b.size())
        });
        if !fits {
            let bufs = self.ctx.checked("a recurrent-state snapshot", || {
                srcs.iter()
                    .map(|b| {
                        self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
                            label: Some("recurrent snapshot"),
                            size: b.size(),
                            usage: b.usage(),
                            mapped_at_creation: false,
                        })
                    })
                    .collect()
            })?;
            *snap = Some(GpuRecurrent {
                model: self.model,
                pos: 0,
                ngram_ctx: Vec::new(),
                bufs,
            });
        }
        let snap = snap.as_mut().expect("made above");
        let mut enc = self
            .ctx
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("save recurrent"),
            });
        for (src, dst) in srcs.into_iter().zip(&snap.bufs) {
            enc.copy_buffer_to_buffer(src, 0, dst, 0, src.size());
        }
        self.ctx.queue.submit([enc.finish()]);
        snap.pos = self.pos;
        snap.ngram_ctx.clone_from(&self.ngram_ctx);
        Ok(())
    }

    /// Returns to the position `snap` was saved at (from this state): its recurrent part
    /// copied back, the position and n-gram context reset.
    pub fn rollback(&mut self, snap: &GpuRecurrent) -> Result<(), ForwardError> {
        let dsts = self.recurrent_buffers();
        if snap.model != self.model || snap.bufs.len() != dsts.len() || snap.pos > self.pos {
            return Err(ForwardError::StateMismatch(0));
        }
        let mut enc = self
            .ctx
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("rollback"),
            });
        for (src, dst) in snap.bufs.iter().zip(dsts) {
            enc.copy_buffer_to_buffer(src, 0, dst, 0, src.size());
        }
        self.ctx.queue.submit([enc.finish()]);
        self.pos = snap.pos;
        self.ngram_ctx.clone_from(&snap.ngram_ctx);
        Ok(())
    }
}

impl Clone for GpuState {
    fn clone(&self) -> GpuState {
        let ctx = &self.ctx;
        let dup = |b: &wgpu::Buffer| {
            ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("state snapshot"),
                size: b.size(),
                usage: b.usage(),
                mapped_at_creation: false,
            })
        };
        let layers = self
            .layers
            .iter()
            .map(|l| match l {
                LayerDeviceState::Gdn(g) => LayerDeviceState::Gdn(GdnDeviceState {
                    conv: dup(&g.conv),
                    s: dup(&g.s),
                }),
                LayerDeviceState::Attn(a) => LayerDeviceState::Attn(AttnDeviceState {
                    k: dup(&a.k),
                    v: dup(&a.v),
                    raw: dup(&a.raw),
                    block_keys: dup(&a.block_keys),
                }),
            })
            .collect();
        let ple = self
            .ple
            .iter()
            .map(|p| p.as_ref().map(|(e, h)| (dup(e), dup(h))))
            .collect();
        let mut out = GpuState {
            ctx: ctx.clone(),
            model: self.model,
            pos: 0,
            ngram_ctx: Vec::new(),
            layers,
            ple,
            frame: graph::frame_buffer(ctx),
            // Readback space only: a snapshot starts with the small ones again.
            stage: readback_buffer(ctx, self.small.0),
            hs_stage: readback_buffer(ctx, self.small.1),
            small: self.small,
            graphs: HashMap::new(),
            next: None,
            recorded: 0,
            uid: NEXT_UID.fetch_add(1, Ordering::Relaxed),
            batches: self.batches.clone(),
        };
        out.restore(self).expect("same model");
        out
    }
}
