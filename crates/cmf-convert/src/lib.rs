//! A Hugging Face checkpoint directory in, one CMF file out (what `cortiq convert` runs).
//!
//! This crate needs nothing above the format and the codecs, so model crates convert their test
//! fixtures without the engine. The principal function is [`convert`]. It opens the directory ([`source::Checkpoint`]: the
//! safetensors shards are memory-mapped, never read whole), asks the architecture's mapping
//! (`qwen4`, `dsv4`, `dsv41`) for a plan (one [`Job`] per CMF tensor: canonical name, role, where its
//! values come from), checks the plan against `config.json`, then converts and writes the
//! tensors one at a time. The canonical names, the roles and every profile's dtypes are
//! documented in `docs/convert.md`.
//!
//! ```no_run
//! use cmf_convert::{ConvertOptions, Profile, convert};
//! let opts = ConvertOptions::new("hf-dir".into(), "model.cmf".into(), Profile::Q4);
//! let report = convert(&opts, &mut |p| eprintln!("{}/{}", p.tensors_done, p.tensors_total))?;
//! println!("{} tensors", report.tensors);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(missing_docs)]

mod decode;
mod dsv4;
mod dsv41;
mod profile;
mod qwen4;
pub mod source;

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use cmf_format::{CmfError, CmfWriter, Header};
use quant_codecs::{CodecError, DType};
use safetensors::Dtype;
use serde_json::Value;

pub use decode::e4m3;
/// The role of a canonical `deepseek_v4` tensor name.
pub use dsv4::role as dsv4_role;
pub use profile::{Profile, Role};
/// The role of a canonical `qwen4_exp` tensor name (what a profile decides its dtype from).
pub use qwen4::role as qwen4_role;
use source::{Checkpoint, SourceTensor, read_json};

/// What to convert, where, and how.
#[derive(Debug, Clone)]
pub struct ConvertOptions {
    /// The Hugging Face checkpoint directory.
    pub input: PathBuf,
    /// The CMF file to write (appears only when the conversion succeeds).
    pub output: PathBuf,
    /// The quantisation profile.
    pub profile: Profile,
    /// Matrices of plain floats whose values take more than this many bytes as f32 are
    /// quantised a block of rows at a time (same bytes, bounded memory). Default 64 MiB
    /// ([`ConvertOptions::new`]); tests set 0 to stream everything.
    pub stream_above: usize,
}

impl ConvertOptions {
    /// Options with the default streaming threshold.
    pub fn new(input: PathBuf, output: PathBuf, profile: Profile) -> ConvertOptions {
        ConvertOptions {
            input,
            output,
            profile,
            stream_above: STREAM_F32_BYTES,
        }
    }
}

/// Progress, reported after each tensor is written.
#[derive(Debug, Clone)]
pub struct Progress<'a> {
    /// The tensor just written (canonical name).
    pub tensor: &'a str,
    /// Tensors written so far.
    pub tensors_done: usize,
    /// Tensors to write.
    pub tensors_total: usize,
    /// Source bytes consumed so far.
    pub bytes_done: u64,
    /// Source bytes to consume.
    pub bytes_total: u64,
}

/// What a finished conversion wrote.
#[derive(Debug, Clone)]
pub struct ConvertReport {
    /// The file written.
    pub output: PathBuf,
    /// `model_type`.
    pub architecture: String,
    /// Tensors written.
    pub tensors: usize,
    /// Source tensor bytes read.
    pub source_bytes: u64,
    /// Size of the CMF file.
    pub output_bytes: u64,
    /// Tensors written verbatim from the source encoding (DeepSeek FP4 experts under `fp4`,
    /// DeepSeek-V4.1's FP8 Engram tables as mxfp8 under every profile).
    pub verbatim: usize,
    /// Tensors whose profile format did not fit their width and fell back (docs/convert.md).
    pub fallbacks: usize,
    /// Matrices quantised a block of rows at a time (see [`ConvertOptions::stream_above`]).
    pub streamed: usize,
    /// Source tensors deliberately not converted: a vision tower, its aligner and image
    /// delimiters (the engine is text-only).
    pub skipped: usize,
}

