//! One Engram lookup table of `deepseek_v41`, bound to its mxfp8 tensor in an open CMF, and
//! the row gather the forward runs on it.
//!
//! What it owns: [`EngramTable`] (binding `model.engram_tables.{L}.weight` with the checks a
//! forward relies on: present, mxfp8, `[rows, engram_head_dim]` with the rows the prime layout
//! implies) and [`EngramTable::gather`], which decodes only the rows asked for.
//!
//! The release's tables are ~98 GB each, so the table is never copied: [`EngramTable`]
//! borrows the CMF's payload (the file's memory map when opened with [`Cmf::open`]) and a
//! gather reads `cols` code bytes and `cols / 32` scale bytes per row, so the process's
//! resident memory grows with the rows read, not with the table (docs/perf.md, "Engram tables
//! on disk", has the measured figures). Decoding is quant-codecs' mxfp8 row decode
//! ([`MatRef::dequantize_row`]), the same code the converter's round-trip tests exercise.

use cmf_format::Cmf;
use model_core::bind::{BindError, Binder};
use quant_codecs::{CodecError, DType, MatRef};

use crate::config_v41::DeepseekV41Config;

/// Why a table cannot be bound or a gather cannot run: each variant names the tensor.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngramTableError {
    /// The layer has no Engram module in the config, so it has no table.
    #[error("layer {layer} is not an Engram layer (engram_layer_ids: {engram_layers:?})")]
    NotEngramLayer {
        /// The model layer asked for.
        layer: usize,
        /// `engram_layer_ids`.
        engram_layers: Vec<usize>,
    },
    /// The configured row count does not fit this platform's address space.
    #[error("tensor `{name}`: {rows} rows do not fit in memory addresses on this platform")]
    TooManyRows {
        /// Tensor name.
        name: String,
        /// Rows the config implies.
        rows: u64,
    },
    /// The tensor is missing or has another shape than `[rows, engram_head_dim]`.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// The tensor is stored in another dtype (a table converted as a float embedding, say).
    #[error("tensor `{name}` is {found}, expected mxfp8 (E4M3 rows with E8M0 scales)")]
    Dtype {
        /// Tensor name.
        name: String,
        /// Stored dtype.
        found: DType,
    },
    /// The payload does not hold an mxfp8 matrix of the shape (the CMF reader checks this too;
    /// kept typed rather than trusted).
    #[error("tensor `{name}`: {source}")]
    Codec {
        /// Tensor name.
        name: String,
        /// Codec error.
        source: CodecError,
    },
    /// A row id at or past the table's rows (a hashing bug or a table from another config).
    #[error(
        "tensor `{name}`: row id {row} (position {position} of the gather) is past its {rows} rows"
    )]
    RowOutOfRange {
        /// Tensor name.
        name: String,
        /// The offending id.
        row: u64,
        /// Its index in the `rows` argument.
        position: usize,
        /// Rows of the table.
        rows: u64,
    },
    /// The output buffer is not `rows.len() * cols` values.
    #[error(
        "tensor `{name}`: gathering {ids} rows of {cols} needs {expected} f32 values, out has {found}"
    )]
    OutLength {
        /// Tensor name.
        name: String,
        /// Row ids asked for.
        ids: usize,
        /// Row width.
        cols: usize,
        /// `ids * cols`.
        expected: usize,
        /// `out.len()`.
        found: usize,
    },
}

/// One Engram table: an mxfp8 `[rows, cols]` matrix borrowed from the CMF, never copied.
#[derive(Debug, Clone)]
pub struct EngramTable<'a> {
    name: String,
    id: usize,
    mat: MatRef<'a>,
}

impl<'a> EngramTable<'a> {
    /// The canonical name of model layer `layer`'s table (docs/convert.md).
    pub fn tensor_name(layer: usize) -> String {
        format!("model.engram_tables.{layer}.weight")
    }

