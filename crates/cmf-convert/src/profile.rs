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
}

impl Profile {
    /// Every profile.
    pub const ALL: [Profile; 7] = [
        Profile::F32,
        Profile::F16,
        Profile::Bf16,
        Profile::Q8,
        Profile::Q4,
        Profile::Q2,
        Profile::Fp4,
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
                format!("unknown profile {s:?} (expected one of f32, f16, bf16, q8, q4, q2, fp4)")
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
