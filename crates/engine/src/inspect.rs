//! `cortiq inspect`: what a CMF file holds, as data ([`Report`]) and as text.
//!
//! [`inspect`] opens and validates the file, optionally verifies every checksum and decodes one
//! tensor's first values, and returns a [`Report`]; [`Report::write_text`] prints it for people
//! and its `Serialize` impl gives the same information as one JSON object.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use cmf_format::{
    Cmf, CmfError, Dims, Provenance, Quantization, SidecarOf, SidecarRef, TensorInfo,
};
use quant_codecs::{CodecError, DType, MatRef, split_matrix_shape};
use serde::Serialize;

/// What to do besides listing (all off by default).
#[derive(Debug, Clone, Default)]
pub struct InspectOptions {
    /// Check every tensor's checksum.
    pub verify: bool,
    /// Describe this tensor in detail.
    pub tensor: Option<String>,
    /// With `tensor`: decode its first `values` elements to f32.
    pub values: Option<usize>,
}

/// Why `inspect` could not produce a report. Corrupt payloads are not errors: they are listed
/// in [`Report::verify`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InspectError {
    /// The file could not be opened or is not a valid CMF file.
    #[error(transparent)]
    Open(#[from] CmfError),
    /// `--tensor` named a tensor the file does not have.
    #[error("{}: no tensor named {name:?} (the file has {count} tensors)", path.display())]
    UnknownTensor {
        /// The file.
        path: PathBuf,
        /// The name asked for.
        name: String,
        /// How many tensors the file has.
        count: usize,
    },
    /// The tensor's values could not be decoded.
    #[error("{}: tensor {name:?}: {source}", path.display())]
    Values {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The codec's error.
        source: CodecError,
    },
}

/// Everything `inspect` reports about one file.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The file as given.
    pub file: PathBuf,
    /// Its size in bytes.
    pub size: u64,
    /// Its uid (meta checksum), 16 hex digits.
    pub uid: String,
    /// The CMF format version.
    pub version: u32,
    /// The header's architecture id.
    pub architecture: String,
    /// The quantisation profile and its parameters.
    pub quantization: Quantization,
    /// Converter, sources, creation time.
    pub provenance: Provenance,
    /// Normalised dimensions.
    pub dims: Dims,
    /// Which optional parts are embedded.
    pub embedded: Embedded,
    /// The model's own sampling settings (what `run` and `chat` use unless a flag overrides).
    pub sampling_defaults: crate::sampling::GenerationDefaults,
    /// Sidecars the file lists.
    pub sidecars: Vec<SidecarRef>,
    /// Set when the file is itself a sidecar.
    pub sidecar_of: Option<SidecarOf>,
    /// Every tensor, in table order.
    pub tensors: Vec<TensorRow>,
    /// Totals per dtype, in dtype id order, then the grand total.
    pub totals: Vec<Total>,
    /// Checksum results, when asked for.
    pub verify: Option<VerifyReport>,
    /// The tensor asked for with `--tensor`.
    pub tensor: Option<TensorDetail>,
}

/// Which optional header parts the file carries.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Embedded {
    /// `tokenizer.json`.
    pub tokenizer: bool,
    /// A chat template.
    pub chat_template: bool,
    /// Generation defaults.
    pub generation: bool,
}

/// One line of the tensor table.
#[derive(Debug, Clone, Serialize)]
pub struct TensorRow {
    /// Name.
    pub name: String,
    /// Dtype name.
    pub dtype: &'static str,
    /// Shape.
    pub shape: Vec<usize>,
    /// Payload offset in the file.
    pub offset: u64,
    /// Payload bytes.
    pub bytes: u64,
}

/// Count, elements and bytes of the tensors of one dtype (or of all: `dtype` = `"total"`).
#[derive(Debug, Clone, Serialize)]
pub struct Total {
    /// Dtype name, or `"total"`.
    pub dtype: &'static str,
    /// Tensors.
    pub count: u64,
    /// Elements (weights).
    pub elements: u64,
    /// Payload bytes.
    pub bytes: u64,
    /// `8 * bytes / elements` (0 when there are no elements).
    pub bits_per_weight: f64,
}

/// The outcome of checking every checksum.
#[derive(Debug, Clone, Serialize)]
pub struct VerifyReport {
    /// Tensors checked.
    pub checked: usize,
    /// The corrupt ones, in table order.
    pub bad: Vec<BadTensor>,
}

