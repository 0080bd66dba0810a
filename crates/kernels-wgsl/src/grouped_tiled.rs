//! The grouped experts of a long frame, expert by expert (`wgsl/grouped_tiled*.wgsl`): a sort
//! of the frame's slots by expert into tiles of [`EXPERT_TILE`] slots ([`GroupedTiled::SORT_ENTRY`]),
//! and a kernel that decodes each weight block of an expert once for a tile's slots
//! ([`GroupedTiled::ENTRY`]), on int8 activations. The one-slot grouped kernels (`Matvec` with
//! `grouped`) decode an expert once per slot: at 256 token rows a layer's slots read their
//! experts about five times each.

use crate::{Codec, Epilogue, offset_index, src};

/// Slots of one expert per tile.
pub const EXPERT_TILE: u32 = 8;
/// Bank slots the sort can count (its workgroup memory).
pub const MAX_TILED_EXPERTS: u32 = 2048;

/// One variant: the experts' codec on int8 activations, and the epilogue (the gate/up pair
/// with SiLU, or none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GroupedTiled {
    /// The experts' codec ([`GroupedTiled::supports`]).
    pub codec: Codec,
    /// [`Epilogue::SiluGateUp`] (rows `o` and `o + rows / 2` of an expert give output `o`) or
    /// [`Epilogue::None`].
    pub epilogue: Epilogue,
}

impl GroupedTiled {
    /// The kernel's entry point: workgroup (x, y) computes row tile x of tile y's slots.
    pub const ENTRY: &'static str = "grouped_tiled";
    /// The sort's entry point (one workgroup).
    pub const SORT_ENTRY: &'static str = "expert_tiles";
    /// Lanes of the kernel's workgroup (each computes two weight rows for the tile's slots).
    pub const WG: u32 = 128;

    /// Whether a variant exists for `codec` and `epilogue`.
    pub const fn supports(codec: Codec, epilogue: Epilogue) -> bool {
        matches!(codec, Codec::Q4tp | Codec::Q2tp | Codec::Mxfp4)
            && matches!(epilogue, Epilogue::None | Epilogue::SiluGateUp)
    }

    /// Every variant the runtime may build.
    pub fn all() -> Vec<GroupedTiled> {
        let mut out = Vec::new();
        for codec in Codec::ALL {
            for epilogue in [Epilogue::None, Epilogue::SiluGateUp] {
                if Self::supports(codec, epilogue) {
                    out.push(GroupedTiled { codec, epilogue });
                }
            }
        }
        out
    }

    /// Systematic name.
    pub fn name(&self) -> String {
        format!(
            "grouped_tiled_{}{}",
            self.codec.name(),
            self.epilogue.suffix()
        )
    }

    /// Output rows per workgroup of the kernel for experts of `rows` rows.
    pub fn rows_per_workgroup(&self) -> u32 {
        if self.epilogue == Epilogue::SiluGateUp {
            Self::WG
        } else {
            2 * Self::WG
        }
    }

    /// The assembled module (both entry points).
    ///
    /// # Panics
    /// For a variant [`GroupedTiled::supports`] refuses (the registry never builds one).
    pub fn source(&self) -> String {
        let codec = match self.codec {
            Codec::Q4tp => src::GROUPED_TILED_Q4TP,
            Codec::Q2tp => src::GROUPED_TILED_Q2TP,
            Codec::Mxfp4 => src::GROUPED_TILED_MXFP4,
            c => panic!("no expert-major grouped kernel for {c:?}"),
        };
        // mxfp4's table helpers, or the tiered codecs' shared row parameters.
        let shared = if self.codec == Codec::Mxfp4 {
            src::I8_CODES
        } else {
            src::GROUPED_TILED_TIERED
        };
        let pair = format!(
            "const PAIR: bool = {};",
            self.epilogue == Epilogue::SiluGateUp
        );
        let body = [
            src::DECODE,
            src::COMMON,
            shared,
            src::GROUPED_TILED,
            codec,
            &pair,
        ]
        .join("\n");
        // Every weight load is offset by the tile's bank slot, so the decoders read its expert.
        offset_index(&offset_index(&body, "wv", "sb16"), "ww", "sb4")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Caps, Specialization, validate};

    #[test]
    fn every_variant_validates() {
        assert!(!GroupedTiled::all().is_empty());
        for k in GroupedTiled::all() {
            for caps in [Caps::FULL, Caps::LAVAPIPE] {
                validate(&k.name(), &k.source(), caps, &Specialization(vec![]))
                    .unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }

    #[test]
    fn the_constants_match_the_wgsl() {
        let s = src::GROUPED_TILED;
        assert!(s.contains(&format!("const TS: u32 = {EXPERT_TILE}u;")));
        assert!(s.contains(&format!("const KWG: u32 = {}u;", GroupedTiled::WG)));
        assert!(s.contains(&format!("const MAX_EXPERTS: u32 = {MAX_TILED_EXPERTS}u;")));
        assert!(s.contains(&format!(
            "@workgroup_size({})\nfn {}",
            GroupedTiled::WG,
            GroupedTiled::ENTRY
        )));
        // Every lane stages one block of one slot per step: TS * CK = KWG.
        assert!(s.contains(&format!(
            "const CK: u32 = {}u;",
            GroupedTiled::WG / EXPERT_TILE
        )));
    }
}
