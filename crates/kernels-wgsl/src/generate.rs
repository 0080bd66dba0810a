//! The template step: `matvec_body` generated for one kernel's token rows, rows per row group,
//! codec and activation path, every accumulator a named scalar and every loop over token rows,
//! rows and a chunk's words unrolled (runtime-indexed private arrays are spilled to memory by
//! some drivers, and an override constant does not make a naga loop unroll).

use std::fmt::Write;

use crate::{Codec, Epilogue, Matvec};

/// Lines shared by both paths' bodies: the row group's rows and accumulators.
fn prelude(b: &mut String, pair: bool, nr: u32, nt: u32, k: &Matvec) {
    let grouped = k.grouped;
    let _ = writeln!(
        b,
        "fn matvec_body(wid: vec3<u32>, li: u32, sg_size: u32, sg_lane: u32) {{"
    );
    if grouped {
        // The grid's y is the slot; its expert's payload starts `ids[slot] * slot_bytes` in.
        let _ = writeln!(b, "    let slot = wid.y;");
        let _ = writeln!(b, "    let wg = wid.x;");
        if k.segments == crate::Segments::One {
            let _ = writeln!(b, "    sb4 = ids[slot] * (P.slot_bytes / 4u);");
        } else {
            // A segmented bank: slot `id` is local slot `id % P.a` of segment `id / P.a`.
            let _ = writeln!(b, "    let id = ids[slot];");
            let _ = writeln!(b, "    seg = id / P.a;");
            let _ = writeln!(b, "    sb4 = (id - seg * P.a) * (P.slot_bytes / 4u);");
        }
        let _ = writeln!(b, "    sb16 = sb4 / 4u;");
        let _ = writeln!(b, "    let xrow = slot / P.x_div;");
    } else {
        let _ = writeln!(b, "    let wg = wid.x + wid.y * P.wg_x;");
        // Frames of more than `nt` rows run in tiles of `nt` rows along the grid's z, each tile
        // the `nt`-row kernel's arithmetic on its own rows (so a row's sum is the same in a frame
        // of any size).
        let _ = writeln!(b, "    let tb = wid.z * {nt}u;");
    }
    if pair {
        // Row group g computes gate row g and up row g + half.
        let _ = writeln!(b, "    let first = wg * (WG / LANES) + li / LANES;");
    } else {
        let _ = writeln!(
            b,
            "    let first = (wg * (WG / LANES) + li / LANES) * {nr}u;"
        );
    }
    let _ = writeln!(b, "    let lane = li % LANES;");
    let _ = writeln!(b, "    let last = P.rows - 1u;");
    for r in 0..nr {
        // Rows past the end reuse the last row; their sums are never written.
        if pair {
            let _ = writeln!(
                b,
                "    let row{r} = min(first, P.half - 1u) + {r}u * P.half;"
            );
        } else {
            let _ = writeln!(b, "    let row{r} = min(first + {r}u, last);");
        }
        for t in 0..nt {
            let _ = writeln!(b, "    var a{r}_{t} = 0.0;");
        }
    }
}

