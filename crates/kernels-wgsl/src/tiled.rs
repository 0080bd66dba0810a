//! The tiled matmat for long frames (`wgsl/tiled*.wgsl`): a prompt's frames of 32-256 token
//! rows, where the 8-row kernel re-reads each weight chunk and every activation once per 8
//! rows. Variants: f16 weights on f32 activations (the chunk decoded in software or through
//! the hardware conversion) or q8_2f weights on int8 activations, the epilogue, and whether
//! the columns are split over several workgroups (partial sums in a scratch buffer, then
//! [`Tiled::REDUCE_ENTRY`]).

use crate::{AUX_DECL, Caps, Codec, Epilogue, Path, src};

/// Token rows of a tile.
pub const TILE_TOKENS: u32 = 64;
/// Matrix rows of a tile.
pub const TILE_ROWS: u32 = 64;
/// Columns per step (`cols` must be a multiple).
pub const TILE_COLS: u32 = 32;

/// One variant of the tiled matmat. Bindings: 0 and 1 the weights (chunks, words), 2 its
/// 12-word parameters, 3 the f32 activations `[nt, cols]` (int8: their codes), 4 y; 5 the int8
/// codes' block scales and sums; 6 the partial sums `[splits, nt, groups]` of vec4 (split
/// variants); 7 the hyper-connection epilogues' buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tiled {
    /// [`Path::F32`] (f16 decoded in software), [`Path::HwF16`], or [`Path::Int8`] (q8_2f
    /// weights on int8 activations).
    pub path: Path,
    /// [`Epilogue::None`], [`Epilogue::Silu`], [`Epilogue::HcFront`] or [`Epilogue::HcReadout`]
    /// over 4 streams.
    pub epilogue: Epilogue,
    /// The columns split over the grid's z.
    pub split: bool,
    /// Eight token rows x eight matrix rows a lane in a workgroup of [`Tiled::WIDE_WG`] lanes
    /// (`tiled_f16_8x8.wgsl`, `tiled_i8_8x8.wgsl`), instead of four x four in [`Tiled::WG`];
    /// the same tiles and grid.
    pub wide: bool,
}

impl Tiled {
    /// The matmat's entry point.
    pub const ENTRY: &'static str = "tiled";
    /// The split variants' second entry point: one lane per token row and group of 4 rows adds
    /// the splits' sums in split order, then applies the epilogue.
    pub const REDUCE_ENTRY: &'static str = "tiled_reduce";
    /// Lanes per workgroup of both entries (the wide variant's matmat: [`Tiled::WIDE_WG`]).
    pub const WG: u32 = 256;
    /// Lanes per workgroup of the wide variant's matmat.
    pub const WIDE_WG: u32 = 64;

    /// Lanes per workgroup of the matmat entry.
    pub const fn lanes(&self) -> u32 {
        if self.wide { Self::WIDE_WG } else { Self::WG }
    }

    /// Whether the tiled matmat has `epilogue` (the read-out only over 4 streams: a lane's 4
    /// consecutive rows are one column's streams).
    pub const fn supports(epilogue: Epilogue) -> bool {
        matches!(
            epilogue,
            Epilogue::None | Epilogue::Silu | Epilogue::HcFront | Epilogue::HcReadout
        )
    }

    /// Every variant the runtime may build.
    pub fn all() -> Vec<Tiled> {
        let mut out = Vec::new();
        for path in [Path::F32, Path::HwF16, Path::Int8] {
            for epilogue in [
                Epilogue::None,
                Epilogue::Silu,
                Epilogue::HcFront,
                Epilogue::HcReadout,
            ] {
                for split in [false, true] {
                    for wide in [false, true] {
                        out.push(Tiled {
                            path,
                            epilogue,
                            split,
                            wide,
                        });
                    }
                }
            }
        }
        out
    }

    /// Systematic name.
    pub fn name(&self) -> String {
        format!(
            "tiled_{}{}{}{}{}",
            self.codec().name(),
            self.path.suffix(),
            self.epilogue.suffix(),
            if self.split { "_split" } else { "" },
            if self.wide { "_8x8" } else { "" }
        )
    }

    /// The weights' codec: f16, or q8_2f on the int8 path.
    pub fn codec(&self) -> Codec {
        if self.path == Path::Int8 {
            Codec::Q8_2f
        } else {
            Codec::F16
        }
    }

