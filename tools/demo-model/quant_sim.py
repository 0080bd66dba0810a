"""What other engines' weight formats cost on the demo models: the comparison behind
docs/quality.md's "not worse than its bits suggest" findings.

    python tools/demo-model/quant_sim.py [--case shakespeare] [--tokens 4096]

Round-trips every matrix of the checkpoint through a simulated format (in float, in transformers)
and reports mean KL(f32 || simulated) and top-1 agreement over the first N held-out tokens, in the
same windows as `cortiq perplexity --ctx 256 --stride 128`. Formats, as llama.cpp defines them:
q8_0 (32-element blocks, f16 absmax/127 scale), q4_0 (32-element blocks, f16 scale max/-8, codes
-8..7), plain mxfp4 (E2M1 codes, scale 2^(floor(log2 amax) - 2), round to nearest), a 2-bit affine
scheme (per-32 f16 scale and minimum, 4 levels; q2_K without super-blocks), and per-row absmax int8.
Expert matrices are `*experts*` / `*shared_expert*` parameters (3-D fused experts per expert).
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference import windows  # noqa: E402

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6.0])


def groups(w):
    r, c = w.shape
    return w.reshape(r, c // 32, 32)


def q8_0(w):
    if w.shape[1] % 32:
        return w
    x = groups(w)
    d = (x.abs().amax(-1, keepdim=True) / 127).half().float()
    return (torch.where(d > 0, (x / d).round().clamp(-127, 127), 0 * x) * d).reshape(w.shape)


def int8_row(w):
    d = (w.abs().amax(-1, keepdim=True) / 127).half().float()
    return torch.where(d > 0, (w / d).round().clamp(-127, 127), 0 * w) * d


def q4_0(w):
    if w.shape[1] % 32:
        return q8_0(w)
    x = groups(w)
    mx = torch.gather(x, -1, x.abs().argmax(-1, keepdim=True))
    d = (mx / -8).half().float()
    return (torch.where(d != 0, (x / d).round().clamp(-8, 7), 0 * x) * d).reshape(w.shape)


def mxfp4(w):
    if w.shape[1] % 32:
        return q8_0(w)
    x = groups(w)
    s = 2.0 ** (torch.floor(torch.log2(x.abs().amax(-1, keepdim=True).clamp_min(1e-30))) - 2)
    y = (x / s).abs().clamp(max=6)
    q = E2M1[(y[..., None] - E2M1).abs().argmin(-1)] * torch.sign(x)
    return (q * s).reshape(w.shape)


def q2_affine(w):
    if w.shape[1] % 32:
        return q8_0(w)
    x = groups(w)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    d, lo = ((hi - lo) / 3).half().float(), lo.half().float()
    return (torch.where(d > 0, ((x - lo) / d).round().clamp(0, 3), 0 * x) * d + lo).reshape(w.shape)


SCHEMES = {  # name: (gate/up experts, down experts, everything else)
    "q8_0 everywhere": (q8_0, q8_0, q8_0),
    "int8 per-row absmax everywhere": (int8_row, int8_row, int8_row),
    "experts q4_0, rest q8_0": (q4_0, q4_0, q8_0),
    "experts plain mxfp4, rest q8_0": (mxfp4, mxfp4, q8_0),
    "gate/up 2-bit affine, down q4_0, rest q8_0": (q2_affine, q4_0, q8_0),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="shakespeare")
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    root = Path("fixtures") / args.case
    ids = np.load(root / "expected/heldout_ids.npy").tolist()[: args.tokens]
    base = AutoModelForCausalLM.from_pretrained(str(root / "hf"), attn_implementation="eager",
                                                dtype=torch.float32).eval()

    def logprobs(m):
        out = []
        for b, e, f in windows(len(ids), 256, 128):
            with torch.no_grad():
                lg = m(input_ids=torch.tensor([ids[b:e]]), use_cache=False).logits[0].double()
            out.append(torch.log_softmax(lg, -1)[f - 1 - b : e - 1 - b])
        return torch.cat(out)

    ref = logprobs(base)
    for name, (gate_up, down, rest) in SCHEMES.items():
        m = copy.deepcopy(base)
        with torch.no_grad():
            for n, p in m.named_parameters():
                expert = "experts" in n or "shared_expert" in n
                fn = (down if "down" in n else gate_up) if expert else rest
                if p.dim() == 2:
                    p.copy_(fn(p))
                elif p.dim() == 3:
                    p.copy_(torch.stack([fn(x) for x in p]))
        lp = logprobs(m)
        kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        top1 = (ref.argmax(-1) == lp.argmax(-1)).double().mean().item()
        print(f"{args.case}: {name}: mean KL {kl:.3e}, top-1 {100 * top1:.3f}%", flush=True)


if __name__ == "__main__":
    main()