/// Why a conversion failed. Every variant names the file and, where one is involved, the tensor.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConvertError {
    /// Reading a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A required file is missing.
    #[error("{}: file not found", path.display())]
    MissingFile {
        /// The file.
        path: PathBuf,
    },
    /// A shard the index names is missing.
    #[error("{}: shard not found (the index puts tensor {tensor:?} in it)", path.display())]
    MissingShard {
        /// The shard.
        path: PathBuf,
        /// A tensor the index places in it.
        tensor: String,
    },
    /// A JSON file does not parse.
    #[error("{}: invalid JSON: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error.
        source: serde_json::Error,
    },
    /// A config or index field is missing or wrong.
    #[error("{}: {detail}", path.display())]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// `model_type` is not one the converter knows.
    #[error("{}: unknown model_type {found:?} (supported: qwen4_exp, deepseek_v4, deepseek_v41)", path.display())]
    UnknownModelType {
        /// config.json.
        path: PathBuf,
        /// The value found.
        found: String,
    },
    /// A safetensors file's header is invalid.
    #[error("{}: invalid safetensors file: {detail}", path.display())]
    Safetensors {
        /// The shard.
        path: PathBuf,
        /// The parser's message.
        detail: String,
    },
    /// A safetensors file is shorter (or longer) than its header says.
    #[error("{}: truncated safetensors file ({file_len} bytes): tensor {tensor:?} extends past the end", path.display())]
    Truncated {
        /// The shard.
        path: PathBuf,
        /// The first tensor whose data is cut off (empty if none could be named).
        tensor: String,
        /// The file's length.
        file_len: u64,
    },
    /// The index names a tensor its shard does not hold.
    #[error("{}: names tensor {tensor:?} in {}, which does not contain it", index.display(), shard.display())]
    IndexMissingTensor {
        /// The index file.
        index: PathBuf,
        /// The tensor.
        tensor: String,
        /// The shard named.
        shard: PathBuf,
    },
    /// A tensor the mapping needs is not in the checkpoint.
    #[error("{}: tensor {tensor:?} not found (needed for {needed_by:?})", dir.display())]
    MissingTensor {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The missing tensor.
        tensor: String,
        /// The output tensor that needs it.
        needed_by: String,
    },
    /// A tensor name the architecture's mapping does not know.
    #[error("{}: tensor {tensor:?} has no CMF name in the {arch} mapping", path.display())]
    UnknownTensor {
        /// The shard.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The architecture.
        arch: String,
    },
    /// A tensor's shape contradicts config.json or its companion tensors.
    #[error("{}: tensor {tensor:?}: expected shape {expected}, found {found:?}", path.display())]
    Shape {
        /// The shard.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// What was expected.
        expected: String,
        /// What the file holds.
        found: Vec<usize>,
    },
    /// An FP8 weight's block-scale grid (its `<stem>.scale`) does not fit its shape in blocks of
    /// `quantization_config.weight_block_size`.
    #[error(
        "{}: tensor {tensor:?} {weight:?}: scale {:?} is {found:?}, expected {:?} (blocks of {block:?}, quantization_config.weight_block_size)",
        path.display(),
        scale_name(tensor),
        decode::fp8_grid_shape(*weight, *block)
    )]
    ScaleGrid {
        /// The shard holding the weight.
        path: PathBuf,
        /// The FP8 weight.
        tensor: String,
        /// The weight's shape.
        weight: [usize; 2],
        /// `[rows, cols]` of one block.
        block: [usize; 2],
        /// The scale tensor's shape.
        found: Vec<usize>,
    },
    /// A tensor's dtype is not one the converter reads for it.
    #[error("{}: tensor {tensor:?}: unsupported dtype {dtype}", path.display())]
    UnsupportedDtype {
        /// The shard.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The dtype found.
        dtype: String,
    },
    /// An integer tensor holds a value f32 cannot represent exactly.
    #[error("{}: tensor {tensor:?}: integer {value} is not exact in f32 (|v| > 2^24)", path.display())]
    IntegerNotExact {
        /// The shard.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The offending value.
        value: i64,
    },
    /// Encoding a tensor failed (e.g. a NaN in a matrix to quantise).
    #[error("{}: tensor {tensor:?}: {source}", path.display())]
    Codec {
        /// The shard.
        path: PathBuf,
        /// The output tensor.
        tensor: String,
        /// The codec's error.
        source: CodecError,
    },
    /// Writing the CMF file failed (nothing is left at the output path).
    #[error(transparent)]
    Cmf(#[from] CmfError),
    /// Writing one tensor failed (a full disk, say); nothing is left at the output path.
    #[error("{}: writing tensor {tensor}: {source}", path.display())]
    WriteTensor {
        /// The output file.
        path: PathBuf,
        /// The tensor being written.
        tensor: String,
        /// What the writer reported.
        source: Box<CmfError>,
    },
}

