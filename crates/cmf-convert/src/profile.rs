//! Quantisation profiles: which CMF dtype each tensor gets, from its role and shape.

use quant_codecs::{DType, GROUP};

/// What a tensor is, decided from its name by the architecture's mapping (docs/convert.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Norm weights, biases, sinks, position biases, conv kernels, any non-matrix.
    Vector,
    /// Integer buffers (stored as exact f32 in every profile).
    Integer,
    /// Hyper-connection (HC / mHC) matrices.
    HyperConnection,
    /// Router (gate) matrices.
    Router,
    /// Token embedding, PLE n-gram tables, lm_head.
    Embedding,
    /// Every other projection matrix.
    Projection,
    /// The shared expert's gate, up and down projections: every token runs them, so the 4-bit
    /// and 2-bit profiles keep them at 8 bits (docs/quality.md: on the trained deepseek_v4 demo,
    /// a 4-bit shared expert alone made fp4's KL 13x larger).
    SharedExpert,
    /// Routed expert gate/up (fused gate_up).
    ExpertGateUp,
    /// Routed expert down projection.
    ExpertDown,
    /// DeepSeek-V4.1 Engram lookup tables stored as FP8 rows with a scale per 32 inputs: mxfp8
    /// in every profile, copied verbatim. That is exact (the stored values, bit for bit) and
    /// the smallest a lossless copy can be (8.25 bits a value; f32 or bf16 would be 4x or 2x
    /// the release's ~200 GB of tables, and any requantisation would add error to a table
    /// whose rows are only ever gathered, never multiplied through a kernel that cares).
    EngramTable,
}

/// A `--quant` profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// Everything f32.
    F32,
    /// Everything f16 (integers f32).
    F16,
    /// Everything bf16 (integers f32); exact from bf16 sources.
    Bf16,
    /// Every matrix q8_2f, vectors f32.
    Q8,
    /// Routed experts q4tp, HC/router f16, other matrices (shared expert too) q8_2f, vectors f32.
    Q4,
    /// As q4 but routed expert gate/up q2tp (down q4tp).
    Q2,
    /// As q4 but routed experts mxfp4 (DeepSeek FP4 experts copied verbatim).
    Fp4,
    /// Every tensor in its checkpoint precision, nothing rounded: f32 stays f32, bf16 bf16,
    /// f16 f16, FP4 experts mxfp4 verbatim, FP8 E4M3 matrices with power-of-two block scales
    /// bf16 (exact: 3 mantissa bits into 7, the scale into the exponent). What exactness
    /// against the reference is judged on for DeepSeek, whose release keeps the mHC and a few
    /// other tensors in f32 (bf16 would move the logits by ~2e-3 relative).
    Source,
}

impl Profile {
    /// Every profile.
    pub const ALL: [Profile; 8] = [
        Profile::F32,
        Profile::F16,
        Profile::Bf16,
        Profile::Q8,
        Profile::Q4,
        Profile::Q2,
        Profile::Fp4,
        Profile::Source,
    ];