/// The reduction of every accumulator and the writes, with `finish(sum, row)` the codec's
/// last step on a row sum.
fn outputs(b: &mut String, k: &Matvec, nr: u32, nt: u32, finish: &dyn Fn(&str, &str) -> String) {
    if k.epilogue.is_pair() {
        // Row group g holds rows g and g + half: the gate/up product, or both sums apart.
        for t in 0..nt {
            let g = finish(
                &format!("reduce(a0_{t}, li, lane, sg_size, sg_lane)"),
                "row0",
            );
            let u = finish(
                &format!("reduce(a1_{t}, li, lane, sg_size, sg_lane)"),
                "row1",
            );
            let _ = writeln!(b, "    {{");
            let _ = writeln!(b, "        let g = {g};");
            let _ = writeln!(b, "        let u = {u};");
            let _ = writeln!(b, "        if (lane == 0u && first < P.half) {{");
            if k.epilogue == Epilogue::PairTwo {
                let _ = writeln!(b, "            y[(tb + {t}u) * P.half + first] = g;");
                let _ = writeln!(b, "            aux[(tb + {t}u) * P.half + first] = u;");
            } else {
                let yt = ytok(k, t);
                let _ = writeln!(
                    b,
                    "            y[{yt} * P.y_stride + P.row_offset + first] = silu(g) * u;"
                );
            }
            let _ = writeln!(b, "        }}");
            let _ = writeln!(b, "    }}");
        }
    } else if k.epilogue == Epilogue::HcReadout {
        // Row group `j` holds stream k's row of column j at row `first + k`; the streams'
        // read-out is added in stream order, as the separate op adds it.
        for t in 0..nt {
            let _ = writeln!(b, "    {{");
            for r in 0..nr {
                let g = finish(
                    &format!("reduce(a{r}_{t}, li, lane, sg_size, sg_lane)"),
                    &format!("(first + {r}u)"),
                );
                let _ = writeln!(b, "        let g{r} = {g};");
            }
            let _ = writeln!(b, "        if (lane == 0u && first < P.rows) {{");
            let _ = writeln!(b, "            let j = first / {nr}u;");
            let _ = writeln!(b, "            let xb = (tb + {t}u) * P.rows + j;");
            let _ = writeln!(b, "            var acc = 0.0;");
            for r in 0..nr {
                let _ = writeln!(
                    b,
                    "            acc += hc_sigmoid(g{r}) * aux[xb + {r}u * (P.rows / {nr}u)];"
                );
            }
            let yt = ytok(k, t);
            let _ = writeln!(
                b,
                "            y[{yt} * P.y_stride + j] = acc / f32({nr}u);"
            );
            let _ = writeln!(b, "        }}");
            let _ = writeln!(b, "    }}");
        }
    } else if k.epilogue == Epilogue::HcReadoutNorm {
        // As HcReadout, with stream k's value of column j read raw, the pending block output
        // injected (and written back: this row group is the only one to touch those values),
        // and normalised as the site's norm does: `v * (1 / rms) * (1 + w)`.
        for t in 0..nt {
            let _ = writeln!(b, "    {{");
            for r in 0..nr {
                let g = finish(
                    &format!("reduce(a{r}_{t}, li, lane, sg_size, sg_lane)"),
                    &format!("(first + {r}u)"),
                );
                let _ = writeln!(b, "        let g{r} = {g};");
            }
            if nt == 1 {
                // The values `readout_preload` loaded.
                let _ = writeln!(b, "        if (lane == 0u && first < P.rows) {{");
                let _ = writeln!(b, "            var acc = 0.0;");
                for r in 0..nr {
                    let _ = writeln!(b, "            {{");
                    let _ = writeln!(b, "                var v = px{r};");
                    let _ = writeln!(b, "                if (P.slot_bytes == 1u) {{");
                    let _ = writeln!(b, "                    v = v + pi{r} * pbv;");
                    let _ = writeln!(b, "                    aux[pq{r}] = v;");
                    let _ = writeln!(b, "                }}");
                    let _ = writeln!(b, "                let xn = v * pr{r} * pw{r};");
                    let _ = writeln!(b, "                acc += hc_sigmoid(g{r}) * xn;");
                    let _ = writeln!(b, "            }}");
                }
                let yt = ytok(k, t);
                let _ = writeln!(
                    b,
                    "            y[{yt} * P.y_stride + pj] = acc / f32({nr}u);"
                );
                let _ = writeln!(b, "        }}");
                let _ = writeln!(b, "    }}");
                continue;
            }
            let _ = writeln!(b, "        if (lane == 0u && first < P.rows) {{");
            let _ = writeln!(b, "            let d = P.rows / {nr}u;");
            let _ = writeln!(b, "            let j = first / {nr}u;");
            let _ = writeln!(b, "            let tt = tb + {t}u;");
            let _ = writeln!(b, "            let bi = tt * d + j;");
            let _ = writeln!(b, "            let bv = blk[bi / 4u][bi % 4u];");
            let _ = writeln!(b, "            var acc = 0.0;");
            for r in 0..nr {
                let _ = writeln!(b, "            {{");
                let _ = writeln!(b, "                let q = tt * P.rows + {r}u * d + j;");
                let _ = writeln!(b, "                var v = aux[q];");
                let _ = writeln!(b, "                if (P.slot_bytes == 1u) {{");
                let _ = writeln!(
                    b,
                    "                    v = v + inj_old[tt * {nr}u + {r}u] * bv;"
                );
                let _ = writeln!(b, "                    aux[q] = v;");
                let _ = writeln!(b, "                }}");
                let _ = writeln!(b, "                let wi = {r}u * d + j;");
                let _ = writeln!(
                    b,
                    "                let xn = v * rstd[tt * {nr}u + {r}u] * (1.0 + nw[wi / 4u][wi % 4u]);"
                );
                let _ = writeln!(b, "                acc += hc_sigmoid(g{r}) * xn;");
                let _ = writeln!(b, "            }}");
            }
            let yt = ytok(k, t);
            let _ = writeln!(
                b,
                "            y[{yt} * P.y_stride + j] = acc / f32({nr}u);"
            );
            let _ = writeln!(b, "        }}");
            let _ = writeln!(b, "    }}");
        }
    } else if k.epilogue == Epilogue::HcFront {
        for r in 0..nr {
            for t in 0..nt {
                let total = finish("sum", &format!("(first + {r}u)"));
                let _ = writeln!(b, "    {{");
                let _ = writeln!(
                    b,
                    "        let sum = reduce(a{r}_{t}, li, lane, sg_size, sg_lane);"
                );
                let _ = writeln!(b, "        let row = first + {r}u;");
                let _ = writeln!(b, "        let total = {total};");
                front_store(b, t);
            }
        }
    } else if k.epilogue == Epilogue::MoeOut {
        // The routed slots' weighted sum, added in slot order with their loads issued four at
        // a time (shared_add's order and grouping), then the gated shared expert. P.half:
        // slots a token row; P.slot_bytes and P.x_div: where the slots' weights and the gates
        // start in aux (floats).
        for r in 0..nr {
            for t in 0..nt {
                let total = finish("total", &format!("(first + {r}u)"));
                let _ = writeln!(b, "    {{");
                let _ = writeln!(
                    b,
                    "        let total = reduce(a{r}_{t}, li, lane, sg_size, sg_lane);"
                );
                let _ = writeln!(b, "        let row = first + {r}u;");
                let _ = writeln!(b, "        if (lane == 0u && row < P.rows) {{");
                let _ = writeln!(b, "            let tt = tb + {t}u;");
                let _ = writeln!(b, "            let s0 = tt * P.half;");
                let _ = writeln!(b, "            var acc = 0.0;");
                let _ = writeln!(b, "            var s = 0u;");
                let _ = writeln!(b, "            for (; s + 4u <= P.half; s += 4u) {{");
                for q in 0..4 {
                    let _ = writeln!(
                        b,
                        "                let w{q} = aux[P.slot_bytes + s0 + s + {q}u];"
                    );
                    let _ = writeln!(
                        b,
                        "                let e{q} = aux[(s0 + s + {q}u) * P.rows + row];"
                    );
                }
                for q in 0..4 {
                    let _ = writeln!(b, "                acc = acc + w{q} * e{q};");
                }
                let _ = writeln!(b, "            }}");
                let _ = writeln!(b, "            for (; s < P.half; s++) {{");
                let _ = writeln!(
                    b,
                    "                acc = acc + aux[P.slot_bytes + s0 + s] * aux[(s0 + s) * P.rows + row];"
                );
                let _ = writeln!(b, "            }}");
                let _ = writeln!(
                    b,
                    "            y[tt * P.y_stride + P.row_offset + row] = acc + aux[P.x_div + tt] * ({total});"
                );
                let _ = writeln!(b, "        }}");
                let _ = writeln!(b, "    }}");
            }
        }
    } else {
        let act = if k.epilogue == Epilogue::Silu {
            "silu"
        } else {
            ""
        };
        for r in 0..nr {
            for t in 0..nt {
                let total = finish("total", &format!("(first + {r}u)"));
                let _ = writeln!(b, "    {{");
                let _ = writeln!(
                    b,
                    "        let total = reduce(a{r}_{t}, li, lane, sg_size, sg_lane);"
                );
                let _ = writeln!(b, "        if (lane == 0u && first + {r}u < P.rows) {{");
                let yt = ytok(k, t);
                let _ = writeln!(
                    b,
                    "            y[{yt} * P.y_stride + P.row_offset + first + {r}u] = {act}({total});"
                );
                let _ = writeln!(b, "        }}");
                let _ = writeln!(b, "    }}");
            }
        }
    }
    let _ = writeln!(b, "}}");
}