/// Where a CMF tensor's values come from.
#[derive(Debug, Clone)]
pub enum Src {
    /// One source tensor. Float, integer, FP8 (`<stem>.scale` alongside, a block grid of
    /// `weight_block_size`) or FP4 (`I8`, with `<stem>.scale`).
    Tensor(String),
    /// An FP8 E4M3 table with one E8M0 scale per 32 inputs of a row (`<stem>.scale`
    /// `[rows, cols/32]`): an mxfp8 payload as stored (DeepSeek-V4.1's Engram tables).
    Mxfp8(String),
    /// Matrix `index` of a stacked `[E, rows, cols]` source tensor.
    Slice {
        /// The stacked tensor.
        name: String,
        /// Which matrix.
        index: usize,
    },
    /// The rows of several sources, one after the other (gate rows, then up rows).
    Rows(Vec<Src>),
}

/// What an architecture's mapping produced: the header config and the tensors to write.
pub(crate) struct Plan {
    /// The config for the CMF header (a composite config's `text_config`).
    pub config: Value,
    /// One job per CMF tensor.
    pub jobs: Vec<Job>,
    /// Source tensors deliberately left out (vision tower and the like).
    pub skipped: usize,
}

/// One CMF tensor to write.
#[derive(Debug, Clone)]
pub struct Job {
    /// Canonical CMF name.
    pub name: String,
    /// Role (decides the dtype under each profile).
    pub role: Role,
    /// Where the values come from.
    pub src: Src,
    /// Logical shape (FP4 sources: unpacked).
    pub shape: Vec<usize>,
    /// Source bytes this job reads.
    pub source_bytes: u64,
}