    /// Entry points of the module.
    pub fn entries(&self) -> &'static [&'static str] {
        if self.split {
            &[Self::ENTRY, Self::REDUCE_ENTRY]
        } else {
            &[Self::ENTRY]
        }
    }

    /// The capabilities the module needs beyond the baseline.
    pub fn needs(&self) -> Caps {
        Caps {
            f16_in_f32: self.path == Path::HwF16,
            ..Caps::MINIMAL
        }
    }

    /// The assembled module.
    pub fn source(&self) -> String {
        let mut parts = vec![src::DECODE, src::COMMON];
        let (f16, i8) = if self.wide {
            (src::TILED_F16_8X8, src::TILED_I8_8X8)
        } else {
            (src::TILED_F16, src::TILED_I8)
        };
        match self.path {
            Path::Int8 => parts.extend([src::TILED, src::TILED_I8_COMMON, i8]),
            Path::HwF16 => parts.extend([src::F16_HW, src::TILED, f16]),
            Path::F32 => parts.extend([src::F16, src::TILED, f16]),
        }
        if self.epilogue.has_aux() {
            parts.insert(0, AUX_DECL);
        }
        let emit = emit4(self.epilogue);
        parts.push(&emit);
        if self.split {
            parts.push(SPLIT);
        } else {
            parts.push(DIRECT);
        }
        parts.join("\n")
    }
}

/// A direct tile's sums go through the epilogue.
const DIRECT: &str = "fn finish(split: u32, t: u32, r0: u32, v: vec4<f32>) {
    emit4(t, r0, v);
}";

/// A split tile's sums go to `part`; `tiled_reduce` adds them up.
const SPLIT: &str = "@group(0) @binding(6) var<storage, read_write> part: array<vec4<f32>>;

fn finish(split: u32, t: u32, r0: u32, v: vec4<f32>) {
    part[(split * P.nt + t) * P.groups + r0 / 4u] = v;
}

@compute @workgroup_size(256)
fn tiled_reduce(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i >= P.nt * P.groups) {
        return;
    }
    let t = i / P.groups;
    let g = i % P.groups;
    var v = part[t * P.groups + g];
    for (var s = 1u; s < P.splits; s++) {
        v += part[(s * P.nt + t) * P.groups + g];
    }
    emit4(t, g * 4u, v);
}";

/// `emit4(t, r0, v)`: the epilogue on token row `t`'s sums of rows `r0 .. r0 + 4` (those past
/// the end dropped), as the 8-row kernel applies it.
fn emit4(epilogue: Epilogue) -> String {
    let per_row = |body: &str| {
        format!(
            "fn emit4(t: u32, r0: u32, v: vec4<f32>) {{
    for (var j = 0u; j < 4u; j++) {{
        let r = r0 + j;
        if (r < P.rows) {{
{body}
        }}
    }}
}}"
        )
    };
    match epilogue {
        Epilogue::Silu => per_row("            y[t * P.y_stride + P.row_offset + r] = silu(v[j]);"),
        Epilogue::HcFront => per_row(
            "            let a = v[j] / bitcast<f32>(P.a);
            if (r < P.half) {
                y[t * P.half + r] = a * hc_sigmoid(a);
            } else {
                aux[t * (P.rows - P.half) + r - P.half] = 2.0 * hc_sigmoid(a);
            }",
        ),
        // Row `4 j + k` is stream k's row of column j; the streams are added in order.
        Epilogue::HcReadout => "fn emit4(t: u32, r0: u32, v: vec4<f32>) {
    let j = r0 / 4u;
    let d = P.rows / 4u;
    let xb = t * P.rows + j;
    var acc = 0.0;
    acc += hc_sigmoid(v.x) * aux[xb];
    acc += hc_sigmoid(v.y) * aux[xb + d];
    acc += hc_sigmoid(v.z) * aux[xb + 2u * d];
    acc += hc_sigmoid(v.w) * aux[xb + 3u * d];
    y[t * P.y_stride + j] = acc / 4.0;
}"
        .into(),
        _ => per_row("            y[t * P.y_stride + P.row_offset + r] = v[j];"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Specialization, validate};

    #[test]
    fn every_variant_validates_under_its_capabilities() {
        for k in Tiled::all() {
            validate(&k.name(), &k.source(), Caps::FULL, &Specialization(vec![]))
                .unwrap_or_else(|e| panic!("{e}"));
            if k.path != Path::HwF16 {
                validate(
                    &k.name(),
                    &k.source(),
                    Caps::LAVAPIPE,
                    &Specialization(vec![]),
                )
                .unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }

    #[test]
    fn the_tile_constants_match_the_wgsl() {
        let s = src::TILED;
        assert!(s.contains(&format!("const TM: u32 = {TILE_TOKENS}u;")));
        assert!(s.contains(&format!("const TN: u32 = {TILE_ROWS}u;")));
        assert!(s.contains(&format!("const TK: u32 = {TILE_COLS}u;")));
        for k in [src::TILED_F16, src::TILED_I8] {
            assert!(k.contains(&format!("@workgroup_size({})", Tiled::WG)));
        }
        for k in [src::TILED_F16_8X8, src::TILED_I8_8X8] {
            assert!(k.contains(&format!("@workgroup_size({})", Tiled::WIDE_WG)));
        }
    }
}