/// A tensor whose payload does not match its checksum.
#[derive(Debug, Clone, Serialize)]
pub struct BadTensor {
    /// Its name.
    pub name: String,
    /// The checksum in the table.
    pub expected: String,
    /// The checksum of the payload.
    pub found: String,
}

/// One tensor in detail.
#[derive(Debug, Clone, Serialize)]
pub struct TensorDetail {
    /// Name.
    pub name: String,
    /// Dtype name.
    pub dtype: &'static str,
    /// Shape.
    pub shape: Vec<usize>,
    /// Elements.
    pub elements: u64,
    /// Payload offset in the file.
    pub offset: u64,
    /// Payload bytes.
    pub bytes: u64,
    /// The table's checksum, 16 hex digits.
    pub checksum: String,
    /// Its first values, dequantised, when asked for (fewer if the tensor is smaller).
    pub values: Option<Vec<f32>>,
}

/// Opens `path`, validates it, and gathers the report `opts` asks for.
pub fn inspect(path: &Path, opts: &InspectOptions) -> Result<Report, InspectError> {
    inspect_cmf(&Cmf::open(path)?, opts)
}

/// The report for an already opened (and so validated) file.
pub fn inspect_cmf(cmf: &Cmf, opts: &InspectOptions) -> Result<Report, InspectError> {
    let path = cmf.display_path();
    let h = cmf.header();
    let tensor = match &opts.tensor {
        Some(name) => Some(detail(cmf, path, name, opts.values)?),
        None => None,
    };
    Ok(Report {
        file: path.to_path_buf(),
        size: cmf.file_len(),
        uid: format!("{:016x}", cmf.uid()),
        version: cmf.version(),
        architecture: h.architecture.clone(),
        quantization: h.quantization.clone(),
        provenance: h.provenance.clone(),
        dims: h.dims.clone(),
        embedded: Embedded {
            tokenizer: h.tokenizer.is_some(),
            chat_template: h.chat_template.is_some(),
            generation: h.generation.is_some(),
        },
        sampling_defaults: crate::sampling::GenerationDefaults::from_json(h.generation.as_ref()),
        sidecars: h.sidecars.clone(),
        sidecar_of: h.sidecar_of.clone(),
        tensors: cmf.tensors().iter().map(row).collect(),
        totals: totals(cmf.tensors()),
        verify: opts.verify.then(|| verify(cmf)),
        tensor,
    })
}

fn row(t: &TensorInfo) -> TensorRow {
    TensorRow {
        name: t.name.clone(),
        dtype: t.dtype.name(),
        shape: t.shape.clone(),
        offset: t.offset,
        bytes: t.nbytes,
    }
}

fn total(dtype: &'static str, count: u64, elements: u64, bytes: u64) -> Total {
    let bits_per_weight = if elements == 0 {
        0.0
    } else {
        8.0 * bytes as f64 / elements as f64
    };
    Total {
        dtype,
        count,
        elements,
        bytes,
        bits_per_weight,
    }
}

/// Per-dtype totals in id order, then the grand total.
pub fn totals(tensors: &[TensorInfo]) -> Vec<Total> {
    let mut by: BTreeMap<u16, (DType, u64, u64, u64)> = BTreeMap::new();
    for t in tensors {
        let e = by.entry(t.dtype.id()).or_insert((t.dtype, 0, 0, 0));
        e.1 += 1;
        e.2 = e.2.saturating_add(t.elements());
        e.3 = e.3.saturating_add(t.nbytes);
    }
    let mut out: Vec<Total> = by
        .values()
        .map(|&(d, c, e, b)| total(d.name(), c, e, b))
        .collect();
    let (c, e, b) = out.iter().fold((0u64, 0u64, 0u64), |(c, e, b), t| {
        (
            c + t.count,
            e.saturating_add(t.elements),
            b.saturating_add(t.bytes),
        )
    });
    out.push(total("total", c, e, b));
    out
}