/// The hyper-connection front's writes of token row `t`'s row `row` (its sum `total`, in a
/// block the caller opened): `silu(v)` of the low-rank rows into `y`, `2 sigmoid(v)` of the
/// injection rows into `aux`, with `v = total / H`. Closes the block.
fn front_store(b: &mut String, t: u32) {
    let _ = writeln!(b, "        if (lane == 0u && row < P.rows) {{");
    let _ = writeln!(b, "            let v = total / bitcast<f32>(P.a);");
    let _ = writeln!(b, "            if (row < P.half) {{");
    let _ = writeln!(
        b,
        "                y[(tb + {t}u) * P.half + row] = v * hc_sigmoid(v);"
    );
    let _ = writeln!(b, "            }} else {{");
    let _ = writeln!(
        b,
        "                aux[(tb + {t}u) * (P.rows - P.half) + row - P.half] = 2.0 * hc_sigmoid(v);"
    );
    let _ = writeln!(b, "            }}");
    let _ = writeln!(b, "        }}");
    let _ = writeln!(b, "    }}");
}

/// The activation row of token row `t` (the slot's row in the grouped variant; on the int8
/// path q8_2f's activations are quantised per slot, with its expert's column scales).
fn xtok(k: &Matvec, t: u32) -> String {
    if k.grouped && k.codec == Codec::Q8_2f && k.path == crate::Path::Int8 {
        "slot".into()
    } else if k.grouped {
        "xrow".into()
    } else {
        format!("(tb + {t}u)")
    }
}