/// Converts `opts.input` to `opts.output`, calling `progress` after each tensor. On any error
/// nothing is left at the output path.
pub fn convert(
    opts: &ConvertOptions,
    progress: &mut dyn FnMut(&Progress<'_>),
) -> Result<ConvertReport, ConvertError> {
    let ckpt = Checkpoint::open(&opts.input)?;
    let config_path = opts.input.join("config.json");
    let model_type = ckpt
        .config
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let Plan {
        config: text_config,
        jobs,
        skipped,
    } = match model_type.as_str() {
        "qwen4_exp" => qwen4::plan(&ckpt, &config_path)?,
        "deepseek_v4" => dsv4::plan(&ckpt, &config_path)?,
        "deepseek_v41" => dsv41::plan(&ckpt, &config_path)?,
        _ => {
            return Err(ConvertError::UnknownModelType {
                path: config_path,
                found: model_type,
            });
        }
    };
    let header = build_header(&opts.input, &ckpt, &model_type, text_config, opts.profile)?;

    let mut writer = CmfWriter::create(&opts.output, header)?;
    let bytes_total: u64 = jobs.iter().map(|j| j.source_bytes).sum();
    let mut bytes_done = 0u64;
    let (mut verbatim, mut fallbacks, mut streamed) = (0, 0, 0);
    for (i, job) in jobs.iter().enumerate() {
        let report = |bytes_done| Progress {
            tensor: &job.name,
            tensors_done: i + 1,
            tensors_total: jobs.len(),
            bytes_done,
            bytes_total,
        };
        // An error returned from here drops `writer`, which removes its temporary file.
        if let Some(ints) = wide_integers(&ckpt, job)? {
            let table = writer
                .header_mut()
                .extra
                .entry(INTEGER_TENSORS)
                .or_insert_with(|| Value::Object(Default::default()));
            if let Value::Object(m) = table {
                m.insert(
                    job.name.clone(),
                    serde_json::json!({ "shape": job.shape, "data": ints }),
                );
            }
            bytes_done += job.source_bytes;
            progress(&report(bytes_done));
            continue;
        }
        let writing = |e| match e {
            ConvertError::Cmf(source) => ConvertError::WriteTensor {
                path: opts.output.clone(),
                tensor: job.name.clone(),
                source: Box::new(source),
            },
            e => e,
        };
        if mxfp8_verbatim_job(&ckpt, job, opts.profile, &mut writer).map_err(writing)? {
            verbatim += 1;
            bytes_done += job.source_bytes;
            progress(&report(bytes_done));
            continue;
        }
        if stream_job(&ckpt, job, opts.profile, opts.stream_above, &mut writer).map_err(writing)? {
            streamed += 1;
            bytes_done += job.source_bytes;
            progress(&report(bytes_done));
            continue;
        }
        let (dtype, bytes, was_verbatim) = encode_job(&ckpt, job, opts.profile)?;
        if job.shape.len() == 2
            && dtype.is_quantized()
            && opts.profile != Profile::Source
            && dtype != opts.profile.dtype_for(job.role, &[job.shape[0], 1 << 20])
        {
            fallbacks += 1;
        }
        verbatim += usize::from(was_verbatim);
        writer
            .add_tensor(&job.name, dtype, &job.shape, &bytes)
            .map_err(|source| ConvertError::WriteTensor {
                path: opts.output.clone(),
                tensor: job.name.clone(),
                source: Box::new(source),
            })?;
        drop(bytes);
        bytes_done += job.source_bytes;
        progress(&report(bytes_done));
    }
    let output = writer.finish()?;
    let output_bytes = std::fs::metadata(&output)
        .map_err(|source| ConvertError::Io {
            path: output.clone(),
            source,
        })?
        .len();
    Ok(ConvertReport {
        output,
        architecture: model_type,
        tensors: jobs.len(),
        source_bytes: bytes_total,
        output_bytes,
        verbatim,
        fallbacks,
        streamed,
        skipped,
    })
}

/// The header field holding integer tensors that f32 cannot hold exactly.
pub const INTEGER_TENSORS: &str = "integer_tensors";

/// Integer tensors with more elements than this must be exact in f32 (they would bloat the
/// header); the PLE hash multipliers are a handful of values.
const MAX_HEADER_INTEGERS: usize = 4096;

/// For an integer tensor with a value beyond 2^24: its values, for the header.
fn wide_integers(ckpt: &Checkpoint, job: &Job) -> Result<Option<Vec<i64>>, ConvertError> {
    let (Role::Integer, Src::Tensor(name)) = (job.role, &job.src) else {
        return Ok(None);
    };
    let t = ckpt.get(name, &job.name)?;
    let v = decode::integer_i64(&t)?;
    match v.iter().find(|x| x.abs() > decode::F32_EXACT) {
        None => Ok(None),
        Some(_) if v.len() <= MAX_HEADER_INTEGERS => Ok(Some(v)),
        Some(&bad) => Err(ConvertError::IntegerNotExact {
            path: t.file.to_path_buf(),
            tensor: t.name.to_string(),
            value: bad,
        }),
    }
}

/// The default [`ConvertOptions::stream_above`]: matrices whose f32 values would take more
/// than this are quantised a block of rows at a time ([`stream_job`]).
const STREAM_F32_BYTES: usize = 64 << 20;

/// f32 bytes of source rows decoded per block when streaming.
const BLOCK_F32_BYTES: usize = 16 << 20;

/// Copies an FP8 row table ([`Src::Mxfp8`]) into an mxfp8 tensor when the profile keeps it
/// mxfp8 (the Engram role always does): the code plane is the source's E4M3 bytes, the scale
/// plane its E8M0 bytes, streamed to the writer a block at a time with each block's source
/// pages released, so a table of hundreds of GB never sits in memory. Returns false for a job
/// it does not handle.
fn mxfp8_verbatim_job(
    ckpt: &Checkpoint,
    job: &Job,
    profile: Profile,
    writer: &mut CmfWriter,
) -> Result<bool, ConvertError> {
    let Src::Mxfp8(name) = &job.src else {
        return Ok(false);
    };
    if profile.dtype_for(job.role, &job.shape) != DType::Mxfp8 {
        return Ok(false);
    }
    let w = ckpt.get(name, &job.name)?;
    let s = ckpt.get(&scale_name(name), &job.name)?;
    decode::mx8_shape(&w, &s)?;
    let mut chunks = [w, s].into_iter().flat_map(|t| {
        t.bytes
            .chunks(BLOCK_F32_BYTES)
            .map(move |bytes| SourceTensor { bytes, ..t })
    });
    let blocks = std::iter::from_fn(|| {
        let part = chunks.next()?;
        let bytes = part.bytes.to_vec();
        ckpt.release(&part);
        Some(Ok(bytes))
    });
    write_blocks(writer, job, DType::Mxfp8, blocks)?;
    Ok(true)
}

/// Writes `job` from encoded blocks pulled as the writer asks; a failure inside an iterator
/// is returned as itself once the writer reports the broken stream.
fn write_blocks(
    writer: &mut CmfWriter,
    job: &Job,
    dtype: DType,
    mut blocks: impl Iterator<Item = Result<Vec<u8>, ConvertError>>,
) -> Result<(), ConvertError> {
    let failure = std::cell::RefCell::new(None);
    let mut source = BlockReader {
        blocks: &mut blocks,
        current: std::io::Cursor::new(Vec::new()),
        failure: &failure,
    };
    let result = writer.add_tensor_from_reader(&job.name, dtype, &job.shape, &mut source);
    if let Some(e) = failure.into_inner() {
        return Err(e);
    }
    result?;
    Ok(())
}

/// Converts a large plain-float (f32, f16, bf16) matrix block by block: each block of rows is
/// decoded, quantised and written, its source pages released (q8_2f first reads every block
/// once for its column maxima). Returns false for a job it does not handle.
fn stream_job(
    ckpt: &Checkpoint,
    job: &Job,
    profile: Profile,
    stream_above: usize,
    writer: &mut CmfWriter,
) -> Result<bool, ConvertError> {
    let Src::Tensor(name) = &job.src else {
        return Ok(false);
    };
    let [rows, cols] = job.shape[..] else {
        return Ok(false);
    };
    let Some(meta) = ckpt.meta(name) else {
        return Ok(false);
    };
    if !decode::is_float(meta.dtype) || rows * cols * 4 <= stream_above {
        return Ok(false);
    }
    let dtype = job_dtype(ckpt, job, profile);
    let t = ckpt.get(name, &job.name)?;
    let src_row = t.bytes.len() / rows;
    let block = (BLOCK_F32_BYTES / (cols * 4)).max(1);
    let decode_rows = |r0: usize, r1: usize| -> Result<Vec<f32>, ConvertError> {
        let shape = [r1 - r0, cols];
        let part = SourceTensor {
            bytes: &t.bytes[r0 * src_row..r1 * src_row],
            shape: &shape,
            ..t
        };
        let v = decode::plain_f32(&part)?;
        ckpt.release(&part);
        Ok(v)
    };
    let codec_err = |source| ConvertError::Codec {
        path: t.file.to_path_buf(),
        tensor: job.name.clone(),
        source,
    };
    let colmax = if dtype == DType::Q8_2f {
        let mut m = vec![0.0f32; cols];
        for r0 in (0..rows).step_by(block) {
            quant_codecs::column_maxima(&mut m, &decode_rows(r0, (r0 + block).min(rows))?);
        }
        Some(m)
    } else {
        None
    };
    let mut enc = Some(
        quant_codecs::RowEncoder::new(dtype, rows, cols, colmax.as_deref()).map_err(codec_err)?,
    );
    let mut next = 0usize;
    // The writer pulls bytes and blocks are encoded as it asks.
    let blocks = std::iter::from_fn(|| {
        let e = enc.as_mut()?;
        if next < rows {
            let r1 = (next + block).min(rows);
            let out = decode_rows(next, r1).and_then(|v| e.push_rows(&v).map_err(codec_err));
            next = r1;
            Some(out)
        } else {
            Some(enc.take()?.finish().map_err(codec_err))
        }
    });
    write_blocks(writer, job, dtype, blocks)?;
    Ok(true)
}

/// Adapts an iterator of encoded blocks to `std::io::Read` for the CMF writer.
struct BlockReader<'a, I: Iterator<Item = Result<Vec<u8>, ConvertError>>> {
    blocks: &'a mut I,
    current: std::io::Cursor<Vec<u8>>,
    failure: &'a std::cell::RefCell<Option<ConvertError>>,
}

