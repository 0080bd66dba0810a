//! The staging ring: a few host-visible buffers that uploads stream through, so a tensor of any
//! size reaches VRAM in fixed-size pieces without a second full-size copy in host memory and
//! without waiting for the GPU between pieces (a piece waits only for its own slot's previous
//! copy to finish).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::{GpuContext, GpuError};

/// Bytes per slot.
pub const SLOT_BYTES: u64 = 16 << 20;
/// Slots in the ring.
pub const SLOTS: usize = 4;

struct Slot {
    buffer: wgpu::Buffer,
    /// Set by the map callback when the slot may be written again.
    ready: Arc<AtomicBool>,
}

/// A ring of mapped upload buffers.
pub struct StagingRing {
    slots: Vec<Slot>,
    next: usize,
}

impl StagingRing {
    /// Creates the ring, every slot mapped and ready.
    pub fn new(ctx: &GpuContext) -> StagingRing {
        let slots = (0..SLOTS)
            .map(|i| Slot {
                buffer: ctx.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(&format!("staging {i}")),
                    size: SLOT_BYTES,
                    usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: true,
                }),
                ready: Arc::new(AtomicBool::new(true)),
            })
            .collect();
        StagingRing { slots, next: 0 }
    }

    /// Copies `data` into `dst` at `offset` (both multiples of 4), slot by slot.
    pub fn upload(
        &mut self,
        ctx: &GpuContext,
        dst: &wgpu::Buffer,
        offset: u64,
        data: &[u8],
    ) -> Result<(), GpuError> {
        for (k, piece) in data.chunks(SLOT_BYTES as usize).enumerate() {
            let slot = &self.slots[self.next];
            self.next = (self.next + 1) % SLOTS;
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
            enc.copy_buffer_to_buffer(&slot.buffer, 0, dst, offset + k as u64 * SLOT_BYTES, len);
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
