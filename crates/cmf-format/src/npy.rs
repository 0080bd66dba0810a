//! NumPy `.npy` arrays: the exchange format of the transformers fixtures (read) and of
//! `cortiq logits` (written). Only what those need: little-endian C-order `<f4` and `<i8`.

use std::io::{self, Write};
use std::path::Path;

/// Writes a little-endian float32 C-order `.npy` (format 1.0) of shape `[rows, cols]`.
pub fn write_npy(out: &mut dyn Write, rows: usize, cols: usize, data: &[f32]) -> io::Result<()> {
    assert_eq!(data.len(), rows * cols, "npy data length");
    let mut header =
        format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    // Magic (6) + version (2) + length (2) + header, padded with spaces to a multiple of 64,
    // ending in a newline.
    let total = (10 + header.len() + 1).div_ceil(64) * 64;
    while 10 + header.len() + 1 < total {
        header.push(' ');
    }
    header.push('\n');
    out.write_all(b"\x93NUMPY\x01\x00")?;
    out.write_all(&(header.len() as u16).to_le_bytes())?;
    out.write_all(header.as_bytes())?;
    let mut buf = Vec::with_capacity(data.len() * 4);
    for v in data {
        buf.extend_from_slice(&v.to_le_bytes());
    }
    out.write_all(&buf)
}

/// A `.npy` array as [`read_npy`] returns it: the shape and, by dtype, the data (the other
/// vector is empty).
#[derive(Debug, Clone, PartialEq)]
pub struct Npy {
    /// Shape (empty for a scalar).
    pub shape: Vec<usize>,
    /// Data when `<f4`.
    pub f32: Vec<f32>,
    /// Data when `<i8`.
    pub i64: Vec<i64>,
}

/// Reads a little-endian C-order `<f4` or `<i8` `.npy` (format 1.0, 2.0 or 3.0), such as
/// [`write_npy`] writes and numpy's `np.save` writes for those dtypes. Anything else (another
/// dtype, Fortran order, a short or long payload, a malformed header) is an
/// [`io::ErrorKind::InvalidData`] error.
pub fn read_npy(path: &Path) -> io::Result<Npy> {
    let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    let b = std::fs::read(path)?;
    if b.len() < 12 || &b[..6] != b"\x93NUMPY" {
        return Err(bad("not a .npy file".into()));
    }
    let (hlen, start) = match b[6] {
        1 => (u16::from_le_bytes([b[8], b[9]]) as usize, 10usize),
        2 | 3 => (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12),
        v => return Err(bad(format!("unsupported .npy version {v}"))),
    };
    let header = b
        .get(start..start.saturating_add(hlen))
        .ok_or_else(|| bad("truncated .npy header".into()))?;
    let header = std::str::from_utf8(header).map_err(|_| bad("non-UTF-8 .npy header".into()))?;
    if !header.contains("'fortran_order': False") {
        return Err(bad(format!("not a C-order .npy: {header}")));
    }
    let shape = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .ok_or_else(|| bad(format!("no shape in .npy header: {header}")))?
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>())
        .collect::<Result<Vec<usize>, _>>()
        .map_err(|_| bad(format!("bad shape in .npy header: {header}")))?;
    let data = &b[start + hlen..];
    let (is_f32, size) = if header.contains("'descr': '<f4'") {
        (true, 4)
    } else if header.contains("'descr': '<i8'") {
        (false, 8)
    } else {
        return Err(bad(format!("unsupported .npy dtype: {header}")));
    };
    let want = shape
        .iter()
        .try_fold(size, |n: usize, &d| n.checked_mul(d))
        .ok_or_else(|| bad(format!("oversized .npy shape {shape:?}")))?;
    if data.len() != want {
        return Err(bad(format!(
            ".npy payload of {} bytes, {want} expected for {shape:?}",
            data.len()
        )));
    }
    let mut out = Npy {
        shape,
        f32: Vec::new(),
        i64: Vec::new(),
    };
    if is_f32 {
        out.f32 = data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
    } else {
        out.i64 = data
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("chunks of 8")))
            .collect();
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("cortiq-npy-{}-{name}", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        p
    }

    /// A `.npy` with a hand-written header (format 1.0), as numpy lays it out.
    fn npy_bytes(header: &str, payload: &[u8]) -> Vec<u8> {
        let mut h = header.to_string();
        while !(10 + h.len() + 1).is_multiple_of(64) {
            h.push(' ');
        }
        h.push('\n');
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        b.extend_from_slice(&(h.len() as u16).to_le_bytes());
        b.extend_from_slice(h.as_bytes());
        b.extend_from_slice(payload);
        b
    }

    #[test]
    fn read_npy_round_trips_write_npy() {
        let data: Vec<f32> = (0..6).map(|i| i as f32 * -0.75 + 1e-3).collect();
        let mut b = Vec::new();
        write_npy(&mut b, 2, 3, &data).unwrap();
        let p = tmp("f4", &b);
        let got = read_npy(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        assert_eq!(got.shape, vec![2, 3]);
        assert_eq!(got.f32, data);
        assert!(got.i64.is_empty());
    }

    #[test]
    fn read_npy_reads_int64_and_one_dimensional_shapes() {
        let vals = [7i64, -1, 1 << 40];
        let payload: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let b = npy_bytes(
            "{'descr': '<i8', 'fortran_order': False, 'shape': (3,), }",
            &payload,
        );
        let p = tmp("i8", &b);
        let got = read_npy(&p).unwrap();
        std::fs::remove_file(&p).unwrap();
        assert_eq!(got.shape, vec![3]);
        assert_eq!(got.i64, vals);
        assert!(got.f32.is_empty());
    }

    #[test]
    fn malformed_npy_is_an_error_not_a_panic() {
        let f4 = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }";
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("empty", Vec::new()),
            ("magic", b"\x93NUMPX\x01\x00\x00\x00".to_vec()),
            ("short-payload", npy_bytes(f4, &[0; 4])),
            ("long-payload", npy_bytes(f4, &[0; 12])),
            (
                "dtype",
                npy_bytes(
                    "{'descr': '<f8', 'fortran_order': False, 'shape': (1,), }",
                    &[0; 8],
                ),
            ),
            (
                "fortran",
                npy_bytes(
                    "{'descr': '<f4', 'fortran_order': True, 'shape': (1,), }",
                    &[0; 4],
                ),
            ),
            (
                "shape",
                npy_bytes(
                    "{'descr': '<f4', 'fortran_order': False, 'shape': (x,), }",
                    &[],
                ),
            ),
            (
                "overflow",
                npy_bytes(
                    "{'descr': '<f4', 'fortran_order': False, 'shape': (18446744073709551615, 2), }",
                    &[],
                ),
            ),
            ("truncated-header", npy_bytes(f4, &[])[..20].to_vec()),
        ];
        for (name, b) in cases {
            let p = tmp(name, &b);
            let r = read_npy(&p);
            std::fs::remove_file(&p).unwrap();
            let e = r.expect_err(name);
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{name}: {e}");
        }
        assert!(read_npy(Path::new("/nonexistent/cortiq.npy")).is_err());
    }
}
