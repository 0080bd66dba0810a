"""What transformers says about the trained demo model: the witness cortiq's tests compare against.

    python tools/demo-model/reference.py --hf fixtures/shakespeare/hf --heldout .demo/heldout.txt \
        --out fixtures/shakespeare/expected [--ppl-tokens 4096]

Runs `Qwen4ExpForCausalLM` (float32, eager, CPU, the unpatched reference) and writes:
- `heldout_ids.npy` (int32): the first `--ppl-tokens` ids of the held-out text;
- `heldout_nll.npy` (float64): per-token negative log-likelihood of ids[1..] under the windowing
  below; `cases.json` holds the perplexity `exp(mean nll)`;
- `parity_logits.npy` (float32 [T, vocab]): logits of one forward over the first T held-out ids;
- greedy continuations (`generate`, do_sample=False, up to 64 new tokens or EOS) of three prompts, in cases.json.

Windowing (the same as `cortiq perplexity --ctx C --stride S`): windows start at 0, S, 2S, ...
and span up to C tokens; each window scores the targets that no earlier window scored (the first
window all but its first token), predicting token t from the window's logits at t - 1.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

PROMPTS = ["ROMEO.\n", "To be, or not to be", "KING LEAR.\nWhat say you, my"]
N_GREEDY = 64


def windows(n: int, ctx: int, stride: int):
    prev_end = 0
    for begin in range(0, n, stride):
        end = min(begin + ctx, n)
        yield begin, end, max(prev_end, begin + 1)
        prev_end = end
        if end == n:
            break


def nll(model, ids: list[int], ctx: int, stride: int) -> np.ndarray:
    out = []
    for begin, end, first in windows(len(ids), ctx, stride):
        x = torch.tensor([ids[begin:end]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=x, use_cache=False).logits[0].double(), dim=-1)
        for t in range(first, end):
            out.append(-float(logp[t - 1 - begin, ids[t]]))
    return np.asarray(out, dtype=np.float64)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", type=Path, required=True)
    ap.add_argument("--heldout", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ppl-tokens", type=int, default=4096, help="held-out tokens scored (0: all)")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--stride", type=int, default=128)
    ap.add_argument("--parity-tokens", type=int, default=128)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tk = Tokenizer.from_file(str(args.hf / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(str(args.hf), attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    ids = tk.encode(args.heldout.read_text(), add_special_tokens=False).ids
    if args.ppl_tokens:
        ids = ids[: args.ppl_tokens]
    np.save(args.out / "heldout_ids.npy", np.asarray(ids, dtype=np.int32), allow_pickle=False)

    with torch.no_grad():
        x = torch.tensor([ids[: args.parity_tokens]])
        logits = model(input_ids=x, use_cache=False).logits[0].float().numpy()
    np.save(args.out / "parity_logits.npy", logits, allow_pickle=False)

    v = nll(model, ids, args.ctx, args.stride)
    np.save(args.out / "heldout_nll.npy", v, allow_pickle=False)
    ppl = math.exp(v.mean())
    print(f"held-out: {len(ids)} tokens, {v.size} scored, PPL {ppl:.6f}", flush=True)

    greedy = []
    for p in PROMPTS:
        pid = tk.encode(p, add_special_tokens=False).ids
        with torch.no_grad():
            g = model.generate(torch.tensor([pid]), do_sample=False, max_new_tokens=N_GREEDY,
                               stop_strings=None, use_cache=True)
        new = g[0, len(pid):].tolist()
        greedy.append({"prompt": p, "ids": pid, "greedy_ids": new, "greedy_text": tk.decode(new, skip_special_tokens=False)})
        print(json.dumps(greedy[-1]["greedy_text"]), flush=True)

    meta = {
        "model": str(args.hf),
        "generator": {"transformers": transformers.__version__, "torch": torch.__version__},
        "compute_dtype": "float32",
        "heldout": {"tokens": len(ids), "scored": int(v.size), "ctx": args.ctx, "stride": args.stride,
                    "mean_nll": float(v.mean()), "ppl": ppl},
        "parity_tokens": args.parity_tokens,
        "greedy": greedy,
    }
    (args.out / "cases.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