fn verify(cmf: &Cmf) -> VerifyReport {
    let mut bad = Vec::new();
    for t in cmf.tensors() {
        tracing::debug!(tensor = %t.name, "verifying");
        if let Err(CmfError::Checksum {
            name,
            expected,
            found,
            ..
        }) = cmf.verify_tensor(&t.name)
        {
            bad.push(BadTensor {
                name,
                expected: format!("{expected:016x}"),
                found: format!("{found:016x}"),
            });
        }
    }
    VerifyReport {
        checked: cmf.tensors().len(),
        bad,
    }
}

fn detail(
    cmf: &Cmf,
    path: &Path,
    name: &str,
    values: Option<usize>,
) -> Result<TensorDetail, InspectError> {
    let Some(t) = cmf.tensor(name) else {
        return Err(InspectError::UnknownTensor {
            path: path.to_path_buf(),
            name: name.to_string(),
            count: cmf.tensors().len(),
        });
    };
    let values = match values {
        Some(n) => Some(
            first_values(t.dtype(), t.shape(), t.bytes, n).map_err(|source| {
                InspectError::Values {
                    path: path.to_path_buf(),
                    name: name.to_string(),
                    source,
                }
            })?,
        ),
        None => None,
    };
    Ok(TensorDetail {
        name: t.info.name.clone(),
        dtype: t.dtype().name(),
        shape: t.info.shape.clone(),
        elements: t.info.elements(),
        offset: t.info.offset,
        bytes: t.info.nbytes,
        checksum: format!("{:016x}", t.info.checksum),
        values,
    })
}

