//! The weight arena: matrices uploaded once from the (memory-mapped) model file and kept
//! resident under a VRAM budget; least recently used unpinned matrices are evicted to make
//! room. A matrix larger than one storage binding is split by rows into parts, each a complete
//! payload of the same dtype (`quant_codecs::slice_rows`), so every kernel sees whole matrices.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use quant_codecs::{DType, Layout, MatRef};

use crate::staging::StagingRing;
use crate::{GpuContext, GpuError};

/// Rows `row_start .. row_start + rows` of a matrix, as one device buffer.
#[derive(Debug)]
pub struct Part {
    /// First row.
    pub row_start: usize,
    /// Rows in this part.
    pub rows: usize,
    /// The section layout of this part's payload.
    pub layout: Layout,
    /// The payload (padded to a multiple of 16 bytes).
    pub buffer: wgpu::Buffer,
}

/// A matrix resident on the device.
#[derive(Debug)]
pub struct GpuMatrix {
    /// Its dtype.
    pub dtype: DType,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Row ranges, each in its own buffer, in row order.
    pub parts: Vec<Part>,
    /// Device bytes held.
    pub bytes: u64,
}

/// Which dtypes the kernels read, and the column multiple each needs.
pub fn kernel_codec(dtype: DType) -> Option<kernels_wgsl::Codec> {
    kernels_wgsl::Codec::from_name(dtype.name())
}

impl GpuMatrix {
    /// Uploads `m`, split into parts of at most `max_binding` bytes.
    pub fn upload(
        ctx: &GpuContext,
        ring: &mut StagingRing,
        m: &MatRef<'_>,
        max_binding: u64,
    ) -> Result<GpuMatrix, GpuError> {
        let (dtype, rows, cols) = (m.dtype(), m.rows(), m.cols());
        let codec = kernel_codec(dtype).ok_or(GpuError::UnsupportedDtype { dtype })?;
        if cols % codec.col_multiple() != 0 {
            return Err(GpuError::UnsupportedShape {
                dtype,
                rows,
                cols,
                multiple: codec.col_multiple(),
            });
        }
        let padded = |n: usize| (n as u64).next_multiple_of(16);
        let one_row = padded(Layout::new(dtype, 1, cols)?.nbytes);
        if one_row > max_binding {
            return Err(GpuError::BindingTooLarge {
                dtype,
                cols,
                requested: one_row,
                max: max_binding,
            });
        }
        // Rows per part: the most whose payload fits one binding (shrunk until it does, since
        // per-matrix sections such as q8_2f's column scales do not scale with rows).
        let mut per_part = rows.min((max_binding / one_row.max(1)).max(1) as usize);
        while per_part > 1 && padded(Layout::new(dtype, per_part, cols)?.nbytes) > max_binding {
            per_part -= per_part.div_ceil(16);
        }
        let mut parts = Vec::new();
        let mut bytes = 0;
        let mut start = 0;
        while start < rows {
            let end = (start + per_part).min(rows);
            let payload = if start == 0 && end == rows {
                std::borrow::Cow::Borrowed(m.bytes())
            } else {
                std::borrow::Cow::Owned(quant_codecs::slice_rows(
                    dtype,
                    rows,
                    cols,
                    m.bytes(),
                    start,
                    end,
                )?)
            };
            let size = padded(payload.len());
            let buffer = ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("weights"),
                size,
                // COPY_SRC: q8_2f column scales are copied into shared quantisers' tables.
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_DST
                    | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            ring.upload(ctx, &buffer, 0, &payload)?;
            parts.push(Part {
                row_start: start,
                rows: end - start,
                layout: Layout::new(dtype, end - start, cols)?,
                buffer,
            });
            bytes += size;
            start = end;
        }
        ring.flush(ctx)?;
        Ok(GpuMatrix {
            dtype,
            rows,
            cols,
            parts,
            bytes,
        })
    }
}

struct Entry {
    matrix: Arc<GpuMatrix>,
    pinned: bool,
    last_use: u64,
}

/// Resident matrices keyed by (model uid, tensor name), under a byte budget.
pub struct WeightArena {
    budget: u64,
    max_binding: u64,
    state: Mutex<ArenaState>,
}

struct ArenaState {
    entries: HashMap<(u64, String), Entry>,
    resident: u64,
    clock: u64,
    ring: Option<StagingRing>,
}

impl WeightArena {
    /// An empty arena with the context's budget and binding limit.
    pub fn new(ctx: &GpuContext) -> WeightArena {
        WeightArena::with_limits(ctx.vram_budget, ctx.max_binding())
    }

    /// An empty arena with explicit limits (tests use a small binding limit to force splits).
    pub fn with_limits(budget: u64, max_binding: u64) -> WeightArena {
        WeightArena {
            budget,
            max_binding: max_binding & !15,
            state: Mutex::new(ArenaState {
                entries: HashMap::new(),
                resident: 0,
                clock: 0,
                ring: None,
            }),
        }
    }

    /// The matrix `name` of model `uid`, uploading it first if needed (evicting least recently
    /// used unpinned matrices to stay within the budget).
    pub fn get_or_upload(
        &self,
        ctx: &GpuContext,
        uid: u64,
        name: &str,
        m: &MatRef<'_>,
    ) -> Result<Arc<GpuMatrix>, GpuError> {
        let mut st = self.state.lock();
        st.clock += 1;
        let now = st.clock;
        let key = (uid, name.to_string());
        if let Some(e) = st.entries.get_mut(&key) {
            e.last_use = now;
            return Ok(e.matrix.clone());
        }
        let need = (m.bytes().len() as u64).next_multiple_of(16);
        while st.resident + need > self.budget {
            let victim = st
                .entries
                .iter()
                .filter(|(_, e)| !e.pinned)
                .min_by_key(|(_, e)| e.last_use)
                .map(|(k, _)| k.clone());
            match victim {
                Some(k) => {
                    if let Some(e) = st.entries.remove(&k) {
                        st.resident -= e.matrix.bytes;
                        tracing::debug!("evicted {} ({} bytes)", k.1, e.matrix.bytes);
                    }
                }
                None => {
                    let pinned = st.entries.values().map(|e| e.matrix.bytes).sum();
                    return Err(GpuError::OverBudget {
                        name: name.to_string(),
                        requested: need,
                        resident: st.resident,
                        pinned,
                        budget: self.budget,
                    });
                }
            }
        }
        let ring = st.ring.get_or_insert_with(|| StagingRing::new(ctx));
        let matrix = Arc::new(GpuMatrix::upload(ctx, ring, m, self.max_binding)?);
        st.resident += matrix.bytes;
        st.entries.insert(
            key,
            Entry {
                matrix: matrix.clone(),
                pinned: false,
                last_use: now,
            },
        );
        Ok(matrix)
    }

    /// Keeps a resident matrix from being evicted (`false` if it is not resident).
    pub fn pin(&self, uid: u64, name: &str, pinned: bool) -> bool {
        match self.state.lock().entries.get_mut(&(uid, name.to_string())) {
            Some(e) => {
                e.pinned = pinned;
                true
            }
            None => false,
        }
    }

    /// Whether a matrix is resident.
    pub fn contains(&self, uid: u64, name: &str) -> bool {
        self.state
            .lock()
            .entries
            .contains_key(&(uid, name.to_string()))
    }

    /// Device bytes held now.
    pub fn resident_bytes(&self) -> u64 {
        self.state.lock().resident
    }

    /// The budget.
    pub fn budget(&self) -> u64 {
        self.budget
    }
}
