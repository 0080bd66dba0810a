//! The JSON header: what the model is, where it came from, and which sidecars belong to it.
//!
//! Every struct keeps fields it does not know in a flattened `extra` map, so a file written by a
//! newer writer round-trips through this reader without losing them. Optional fields are left out
//! of the JSON when empty, so a minimal header is a few dozen bytes.

use std::collections::HashSet;
use std::path::{Component, Path};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::CmfError;

/// The value of the header's `format` field.
pub const FORMAT: &str = "cmf";

/// The model-level metadata stored as JSON in every CMF file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    /// Always [`FORMAT`] (`"cmf"`).
    pub format: String,
    /// The architecture id that picks the model implementation, e.g. `"qwen4_exp"`, `"deepseek_v4"`.
    pub architecture: String,
    /// The model's own `config.json`, verbatim (as JSON values; key order is not kept).
    #[serde(default = "empty_object")]
    pub config: Value,
    /// Dimensions normalised across architectures, for tools that do not parse `config`.
    #[serde(default, skip_serializing_if = "Dims::is_empty")]
    pub dims: Dims,
    /// The embedded `tokenizer.json`, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<Value>,
    /// The embedded chat template (Jinja source), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<String>,
    /// Generation defaults (`generation_config.json`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<Value>,
    /// How the weights were quantised.
    #[serde(default)]
    pub quantization: Quantization,
    /// Who wrote the file, from what.
    #[serde(default)]
    pub provenance: Provenance,
    /// Companion files that complete this model (e.g. the MTP head).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sidecars: Vec<SidecarRef>,
    /// Set when this file is itself a sidecar.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sidecar_of: Option<SidecarOf>,
    /// Fields this version does not know, preserved.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn empty_object() -> Value {
    Value::Object(Map::new())
}

impl Header {
    /// A minimal header for `architecture`: empty config, profile `"none"`, no sidecars.
    pub fn new(architecture: impl Into<String>) -> Header {
        Header {
            format: FORMAT.to_string(),
            architecture: architecture.into(),
            config: empty_object(),
            dims: Dims::default(),
            tokenizer: None,
            chat_template: None,
            generation: None,
            quantization: Quantization::default(),
            provenance: Provenance::default(),
            sidecars: Vec::new(),
            sidecar_of: None,
            extra: Map::new(),
        }
    }

    /// The sidecar reference with this role, if any.
    pub fn sidecar(&self, role: &str) -> Option<&SidecarRef> {
        self.sidecars.iter().find(|s| s.role == role)
    }

    /// Checks the rules serde cannot express; `path` names the file in errors.
    pub fn validate(&self, path: &Path) -> Result<(), CmfError> {
        let bad = |field: String, detail: String| CmfError::Header {
            path: path.to_path_buf(),
            field,
            detail,
        };
        if self.format != FORMAT {
            return Err(bad(
                "format".into(),
                format!("expected {FORMAT:?}, found {:?}", self.format),
            ));
        }
        if self.architecture.is_empty() {
            return Err(bad("architecture".into(), "must not be empty".into()));
        }
        let mut roles = HashSet::new();
        for (i, s) in self.sidecars.iter().enumerate() {
            if s.role.is_empty() {
                return Err(bad(
                    format!("sidecars[{i}].role"),
                    "must not be empty".into(),
                ));
            }
            if !roles.insert(s.role.as_str()) {
                return Err(bad(
                    format!("sidecars[{i}].role"),
                    format!("role {:?} appears twice", s.role),
                ));
            }
            check_relative(&s.file).map_err(|d| bad(format!("sidecars[{i}].file"), d))?;
        }
        if let Some(of) = &self.sidecar_of
            && of.role.is_empty()
        {
            return Err(bad("sidecar_of.role".into(), "must not be empty".into()));
        }
        Ok(())
    }
}

/// A sidecar path must stay inside the main file's directory: relative, no `..`, not empty.
fn check_relative(file: &str) -> Result<(), String> {
    if file.is_empty() {
        return Err("must not be empty".into());
    }
    let p = Path::new(file);
    if p.components().all(|c| matches!(c, Component::Normal(_))) {
        Ok(())
    } else {
        Err(format!(
            "{file:?} must be a relative path without `..` or `.` components"
        ))
    }
}

/// Normalised model dimensions. Every field is optional; converters fill what the config has.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dims {
    /// Width of the residual stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_size: Option<u64>,
    /// Number of decoder layers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_hidden_layers: Option<u64>,
    /// Vocabulary size (embedding rows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab_size: Option<u64>,
    /// Longest context the model was trained for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_position_embeddings: Option<u64>,
    /// Fields this version does not know, preserved.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Dims {
    /// True when no field is set.
    pub fn is_empty(&self) -> bool {
        self.hidden_size.is_none()
            && self.num_hidden_layers.is_none()
            && self.vocab_size.is_none()
            && self.max_position_embeddings.is_none()
            && self.extra.is_empty()
    }
}

