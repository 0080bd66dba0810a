"""Train the demo model with transformers' own `Qwen4ExpForCausalLM` (runs on a CUDA GPU; minutes).

    python tools/demo-model/train.py --data .demo --out OUT_DIR [--config config.json] [--steps N] [--probe]

Reads DATA/{train.u16, heldout.txt, tokenizer.json, tokenizer_config.json, prepare.json} from
prepare.py and config.json next to this file; writes OUT_DIR/hf/ in the released Qwen3.8 layout
(bf16 safetensors in shards of < 15 MB, composite config.json, generation_config.json, the
tokenizer) plus OUT_DIR/train_log.json. `--probe` times a few steps at several batch sizes and
writes nothing else (to size the real run).

Training: random windows of seq_len+1 tokens from the EOS-joined training works; AdamW with fp32
master weights and bf16 autocast; linear warmup then cosine decay; the router's load-balancing
loss on (output_router_logits, router_aux_loss_coef). Why the batch is large: the reference
implementation is launch-bound (GDN and conv run on pure-torch fallbacks), so a step's time barely
grows with the batch until the GPU is busy, once the QSA indexer's per-query Python loop is
replaced by fast_indexer.py (machines.md §4 measured the reference with that loop).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "reference"))


def build(cfg, prep):
    import cases
    from transformers import AutoModelForCausalLM

    case = {"family": cfg["family"], "cfg": cfg["model"], "vocab_size": prep["vocab_size"]}
    text_cfg, released = cases.make_config(case, prep["special_ids"])
    gen = cases.generation_config(case, prep["special_ids"])
    gen["stop_strings"] = ["\n\n"]  # a reply in `cortiq chat` is one speech (prepare.py)
    model = AutoModelForCausalLM.from_config(text_cfg, dtype=torch.float32)
    return text_cfg, released, gen, model


def heldout_loss(model, ids: torch.Tensor, seq: int, dev) -> float:
    model.eval()
    n = (ids.numel() - 1) // seq
    x = ids[: n * seq].view(n, seq).to(dev)
    y = ids[1 : n * seq + 1].view(n, seq).to(dev)
    tot, cnt = 0.0, 0
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
        for i in range(0, n, 64):
            logits = model(input_ids=x[i : i + 64], use_cache=False).logits.float()
            tot += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y[i : i + 64].reshape(-1), reduction="sum").item()
            cnt += y[i : i + 64].numel()
    model.train()
    return tot / cnt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path(".demo"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, help="override config.json train.steps")
    ap.add_argument("--config", type=Path, default=HERE / "config.json")
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--batch", type=int, help="override config.json train.batch_size")
    ap.add_argument("--max-seconds", type=float, default=1e9, help="stop early (and save) after this long")
    args = ap.parse_args()
    import transformers

    cfg = json.loads(args.config.read_text())
    tc = cfg["train"]
    prep = json.loads((args.data / "prepare.json").read_text())
    torch.manual_seed(tc["seed"])
    np.random.seed(tc["seed"])
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    text_cfg, released, gen, model = build(cfg, prep)
    if cfg["family"] == "qwen4_exp":
        import fast_indexer

        rows, ties = fast_indexer.check(text_cfg, seq_len=tc["seq_len"], batch=2)
        print(f"batched QSA indexer agrees with the reference on {rows} queries ({ties} differ only by ties)")
        fast_indexer.install()
    nparams = sum(p.numel() for p in model.parameters())
    print(f"transformers {transformers.__version__} torch {torch.__version__}; {nparams / 1e6:.2f} M parameters",
          flush=True)
    model.config.output_router_logits = True
    model.to(dev).train()

    data = torch.from_numpy(np.fromfile(args.data / "train.u16", dtype=np.uint16).astype(np.int64))
    seq = tc["seq_len"]
    gen_rng = torch.Generator().manual_seed(tc["seed"])

    def batch(bs):
        starts = torch.randint(0, data.numel() - seq - 1, (bs,), generator=gen_rng)
        idx = starts[:, None] + torch.arange(seq + 1)[None, :]
        w = data[idx].to(dev, non_blocking=True)
        return w[:, :-1], w[:, 1:]

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=tc["lr"], betas=tuple(tc["betas"]), fused=True)

    def step(bs, lr):
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(bs)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out = model(input_ids=x, use_cache=False)
            logits = out.logits.float()
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss = ce + (aux * text_cfg.router_aux_loss_coef if (aux := getattr(out, "aux_loss", None)) is not None else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc["grad_clip"])
        opt.step()
        return ce.item()

    if args.probe:
        for bs in (64, 256):
            times = []
            for _ in range(3):
                t0 = time.time()
                ce = step(bs, 1e-4)
                times.append(time.time() - t0)
            mem = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
            print(f"probe batch {bs}: step times {[round(t, 2) for t in times]} s, ce {ce:.3f}, "
                  f"{bs * seq / min(times):.0f} tok/s, peak {mem:.1f} GiB", flush=True)
        return

    steps = args.steps or tc["steps"]
    if args.batch:
        tc["batch_size"] = args.batch
    held_ids = torch.tensor(_encode_heldout(args.data), dtype=torch.int64)
    log = {"transformers": transformers.__version__, "torch": torch.__version__, "parameters": nparams,
           "steps": steps, "batch_size": tc["batch_size"], "seq_len": seq, "history": []}
    t_start = time.time()
    for s in range(steps):
        if s < tc["warmup_steps"]:
            lr = tc["lr"] * (s + 1) / tc["warmup_steps"]
        else:
            frac = (s - tc["warmup_steps"]) / max(1, steps - tc["warmup_steps"])
            lr = tc["min_lr"] + 0.5 * (tc["lr"] - tc["min_lr"]) * (1 + math.cos(math.pi * frac))
        ce = step(tc["batch_size"], lr)
        rec = {"step": s + 1, "train_ce": round(ce, 4), "lr": lr, "seconds": round(time.time() - t_start, 1)}
        if (s + 1) % 20 == 0 or s + 1 == steps:
            rec["heldout_ce"] = round(heldout_loss(model, held_ids, seq, dev), 4)
        log["history"].append(rec)
        if (s + 1) % 10 == 0 or "heldout_ce" in rec:
            print(json.dumps(rec), flush=True)
        if time.time() - t_start > args.max_seconds and "heldout_ce" not in rec:
            rec["heldout_ce"] = round(heldout_loss(model, held_ids, seq, dev), 4)
            log["stopped_early_at"] = s + 1
            print(f"stopped at step {s + 1} (--max-seconds)", flush=True)
            break
    log["heldout_ce"] = log["history"][-1]["heldout_ce"]
    log["heldout_ppl"] = math.exp(log["heldout_ce"])
    save(model.cpu(), cfg["family"], text_cfg, released, gen, args, log)


def _encode_heldout(data: Path) -> list[int]:
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(data / "tokenizer.json"))
    return tk.encode((data / "heldout.txt").read_text(), add_special_tokens=False).ids


def save(model, family, text_cfg, released, gen, args, log):
    """The released layout: Qwen3.8's bf16 safetensors, or V4-Flash's FP8 block-scaled projections
    and FP4 experts (so the released deepseek_v4 model is the quantised one, as DeepSeek ships it)."""
    import shutil

    from make_fixtures import (bf16_round, clean_config_dict, ds_quantise_in_place, ds_released_tensors,
                               dump_json, qwen_released_tensors, write_safetensors)

    hf = args.out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    model.eval()
    if family == "qwen4_exp":
        with torch.no_grad():
            for t in model.state_dict().values():
                if t.is_floating_point():
                    t.copy_(bf16_round(t))
        tensors = qwen_released_tensors(model, text_cfg)
    else:
        tensors = ds_released_tensors(model, ds_quantise_in_place(model))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    files = write_safetensors(tensors, hf, max(1, math.ceil(total / 12e6)))
    dump_json(hf / "config.json", clean_config_dict(released))
    dump_json(hf / "generation_config.json", gen)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(args.data / f, hf / f)
    log["files"] = files
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"saved {len(files)} files, {total / 1e6:.1f} MB to {hf}")


if __name__ == "__main__":
    main()
