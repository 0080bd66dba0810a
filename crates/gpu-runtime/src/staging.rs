//! The staging ring: a few host-visible buffers that uploads stream through, so a tensor of any
//! size reaches VRAM in fixed-size pieces without a second full-size copy in host memory and
//! without waiting for the GPU between pieces (a piece waits only for its own slot's previous
//! copy to finish).
//!
//! The same ring also stages uploads that must not wait at all ([`StagingRing::try_stage`]):
//! an expert admitted into a VRAM bank while a model runs is written into a ready slot from
//! any thread, its copies go into the submission that next needs them, and when no slot is
//! ready the caller is told so and keeps computing the expert where it is.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::{GpuContext, GpuError};

/// Bytes per slot.
pub const SLOT_BYTES: u64 = 16 << 20;
/// Slots in the ring.
pub const SLOTS: usize = 4;

struct Slot {
    buffer: wgpu::Buffer,
    size: u64,
    /// Set by the map callback when the slot may be written again.
    ready: Arc<AtomicBool>,
}

/// A ring of mapped upload buffers.
pub struct StagingRing {
    slots: Vec<Slot>,
    /// The slot to stage into next (locked only to claim it: the copy into a claimed slot
    /// runs without the lock, so threads stage side by side and the recorder never waits).
    next: std::sync::Mutex<usize>,
}

/// Bytes written into one slot by [`StagingRing::try_stage`], waiting for their copies.
#[derive(Debug)]
pub struct Staged {
    slot: usize,
    /// Each part's offset in the slot and its length (padded to 4).
    parts: Vec<(u64, u64)>,
}

impl StagingRing {
    /// Creates the ring, every slot mapped and ready.
    pub fn new(ctx: &GpuContext) -> StagingRing {
        Self::with_slots(ctx, SLOTS, SLOT_BYTES)
    }

    /// A ring of `slots` slots of `bytes` each (rounded up to 256).
    pub fn with_slots(ctx: &GpuContext, slots: usize, bytes: u64) -> StagingRing {
        let size = bytes.next_multiple_of(256).max(256);
        let slots = (0..slots.max(1))
            .map(|i| Slot {
                buffer: ctx.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(&format!("staging {i}")),
                    size,
                    usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: true,
                }),
                size,
                ready: Arc::new(AtomicBool::new(true)),
            })
            .collect();
        StagingRing {
            slots,
            next: std::sync::Mutex::new(0),
        }
    }

    /// Writes `parts` one after another (each at a 256-byte offset, zero-padded to a multiple
    /// of 4) into the next slot, without waiting: `None` when that slot's last copy has not
    /// finished or the parts do not fit one slot.
    pub fn try_stage(&self, parts: &[&[u8]]) -> Option<Staged> {
        let mut at = 0u64;
        let mut placed = Vec::with_capacity(parts.len());
        for p in parts {
            let len = (p.len() as u64).next_multiple_of(4);
            placed.push((at, len));
            at = (at + len).next_multiple_of(256);
        }
        let i = {
            let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
            let i = *next;
            let slot = &self.slots[i];
            // Claimed by clearing `ready`: nobody else writes it until its copy has run.
            if at > slot.size || !slot.ready.swap(false, Ordering::AcqRel) {
                return None;
            }
            *next = (i + 1) % self.slots.len();
            i
        };
        let slot = &self.slots[i];
        {
            let Ok(mut view) = slot.buffer.get_mapped_range_mut(..at) else {
                // Not mapped after all: the slot stays as it was, ready for a later try.
                slot.ready.store(true, Ordering::Release);
                return None;
            };
            for (p, &(off, len)) in parts.iter().zip(&placed) {
                let (off, len) = (off as usize, len as usize);
                view.slice(off..off + p.len()).copy_from_slice(p);
                // The padding to a whole word (mapped memory is written, never read).
                view.slice(off + p.len()..off + len)
                    .copy_from_slice(&[0u8; 4][..len - p.len()]);
            }
        }
        slot.buffer.unmap();
        Some(Staged {
            slot: i,
            parts: placed,
        })
    }

    /// Records the copy of `staged`'s part `part` to `dst` at `offset`.
    pub fn record(
        &self,
        enc: &mut wgpu::CommandEncoder,
        staged: &Staged,
        part: usize,
        dst: &wgpu::Buffer,
        offset: u64,
    ) {
        let (src, len) = staged.parts[part];
        enc.copy_buffer_to_buffer(&self.slots[staged.slot].buffer, src, dst, offset, len);
    }

    /// Hands `staged`'s slot back once the submission with its copies (already made) has run.
    pub fn release(&self, staged: Staged) {
        let slot = &self.slots[staged.slot];
        let ready = slot.ready.clone();
        slot.buffer.map_async(wgpu::MapMode::Write, .., move |r| {
            if r.is_ok() {
                ready.store(true, Ordering::Release);
            }
        });
    }

    /// Copies `data` into `dst` at `offset` (both multiples of 4), slot by slot.
    pub fn upload(
        &mut self,
        ctx: &GpuContext,
        dst: &wgpu::Buffer,
        offset: u64,
        data: &[u8],
    ) -> Result<(), GpuError> {
        let size = self.slots[0].size;
        for (k, piece) in data.chunks(size as usize).enumerate() {
            let next = self.next.get_mut().unwrap_or_else(|p| p.into_inner());
            let slot = &self.slots[*next];
            *next = (*next + 1) % self.slots.len();
            while !slot.ready.load(Ordering::Acquire) {
                ctx.device
                    .poll(wgpu::PollType::wait_indefinitely())
                    .map_err(|e| GpuError::Map(e.to_string()))?;
            }
            let len = (piece.len() as u64).next_multiple_of(4);
            {
                let mut view = slot
                    .buffer
                    .get_mapped_range_mut(..len)
                    .map_err(|e| GpuError::Map(e.to_string()))?;
                if piece.len() as u64 == len {
                    view.copy_from_slice(piece);
                } else {
                    // Only a last piece whose length is not a multiple of 4 gets here.
                    let mut padded = piece.to_vec();
                    padded.resize(len as usize, 0);
                    view.copy_from_slice(&padded);
                }
            }
            slot.buffer.unmap();
            slot.ready.store(false, Ordering::Release);
            let mut enc = ctx
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("upload"),
                });
            enc.copy_buffer_to_buffer(&slot.buffer, 0, dst, offset + k as u64 * size, len);
            ctx.queue.submit([enc.finish()]);
            let ready = slot.ready.clone();
            slot.buffer.map_async(wgpu::MapMode::Write, .., move |r| {
                if r.is_ok() {
                    ready.store(true, Ordering::Release);
                }
            });
        }
        Ok(())
    }

    /// Waits until every slot's copy has finished.
    pub fn flush(&self, ctx: &GpuContext) -> Result<(), GpuError> {
        while self.slots.iter().any(|s| !s.ready.load(Ordering::Acquire)) {
            ctx.device
                .poll(wgpu::PollType::wait_indefinitely())
                .map_err(|e| GpuError::Map(e.to_string()))?;
        }
        Ok(())
    }
}