/// The output row of token row `t` (the slot in the grouped variant).
fn ytok(k: &Matvec, t: u32) -> String {
    if k.grouped {
        "slot".into()
    } else {
        format!("(tb + {t}u)")
    }
}

/// Token rows and rows per row group, clamped to what the kernels are built for.
fn shape(k: &Matvec) -> (bool, u32, u32) {
    let pair = k.epilogue.is_pair();
    let nr = if pair { 2 } else { k.rows.clamp(1, 4) };
    let nt = if k.grouped { 1 } else { k.nt.clamp(1, 8) };
    (pair, nr, nt)
}

/// The loop over a lane's chunks `lane, lane + LANES, ... < bound`, with `inner` (which reads
/// the chunk as `c`) as its body. (Four chunks per iteration, the same additions in the same
/// order, was measured on the H200 and not kept: small f16 matrices 4-9% faster, but the f32
/// path's large matrices up to 2.9x slower and q8_2f's int8 10240x2560 1.9x; docs/perf.md.)
fn chunk_loop(b: &mut String, bound: &str, inner: &str) {
    let _ = writeln!(b, "    for (var c = lane; c < {bound}; c = c + LANES) {{");
    b.push_str(inner);
    let _ = writeln!(b, "    }}");
}

/// The f32 path: lane `l` of a row group walks chunks `l, l + LANES, ...` of its rows; per
/// chunk it loads each row's 16 bytes and scale once, then for each of the chunk's vec4s loads
/// the `nt` activation vectors once and adds `dot(weight, x)` into accumulator `a{r}_{t}`.
pub(crate) fn body_f32(k: &Matvec) -> String {
    let (pair, nr, nt) = shape(k);
    let kv = k.codec.chunk_vec4();
    let mut b = String::new();
    prelude(&mut b, pair, nr, nt, k);
    let _ = writeln!(b, "    let x_row = P.cols / 4u;");
    let inner = {
        let mut b = String::new();
        let _ = writeln!(b, "        let xc = c * CHUNK_VEC4;");
        for r in 0..nr {
            let _ = writeln!(b, "        let v{r} = wv[chunk_index(row{r}, c)];");
            let _ = writeln!(b, "        let s{r} = chunk_scale(row{r}, c);");
        }
        for kk in 0..kv {
            let _ = writeln!(b, "        {{");
            let _ = writeln!(b, "            let xs = x_scale(c, {kk}u);");
            for t in 0..nt {
                let xt = xtok(k, t);
                let _ = writeln!(
                    b,
                    "            let x{t} = x[{xt} * x_row + xc + {kk}u] * xs;"
                );
            }
            for r in 0..nr {
                let _ = writeln!(b, "            let w{r} = weight4(v{r}, s{r}, {kk}u);");
                for t in 0..nt {
                    let _ = writeln!(b, "            a{r}_{t} = a{r}_{t} + dot(w{r}, x{t});");
                }
            }
            let _ = writeln!(b, "        }}");
        }
        b
    };
    if k.epilogue == Epilogue::HcReadoutNorm && nt == 1 {
        readout_preload(&mut b, nr);
    }
    chunk_loop(&mut b, "row_chunks()", &inner);
    outputs(&mut b, k, nr, nt, &|sum, row| {
        format!("row_finish({sum}, {row})")
    });
    b
}

/// A decode step's [`Epilogue::HcReadoutNorm`]: the column's stream values, injection and
/// norm factors loaded before the chunk loop, so their latency hides behind it instead of
/// following the reduction (a read-out step is a chain of a few memory latencies).
fn readout_preload(b: &mut String, nr: u32) {
    let _ = writeln!(b, "    let pd = P.rows / {nr}u;");
    let _ = writeln!(b, "    let pj = min(first, P.rows - 1u) / {nr}u;");
    let _ = writeln!(b, "    let pbi = tb * pd + pj;");
    let _ = writeln!(b, "    let pbv = blk[pbi / 4u][pbi % 4u];");
    for r in 0..nr {
        let _ = writeln!(b, "    let pq{r} = tb * P.rows + {r}u * pd + pj;");
        let _ = writeln!(b, "    let px{r} = aux[pq{r}];");
        let _ = writeln!(
            b,
            "    let pi{r} = inj_old[min(tb * {nr}u + {r}u, arrayLength(&inj_old) - 1u)];"
        );
        let _ = writeln!(b, "    let pr{r} = rstd[tb * {nr}u + {r}u];");
        let _ = writeln!(b, "    let pwi{r} = {r}u * pd + pj;");
        let _ = writeln!(b, "    let pw{r} = 1.0 + nw[pwi{r} / 4u][pwi{r} % 4u];");
    }
}