    /// Binds model layer `layer`'s table with the shape `config` implies: rows from the prime
    /// layout ([`DeepseekV41Config::engram_layout`]), cols `engram_head_dim`.
    pub fn from_config(
        cmf: &'a Cmf,
        config: &DeepseekV41Config,
        layer: usize,
    ) -> Result<EngramTable<'a>, EngramTableError> {
        let not_engram = || EngramTableError::NotEngramLayer {
            layer,
            engram_layers: config.engram_layer_ids.clone(),
        };
        let index = config
            .engram_layer_ids
            .iter()
            .position(|&l| l == layer)
            .ok_or_else(not_engram)?;
        let rows = config
            .engram_layout()
            .and_then(|l| l.table_rows().get(index).copied())
            .ok_or_else(not_engram)?;
        EngramTable::bind(cmf, layer, rows, config.engram_head_dim)
    }

    /// Binds `model.engram_tables.{layer}.weight`, checked to be mxfp8 `[rows, cols]`.
    pub fn bind(
        cmf: &'a Cmf,
        layer: usize,
        rows: u64,
        cols: usize,
    ) -> Result<EngramTable<'a>, EngramTableError> {
        let name = EngramTable::tensor_name(layer);
        let rows_usize = usize::try_from(rows).map_err(|_| EngramTableError::TooManyRows {
            name: name.clone(),
            rows,
        })?;
        // Binder gives the missing-tensor and wrong-shape errors every other weight gets.
        let (id, view) = Binder::new(cmf).view(&name, &[rows_usize, cols])?;
        if view.dtype() != DType::Mxfp8 {
            return Err(EngramTableError::Dtype {
                name,
                found: view.dtype(),
            });
        }
        let mat = MatRef::new(DType::Mxfp8, rows_usize, cols, view.bytes).map_err(|source| {
            EngramTableError::Codec {
                name: name.clone(),
                source,
            }
        })?;
        Ok(EngramTable { name, id, mat })
    }

    /// The canonical tensor name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tensor's index in the CMF tensor table.
    pub fn id(&self) -> usize {
        self.id
    }

    /// Rows of the table.
    pub fn rows(&self) -> u64 {
        self.mat.rows() as u64
    }

    /// Row width (`engram_head_dim`).
    pub fn cols(&self) -> usize {
        self.mat.cols()
    }

    /// The encoded payload (borrowed from the file: code plane, then scale plane).
    pub fn bytes(&self) -> &'a [u8] {
        self.mat.bytes()
    }

    /// Decodes rows `rows[i]` into `out[i * cols..(i + 1) * cols]`.
    ///
    /// Every id is checked before anything is decoded, so a bad id leaves `out` untouched and
    /// no page of the table is read for it. Only the asked-for rows' bytes are read.
    pub fn gather(&self, rows: &[u64], out: &mut [f32]) -> Result<(), EngramTableError> {
        let cols = self.cols();
        let expected = rows.len().saturating_mul(cols);
        if out.len() != expected {
            return Err(EngramTableError::OutLength {
                name: self.name.clone(),
                ids: rows.len(),
                cols,
                expected,
                found: out.len(),
            });
        }
        let n = self.rows();
        if let Some((position, &row)) = rows.iter().enumerate().find(|&(_, &r)| r >= n) {
            return Err(EngramTableError::RowOutOfRange {
                name: self.name.clone(),
                row,
                position,
                rows: n,
            });
        }
        // Sequential on purpose: a step gathers (tokens x hash columns) rows of a few hundred
        // values each, far less work than a thread hand-off; the cost is the page faults.
        for (&row, o) in rows.iter().zip(out.chunks_exact_mut(cols.max(1))) {
            // `row < n`, which came from a usize, so the cast is exact.
            self.mat
                .dequantize_row(row as usize, o)
                .map_err(|source| EngramTableError::Codec {
                    name: self.name.clone(),
                    source,
                })?;
        }
        Ok(())
    }
}