impl<I: Iterator<Item = Result<Vec<u8>, ConvertError>>> std::io::Read for BlockReader<'_, I> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let n = self.current.read(buf)?;
            if n > 0 || buf.is_empty() {
                return Ok(n);
            }
            match self.blocks.next() {
                None => return Ok(0),
                Some(Ok(bytes)) => self.current = std::io::Cursor::new(bytes),
                Some(Err(e)) => {
                    let msg = e.to_string();
                    *self.failure.borrow_mut() = Some(e);
                    return Err(std::io::Error::other(msg));
                }
            }
        }
    }
}

/// The dtype `profile` gives `job`: the profile's choice for its role and shape, or for
/// [`Profile::Source`], the one its source tensors' dtypes keep exactly.
fn job_dtype(ckpt: &Checkpoint, job: &Job, profile: Profile) -> DType {
    if profile != Profile::Source {
        return profile.dtype_for(job.role, &job.shape);
    }
    fn leaves(src: &Src, ckpt: &Checkpoint, out: &mut Vec<Dtype>) {
        match src {
            Src::Tensor(n) | Src::Slice { name: n, .. } | Src::Mxfp8(n) => {
                out.extend(ckpt.meta(n).map(|m| m.dtype));
            }
            Src::Rows(parts) => parts.iter().for_each(|p| leaves(p, ckpt, out)),
        }
    }
    let mut dtypes = Vec::new();
    leaves(&job.src, ckpt, &mut dtypes);
    Profile::source_dtype(job.role, &job.shape, &dtypes)
}