const XYZW: [&str; 4] = ["x", "y", "z", "w"];

/// Streams the folded norm's front keeps apart (a vec4 of sums per token row and row).
const NORM_STREAMS: u32 = 4;

/// [`Epilogue::HcFrontNorm`] on the f32 paths: the hyper-connection front over the raw
/// streams `x` `[nt, H * D]` with the site's norm folded in. Lane `l` walks chunks
/// `l, l + LANES, ...` of a stream, every stream's at once (a chunk never straddles two: D is
/// a whole number of chunks), injecting the pending block output into each activation vec4 first,
/// then adding its squares into the token row's sum for that stream and its dot with the
/// weights times `1 + w` into the row's sum for that stream: the component `k` of a vec4
/// accumulator. After the row group's reduction, `v = sum_k dot_k / rms_k`, the
/// [`Epilogue::HcFront`] activations of `v / H`; the row group of row 0 writes each token
/// row's `1 / rms_k` for the read-out.
pub(crate) fn body_front_norm(k: &Matvec) -> String {
    let (_, nr, nt) = shape(k);
    let kv = k.codec.chunk_vec4();
    let mut b = String::new();
    prelude(&mut b, false, nr, nt, k);
    let _ = writeln!(b, "    let x_row = P.cols / 4u;");
    let _ = writeln!(b, "    let h = u32(bitcast<f32>(P.a));");
    let _ = writeln!(b, "    let d4 = x_row / h;");
    let _ = writeln!(b, "    let cps = d4 / CHUNK_VEC4;");
    let _ = writeln!(b, "    let inject = P.slot_bytes == 1u;");
    for t in 0..nt {
        let _ = writeln!(b, "    var q{t} = vec4<f32>(0.0);");
        for r in 0..nr {
            let _ = writeln!(b, "    var s{r}_{t} = vec4<f32>(0.0);");
        }
    }
    // Each stream's injection weight, once per token row.
    for t in 0..nt {
        for si in 0..NORM_STREAMS {
            let _ = writeln!(
                b,
                "    let i{t}_{si} = select(0.0, inj_old[min((tb + {t}u) * h + {si}u, arrayLength(&inj_old) - 1u)], inject && {si}u < h);"
            );
        }
    }
    // One loop over a stream's chunks, every stream's chunk c in the same iteration: four
    // times the independent loads in flight a lane (the front is a chain of memory latencies:
    // a loop per stream took 14 us a step on the H100 against 9.4 for the unfolded front).
    let _ = writeln!(b, "    for (var c = lane; c < cps; c = c + LANES) {{");
    for (si, comp) in XYZW.iter().enumerate().take(NORM_STREAMS as usize) {
        let _ = writeln!(b, "    if ({si}u < h) {{");
        let _ = writeln!(b, "        let cc = {si}u * cps + c;");
        let _ = writeln!(b, "        let xc = cc * CHUNK_VEC4;");
        for r in 0..nr {
            let _ = writeln!(b, "        let v{r} = wv[chunk_index(row{r}, cc)];");
            let _ = writeln!(b, "        let e{r} = chunk_scale(row{r}, cc);");
        }
        for kk in 0..kv {
            let _ = writeln!(b, "        {{");
            let _ = writeln!(b, "            let f = 1.0 + nw[xc + {kk}u];");
            let _ = writeln!(b, "            let bo = c * CHUNK_VEC4 + {kk}u;");
            for t in 0..nt {
                let _ = writeln!(
                    b,
                    "            var x{t} = x[(tb + {t}u) * x_row + xc + {kk}u];"
                );
                let _ = writeln!(b, "            if (inject) {{");
                let _ = writeln!(
                    b,
                    "                x{t} = x{t} + i{t}_{si} * blk[(tb + {t}u) * d4 + bo];"
                );
                let _ = writeln!(b, "            }}");
                let _ = writeln!(
                    b,
                    "            q{t}.{comp} = q{t}.{comp} + dot(x{t}, x{t});"
                );
                let _ = writeln!(b, "            let xw{t} = x{t} * f;");
            }
            for r in 0..nr {
                let _ = writeln!(b, "            let w{r} = weight4(v{r}, e{r}, {kk}u);");
                for t in 0..nt {
                    let _ = writeln!(
                        b,
                        "            s{r}_{t}.{comp} = s{r}_{t}.{comp} + dot(w{r}, xw{t});"
                    );
                }
            }
            let _ = writeln!(b, "        }}");
        }
        let _ = writeln!(b, "    }}");
    }
    let _ = writeln!(b, "    }}");
    // Every row group's sums of squares are the same (the same lanes add the same values in
    // the same order), so its 1/rms are the ones the row group of row 0 stores.
    let _ = writeln!(b, "    let eps = bitcast<f32>(P.x_div);");
    let _ = writeln!(b, "    let dn = f32(d4 * 4u);");
    for t in 0..nt {
        let _ = writeln!(
            b,
            "    let rs{t} = 1.0 / sqrt(reduce4(q{t}, li, lane) / dn + eps);"
        );
        let _ = writeln!(b, "    if (first == 0u && lane == 0u) {{");
        for (si, comp) in XYZW.iter().enumerate().take(NORM_STREAMS as usize) {
            let _ = writeln!(
                b,
                "        if ({si}u < h) {{ rstd[(tb + {t}u) * h + {si}u] = rs{t}.{comp}; }}"
            );
        }
        let _ = writeln!(b, "    }}");
    }
    for r in 0..nr {
        for t in 0..nt {
            let _ = writeln!(b, "    {{");
            let _ = writeln!(b, "        let sums = reduce4(s{r}_{t}, li, lane);");
            let _ = writeln!(b, "        let row = first + {r}u;");
            let _ = writeln!(
                b,
                "        let total = row_finish(dot(sums, rs{t}), min(row, last));"
            );
            front_store(&mut b, t);
        }
    }
    let _ = writeln!(b, "}}");
    b
}

