//! A Hugging Face checkpoint directory: `config.json`, safetensors shards (one file, or several
//! with `model.safetensors.index.json`), mapped into memory and never read whole.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensorError, SafeTensors};
use serde_json::Value;

use super::ConvertError;

/// One safetensors file, mapped.
struct Shard {
    path: PathBuf,
    map: Mmap,
    /// Byte offset of the data section (8 + header length).
    data_start: usize,
    bytes: u64,
}

/// Where one source tensor lives and what it is.
#[derive(Debug, Clone)]
pub struct TensorMeta {
    /// Index into the shard list.
    shard: usize,
    /// Storage dtype.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// A borrowed source tensor.
#[derive(Debug, Clone, Copy)]
pub struct SourceTensor<'a> {
    /// The tensor's name in the checkpoint.
    pub name: &'a str,
    /// The file that holds it.
    pub file: &'a Path,
    /// Storage dtype.
    pub dtype: Dtype,
    /// Shape.
    pub shape: &'a [usize],
    /// The raw little-endian payload (a view into the mapped file).
    pub bytes: &'a [u8],
}

/// An opened checkpoint directory.
pub struct Checkpoint {
    /// The directory.
    pub dir: PathBuf,
    /// `config.json`, parsed.
    pub config: Value,
    /// `[rows, cols]` of one FP8 scale block: `quantization_config.weight_block_size` (top
    /// level, or inside `text_config` for a flat text config), [`DEFAULT_FP8_BLOCK`] when the
    /// config has none. DeepSeek-V4 uses 128 x 128, V4.1 32 x 32.
    pub fp8_block: [usize; 2],
    shards: Vec<Shard>,
    tensors: BTreeMap<String, TensorMeta>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("fp8_block", &self.fp8_block)
            .field("shards", &self.shards.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// Reads and parses a JSON file.
pub fn read_json(path: &Path) -> Result<Value, ConvertError> {
    let text = std::fs::read(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            ConvertError::MissingFile {
                path: path.to_path_buf(),
            }
        } else {
            ConvertError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    })?;
    serde_json::from_slice(&text).map_err(|source| ConvertError::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// The FP8 scale block when the config does not say (DeepSeek-V4's, and the converter's
/// before V4.1).
pub const DEFAULT_FP8_BLOCK: [usize; 2] = [128, 128];

/// `quantization_config.weight_block_size` of `config` (top level first, then `text_config`'s,
/// where transformers copies it), or [`DEFAULT_FP8_BLOCK`]; anything but two positive integers
/// is an error naming the file.
fn fp8_block(config: &Value, path: &Path) -> Result<[usize; 2], ConvertError> {
    let field = [Some(config), config.get("text_config")]
        .into_iter()
        .flatten()
        .find_map(|c| c.get("quantization_config")?.get("weight_block_size"));
    let Some(v) = field else {
        return Ok(DEFAULT_FP8_BLOCK);
    };
    let dims: Option<Vec<usize>> = v.as_array().map(|a| {
        a.iter()
            .filter_map(|x| x.as_u64().filter(|&n| n > 0).map(|n| n as usize))
            .collect()
    });
    match (dims, v.as_array().map(Vec::len)) {
        (Some(d), Some(2)) if d.len() == 2 => Ok([d[0], d[1]]),
        _ => Err(ConvertError::Config {
            path: path.to_path_buf(),
            detail: format!(
                "quantization_config.weight_block_size must be two positive integers, found {v}"
            ),
        }),
    }
}

impl Checkpoint {
    /// Opens `dir`: parses `config.json`, maps every shard and reads every shard's header.
    /// Checks that each tensor the index names is in the shard it names.
    pub fn open(dir: &Path) -> Result<Checkpoint, ConvertError> {
        let config_path = dir.join("config.json");
        let config = read_json(&config_path)?;
        let fp8_block = fp8_block(&config, &config_path)?;
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        // (file name, tensors the index promises in it)
        let mut files: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let indexed = index_path.exists();
        if indexed {
            let index = read_json(&index_path)?;
            let map = index
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| ConvertError::Config {
                    path: index_path.clone(),
                    detail: "no \"weight_map\" object".into(),
                })?;
            for (tensor, file) in map {
                let file = file.as_str().ok_or_else(|| ConvertError::Config {
                    path: index_path.clone(),
                    detail: format!("weight_map[{tensor:?}] is not a file name"),
                })?;
                files
                    .entry(file.to_string())
                    .or_default()
                    .push(tensor.clone());
            }
        } else if single.exists() {
            files.insert("model.safetensors".into(), Vec::new());
        } else {
            return Err(ConvertError::MissingFile { path: single });
        }

        let mut shards = Vec::new();
        let mut tensors = BTreeMap::new();
        for (file, promised) in files {
            let path = dir.join(&file);
            let shard = map_shard(&path, promised.first().map(String::as_str))?;
            // The header was validated when mapping; read it again for the tensor table.
            let (_, meta) = SafeTensors::read_metadata(&shard.map[..]).map_err(|e| {
                ConvertError::Safetensors {
                    path: path.clone(),
                    detail: e.to_string(),
                }
            })?;
            let idx = shards.len();
            for (name, info) in meta.tensors() {
                tensors.insert(
                    name.clone(),
                    TensorMeta {
                        shard: idx,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        start: shard.data_start + info.data_offsets.0,
                        end: shard.data_start + info.data_offsets.1,
                    },
                );
            }
            for t in &promised {
                if !meta.tensors().contains_key(t) {
                    return Err(ConvertError::IndexMissingTensor {
                        index: index_path.clone(),
                        tensor: t.clone(),
                        shard: path.clone(),
                    });
                }
            }
            shards.push(shard);
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            config,
            fp8_block,
            shards,
            tensors,
        })
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Metadata of `name`, if present.
    pub fn meta(&self, name: &str) -> Option<&TensorMeta> {
        self.tensors.get(name)
    }

    /// The tensor `name`; `needed_by` names the output tensor for the error message.
    pub fn get(&self, name: &str, needed_by: &str) -> Result<SourceTensor<'_>, ConvertError> {
        let (key, m) =
            self.tensors
                .get_key_value(name)
                .ok_or_else(|| ConvertError::MissingTensor {
                    dir: self.dir.clone(),
                    tensor: name.to_string(),
                    needed_by: needed_by.to_string(),
                })?;
        let shard = &self.shards[m.shard];
        Ok(SourceTensor {
            name: key,
            file: &shard.path,
            dtype: m.dtype,
            shape: &m.shape,
            bytes: &shard.map[m.start..m.end],
        })
    }

    /// Tells the OS that `t`'s pages are no longer needed, so resident memory stays bounded by
    /// the tensor being converted (mapped file pages otherwise count towards the process's RSS
    /// until the kernel reclaims them). Best effort: errors are ignored.
    pub fn release(&self, t: &SourceTensor<'_>) {
        let p = t.bytes.as_ptr() as usize;
        for s in &self.shards {
            let base = s.map.as_ptr() as usize;
            if p >= base && p + t.bytes.len() <= base + s.map.len() {
                #[cfg(unix)]
                // SAFETY: the map is a read-only shared mapping of a file this process never
                // writes, so MADV_DONTNEED only drops page-table entries: a later access reads
                // the same bytes from the page cache or the file. Slices into the map that are
                // still alive therefore keep their contents.
                let _ = unsafe {
                    s.map.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        p - base,
                        t.bytes.len(),
                    )
                };
                return;
            }
        }
    }

