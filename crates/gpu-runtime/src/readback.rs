//! Reading results back: a copy into a mappable buffer, a blocking map, a copy out.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::{GpuContext, GpuError};

/// Reads `count` f32 values at byte `offset` of `src` (which needs `COPY_SRC`).
pub fn read_f32(
    ctx: &GpuContext,
    src: &wgpu::Buffer,
    offset: u64,
    count: usize,
) -> Result<Vec<f32>, GpuError> {
    let bytes = (count as u64 * 4).max(4);
    let stage = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("readback"),
        size: bytes,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut enc = ctx
        .device
        .create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("readback"),
        });
    enc.copy_buffer_to_buffer(src, offset, &stage, 0, bytes);
    ctx.queue.submit([enc.finish()]);
    read_mapped(ctx, &stage, count)
}

/// How long a readback polls before it blocks: 2 ms (the original engine's figure), or
/// `CORTIQ_SPIN_US` microseconds (0: block at once).
fn spin_limit() -> std::time::Duration {
    static SPIN: std::sync::OnceLock<std::time::Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        let us = std::env::var("CORTIQ_SPIN_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2000);
        std::time::Duration::from_micros(us)
    })
}

/// Maps `stage` (a `MAP_READ` buffer the submitted work has filled), copies `count` f32 out,
/// unmaps it: the readback of a preallocated buffer.
pub fn read_mapped(
    ctx: &GpuContext,
    stage: &wgpu::Buffer,
    count: usize,
) -> Result<Vec<f32>, GpuError> {
    read_mapped_after(ctx, stage, count, None)
}

/// [`read_mapped`] of a buffer that submission `after` filled, without waiting for the
/// submissions made after it (the GPU goes on with those while the host reads).
pub fn read_mapped_after(
    ctx: &GpuContext,
    stage: &wgpu::Buffer,
    count: usize,
    after: Option<wgpu::SubmissionIndex>,
) -> Result<Vec<f32>, GpuError> {
    let result: Arc<Mutex<Option<Result<(), wgpu::BufferAsyncError>>>> = Arc::new(Mutex::new(None));
    let r = result.clone();
    stage.map_async(wgpu::MapMode::Read, .., move |res| *r.lock() = Some(res));
    // On a hardware adapter the host polls without blocking for a while first: a blocking
    // fence wait wakes the thread tens of microseconds after the GPU is done, and the cold
    // path waits dozens of times a token. A software adapter's GPU is the CPU: no spinning.
    let spin = if ctx.is_software() {
        std::time::Duration::ZERO
    } else {
        spin_limit()
    };
    let t0 = std::time::Instant::now();
    while result.lock().is_none() && t0.elapsed() < spin {
        ctx.device
            .poll(wgpu::PollType::Poll)
            .map_err(|e| GpuError::Map(e.to_string()))?;
        std::hint::spin_loop();
    }
    let mut wait = match after {
        Some(index) => wgpu::PollType::Wait {
            submission_index: Some(index),
            timeout: None,
        },
        None => wgpu::PollType::wait_indefinitely(),
    };
    while result.lock().is_none() {
        ctx.device
            .poll(wait.clone())
            .map_err(|e| GpuError::Map(e.to_string()))?;
        // Should the map wait for later work after all, the next poll waits for that.
        wait = wgpu::PollType::wait_indefinitely();
    }
    if let Some(Err(e)) = result.lock().take() {
        return Err(GpuError::Map(e.to_string()));
    }
    let view = stage
        .get_mapped_range(..)
        .map_err(|e| GpuError::Map(e.to_string()))?;
    let out: Vec<f32> = bytemuck::pod_collect_to_vec(&view[..count * 4]);
    drop(view);
    stage.unmap();
    Ok(out)
}