/// mxfp4's table: byte -> its two E2M1 nibbles as int8 `2 * e2m1` (low nibble in byte 0), in
/// `copies` interleaved copies (entry `byte * copies + copy`, lane `l` reading copy `l %
/// copies`): with one copy the lanes of a subgroup hit random banks, and on the H200 the
/// table's conflicts held tall mxfp4 matrices at half the read ceiling (docs/perf.md). Copy 0
/// is computed, the others copied from it (a subgroup's lanes then read one entry).
fn lut_fill(b: &mut String, k: &Matvec) {
    let copies = k.lut_copies.clamp(1, 32).next_power_of_two();
    let _ = writeln!(b, "    let cp = li % {copies}u;");
    let _ = writeln!(
        b,
        "    for (var i = li; i < 256u; i = i + WG) {{ lut[i * {copies}u] = mx_pair(i); }}"
    );
    let _ = writeln!(b, "    workgroupBarrier();");
    if copies > 1 {
        let _ = writeln!(
            b,
            "    for (var i = li; i < {}u; i = i + WG) {{ let o = i % {copies}u; if (o != 0u) {{ lut[i] = lut[i - o]; }} }}",
            256 * copies
        );
        let _ = writeln!(b, "    workgroupBarrier();");
    }
}

/// The int8 path: per chunk (one 32-element block; two for q2tp) each row's weight words are
/// unpacked once into int8 words `u{r}_{j}` in the order the activation layout expects, and
/// per token row and block one `dot8` (8 `dot4I8Packed`) gives the exact integer dot product,
/// corrected for the codec's level offset with the block's code sum and added as
/// `f32(I) * (S * d)`.
pub(crate) fn body_i8(k: &Matvec) -> String {
    let (pair, nr, nt) = shape(k);
    let codec = k.codec;
    let members = k.epilogue.has_members() && !k.grouped;
    let mut b = String::new();
    // q2tp's two group scales per chunk from a per-row ladder in workgroup memory, on the one
    // shape where that pays (H200, 2026-12-02: the 485417x8192 q2tp matvec 67.3% -> 74.3% of
    // the read ceiling, 248320x2560 37.4% -> 39.3%); q4tp (one scale per chunk), split rows,
    // token-row batches and the grouped experts ran slower with it (the table fill and the
    // barrier cost more than the exp2q they save: q4tp 95.4% -> 93.4%, q4tp experts T=8
    // 52.8% -> 48.4%).
    let ladder = codec == Codec::Q2tp && nr == 4 && nt == 1 && !k.grouped;
    if ladder {
        // Each row group's rows' 32 group scales by scale code.
        let _ = writeln!(
            b,
            "var<workgroup> ladder: array<f32, (WG / LANES) * {}u>;",
            32 * nr
        );
    }
    if codec == Codec::Mxfp4 {
        let _ = writeln!(
            b,
            "var<workgroup> lut: array<u32, {}u>;",
            256 * k.lut_copies.clamp(1, 32).next_power_of_two()
        );
    }
    prelude(&mut b, pair, nr, nt, k);
    if codec == Codec::Mxfp4 {
        lut_fill(&mut b, k);
    }
    let _ = writeln!(b, "    let nb = P.cols / 32u;");
    let tiered = matches!(codec, Codec::Q4tp | Codec::Q2tp);
    if tiered {
        for r in 0..nr {
            let _ = writeln!(b, "    let ls{r} = f16x2(ww[P.second / 4u + row{r}]);");
            let _ = writeln!(b, "    let cb{r} = P.third + row{r} * P.code_stride;");
        }
    }
    if ladder {
        // Each row's scale ladder (a 5-bit code -> its group scale: 32 values) decoded once
        // into workgroup memory by its row group's lanes, instead of one `exp2q` per group in
        // the chunk loop (q2tp went from 67% to 78% of the read ceiling without the exp2q).
        // The same values: the same `exp2q` of the same arguments.
        let _ = writeln!(b, "    let lb = (li / LANES) * {}u;", 32 * nr);
        for r in 0..nr {
            let value =
                format!("select(exp2q(ls{r}.x + (f32(e) - 1.0) * ls{r}.y) * 0.5, 0.0, e == 0u)");
            let _ = writeln!(
                b,
                "    for (var e = lane; e < 32u; e = e + LANES) {{ ladder[lb + {}u + e] = {value}; }}",
                32 * r
            );
        }
        let _ = writeln!(b, "    workgroupBarrier();");
    }
    // The table entry of byte expression `e` in this lane's copy.
    let copies = k.lut_copies.clamp(1, 32).next_power_of_two();
    let entry = |e: &str| {
        if copies == 1 {
            format!("lut[{e}]")
        } else {
            format!("lut[(({e}) << {}u) | cp]", copies.trailing_zeros())
        }
    };
    let (chunks, blocks) = match codec {
        Codec::Q2tp => ("P.cols / 64u", 2),
        _ => ("nb", 1),
    };
    let inner = {
        let mut b = String::new();
        // Weight words and block factors per row.
        for r in 0..nr {
            match codec {
                Codec::Q8_2f => {
                    let _ = writeln!(
                        b,
                        "        let v{r}a = wv[row{r} * (P.cols / 16u) + 2u * c];"
                    );
                    let _ = writeln!(
                        b,
                        "        let v{r}b = wv[row{r} * (P.cols / 16u) + 2u * c + 1u];"
                    );
                    for j in 0..8 {
                        let half = if j < 4 { "a" } else { "b" };
                        let _ = writeln!(b, "        let u{r}_{j} = v{r}{half}.{};", XYZW[j % 4]);
                    }
                }
                Codec::Q4tp => {
                    let _ = writeln!(b, "        let v{r} = wv[row{r} * nb + c];");
                    for (kk, comp) in XYZW.iter().enumerate() {
                        let _ = writeln!(
                            b,
                            "        let u{r}_{} = v{r}.{comp} & 0x0f0f0f0fu;",
                            2 * kk
                        );
                        let _ = writeln!(
                            b,
                            "        let u{r}_{} = (v{r}.{comp} >> 4u) & 0x0f0f0f0fu;",
                            2 * kk + 1
                        );
                    }
                    let _ = writeln!(
                        b,
                        "        let s{r}_0 = exp2q(ls{r}.x + f32(scale_code(cb{r}, c)) * ls{r}.y);"
                    );
                }
                Codec::Q2tp => {
                    let _ = writeln!(b, "        let v{r} = wv[row{r} * (P.cols / 64u) + c];");
                    for (kk, comp) in XYZW.iter().enumerate() {
                        for j in 0..4 {
                            let _ = writeln!(
                                b,
                                "        let u{r}_{} = (v{r}.{comp} >> {}u) & 0x03030303u;",
                                4 * kk + j,
                                2 * j
                            );
                        }
                    }
                    // Both groups' codes are the 10 bits at bit 10c: one (rarely two) word loads.
                    let _ = writeln!(
                        b,
                        "        let cw{r} = bits_at(cb{r} + ((10u * c) >> 3u)) >> ((10u * c) & 7u);"
                    );
                    for j in 0..2 {
                        let _ = writeln!(b, "        let c{r}_{j} = (cw{r} >> {}u) & 31u;", 5 * j);
                        // The zero rung is S = 0; levels 2c - 3 carry the factor 1/2 (both in the
                        // ladder).
                        if ladder {
                            let _ = writeln!(
                                b,
                                "        let s{r}_{j} = ladder[lb + {}u + c{r}_{j}];",
                                32 * r
                            );
                        } else {
                            let _ = writeln!(
                                b,
                                "        let s{r}_{j} = select(exp2q(ls{r}.x + (f32(c{r}_{j}) - 1.0) * ls{r}.y) * 0.5, 0.0, c{r}_{j} == 0u);"
                            );
                        }
                    }
                }
                Codec::Mxfp4 => {
                    let _ = writeln!(b, "        let v{r} = wv[row{r} * nb + c];");
                    for (kk, comp) in XYZW.iter().enumerate() {
                        let _ = writeln!(
                            b,
                            "        let u{r}_{} = {} | ({} << 16u);",
                            2 * kk,
                            entry(&format!("v{r}.{comp} & 0xffu")),
                            entry(&format!("(v{r}.{comp} >> 8u) & 0xffu")),
                        );
                        let _ = writeln!(
                            b,
                            "        let u{r}_{} = {} | ({} << 16u);",
                            2 * kk + 1,
                            entry(&format!("(v{r}.{comp} >> 16u) & 0xffu")),
                            entry(&format!("v{r}.{comp} >> 24u")),
                        );
                    }
                    let _ = writeln!(
                        b,
                        "        let s{r}_0 = e8m0_i8(byte_at(P.second + row{r} * nb + c)) * 0.5;"
                    );
                }
                Codec::F32 | Codec::F16 | Codec::Bf16 => {
                    unreachable!("float codecs have no int8 path")
                }
            }
        }
        // Per token row: its activation words, then every row's products (one token's words live
        // at a time, which keeps T = 8 within the register file: q2tp's T = 8 went from 2408 to
        // 1541 us on the H200). q8_2f, whose weights need no unpacking, emits all loads, then all
        // products; its T = 8 time moved between 170 and 246 us across builds with either order,
        // so the driver's register allocation, not this order, decides it (docs/perf.md).
        let token_major = codec != Codec::Q8_2f;
        let loads = |b: &mut String, t: u32| {
            for j in 0..blocks {
                let blk = if blocks == 2 {
                    format!("2u * c + {j}u")
                } else {
                    "c".into()
                };
                let xt = xtok(k, t);
                let _ = writeln!(b, "            let xi{t}_{j} = {xt} * nb + {blk};");
                let _ = writeln!(b, "            let xa{t}_{j} = xq[2u * xi{t}_{j}];");
                let _ = writeln!(b, "            let xb{t}_{j} = xq[2u * xi{t}_{j} + 1u];");
                let _ = writeln!(b, "            let xd{t}_{j} = xd[xi{t}_{j}];");
                let _ = writeln!(b, "            let d{t}_{j} = bitcast<f32>(xd{t}_{j}.x);");
                if members {
                    // The second member's block: `slot_bytes` blocks and `x_div` pairs on.
                    let _ = writeln!(b, "            let xm{t}_{j} = xi{t}_{j} + P.slot_bytes;");
                    let _ = writeln!(b, "            let xa{t}_{j}m = xq[2u * xm{t}_{j}];");
                    let _ = writeln!(b, "            let xb{t}_{j}m = xq[2u * xm{t}_{j} + 1u];");
                    let _ = writeln!(b, "            let xd{t}_{j}m = xd[xi{t}_{j} + P.x_div];");
                    let _ = writeln!(b, "            let d{t}_{j}m = bitcast<f32>(xd{t}_{j}m.x);");
                }
            }
        };
        let products = |b: &mut String, t: u32| {
            for r in 0..nr {
                // The second half's row reads the second member.
                let m = if members && r == 1 { "m" } else { "" };
                for j in 0..blocks {
                    let w0 = 8 * j;
                    let words: Vec<String> = (w0..w0 + 8).map(|w| format!("u{r}_{w}")).collect();
                    let dot = format!("dot8({}, xa{t}_{j}{m}, xb{t}_{j}{m})", words.join(", "));
                    let sum = format!("bitcast<i32>(xd{t}_{j}{m}.y)");
                    let d = format!("d{t}_{j}{m}");
                    let (int, factor) = match codec {
                        Codec::Q8_2f => (dot, d),
                        Codec::Q4tp => (format!("{dot} - 8 * {sum}"), format!("s{r}_0 * {d}")),
                        Codec::Q2tp => {
                            (format!("2 * {dot} - 3 * {sum}"), format!("s{r}_{j} * {d}"))
                        }
                        _ => (dot, format!("s{r}_0 * {d}")),
                    };
                    let _ = writeln!(
                        b,
                        "            a{r}_{t} = a{r}_{t} + f32({int}) * ({factor});"
                    );
                }
            }
        };
        if token_major {
            for t in 0..nt {
                let _ = writeln!(b, "        {{");
                loads(&mut b, t);
                products(&mut b, t);
                let _ = writeln!(b, "        }}");
            }
        } else {
            let _ = writeln!(b, "        {{");
            for t in 0..nt {
                loads(&mut b, t);
            }
            for t in 0..nt {
                products(&mut b, t);
            }
            let _ = writeln!(b, "        }}");
        }
        b
    };
    chunk_loop(&mut b, chunks, &inner);
    outputs(&mut b, k, nr, nt, &|sum, row| {
        if codec == Codec::Q8_2f {
            format!("{sum} * f16_at(P.second + 2u * {row})")
        } else {
            sum.to_string()
        }
    });
    b
}