/// Converts one job: (dtype, payload, copied verbatim).
fn encode_job(
    ckpt: &Checkpoint,
    job: &Job,
    profile: Profile,
) -> Result<(DType, Vec<u8>, bool), ConvertError> {
    let dtype = job_dtype(ckpt, job, profile);
    if dtype == DType::Mxfp4
        && let Some(bytes) = fp4_verbatim(ckpt, job)?
    {
        return Ok((dtype, bytes, true));
    }
    let values = values(ckpt, &job.src, &job.name)?;
    let n: usize = job.shape.iter().product();
    debug_assert_eq!(values.len(), n);
    let (rows, cols) = if job.shape.len() == 2 && dtype.is_quantized() {
        (job.shape[0], job.shape[1])
    } else {
        (1, n)
    };
    let bytes = if n == 0 {
        Vec::new()
    } else {
        quant_codecs::quantize(dtype, rows, cols, &values).map_err(|source| {
            ConvertError::Codec {
                path: ckpt.file_of(first_name(&job.src)),
                tensor: job.name.clone(),
                source,
            }
        })?
    };
    Ok((dtype, bytes, false))
}

fn first_name(src: &Src) -> &str {
    match src {
        Src::Tensor(n) | Src::Mxfp8(n) | Src::Slice { name: n, .. } => n,
        Src::Rows(parts) => parts.first().map(first_name).unwrap_or(""),
    }
}

/// The companion scale tensor name of `<stem>.weight`.
pub(crate) fn scale_name(weight: &str) -> String {
    match weight.strip_suffix(".weight") {
        Some(stem) => format!("{stem}.scale"),
        None => format!("{weight}.scale"),
    }
}

/// All of `src`'s values as f32, row-major.
fn values(ckpt: &Checkpoint, src: &Src, needed_by: &str) -> Result<Vec<f32>, ConvertError> {
    match src {
        Src::Tensor(name) => {
            let t = ckpt.get(name, needed_by)?;
            let v = tensor_values(ckpt, &t, needed_by)?;
            ckpt.release(&t);
            Ok(v)
        }
        Src::Mxfp8(name) => {
            let t = ckpt.get(name, needed_by)?;
            let s = ckpt.get(&scale_name(name), needed_by)?;
            let v = decode::mx8_f32(&t, &s)?;
            ckpt.release(&t);
            Ok(v)
        }
        Src::Slice { name, index } => {
            let t = ckpt.get(name, needed_by)?;
            if !decode::is_float(t.dtype) {
                return Err(ConvertError::UnsupportedDtype {
                    path: t.file.to_path_buf(),
                    tensor: t.name.to_string(),
                    dtype: format!("{:?} (stacked experts must be f32, f16 or bf16)", t.dtype),
                });
            }
            let per = t.bytes.len() / t.shape[0];
            let part = SourceTensor {
                bytes: &t.bytes[index * per..(index + 1) * per],
                shape: &t.shape[1..],
                ..t
            };
            let v = decode::plain_f32(&part)?;
            ckpt.release(&part);
            Ok(v)
        }
        Src::Rows(parts) => {
            let mut out = Vec::new();
            for p in parts {
                out.extend(values(ckpt, p, needed_by)?);
            }
            Ok(out)
        }
    }
}

fn tensor_values(
    ckpt: &Checkpoint,
    t: &SourceTensor<'_>,
    needed_by: &str,
) -> Result<Vec<f32>, ConvertError> {
    match t.dtype {
        d if decode::is_float(d) => decode::plain_f32(t),
        d if decode::is_integer(d) => decode::integer_f32(t),
        Dtype::F8_E4M3 => {
            let s = ckpt.get(&scale_name(t.name), needed_by)?;
            decode::fp8_f32(t, &s, ckpt.fp8_block)
        }
        Dtype::I8 => {
            let s = ckpt.get(&scale_name(t.name), needed_by)?;
            decode::fp4_f32(t, &s)
        }
        other => Err(ConvertError::UnsupportedDtype {
            path: t.file.to_path_buf(),
            tensor: t.name.to_string(),
            dtype: format!("{other:?}"),
        }),
    }
}