    /// The command-line name.
    pub const fn name(self) -> &'static str {
        match self {
            Profile::F32 => "f32",
            Profile::F16 => "f16",
            Profile::Bf16 => "bf16",
            Profile::Q8 => "q8",
            Profile::Q4 => "q4",
            Profile::Q2 => "q2",
            Profile::Fp4 => "fp4",
            Profile::Source => "source",
        }
    }

    /// The dtype this profile wants for a tensor of `role` before the width fallback.
    fn wanted(self, role: Role, is_matrix: bool) -> DType {
        if role == Role::Integer {
            return DType::F32;
        }
        if role == Role::EngramTable && is_matrix {
            return DType::Mxfp8;
        }
        match self {
            Profile::F32 => return DType::F32,
            Profile::F16 => return DType::F16,
            Profile::Bf16 => return DType::BF16,
            // The source's own dtype decides ([`Profile::source_dtype`]); f32 where unknown.
            Profile::Source => return DType::F32,
            _ => {}
        }
        if !is_matrix || role == Role::Vector {
            return DType::F32;
        }
        if self == Profile::Q8 {
            return DType::Q8_2f;
        }
        match role {
            Role::HyperConnection | Role::Router => DType::F16,
            Role::Embedding | Role::Projection | Role::SharedExpert => DType::Q8_2f,
            Role::ExpertGateUp => match self {
                Profile::Q2 => DType::Q2tp,
                Profile::Fp4 => DType::Mxfp4,
                _ => DType::Q4tp,
            },
            Role::ExpertDown => match self {
                Profile::Fp4 => DType::Mxfp4,
                _ => DType::Q4tp,
            },
            Role::Vector | Role::Integer => DType::F32,
            Role::EngramTable => DType::Mxfp8,
        }
    }

    /// The dtype [`Profile::Source`] gives a tensor of `role` and logical `shape` whose source
    /// tensors have the dtypes `sources` (several for a fused matrix): the widest float among
    /// them; FP4 experts mxfp4 (where the rows fit groups of 32); FP8 bf16.
    pub fn source_dtype(role: Role, shape: &[usize], sources: &[safetensors::Dtype]) -> DType {
        use safetensors::Dtype as S;
        let is_matrix = shape.len() == 2 && shape.iter().all(|&d| d > 0);
        if role == Role::Integer {
            return DType::F32;
        }
        if role == Role::EngramTable && is_matrix {
            return DType::Mxfp8;
        }
        let fits = shape.get(1).is_some_and(|c| c.is_multiple_of(GROUP));
        let has = |d: S| sources.contains(&d);
        if has(S::F32) || has(S::F64) || sources.is_empty() {
            DType::F32
        } else if has(S::I8) && is_matrix && fits {
            DType::Mxfp4
        } else if has(S::BF16) || has(S::F8_E4M3) || has(S::F8_E5M2) || has(S::I8) {
            if has(S::F16) { DType::F32 } else { DType::BF16 }
        } else if has(S::F16) {
            DType::F16
        } else {
            DType::F32
        }
    }

    /// The dtype of a tensor of `role` and logical `shape`: the profile's choice, falling back
    /// to q8_2f and then f16 when the row width does not fit the format's groups of 32.
    pub fn dtype_for(self, role: Role, shape: &[usize]) -> DType {
        let is_matrix = shape.len() == 2 && shape.iter().all(|&d| d > 0);
        let d = self.wanted(role, is_matrix);
        match d {
            DType::Q4tp | DType::Q2tp | DType::Mxfp4 | DType::Mxfp8
                if !shape.get(1).is_some_and(|c| c.is_multiple_of(GROUP)) =>
            {
                DType::Q8_2f
            }
            _ => d,
        }
    }
}

impl std::str::FromStr for Profile {
    type Err = String;
    fn from_str(s: &str) -> Result<Profile, String> {
        Profile::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown profile {s:?} (expected one of f32, f16, bf16, q8, q4, q2, fp4, source)"
                )
            })
    }
}

impl std::fmt::Display for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrow_matrices_fall_back_to_q8() {
        assert_eq!(
            Profile::Q4.dtype_for(Role::ExpertDown, &[32, 16]),
            DType::Q8_2f
        );
        assert_eq!(
            Profile::Q4.dtype_for(Role::ExpertDown, &[32, 64]),
            DType::Q4tp
        );
        assert_eq!(
            Profile::Q2.dtype_for(Role::ExpertGateUp, &[32, 64]),
            DType::Q2tp
        );
        assert_eq!(Profile::Q4.dtype_for(Role::Vector, &[64]), DType::F32);
        assert_eq!(Profile::Q8.dtype_for(Role::Router, &[8, 64]), DType::Q8_2f);
        assert_eq!(Profile::Q4.dtype_for(Role::Router, &[8, 64]), DType::F16);
        assert_eq!(Profile::Bf16.dtype_for(Role::Integer, &[8]), DType::F32);
    }

    #[test]
    fn engram_tables_are_mxfp8_in_every_profile() {
        for p in Profile::ALL {
            assert_eq!(
                p.dtype_for(Role::EngramTable, &[834, 64]),
                DType::Mxfp8,
                "{p}"
            );
        }
    }
}