    /// The file holding `name`.
    pub fn file_of(&self, name: &str) -> PathBuf {
        self.tensors
            .get(name)
            .map(|m| self.shards[m.shard].path.clone())
            .unwrap_or_else(|| self.dir.clone())
    }

    /// (file name relative to the directory, size) of every shard.
    pub fn shard_files(&self) -> Vec<(String, u64)> {
        self.shards
            .iter()
            .map(|s| {
                let name = s
                    .path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                (name, s.bytes)
            })
            .collect()
    }
}

fn map_shard(path: &Path, some_tensor: Option<&str>) -> Result<Shard, ConvertError> {
    let file = File::open(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            ConvertError::MissingShard {
                path: path.to_path_buf(),
                tensor: some_tensor.unwrap_or("").to_string(),
            }
        } else {
            ConvertError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    })?;
    let bytes = file
        .metadata()
        .map_err(|source| ConvertError::Io {
            path: path.to_path_buf(),
            source,
        })?
        .len();
    // SAFETY: the map is read-only and the converter only reads it. A checkpoint modified by
    // another process while it is converted can change what is read (not memory safety in
    // the sense of this program's invariants: every access is bounds-checked against the
    // header validated below, and the data is plain bytes); documented in docs/convert.md.
    let map = unsafe { Mmap::map(&file) }.map_err(|source| ConvertError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    match SafeTensors::read_metadata(&map[..]) {
        Ok((n, _)) => Ok(Shard {
            path: path.to_path_buf(),
            map,
            data_start: 8 + n,
            bytes,
        }),
        Err(SafeTensorError::MetadataIncompleteBuffer) => Err(ConvertError::Truncated {
            path: path.to_path_buf(),
            tensor: first_cut_tensor(&map[..]).unwrap_or_default(),
            file_len: bytes,
        }),
        Err(e) => Err(ConvertError::Safetensors {
            path: path.to_path_buf(),
            detail: e.to_string(),
        }),
    }
}

/// For a file whose data section is shorter (or longer) than its header says: the first
/// tensor (by offset) whose bytes are not all in the file.
fn first_cut_tensor(buf: &[u8]) -> Option<String> {
    let n = u64::from_le_bytes(buf.get(..8)?.try_into().ok()?) as usize;
    let header: serde_json::Map<String, Value> = serde_json::from_slice(buf.get(8..8 + n)?).ok()?;
    let avail = buf.len() - 8 - n;
    let mut cut: Vec<(u64, &String)> = header
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .filter_map(|(k, v)| {
            let off = v.get("data_offsets")?.as_array()?;
            let end = off.get(1)?.as_u64()?;
            (end as usize > avail).then_some((off.first()?.as_u64()?, k))
        })
        .collect();
    cut.sort();
    cut.first().map(|(_, k)| (*k).clone())
}