/// If every part of `job` is an FP4 source, its mxfp4 payload re-laid from the source bytes
/// (code plane = the parts' packed bytes in row order, then scale plane = their E8M0 bytes).
fn fp4_verbatim(ckpt: &Checkpoint, job: &Job) -> Result<Option<Vec<u8>>, ConvertError> {
    let mut names = Vec::new();
    fn collect<'s>(src: &'s Src, out: &mut Vec<&'s str>) -> bool {
        match src {
            Src::Tensor(n) => {
                out.push(n);
                true
            }
            Src::Slice { .. } | Src::Mxfp8(_) => false,
            Src::Rows(parts) => parts.iter().all(|p| collect(p, out)),
        }
    }
    if !collect(&job.src, &mut names) {
        return Ok(None);
    }
    let mut codes = Vec::new();
    let mut scales = Vec::new();
    for n in names {
        let w = ckpt.get(n, &job.name)?;
        if w.dtype != Dtype::I8 {
            return Ok(None);
        }
        let s = ckpt.get(&scale_name(n), &job.name)?;
        decode::fp4_shape(&w, &s)?;
        codes.extend_from_slice(w.bytes);
        scales.extend_from_slice(s.bytes);
        ckpt.release(&w);
    }
    codes.extend_from_slice(&scales);
    Ok(Some(codes))
}

/// Adds the job writing `name` from `src`, its role given by the architecture's `role` rule
/// (which also learns whether the source is an integer tensor).
pub(crate) fn push_job(
    ckpt: &Checkpoint,
    jobs: &mut Vec<Job>,
    name: String,
    src: Src,
    role: fn(&str, bool) -> Role,
) -> Result<(), ConvertError> {
    let (shape, source_bytes) = src_shape(ckpt, &src, &name)?;
    let integer = match &src {
        Src::Tensor(n) => ckpt.meta(n).is_some_and(|m| decode::is_integer(m.dtype)),
        _ => false,
    };
    jobs.push(Job {
        role: role(&name, integer),
        name,
        src,
        shape,
        source_bytes,
    });
    Ok(())
}

/// Logical shape and source byte count of `src`, checking that row-concatenated parts agree.
pub(crate) fn src_shape(
    ckpt: &Checkpoint,
    src: &Src,
    needed_by: &str,
) -> Result<(Vec<usize>, u64), ConvertError> {
    match src {
        Src::Tensor(name) => {
            let t = ckpt.get(name, needed_by)?;
            match t.dtype {
                Dtype::I8 => {
                    let s = ckpt.get(&scale_name(name), needed_by)?;
                    let shape = decode::fp4_shape(&t, &s)?;
                    Ok((shape.to_vec(), (t.bytes.len() + s.bytes.len()) as u64))
                }
                Dtype::F8_E4M3 => {
                    // The grid is checked here, before anything is written.
                    let s = ckpt.get(&scale_name(name), needed_by)?;
                    decode::fp8_grid(&t, &s, ckpt.fp8_block)?;
                    Ok((t.shape.to_vec(), (t.bytes.len() + s.bytes.len()) as u64))
                }
                d if decode::is_float(d) || decode::is_integer(d) => {
                    Ok((t.shape.to_vec(), t.bytes.len() as u64))
                }
                other => Err(ConvertError::UnsupportedDtype {
                    path: t.file.to_path_buf(),
                    tensor: t.name.to_string(),
                    dtype: format!("{other:?}"),
                }),
            }
        }
        Src::Mxfp8(name) => {
            let t = ckpt.get(name, needed_by)?;
            let s = ckpt.get(&scale_name(name), needed_by)?;
            let shape = decode::mx8_shape(&t, &s)?;
            Ok((shape.to_vec(), (t.bytes.len() + s.bytes.len()) as u64))
        }
        Src::Slice { name, .. } => {
            let t = ckpt.get(name, needed_by)?;
            if t.shape.len() != 3 {
                return Err(ConvertError::Shape {
                    path: t.file.to_path_buf(),
                    tensor: name.clone(),
                    expected: "[experts, rows, cols]".into(),
                    found: t.shape.to_vec(),
                });
            }
            Ok((t.shape[1..].to_vec(), (t.bytes.len() / t.shape[0]) as u64))
        }
        Src::Rows(parts) => {
            let mut rows = 0;
            let mut cols = None;
            let mut bytes = 0;
            for p in parts {
                let (s, b) = src_shape(ckpt, p, needed_by)?;
                if s.len() != 2 || cols.is_some_and(|c| c != s[1]) {
                    return Err(ConvertError::Shape {
                        path: ckpt.file_of(first_name(p)),
                        tensor: first_name(p).to_string(),
                        expected: format!("a matrix with {} columns", cols.unwrap_or(0)),
                        found: s,
                    });
                }
                rows += s[0];
                cols = Some(s[1]);
                bytes += b;
            }
            Ok((vec![rows, cols.unwrap_or(0)], bytes))
        }
    }
}