/// How the weights were quantised.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Quantization {
    /// The converter's profile name, e.g. `"q4tp-experts"`; `"none"` for unquantised files.
    #[serde(default = "none_profile")]
    pub profile: String,
    /// Profile parameters, preserved.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn none_profile() -> String {
    "none".to_string()
}

impl Default for Quantization {
    fn default() -> Self {
        Quantization {
            profile: none_profile(),
            extra: Map::new(),
        }
    }
}

/// Who wrote the file, from which source files.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Provenance {
    /// The writing tool and its version, e.g. `"cortiq convert 0.1.0"`.
    #[serde(default)]
    pub converter: String,
    /// The source files the tensors came from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<SourceFile>,
    /// Creation time (RFC 3339), if the writer records one; deterministic writers leave it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created: Option<String>,
    /// Fields this version does not know, preserved.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One source file of a conversion.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceFile {
    /// Its name, relative to the source model's directory.
    pub file: String,
    /// Its size in bytes.
    pub bytes: u64,
}

/// The main file's reference to one sidecar.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SidecarRef {
    /// What the sidecar holds, e.g. `"mtp"`. Unique within one header.
    pub role: String,
    /// Its path, relative to the main file's directory (no `..`).
    pub file: String,
    /// The sidecar's [`uid`](crate::Cmf::uid), as 16 lowercase hex digits in JSON.
    #[serde(with = "hex_u64")]
    pub uid: u64,
}

/// A sidecar's back-reference to its main file.
///
/// It records the role only, not the main file's uid: the main file's uid covers its header, which
/// records the sidecar's uid, so the two cannot both be content hashes of each other. The binding
/// check is the main file's [`SidecarRef::uid`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SidecarOf {
    /// The role this file plays, matching the main file's [`SidecarRef::role`].
    pub role: String,
    /// Fields this version does not know, preserved (a writer may note the main file's name).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Serialises a `u64` as 16 lowercase hex digits: JSON numbers above 2^53 lose precision in many readers.
pub mod hex_u64 {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    /// Writes `v` as `"%016x"`.
    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{v:016x}"))
    }

    /// Reads 1 to 16 hex digits.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let s = String::deserialize(d)?;
        if s.is_empty() || s.len() > 16 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(D::Error::custom(format!(
                "expected up to 16 hex digits, found {s:?}"
            )));
        }
        u64::from_str_radix(&s, 16).map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_header_is_small_and_round_trips() {
        let h = Header::new("tiny");
        let json = serde_json::to_string(&h).unwrap();
        assert_eq!(
            json,
            r#"{"format":"cmf","architecture":"tiny","config":{},"quantization":{"profile":"none"},"provenance":{"converter":""}}"#
        );
        let back: Header = serde_json::from_str(&json).unwrap();
        assert_eq!(back, h);
    }

    #[test]
    fn unknown_fields_are_preserved() {
        let json = r#"{"format":"cmf","architecture":"a","future":{"x":1},"dims":{"hidden_size":8,"head_dim":2},
            "sidecars":[{"role":"mtp","file":"m.cmf","uid":"00000000000000ff"}]}"#;
        let h: Header = serde_json::from_str(json).unwrap();
        assert_eq!(h.extra["future"]["x"], 1);
        assert_eq!(h.dims.extra["head_dim"], 2);
        assert_eq!(h.sidecars[0].uid, 255);
        let again: Header = serde_json::from_str(&serde_json::to_string(&h).unwrap()).unwrap();
        assert_eq!(again, h);
    }

    #[test]
    fn validation_names_the_field() {
        let p = Path::new("x.cmf");
        let mut h = Header::new("a");
        h.format = "gguf".into();
        assert!(matches!(h.validate(p), Err(CmfError::Header { field, .. }) if field == "format"));
        let mut h = Header::new("a");
        for file in ["../evil.cmf", "/abs.cmf", "", "./x"] {
            h.sidecars = vec![SidecarRef {
                role: "mtp".into(),
                file: file.into(),
                uid: 1,
            }];
            assert!(
                matches!(h.validate(p), Err(CmfError::Header { ref field, .. }) if field == "sidecars[0].file"),
                "{file:?}"
            );
        }
        h.sidecars = vec![
            SidecarRef {
                role: "mtp".into(),
                file: "a".into(),
                uid: 1,
            },
            SidecarRef {
                role: "mtp".into(),
                file: "b".into(),
                uid: 2,
            },
        ];
        assert!(h.validate(p).is_err());
    }
}
