#!/usr/bin/env python3
"""Fingerprints everything the CPU path produces from the committed fixtures, to show that a
refactor changed no number: run it with the `cortiq` binary of the old commit and of the new one,
then compare the two manifests (`diff` or `--compare`).

For every fixture under fixtures/ and every conversion profile it records
  - the sha256 of the converted CMF (the converter's output, byte for byte),
  - the sha256 of `cortiq logits` on each fixture prompt: one prefill, and a prefill of
    `k_prefill` tokens followed by one-at-a-time cached decode,
  - for the two trained models (which carry a tokenizer), the greedy text of `cortiq run`.

Usage:
  scripts/logit-snapshot.py CORTIQ_BINARY WORK_DIR > manifest.txt
  scripts/logit-snapshot.py --compare OLD.txt NEW.txt
No numpy needed: the int64 `.npy` prompt files are parsed here.
"""

import ast
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROFILES = ["f32", "f16", "bf16", "q8", "q4", "q2", "fp4"]
TRAINED = {"shakespeare", "deepseek_v4_shakespeare"}
GREEDY_PROMPTS = ["ROMEO.", "First Citizen.\nBefore we proceed any further"]


def read_int_npy(path: Path) -> list[int]:
    raw = path.read_bytes()
    assert raw[:6] == b"\x93NUMPY", path
    major = raw[6]
    if major == 1:
        (hlen,) = struct.unpack("<H", raw[8:10])
        start = 10
    else:
        (hlen,) = struct.unpack("<I", raw[8:12])
        start = 12
    header = ast.literal_eval(raw[start : start + hlen].decode("latin1"))
    code = {"<i8": "q", "<i4": "i"}[header["descr"]]
    assert not header["fortran_order"], (path, header)
    n = 1
    for d in header["shape"]:
        n *= d
    body = raw[start + hlen :]
    size = struct.calcsize(code)
    return list(struct.unpack(f"<{n}{code}", body[: size * n]))


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(cmd: list[str]) -> str:
    # A fixed "now": the converter stamps its provenance with the time, and the files of two
    # runs must compare byte for byte.
    env = dict(os.environ, SOURCE_DATE_EPOCH="1700000000")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr}")
    return r.stdout


def snapshot(binary: str, work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    for case_dir in sorted((ROOT / "fixtures").iterdir()):
        if not (case_dir / "hf").is_dir():
            continue
        case = case_dir.name
        prompts = []
        expected = case_dir / "expected"
        cases_json = expected / "cases.json"
        meta = json.loads(cases_json.read_text()) if cases_json.exists() else {}
        for p in range(16):
            ids_file = expected / f"p{p}_ids.npy"
            if not ids_file.exists():
                break
            k = meta.get("prompts", [{}] * 16)[p].get("k_prefill")
            prompts.append((p, read_int_npy(ids_file), k))
        if not prompts and (expected / "heldout_ids.npy").exists():
            # The trained fixtures: a 96-token slice of held-out text, split at 40.
            prompts.append((0, read_int_npy(expected / "heldout_ids.npy")[:96], 40))
        for profile in PROFILES:
            cmf = work / f"{case}.{profile}.cmf"
            run([binary, "convert", str(case_dir / "hf"), "-o", str(cmf), "--quant", profile,
                 "--quiet"])
            print(f"{case} {profile} cmf {sha(cmf)}")
            for p, ids, k in prompts:
                toks = ",".join(str(i) for i in ids)
                out = work / f"{case}.{profile}.p{p}.prefill.npy"
                run([binary, "logits", str(cmf), "--tokens", toks, "--out", str(out)])
                print(f"{case} {profile} p{p} prefill {sha(out)}")
                if k:
                    out = work / f"{case}.{profile}.p{p}.decode.npy"
                    run([binary, "logits", str(cmf), "--tokens", toks, "--out", str(out),
                         "--decode-from", str(k)])
                    print(f"{case} {profile} p{p} decode{k} {sha(out)}")
            if case in TRAINED:
                for i, prompt in enumerate(GREEDY_PROMPTS):
                    text = run([binary, "run", str(cmf), "-p", prompt, "--temp", "0", "-n", "48"])
                    h = hashlib.sha256(text.encode()).hexdigest()
                    print(f"{case} {profile} greedy{i} {h}")
            cmf.unlink()
            sys.stdout.flush()


def compare(old: str, new: str) -> None:
    a = Path(old).read_text().splitlines()
    b = Path(new).read_text().splitlines()
    diffs = [(x, y) for x, y in zip(a, b) if x != y]
    if len(a) != len(b) or diffs:
        for x, y in diffs:
            print(f"- {x}\n+ {y}")
        sys.exit(f"{len(diffs)} of {len(a)} lines differ ({len(a)} vs {len(b)} lines)")
    print(f"{len(a)} fingerprints identical")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3:
        snapshot(sys.argv[1], Path(sys.argv[2]))
    else:
        sys.exit(__doc__)