/// Checks that job `name` (if planned) has `expected` shape; the error names its source.
pub(crate) fn expect_job_shape(
    ckpt: &Checkpoint,
    jobs: &[Job],
    name: &str,
    expected: &[usize],
    config: &Path,
) -> Result<(), ConvertError> {
    if let Some(j) = jobs.iter().find(|j| j.name == name)
        && j.shape != expected
    {
        let src = first_name(&j.src);
        return Err(ConvertError::Shape {
            path: ckpt.file_of(src),
            tensor: src.to_string(),
            expected: format!("{expected:?} (from {})", config.display()),
            found: j.shape.clone(),
        });
    }
    Ok(())
}

/// Reads an unsigned config field.
pub(crate) fn config_usize(cfg: &Value, key: &str, path: &Path) -> Result<usize, ConvertError> {
    cfg.get(key)
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| ConvertError::Config {
            path: path.to_path_buf(),
            detail: format!("missing or non-integer field {key:?}"),
        })
}

fn build_header(
    dir: &Path,
    ckpt: &Checkpoint,
    model_type: &str,
    text_config: Value,
    profile: Profile,
) -> Result<Header, ConvertError> {
    let mut h = Header::new(model_type);
    let dim = |k: &str| text_config.get(k).and_then(Value::as_u64);
    h.dims.hidden_size = dim("hidden_size");
    h.dims.num_hidden_layers = dim("num_hidden_layers");
    h.dims.vocab_size = dim("vocab_size");
    h.dims.max_position_embeddings = dim("max_position_embeddings");
    if text_config != ckpt.config {
        h.provenance
            .extra
            .insert("source_config".into(), ckpt.config.clone());
    }
    h.config = text_config;
    h.quantization.profile = profile.name().to_string();
    h.provenance.converter = format!("cortiq {}", env!("CARGO_PKG_VERSION"));
    h.provenance.created = Some(utc_now());
    let mut sources = Vec::new();
    let mut add = |name: &str| -> Result<bool, ConvertError> {
        let p = dir.join(name);
        match std::fs::metadata(&p) {
            Ok(m) => {
                sources.push(cmf_format::header::SourceFile {
                    file: name.to_string(),
                    bytes: m.len(),
                });
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(source) => Err(ConvertError::Io { path: p, source }),
        }
    };
    for f in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "model.safetensors.index.json",
    ] {
        add(f)?;
    }
    for (f, _) in ckpt.shard_files() {
        add(&f)?;
    }
    h.provenance.sources = sources;

    let opt_json = |name: &str| -> Result<Option<Value>, ConvertError> {
        let p = dir.join(name);
        if p.exists() {
            read_json(&p).map(Some)
        } else {
            Ok(None)
        }
    };
    h.tokenizer = opt_json("tokenizer.json")?;
    h.generation = opt_json("generation_config.json")?;
    let jinja = dir.join("chat_template.jinja");
    h.chat_template = if jinja.exists() {
        Some(
            std::fs::read_to_string(&jinja).map_err(|source| ConvertError::Io {
                path: jinja,
                source,
            })?,
        )
    } else {
        opt_json("tokenizer_config.json")?.and_then(|tc| match tc.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            // A list of named templates: the one named "default", else the first.
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .or_else(|| list.first())
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_string),
            _ => None,
        })
    };
    Ok(h)
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ`.
/// `SOURCE_DATE_EPOCH` (the reproducible-builds convention), when set, stands for "now", so
/// that converting the same checkpoint twice gives the same bytes (the shipped demo model is
/// checked that way).
fn utc_now() -> String {
    let secs = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|v| v.trim().parse::<i64>().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs() as i64)
                .unwrap_or(0)
        });
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}
