//! Binding a CMF's tensors by canonical name (docs/convert.md), with the shape the config
//! implies, before anything runs.
//!
//! Matrices stay in their stored dtype as [`MatRef`]s behind a [`Mat`], which keeps the
//! tensor's name and id; small vectors (norm weights, conv kernels, biases) are decoded to f32
//! once into a [`Vector`], named the same way. A missing tensor or a wrong shape is a
//! [`BindError`] naming the tensor.

use std::ops::Deref;

use cmf_format::{Cmf, TensorView};
use quant_codecs::{CodecError, MatRef};

/// Why a tensor cannot be bound.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// A tensor the config requires is absent.
    #[error("missing tensor `{0}`")]
    Missing(String),
    /// A tensor has the wrong shape.
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    Shape {
        /// Tensor name.
        name: String,
        /// Shape the config implies.
        expected: Vec<usize>,
        /// Stored shape.
        found: Vec<usize>,
    },
    /// The payload does not decode.
    #[error("tensor `{name}`: {source}")]
    Codec {
        /// Tensor name.
        name: String,
        /// Codec error.
        source: CodecError,
    },
    /// An integer tensor holds a value that is not a valid integer, or is malformed.
    #[error("tensor `{name}`: {detail}")]
    Integer {
        /// Tensor name.
        name: String,
        /// What is wrong.
        detail: String,
    },
}

/// A bound matrix: its canonical name, its index in the CMF tensor table, and the encoded
/// payload (zero-copy). Dereferences to the [`MatRef`] the kernels take.
#[derive(Debug, Clone)]
pub struct Mat<'a> {
    name: String,
    id: usize,
    mat: MatRef<'a>,
}

impl<'a> Mat<'a> {
    /// A matrix not bound from a file (tests, weights built in memory): `id` is whatever the
    /// caller keys it by.
    pub fn new(name: impl Into<String>, id: usize, mat: MatRef<'a>) -> Mat<'a> {
        Mat {
            name: name.into(),
            id,
            mat,
        }
    }

    /// The canonical tensor name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tensor's index in the CMF tensor table (what a device arena keys uploads by).
    pub fn id(&self) -> usize {
        self.id
    }

    /// The payload as the kernels take it.
    pub fn mat(&self) -> &MatRef<'a> {
        &self.mat
    }
}

impl<'a> Deref for Mat<'a> {
    type Target = MatRef<'a>;

    fn deref(&self) -> &MatRef<'a> {
        &self.mat
    }
}

/// A bound vector decoded to f32, with its canonical name and CMF tensor id. Dereferences to
/// the values.
#[derive(Debug, Clone, PartialEq)]
pub struct Vector {
    name: String,
    id: usize,
    data: Vec<f32>,
}

impl Vector {
    /// A vector not bound from a file (weights made in memory): `id` is whatever the caller
    /// keys it by.
    pub fn new(name: impl Into<String>, id: usize, data: Vec<f32>) -> Vector {
        Vector {
            name: name.into(),
            id,
            data,
        }
    }

    /// The canonical tensor name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tensor's index in the CMF tensor table.
    pub fn id(&self) -> usize {
        self.id
    }

    /// The values.
    pub fn values(&self) -> &[f32] {
        &self.data
    }
}

impl Deref for Vector {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        &self.data
    }
}

impl<'v> IntoIterator for &'v Vector {
    type Item = &'v f32;
    type IntoIter = std::slice::Iter<'v, f32>;

    fn into_iter(self) -> Self::IntoIter {
        self.data.iter()
    }
}

/// Binds tensors from one CMF by name and expected shape.
#[derive(Debug, Clone, Copy)]
pub struct Binder<'a> {
    cmf: &'a Cmf,
}

impl<'a> Binder<'a> {
    /// A binder over `cmf`.
    pub fn new(cmf: &'a Cmf) -> Binder<'a> {
        Binder { cmf }
    }

    /// The file.
    pub fn cmf(&self) -> &'a Cmf {
        self.cmf
    }

