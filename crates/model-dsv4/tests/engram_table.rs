//! The Engram table gather (#19): values against an independent decode of the source
//! safetensors bytes, typed errors for bad ids and bad tables, and (item 4) that gathering
//! from a memory-mapped table far larger than the rest of the model grows resident memory by
//! the rows read, not by the table size.

mod common;

use std::collections::HashSet;
use std::io::Read;
use std::path::Path;

use cmf_format::{Cmf, CmfWriter, Header};
use model_dsv4::engram::{EngramTable, EngramTableError};
use model_dsv4::{BindError, DeepseekV41Config};
use quant_codecs::DType;

use common::{Profile, convert_fixture, fixture};

/// OCP E4M3 ("fn": no infinities, S.1111.111 is NaN) from its definition, in f64: written
/// here from docs/codecs.md rather than taken from quant-codecs, so the test checks it.
fn e4m3(b: u8) -> f64 {
    let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((b >> 3) & 15);
    let m = f64::from(b & 7);
    if e == 15 && m == 7.0 {
        f64::NAN
    } else if e == 0 {
        s * m / 8.0 * 2f64.powi(-6)
    } else {
        s * (1.0 + m / 8.0) * 2f64.powi(e - 7)
    }
}

/// E8M0: `2^(byte - 127)` (255 is NaN; no table here uses it).
fn e8m0(b: u8) -> f64 {
    2f64.powi(i32::from(b) - 127)
}

