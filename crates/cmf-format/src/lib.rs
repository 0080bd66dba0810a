//! The CMF model container: one file holding a model's tensors and metadata.
//!
//! The principal type is [`Cmf`], an opened file. [`Cmf::open`] memory-maps a file and validates
//! the whole container (preamble, JSON [`Header`], tensor table, sizes, alignment, overlaps)
//! before returning; after that, [`Cmf::tensor`] hands out zero-copy [`TensorView`]s without
//! checking again, and [`Cmf::verify`] checks the payload checksums. Files are written by
//! [`CmfWriter`], which streams payloads and renames the finished file into place atomically.
//! A model may span a main file and sidecars ([`Cmf::open_sidecar`]). The byte-level
//! specification is `docs/cmf.md`.
//!
//! ```
//! use cmf_format::{Cmf, CmfWriter, Header};
//! use quant_codecs::DType;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("model.cmf");
//!
//! let mut header = Header::new("tiny-example");
//! header.provenance.converter = "doctest".into();
//! let mut w = CmfWriter::create(&path, header)?;
//! let norm: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
//! w.add_tensor("model.norm.weight", DType::F32, &[4], &norm)?;
//! w.finish()?;
//!
//! let cmf = Cmf::open(&path)?;
//! assert_eq!(cmf.header().architecture, "tiny-example");
//! let t = cmf.tensor("model.norm.weight").expect("written above");
//! assert_eq!((t.dtype(), t.shape(), t.bytes), (DType::F32, &[4usize][..], &norm[..]));
//! assert_eq!(t.info.offset % cmf_format::ALIGN, 0);
//! cmf.verify()?;
//! # Ok(())
//! # }
//! ```
#![deny(missing_docs)]

mod error;
pub mod header;
pub mod npy;
mod preamble;
mod reader;
mod sidecar;
pub mod table;
mod writer;

pub use error::CmfError;
pub use header::{
    Dims, FORMAT, Header, Provenance, Quantization, SidecarOf, SidecarRef, SourceFile,
};
pub use preamble::{ALIGN, DATA_START, KNOWN_REQUIRED_FEATURES, MAGIC, PREAMBLE_LEN, VERSION};
pub use reader::{Cmf, IN_MEMORY, TensorView, non_regular_kind};
pub use sidecar::check_sidecar;
pub use table::TensorInfo;
pub use writer::{CmfWriter, temp_files};