    /// The tensor `name` with its table index, checked to have exactly `shape`.
    pub fn view(&self, name: &str, shape: &[usize]) -> Result<(usize, TensorView<'a>), BindError> {
        let (id, v) = self
            .cmf
            .tensor_index(name)
            .and_then(|id| Some((id, self.cmf.tensor_at(id)?)))
            .ok_or_else(|| BindError::Missing(name.to_string()))?;
        if v.shape() != shape {
            return Err(BindError::Shape {
                name: name.to_string(),
                expected: shape.to_vec(),
                found: v.shape().to_vec(),
            });
        }
        Ok((id, v))
    }

    /// The `[rows, cols]` matrix `name`, in its stored dtype.
    pub fn mat(&self, name: &str, rows: usize, cols: usize) -> Result<Mat<'a>, BindError> {
        let (id, v) = self.view(name, &[rows, cols])?;
        let mat =
            MatRef::new(v.dtype(), rows, cols, v.bytes).map_err(|source| codec(name, source))?;
        Ok(Mat {
            name: name.to_string(),
            id,
            mat,
        })
    }

    /// The tensor `name` of `shape`, decoded to f32.
    pub fn vector(&self, name: &str, shape: &[usize]) -> Result<Vector, BindError> {
        let (id, v) = self.view(name, shape)?;
        let data = quant_codecs::dequantize(v.dtype(), shape, v.bytes)
            .map_err(|source| codec(name, source))?;
        Ok(Vector {
            name: name.to_string(),
            id,
            data,
        })
    }

    /// An integer tensor of `shape`: stored as exact f32 values, or (as the converter writes
    /// integer tensors that f32 cannot hold) in the header's `integer_tensors` entry.
    pub fn integers(&self, name: &str, shape: &[usize]) -> Result<Vec<i64>, BindError> {
        if self.cmf.tensor(name).is_some() {
            return self
                .vector(name, shape)?
                .iter()
                .map(|&x| {
                    if x.fract() == 0.0 && x.is_finite() {
                        Ok(x as i64)
                    } else {
                        Err(BindError::Integer {
                            name: name.to_string(),
                            detail: format!("holds the non-integer value {x}"),
                        })
                    }
                })
                .collect();
        }
        let t = self
            .header_integers(name)
            .ok_or_else(|| BindError::Missing(name.to_string()))?;
        let found: Vec<usize> = t
            .get("shape")
            .and_then(|s| s.as_array())
            .map(|s| {
                s.iter()
                    .filter_map(|x| x.as_u64())
                    .map(|x| x as usize)
                    .collect()
            })
            .unwrap_or_default();
        if found != shape {
            return Err(BindError::Shape {
                name: name.to_string(),
                expected: shape.to_vec(),
                found,
            });
        }
        let data = t
            .get("data")
            .and_then(|d| d.as_array())
            .and_then(|d| d.iter().map(|v| v.as_i64()).collect::<Option<Vec<_>>>())
            .ok_or_else(|| BindError::Integer {
                name: name.to_string(),
                detail: "the header entry has no integer `data`".into(),
            })?;
        // The header's `shape` and `data` are independent JSON fields: a short (or long) array
        // under a correct shape would otherwise bind and be indexed out of bounds later.
        let want = shape.iter().try_fold(1usize, |a, &b| a.checked_mul(b));
        if want != Some(data.len()) {
            return Err(BindError::Integer {
                name: name.to_string(),
                detail: format!(
                    "the header entry declares shape {shape:?} but `data` holds {} values",
                    data.len()
                ),
            });
        }
        Ok(data)
    }

    /// The header's `integer_tensors` entry for `name` (the raw JSON), if any.
    pub fn header_integers(&self, name: &str) -> Option<&'a serde_json::Value> {
        self.cmf.header().extra.get("integer_tensors")?.get(name)
    }
}

fn codec(name: &str, source: CodecError) -> BindError {
    BindError::Codec {
        name: name.to_string(),
        source,
    }
}