/// The raw bytes of tensor `name` in a safetensors file, with its dtype and shape.
fn safetensors_tensor(path: &Path, name: &str) -> (String, Vec<usize>, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let t = &header[name];
    let dtype = t["dtype"].as_str().unwrap().to_string();
    let shape = t["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect();
    let off: Vec<usize> = t["data_offsets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_u64().unwrap() as usize)
        .collect();
    (dtype, shape, bytes[8 + n + off[0]..8 + n + off[1]].to_vec())
}

fn config_of(cmf: &Cmf) -> DeepseekV41Config {
    DeepseekV41Config::from_json(&cmf.header().config).unwrap()
}

#[test]
fn gathered_rows_equal_the_source_fp8_rows() {
    let case = "deepseek_v41_a";
    let dir = tempfile::tempdir().unwrap();
    // The tables are copied verbatim under every profile; q4 is the one most files use.
    let path = convert_fixture(case, dir.path(), Profile::Q4);
    let cmf = Cmf::open(&path).unwrap();
    let config = config_of(&cmf);
    let st = fixture(case).join("hf/model.safetensors");
    assert!(!config.engram_layer_ids.is_empty());
    for &layer in &config.engram_layer_ids {
        let table = EngramTable::from_config(&cmf, &config, layer).unwrap();
        let cols = config.engram_head_dim;
        assert_eq!(table.cols(), cols);
        let (wdt, wshape, codes) =
            safetensors_tensor(&st, &format!("layers.{layer}.engram.embed.weight"));
        let (sdt, sshape, scales) =
            safetensors_tensor(&st, &format!("layers.{layer}.engram.embed.scale"));
        assert_eq!((wdt.as_str(), sdt.as_str()), ("F8_E4M3", "F8_E8M0"));
        let rows = wshape[0];
        assert_eq!(wshape, [rows, cols]);
        assert_eq!(sshape, [rows, cols / 32]);
        assert_eq!(table.rows(), rows as u64);
        // Every row once, in a scrambled order with repeats, so the row -> slot mapping is
        // checked too, not just a contiguous copy.
        let ids: Vec<u64> = (0..rows as u64)
            .map(|i| (i * 7 + 3) % rows as u64)
            .chain([0, rows as u64 - 1, 0])
            .collect();
        let mut out = vec![f32::NAN; ids.len() * cols];
        table.gather(&ids, &mut out).unwrap();
        let mut worst = 0usize;
        for (slot, &r) in ids.iter().enumerate() {
            let r = r as usize;
            for c in 0..cols {
                let want = e4m3(codes[r * cols + c]) * e8m0(scales[r * (cols / 32) + c / 32]);
                let got = out[slot * cols + c];
                // E4M3 x 2^k is exact in f32 for the fixture's scales.
                if got as f64 != want {
                    worst += 1;
                    assert!(worst < 5, "{layer} row {r} col {c}: got {got}, want {want}");
                }
            }
        }
        assert_eq!(worst, 0, "layer {layer}: {worst} values differ");
        println!(
            "layer {layer}: {} ids of {rows} x {cols} match the safetensors bytes",
            ids.len()
        );
    }
}

#[test]
fn bad_ids_and_bad_tables_are_typed_errors() {
    let case = "deepseek_v41_a";
    let dir = tempfile::tempdir().unwrap();
    let path = convert_fixture(case, dir.path(), Profile::Q4);
    let cmf = Cmf::open(&path).unwrap();
    let config = config_of(&cmf);
    let layer = config.engram_layer_ids[0];
    let table = EngramTable::from_config(&cmf, &config, layer).unwrap();
    let (rows, cols) = (table.rows(), table.cols());
    let name = format!("model.engram_tables.{layer}.weight");
    assert_eq!(table.name(), name);

    for bad in [rows, rows + 1, u64::MAX] {
        let mut out = vec![7.0f32; 3 * cols];
        let err = table.gather(&[0, bad, 1], &mut out).unwrap_err();
        match &err {
            EngramTableError::RowOutOfRange {
                name: n,
                row,
                position,
                rows: r,
            } => assert_eq!(
                (n.as_str(), *row, *position, *r),
                (name.as_str(), bad, 1, rows)
            ),
            e => panic!("expected RowOutOfRange, got {e:?}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains(&name) && msg.contains(&bad.to_string()),
            "{msg}"
        );
        assert!(msg.contains(&rows.to_string()), "{msg}");
        // Checked before decoding: nothing written.
        assert!(out.iter().all(|&v| v == 7.0));
    }
    let err = table.gather(&[0, 1], &mut vec![0.0; cols]).unwrap_err();
    assert!(
        matches!(err, EngramTableError::OutLength { expected, found, .. } if expected == 2 * cols && found == cols),
        "{err:?}"
    );
    // An empty gather is fine.
    table.gather(&[], &mut []).unwrap();

    // Layer 0 has no Engram module in the fixture, and no table in the file.
    assert!(!config.engram_layer_ids.contains(&0));
    let err = EngramTable::from_config(&cmf, &config, 0).unwrap_err();
    assert!(
        matches!(err, EngramTableError::NotEngramLayer { layer: 0, .. }),
        "{err:?}"
    );
    let err = EngramTable::bind(&cmf, 0, rows, cols).unwrap_err();
    assert!(
        matches!(&err, EngramTableError::Bind(BindError::Missing(n)) if n == "model.engram_tables.0.weight"),
        "{err:?}"
    );
    // Rows the config does not imply, and another head dim.
    for (r, c) in [(rows + 1, cols), (rows, cols + 32)] {
        let err = EngramTable::bind(&cmf, layer, r, c).unwrap_err();
        match &err {
            EngramTableError::Bind(BindError::Shape {
                name: n,
                expected,
                found,
            }) => {
                assert_eq!(n, &name);
                assert_eq!(expected, &[r as usize, c]);
                assert_eq!(found, &[rows as usize, cols]);
            }
            e => panic!("expected a shape error, got {e:?}"),
        }
        assert!(err.to_string().contains(&name), "{err}");
    }

    // A table stored as a float embedding is refused by dtype, naming the tensor.
    let f32_path = dir.path().join("float_table.cmf");
    let mut w = CmfWriter::create(&f32_path, Header::new("deepseek_v41")).unwrap();
    let vals = vec![0.5f32; 64 * 32];
    let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    w.add_tensor(
        "model.engram_tables.3.weight",
        DType::F32,
        &[64, 32],
        &bytes,
    )
    .unwrap();
    w.finish().unwrap();
    let f = Cmf::open(&f32_path).unwrap();
    let err = EngramTable::bind(&f, 3, 64, 32).unwrap_err();
    assert!(
        matches!(&err, EngramTableError::Dtype { name, found: DType::F32 } if name == "model.engram_tables.3.weight"),
        "{err:?}"
    );
    assert!(err.to_string().contains("mxfp8"), "{err}");
}

// ----- Item 4: the table stays on disk -----

/// Row width of the release's tables.
const COLS: usize = 256;
/// Rows of the synthetic table: 8 Mi rows x 264 bytes = 2.06 GiB, about 20x everything else
/// in the file.
const SYNTH_ROWS: u64 = 8 << 20;
/// Rows gathered: ~2,900 fault-around windows (below), so the bound stays a small fraction of
/// the table while still being thousands of scattered reads.
const GATHER: usize = 2_000;
/// Page size and the kernel's default read fault-around window (`fault_around_bytes`): a
/// read fault on a file mapping reads around the page into the page cache (128 KiB) and maps
/// the neighbours within the aligned 64 KiB window, so each row read costs up to one window
/// of codes and one of scales in the mapping's Rss, not 4 KiB.
const PAGE: usize = 4096;
const FAULT_AROUND: usize = 64 << 10;

/// Code byte `i` of the synthetic table: a scramble with bit 3 clear, so the exponent field
/// is never 15 and no code is NaN.
fn synth_code(i: u64) -> u8 {
    ((i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8) & 0xF7
}

/// Scale byte `j`: 2^-7 ..= 2^8.
fn synth_scale(j: u64) -> u8 {
    120 + (j % 16) as u8
}

/// The synthetic mxfp8 payload, produced a chunk at a time so the writer streams it and the
/// test never holds the table.
struct SynthPayload {
    pos: u64,
    code_len: u64,
    len: u64,
}

impl Read for SynthPayload {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min((self.len - self.pos) as usize);
        for (k, b) in buf[..n].iter_mut().enumerate() {
            let i = self.pos + k as u64;
            *b = if i < self.code_len {
                synth_code(i)
            } else {
                synth_scale(i - self.code_len)
            };
        }
        self.pos += n as u64;
        Ok(n)
    }
}

/// `Rss` (bytes) of this process's mapping(s) of `path`, from /proc/self/smaps: only the
/// pages this process has mapped, whatever else is in the page cache or on the heap.
fn mapping_rss(path: &Path) -> usize {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let want = path.to_str().unwrap();
    let mut inside = false;
    let mut kb = 0usize;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            // A mapping header: "start-end perms offset dev inode [path]".
            inside = line.split_whitespace().nth(5) == Some(want);
        } else if inside && let Some(v) = line.strip_prefix("Rss:") {
            kb += v
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<usize>()
                .unwrap();
        }
    }
    kb * 1024
}

/// VmRSS (bytes) of the whole process.
fn vm_rss() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kb: usize = line[6..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap();
    kb * 1024
}

fn mib(b: usize) -> f64 {
    b as f64 / (1 << 20) as f64
}

#[test]
fn gathering_from_a_mapped_table_reads_only_the_rows() {
    if !Path::new("/proc/self/smaps").exists() {
        println!("skipped: no /proc/self/smaps (not Linux)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let code_len = SYNTH_ROWS * COLS as u64;
    let table_bytes = code_len + code_len / 32;
    // Room for the file and a margin: refuse to fill the disk.
    let free = rustix::fs::statvfs(dir.path()).unwrap();
    let avail = free.f_bavail * free.f_frsize;
    assert!(
        avail > table_bytes * 2,
        "{}: {avail} bytes free, the test writes {table_bytes}",
        dir.path().display()
    );
    let path = dir.path().canonicalize().unwrap().join("synth_engram.cmf");

    // The rest of the "model": an embedding and a norm, ~100 MiB less than the table.
    let start = std::time::Instant::now();
    let mut w = CmfWriter::create(&path, Header::new("deepseek_v41")).unwrap();
    let embed: Vec<u8> = (0..4096u32 * COLS as u32)
        .flat_map(|i| ((i % 97) as f32 * 0.01).to_le_bytes())
        .collect();
    w.add_tensor(
        "model.embed_tokens.weight",
        DType::F32,
        &[4096, COLS],
        &embed,
    )
    .unwrap();
    w.add_tensor("model.norm.weight", DType::F32, &[COLS], &[0u8; COLS * 4])
        .unwrap();
    let rows = usize::try_from(SYNTH_ROWS).unwrap();
    w.add_tensor_from_reader(
        "model.engram_tables.1.weight",
        DType::Mxfp8,
        &[rows, COLS],
        SynthPayload {
            pos: 0,
            code_len,
            len: table_bytes,
        },
    )
    .unwrap();
    w.finish().unwrap();
    drop(embed);
    let written = start.elapsed();
    // Drop the file from the page cache (`finish` synced it, so its pages are clean): a hot
    // cache holds the just-written file in large folios, and a read fault maps the whole
    // folio (up to megabytes) around the row. A cold cache is also the honest case: a 98 GB
    // release table is mostly not cached.
    let f = std::fs::File::open(&path).unwrap();
    rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
    drop(f);

    let cmf = Cmf::open(&path).unwrap();
    let table = EngramTable::bind(&cmf, 1, SYNTH_ROWS, COLS).unwrap();
    assert_eq!(table.bytes().len() as u64, table_bytes);

    // Random ids (xorshift), and the buffer they decode into, allocated and touched before the
    // measurement so only the gather's page faults fall inside it.
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let ids: Vec<u64> = (0..GATHER)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s % SYNTH_ROWS
        })
        .collect();
    let mut out = vec![1.0f32; GATHER * COLS];

    // What the rows can map at most: the fault-around windows holding their code and scale
    // bytes (virtual addresses, as the kernel aligns them), and the 4 KiB pages they lie in.
    let base = table.bytes().as_ptr() as usize;
    let gpr = COLS / 32;
    let mut windows = HashSet::new();
    let mut pages = HashSet::new();
    for &r in &ids {
        let r = r as usize;
        let code = base + r * COLS;
        let scale = base + code_len as usize + r * gpr;
        for (a, len) in [(code, COLS), (scale, gpr)] {
            for b in [a, a + len - 1] {
                windows.insert(b / FAULT_AROUND);
                pages.insert(b / PAGE);
            }
        }
    }

    let map_before = mapping_rss(&path);
    let rss_before = vm_rss();
    let t = std::time::Instant::now();
    table.gather(&ids, &mut out).unwrap();
    let gather_time = t.elapsed();
    let map_after = mapping_rss(&path);
    let rss_after = vm_rss();
    let growth = map_after.saturating_sub(map_before);

    // The values are the generator's: the right rows were read.
    for (slot, &r) in ids.iter().enumerate().step_by(997) {
        for c in [0, 31, 32, 255] {
            let i = r * COLS as u64 + c as u64;
            let want = e4m3(synth_code(i)) * e8m0(synth_scale(i / 32));
            assert_eq!(out[slot * COLS + c] as f64, want, "row {r} col {c}");
        }
    }

    let read_bound = pages.len() * PAGE;
    let window_bound = windows.len() * FAULT_AROUND;
    println!(
        "engram residency: table {table_bytes} bytes ({:.1} MiB, {SYNTH_ROWS} x {COLS} mxfp8) \
         written in {:.1} s; file {} bytes",
        mib(table_bytes as usize),
        written.as_secs_f64(),
        cmf.file_len()
    );
    println!(
        "engram residency: gathered {GATHER} random rows ({} bytes of codes+scales) in {:.0} ms; \
         they lie in {} distinct 4 KiB pages ({:.1} MiB) and {} distinct 64 KiB fault-around \
         windows ({:.1} MiB)",
        GATHER * (COLS + gpr),
        gather_time.as_secs_f64() * 1e3,
        pages.len(),
        mib(read_bound),
        windows.len(),
        mib(window_bound)
    );
    println!(
        "engram residency: mapping Rss {:.1} -> {:.1} MiB (+{:.1} MiB, {:.2}% of the table, \
         {:.1} KiB per row); process VmRSS {:.1} -> {:.1} MiB",
        mib(map_before),
        mib(map_after),
        mib(growth),
        100.0 * growth as f64 / table_bytes as f64,
        growth as f64 / 1024.0 / GATHER as f64,
        mib(rss_before),
        mib(rss_after)
    );
    // Pages the gather reads are all resident afterwards (it touched them).
    assert!(
        growth >= read_bound / 2,
        "the mapping grew by {growth} bytes, less than the {read_bound} bytes read: is it mapped?"
    );
    // Bounded by the rows read: the windows holding them (plus 4 MiB of slack for the
    // header/table pages the kernel may map around), at most 2 windows a row, never the table.
    assert!(window_bound <= GATHER * 4 * FAULT_AROUND);
    // Twice the windows: the kernel's fault-around and folio sizes differ between machines;
    // what must hold is that the growth follows the rows read, not the table.
    assert!(
        growth <= 2 * window_bound + (4 << 20),
        "the mapping grew by {growth} bytes, more than the {window_bound} bytes of windows the \
         {GATHER} rows lie in"
    );
    assert!(
        (growth as u64) < table_bytes / 8,
        "the mapping grew by {growth} bytes of a {table_bytes}-byte table"
    );
}

/// The whole V4.1 forward over tables far larger than the rest of the model: the fixture's
/// weights (4.3 MB) with its two Engram tables replaced by synthetic ones of the sizes a much
/// larger `engram_vocab_size` gives (1.6 GB together). Prefill of a 56-token prompt and 8
/// cached decode steps grow the file mapping's resident memory by the rest of the weights and
/// the windows holding the rows the hashes name, not by the tables.
#[test]
fn a_v41_forward_reads_only_the_rows_its_ngrams_name() {
    use model_dsv4::CausalLm;
    use model_dsv4::engram::CompressedTokenMap;
    use model_dsv4::v41::{Model, Weights};
    if !Path::new("/proc/self/smaps").exists() {
        println!("skipped: no /proc/self/smaps (not Linux)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src_path = convert_fixture("deepseek_v41_a", dir.path(), Profile::F32);
    let src = Cmf::open(&src_path).unwrap();

    // The config with a large n-gram bucket space: 6 primes above 2,000,000 per Engram layer.
    let mut header = src.header().clone();
    let big = model_dsv4::engram::EngramLayout::new(2, 2_000_000, 4, 2).unwrap();
    header.config["engram_vocab_size"] = 2_000_000.into();
    header.config["engram_num_embeddings"] = serde_json::json!(big.table_rows());
    let config = DeepseekV41Config::from_json(&header.config).unwrap();
    let layout = config.engram_layout().unwrap().clone();
    let cols = config.engram_head_dim;
    let table_rows = layout.table_rows().to_vec();
    let tables_bytes: u64 = table_rows.iter().map(|r| r * cols as u64 * 33 / 32).sum();
    let rest_bytes: u64 = src
        .tensors()
        .iter()
        .filter(|t| !t.name.starts_with("model.engram_tables."))
        .map(|t| src.tensor(&t.name).unwrap().bytes.len() as u64)
        .sum();
    let free = rustix::fs::statvfs(dir.path()).unwrap();
    assert!(free.f_bavail * free.f_frsize > tables_bytes * 2);

    let path = dir.path().canonicalize().unwrap().join("big_engram.cmf");
    let mut w = CmfWriter::create(&path, header).unwrap();
    for t in src.tensors() {
        if t.name.starts_with("model.engram_tables.") {
            continue;
        }
        let v = src.tensor(&t.name).unwrap();
        w.add_tensor(&t.name, v.dtype(), v.shape(), v.bytes)
            .unwrap();
    }
    for (k, &layer) in config.engram_layer_ids.iter().enumerate() {
        let code_len = table_rows[k] * cols as u64;
        w.add_tensor_from_reader(
            &format!("model.engram_tables.{layer}.weight"),
            DType::Mxfp8,
            &[table_rows[k] as usize, cols],
            SynthPayload {
                pos: 0,
                code_len,
                len: code_len + code_len / 32,
            },
        )
        .unwrap();
    }
    w.finish().unwrap();
    let f = std::fs::File::open(&path).unwrap();
    rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
    drop(f);

    let cmf = Cmf::open(&path).unwrap();
    let npy = common::read_npy(&fixture("deepseek_v41_a").join("expected/engram_token_map.npy"));
    let map = CompressedTokenMap::from_i64(&npy.i64).unwrap();
    let (config, weights) = Weights::bind(&cmf, Some(map)).unwrap();
    let model = Model::new(config, weights);
    let prompt = common::ids("deepseek_v41_a", 0);

    // The rows the forward will read: the hashes of the prompt and the decoded tokens are only
    // known as it runs, so the windows are counted from the ids the hasher gives afterwards.
    let map_before = mapping_rss(&path);
    let mut st = model.new_state();
    let mut logits = model.forward_last(&prompt, &mut st).unwrap();
    let mut seq = prompt.clone();
    for _ in 0..8 {
        let next = common::argmax(&logits) as u32;
        seq.push(next);
        logits = model.forward_last(&[next], &mut st).unwrap();
    }
    let map_after = mapping_rss(&path);
    let growth = map_after.saturating_sub(map_before) as u64;
    assert!(logits.iter().all(|v| v.is_finite()));

    let hasher = model.weights.hasher.as_ref().unwrap();
    let ids = hasher.hash_prompt(&seq[..seq.len() - 1]).unwrap();
    let (n_cols, per_token) = (hasher.layout().n_cols(), hasher.ids_per_token());
    let mut windows = HashSet::new();
    let mut rows_read = 0usize;
    for (il, lw) in model.weights.layers.iter().enumerate() {
        let (Some(ew), Some(k)) = (&lw.engram, model.config.roles()[il].engram) else {
            continue;
        };
        let base = ew.table.bytes().as_ptr() as usize;
        let code_len = ew.table.rows() as usize * cols;
        for tok in ids.chunks_exact(per_token) {
            for &r in &tok[k * n_cols..(k + 1) * n_cols] {
                let r = r as usize;
                rows_read += 1;
                for (a, len) in [
                    (base + r * cols, cols),
                    (base + code_len + r * cols / 32, 2),
                ] {
                    windows.insert(a / FAULT_AROUND);
                    windows.insert((a + len - 1) / FAULT_AROUND);
                }
            }
        }
    }
    let window_bound = (windows.len() * FAULT_AROUND) as u64;
    println!(
        "v41 forward residency: tables {:.1} MiB ({:?} rows x {cols} mxfp8), rest of the model \
         {:.1} MiB; prefill {} + 8 decode tokens read {rows_read} table rows in {} 64 KiB \
         windows ({:.1} MiB); mapping Rss {:.1} -> {:.1} MiB (+{:.1} MiB, {:.2}% of the tables)",
        mib(tables_bytes as usize),
        table_rows,
        mib(rest_bytes as usize),
        prompt.len(),
        windows.len(),
        mib(window_bound as usize),
        mib(map_before),
        mib(map_after),
        mib(growth as usize),
        100.0 * growth as f64 / tables_bytes as f64
    );
    // The rest of the weights, the windows the rows lie in (twice: fault-around and folio
    // sizes differ between machines) and 4 MiB of slack; never the tables.
    assert!(
        growth <= rest_bytes + 2 * window_bound + (4 << 20),
        "the mapping grew by {growth} bytes: more than the weights ({rest_bytes}) and the \
         {window_bound} bytes of windows the rows lie in"
    );
    assert!(
        growth < tables_bytes / 8,
        "grew by {growth} of {tables_bytes}"
    );
}