/// The first `n` values of a tensor in row-major order, decoding no more than needed: a float
/// prefix, or the leading rows of the first matrix of a quantised stack.
pub fn first_values(
    dtype: DType,
    shape: &[usize],
    bytes: &[u8],
    n: usize,
) -> Result<Vec<f32>, CodecError> {
    if let Some(size) = dtype.element_size() {
        let k = n.min(bytes.len() / size);
        return quant_codecs::dequantize(dtype, &[k], &bytes[..k * size]);
    }
    let (batch, rows, cols) = split_matrix_shape(dtype, shape)?;
    let one = dtype.expected_nbytes(&[rows, cols])?;
    let mut out = Vec::with_capacity(n.min(bytes.len().saturating_mul(4)));
    if cols == 0 || rows == 0 {
        return Ok(out);
    }
    let mut row = vec![0.0f32; cols];
    for b in 0..batch {
        let Some(payload) = bytes.get(b * one..(b + 1) * one) else {
            break;
        };
        let m = MatRef::new(dtype, rows, cols, payload)?;
        for r in 0..rows {
            if out.len() >= n {
                return Ok(out);
            }
            m.dequantize_row(r, &mut row)?;
            out.extend_from_slice(&row[..cols.min(n - out.len())]);
        }
    }
    Ok(out)
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn opt(v: Option<u64>) -> String {
    v.map_or_else(|| "-".to_string(), |v| v.to_string())
}

fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

fn shape(s: &[usize]) -> String {
    let parts: Vec<String> = s.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

impl Report {
    /// Writes the report for people: a summary, then the tensor table (or the one tensor asked
    /// for), totals, and the verify outcome.
    pub fn write_text(&self, w: &mut dyn Write) -> io::Result<()> {
        writeln!(w, "file          {}", self.file.display())?;
        writeln!(
            w,
            "size          {} bytes ({})",
            self.size,
            human(self.size)
        )?;
        writeln!(w, "uid           {}", self.uid)?;
        writeln!(w, "format        CMF version {}", self.version)?;
        writeln!(w, "architecture  {}", self.architecture)?;
        writeln!(w, "quantization  {}", self.quantization.profile)?;
        let p = &self.provenance;
        let conv = if p.converter.is_empty() {
            "-"
        } else {
            &p.converter
        };
        let sources: u64 = p.sources.iter().map(|s| s.bytes).sum();
        writeln!(
            w,
            "provenance    {conv}; {} source files ({}); created {}",
            p.sources.len(),
            human(sources),
            p.created.as_deref().unwrap_or("-")
        )?;
        let d = &self.dims;
        writeln!(
            w,
            "dims          hidden_size={} num_hidden_layers={} vocab_size={} max_position_embeddings={}",
            opt(d.hidden_size),
            opt(d.num_hidden_layers),
            opt(d.vocab_size),
            opt(d.max_position_embeddings)
        )?;
        let e = self.embedded;
        writeln!(
            w,
            "embedded      tokenizer: {}, chat template: {}, generation defaults: {}",
            yes(e.tokenizer),
            yes(e.chat_template),
            yes(e.generation)
        )?;
        let g = &self.sampling_defaults;
        if !g.is_empty() {
            let mut parts = Vec::new();
            if let Some(v) = g.do_sample {
                parts.push(format!("do_sample={v}"));
            }
            if let Some(v) = g.temperature {
                parts.push(format!("temperature={v}"));
            }
            if let Some(v) = g.top_k {
                parts.push(format!("top_k={v}"));
            }
            if let Some(v) = g.top_p {
                parts.push(format!("top_p={v}"));
            }
            if let Some(v) = g.min_p {
                parts.push(format!("min_p={v}"));
            }
            if let Some(v) = g.repetition_penalty {
                parts.push(format!("repetition_penalty={v}"));
            }
            writeln!(
                w,
                "sampling      {} (run/chat flags override)",
                parts.join(" ")
            )?;
        }
        if self.sidecars.is_empty() {
            writeln!(w, "sidecars      none")?;
        }
        for s in &self.sidecars {
            writeln!(
                w,
                "sidecar       {} -> {} (uid {:016x})",
                s.role, s.file, s.uid
            )?;
        }
        if let Some(of) = &self.sidecar_of {
            writeln!(w, "sidecar of    a main file, as role {:?}", of.role)?;
        }
        match &self.tensor {
            Some(t) => self.write_detail(w, t)?,
            None => self.write_table(w)?,
        }
        writeln!(w)?;
        writeln!(
            w,
            "{:<8} {:>7} {:>15} {:>15} {:>11}",
            "dtype", "tensors", "elements", "bytes", "bits/weight"
        )?;
        for t in &self.totals {
            writeln!(
                w,
                "{:<8} {:>7} {:>15} {:>15} {:>11.3}",
                t.dtype, t.count, t.elements, t.bytes, t.bits_per_weight
            )?;
        }
        if let Some(v) = &self.verify {
            writeln!(w)?;
            if v.bad.is_empty() {
                writeln!(w, "verify: all {} tensors OK", v.checked)?;
            } else {
                writeln!(
                    w,
                    "verify: {} of {} tensors CORRUPT",
                    v.bad.len(),
                    v.checked
                )?;
                for b in &v.bad {
                    writeln!(
                        w,
                        "  CORRUPT {}: checksum {} expected {}",
                        b.name, b.found, b.expected
                    )?;
                }
            }
        }
        Ok(())
    }

    fn write_table(&self, w: &mut dyn Write) -> io::Result<()> {
        writeln!(w)?;
        let name_w = self
            .tensors
            .iter()
            .map(|t| t.name.len())
            .max()
            .unwrap_or(4)
            .max(4);
        let shapes: Vec<String> = self.tensors.iter().map(|t| shape(&t.shape)).collect();
        let shape_w = shapes.iter().map(String::len).max().unwrap_or(5).max(5);
        writeln!(
            w,
            "{:<name_w$}  {:<6} {:<shape_w$} {:>12}",
            "name", "dtype", "shape", "bytes"
        )?;
        for (t, s) in self.tensors.iter().zip(&shapes) {
            writeln!(
                w,
                "{:<name_w$}  {:<6} {:<shape_w$} {:>12}",
                t.name, t.dtype, s, t.bytes
            )?;
        }
        Ok(())
    }

    fn write_detail(&self, w: &mut dyn Write, t: &TensorDetail) -> io::Result<()> {
        writeln!(w)?;
        writeln!(w, "tensor        {}", t.name)?;
        writeln!(w, "dtype         {}", t.dtype)?;
        writeln!(
            w,
            "shape         {} ({} elements)",
            shape(&t.shape),
            t.elements
        )?;
        writeln!(w, "offset        {}", t.offset)?;
        writeln!(w, "bytes         {}", t.bytes)?;
        writeln!(w, "checksum      {}", t.checksum)?;
        if let Some(values) = &t.values {
            writeln!(w, "values        first {} of {}:", values.len(), t.elements)?;
            for chunk in values.chunks(8) {
                let line: Vec<String> = chunk.iter().map(|v| format!("{v:>13?}")).collect();
                writeln!(w, "  {}", line.join(" "))?;
            }
        }
        Ok(())
    }
}
