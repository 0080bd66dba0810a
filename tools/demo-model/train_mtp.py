"""Train a multi-token-prediction (MTP) head for the demo model, with the trunk frozen (CUDA GPU, minutes).

    python tools/demo-model/train_mtp.py --hf fixtures/shakespeare/hf --data .demo --out OUT_HF \
        [--fixture DIR] [--device cuda|cpu] [--steps N] [--batch B] [--seq-len T]

Needs a transformers with `qwen4_exp` `indexed_attention` layers (5.24; 5.16-5.23 name the layer type
`qwen_sparse_attention` and cannot load the checkpoint), torch, safetensors, tokenizers, numpy. On a
machine with an older transformers, put 5.24 first on PYTHONPATH (the PyPI wheel's package with
`models/` cut down to `auto` and `qwen4_exp` works: 9 MB, 1.3 MB as tar.xz).

Reads the trained checkpoint `--hf` (never modified) and `--data` from prepare.py (train.u16,
heldout.txt, tokenizer.json); writes
- OUT_HF/: a copy of every file of `--hf`, plus `model-mtp.safetensors` holding the `mtp.*` tensors
  (same dtype as the trunk's, BF16) and `model.safetensors.index.json` with them added to the
  weight map (the converter, crates/cmf-convert/src/source.rs, reads the shards the index names;
  transformers ignores `mtp.*` on load);
- OUT_HF/mtp_log.json: the recipe, training history, held-out MTP cross-entropy, draft acceptance;
- with `--fixture DIR`: the parity fixture for the Rust head (below).

## The head (what cortiq's model-qwen4 `mtp.rs` implements)

H = hc_count (4), D = hidden_size (256), eps = rms_norm_eps. Every norm is transformers'
`Qwen4ExpTextRMSNorm`: x * rsqrt(mean(x^2) + eps) * (1 + w), computed in float32, zero-centred weight.
`Hs_p` [H, D] is the trunk's multi-stream hidden at position p: the output of the LAST decoder layer,
before `model.hyper_connection_mixer`. transformers carries it as one [.., H*D] vector, stream-major:
stream k is elements [k*D, (k+1)*D) (the embedding is `repeat`ed H times, the hyper-connection sites
`unflatten(-1, (H, D))`). One MTP step at trunk position p takes Hs_p and the next token t_{p+1}:

    e   = embed_tokens(t_{p+1})                                    (the trunk's, shared)
    e'  = fc_embedding( RMSNorm_D(e; w = pre_fc_norm_embedding) )  ([D, D], no bias, y = W x)
    Hn  = RMSNorm_{H*D}(Hs_p; w = pre_fc_norm_hidden)              (ONE norm over all H*D values)
    h_k = fc_hidden( Hn[k*D:(k+1)*D] )                             (one shared [D, D], no bias)
    X_k = h_k + e'                                                 (the layer's input streams [H, D])
    X'  = DecoderLayer(X) at RoPE position p, causal over the head's own entries at positions 0..p
    logits_p = lm_head( MtpMixer(X') )                             (lm_head shared) -> predicts t_{p+2}

DecoderLayer is transformers' `Qwen4ExpTextDecoderLayer` built from a copy of the text config with
layer_types = ["indexed_attention"], num_hidden_layers = 1, ple_layer_ids = [] (so: attention with
the QSA indexer, the MoE with the trunk's expert config, the two hyper-connection sites
`attn_hyper_connection` / `mlp_hyper_connection`, no PLE). It is called as the trunk calls its layers:
`layer(x [B, T, H*D], position_embeddings=rotary_emb(x, position_ids), attention_mask=M)` where
position_ids = 0..T-1 (the head's entry i sits at RoPE position i, like the trunk's token i) and M
is `create_causal_mask` (a plain causal 4-D mask; the indexer ANDs its block selection into it).
MtpMixer is `Qwen4ExpTextGatedResidual(config, use_combine=False)`, the class of
`model.hyper_connection_mixer`, with its own weights. Only fc_embedding, fc_hidden and the two
pre-fc norms are new; everything else is transformers' code. Chained drafting: the next step takes
(X'_p, the drafted token) at position p+1, its attention seeing the entries 0..p and itself.

Training: teacher forcing, i.e. for a window t_0..t_{T-1} the trunk (eval, no grad) gives Hs_0..Hs_{T-1},
the head's inputs X_p are built from (Hs_p, t_{p+1}) for p = 0..T-3 and the layer runs causally over
them in one call; loss = mean cross-entropy of logits_p against t_{p+2}, plus the head's own router
load-balancing loss times router_aux_loss_coef (as train.py). Same corpus windows as train.py (random
windows of the EOS-joined training works), AdamW (fp32 master, bf16 autocast, betas 0.9/0.95, weight
decay 0.1 on matrices, clip 1.0), lr 1e-3 after 20 warmup steps, cosine to 1e-4; 1000 steps of 64 x 256
(16 M tokens, ~10 passes over the 1.6 M training tokens; about a minute on one H200). Held-out MTP CE
by steps (one run each, same seed): 500 -> 4.219, 1000 -> 4.182, 1500 -> 4.205 (overfitting).
Initialisation: the decoder layer is a copy of the trunk's last indexed_attention layer (layer 5),
MtpMixer a copy of `model.hyper_connection_mixer`, fc_hidden = fc_embedding = identity, both pre-fc
norm weights 0 (unit gain): at step 0 the layer sees the normalised trunk streams plus the normalised
next-token embedding, both at full strength (`--embed-init small` makes fc_embedding N(0, 0.02) instead).

After training the head's weights are rounded to the export dtype (BF16) in place, so every figure
below is of the exported head, and the exported tensors are read back and checked bit-exact.

## Reported (mtp_log.json), all in float32 without autocast

- heldout_mtp_ce: the held-out text (The Tempest) in consecutive windows of --seq-len tokens (the
  trunk's context restarts at each window), mean over p = 0..T-3 of -log softmax(logits_p)[t_{p+2}],
  teacher forced; also at initialisation, the top-1 accuracy, and the trunk's own next-token CE.
- acceptance: greedy speculative decoding from a held-out prompt. For --accept-positions pairs
  (window w, position p) drawn with the seed, the prompt is window[0..p]; the trunk's greedy
  continuation g_1..g_5 is computed by the trunk itself (g_1 = argmax of its logits at p, g_{i+1} =
  its argmax after appending g_1..g_i). The head's entries 0..p-1 are teacher forced from the prompt
  ((Hs_q, t_{q+1})), entry p is (Hs_p, g_1): exactly the head's cache in a real greedy run that has
  just emitted g_1. Draft 1 is the argmax of that step, draft j+1 the argmax of the chained step
  (X' of step j, draft j) at position p+j. acceptance[j] = fraction of pairs where drafts 1..j all
  equal g_2..g_{j+1} (what greedy verification would accept); mean_accepted[k] = mean over pairs of
  the number of leading accepted drafts when k are drafted = sum_{j<=k} acceptance[j] (tokens gained
  per trunk step beyond its own, at draft depth k).

## Parity fixture (--fixture DIR), float32, eval, no autocast, CPU, reference QSA indexer

The trunk is loaded from OUT_HF with `from_pretrained` (checking transformers loads it with the head
present) and the head from OUT_HF's exported tensors.
- mtp_ids.npy (int64 [40]): held-out ids [--fixture-offset, +40).
- mtp_logits.npy (float32 [38, vocab]): teacher-forced logits_p, p = 0..37 (step p takes Hs_p, ids[p+1]).
- mtp_chain.npy (float32 [3, vocab]): from p = 20: step 1 takes (Hs_20, ids[21]) at position 20 over
  the teacher-forced entries 0..19 (so equals mtp_logits[20]); step j+1 takes (X' of step j, argmax
  of step j's logits) at position 20+j, over entries 0..19, the chained entries before it and itself.
- for debugging, also: mtp_trunk_streams.npy (float32 [40, H, D], Hs), mtp_layer_in.npy /
  mtp_layer_out.npy (float32 [38, H, D], X and X' teacher forced), mtp_chain_tokens.npy (int64 [3],
  the argmax of each chained step).
np.save with allow_pickle=False, like reference.py.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MTP_SHARD = "model-mtp.safetensors"
INDEX = "model.safetensors.index.json"


# ----------------------------------------------------------------------------------------------
# The head
# ----------------------------------------------------------------------------------------------
class MtpHead(nn.Module):
    """The `mtp.*` tensors; state_dict names are the released names without the `mtp.` prefix."""

    def __init__(self, text_cfg):
        super().__init__()
        from transformers.models.qwen4_exp import modeling_qwen4_exp as mq

        self.H, self.D = text_cfg.hc_count, text_cfg.hidden_size
        cfg = copy.deepcopy(text_cfg)
        cfg.layer_types = ["indexed_attention"]
        cfg.num_hidden_layers = 1
        cfg.ple_layer_ids = []
        self.cfg = cfg
        eps = cfg.rms_norm_eps
        self.pre_fc_norm_embedding = mq.Qwen4ExpTextRMSNorm(self.D, eps=eps)
        self.pre_fc_norm_hidden = mq.Qwen4ExpTextRMSNorm(self.H * self.D, eps=eps)  # whole H*D vector
        self.fc_embedding = nn.Linear(self.D, self.D, bias=False)
        self.fc_hidden = nn.Linear(self.D, self.D, bias=False)
        self.layers = nn.ModuleList([mq.Qwen4ExpTextDecoderLayer(cfg, 0)])
        self.hyper_connection_mixer = mq.Qwen4ExpTextGatedResidual(cfg, use_combine=False)
        assert self.layers[0].ple is None and self.layers[0].layer_type == "indexed_attention"

    def inputs(self, hs: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """X from streams hs [..., H*D] and token embeddings emb [..., D]; returns [..., H*D]."""
        e = self.fc_embedding(self.pre_fc_norm_embedding(emb))
        hn = self.pre_fc_norm_hidden(hs).unflatten(-1, (self.H, self.D))
        return (self.fc_hidden(hn) + e.unsqueeze(-2)).flatten(-2)

    def layer(self, x: torch.Tensor, rotary_emb) -> torch.Tensor:
        """The decoder layer over x [B, T, H*D] at positions 0..T-1, causal; returns X' [B, T, H*D]."""
        from transformers.masking_utils import create_causal_mask

        b, t, _ = x.shape
        pos = torch.arange(t, device=x.device)[None].expand(b, t)
        mask = create_causal_mask(config=self.cfg, inputs_embeds=x, attention_mask=None, cache=None,
                                  position_ids=pos, allow_is_causal_skip=False)
        pe = rotary_emb(x, pos)
        return self.layers[0](x, position_embeddings=pe, attention_mask=mask)

    def logits(self, xo: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        return lm_head(self.hyper_connection_mixer(xo))


class Trunk:
    """The frozen trunk: embeddings, lm_head, rotary and Hs (a forward hook on the last layer)."""

    def __init__(self, model):
        self.model = model.eval().requires_grad_(False)
        self.inner = model.model
        self.embed = self.inner.embed_tokens
        self.lm_head = model.lm_head
        self.rotary = self.inner.rotary_emb
        self._hs = None
        self.inner.layers[-1].register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self._hs = output[0] if isinstance(output, tuple) else output

    @torch.no_grad()
    def streams(self, ids: torch.Tensor, with_logits: bool = False):
        """(Hs [B, T, H*D] float32, logits [B, T, V] float32 or None) of a plain causal forward."""
        if with_logits:
            logits = self.model(input_ids=ids, use_cache=False).logits.float()
        else:
            self.inner(input_ids=ids, use_cache=False)
            logits = None
        hs, self._hs = self._hs.float(), None
        return hs, logits


def load_trunk(hf: Path, dev):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf), attn_implementation="eager", dtype=torch.float32)
    return model.to(dev)


def last_indexed_layer(text_cfg) -> int:
    return max(i for i, t in enumerate(text_cfg.layer_types) if t == "indexed_attention")


def init_head(head: MtpHead, trunk: Trunk, text_cfg, embed_init: str, seed: int):
    src = last_indexed_layer(text_cfg)
    head.layers[0].load_state_dict(trunk.inner.layers[src].state_dict(), strict=True)
    head.hyper_connection_mixer.load_state_dict(trunk.inner.hyper_connection_mixer.state_dict(), strict=True)
    with torch.no_grad():
        head.fc_hidden.weight.copy_(torch.eye(head.D))
        if embed_init == "identity":
            head.fc_embedding.weight.copy_(torch.eye(head.D))
        else:
            g = torch.Generator().manual_seed(seed)
            head.fc_embedding.weight.copy_(torch.randn(head.D, head.D, generator=g) * text_cfg.initializer_range)
        head.pre_fc_norm_embedding.weight.zero_()
        head.pre_fc_norm_hidden.weight.zero_()
    return src


# ----------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------
def heldout_windows(ids: torch.Tensor, seq: int, limit: int | None) -> torch.Tensor:
    n = ids.numel() // seq
    if limit:
        n = min(n, limit)
    return ids[: n * seq].view(n, seq)


@torch.no_grad()
def heldout_ce(head: MtpHead, trunk: Trunk, wins: torch.Tensor, dev, bs: int) -> dict:
    """Teacher-forced MTP cross-entropy (and top-1 accuracy) against t_{p+2}, p = 0..T-3, float32."""
    head.eval()
    tot = tot_trunk = 0.0
    hit = cnt = cnt_trunk = 0
    for i in range(0, wins.shape[0], bs):
        x = wins[i : i + bs].to(dev)
        hs, tl = trunk.streams(x, with_logits=True)
        t = x.shape[1]
        xin = head.inputs(hs[:, : t - 2], trunk.embed(x[:, 1 : t - 1]).float())
        logits = head.logits(head.layer(xin, trunk.rotary), trunk.lm_head).float()
        y = x[:, 2:]
        tot += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                 reduction="sum").item()
        hit += (logits.argmax(-1) == y).sum().item()
        cnt += y.numel()
        tot_trunk += torch.nn.functional.cross_entropy(tl[:, :-1].reshape(-1, tl.shape[-1]), x[:, 1:].reshape(-1),
                                                       reduction="sum").item()
        cnt_trunk += x[:, 1:].numel()
    return {"mtp_ce": tot / cnt, "mtp_top1": hit / cnt, "trunk_next_token_ce": tot_trunk / cnt_trunk,
            "windows": int(wins.shape[0]), "targets": cnt}


@torch.no_grad()
def acceptance(head: MtpHead, trunk: Trunk, wins: torch.Tensor, n_pos: int, depth: int, seed: int, dev,
               bs: int, pad_id: int) -> dict:
    """Greedy speculative-decoding acceptance of chained drafts (module docstring)."""
    head.eval()
    rng = np.random.default_rng(seed)
    nw, w_len = wins.shape
    pairs = [(int(rng.integers(nw)), int(rng.integers(w_len))) for _ in range(n_pos)]
    match_all = []  # [n_pos, depth] bool: draft j equals the trunk's greedy g_{j+1}
    rows = torch.arange(bs, device=dev)
    for c in range(0, n_pos, bs):
        chunk = pairs[c : c + bs]
        b = len(chunk)
        r = rows[:b]
        win = wins[[w for w, _ in chunk]].to(dev)
        p = torch.tensor([q for _, q in chunk], device=dev)
        hs, tl = trunk.streams(win, with_logits=True)
        # The trunk's greedy continuation g_1..g_{depth+1} of each prompt window[0..p].
        g = [tl[r, p].argmax(-1)]
        seqs = torch.full((b, w_len + depth), pad_id, dtype=torch.long, device=dev)
        seqs[:, :w_len] = win
        keep = torch.arange(w_len + depth, device=dev)[None] <= p[:, None]
        seqs = torch.where(keep, seqs, torch.full_like(seqs, pad_id))
        for k in range(1, depth + 1):
            seqs[r, p + k] = g[-1]
            ln = int(p.max()) + k + 1
            lg = trunk.model(input_ids=seqs[:, :ln], use_cache=False).logits.float()
            g.append(lg[r, p + k].argmax(-1))
        # The head: entries 0..p-1 teacher forced, entry p = (Hs_p, g_1), then chained.
        xin = torch.zeros(b, w_len + depth, head.H * head.D, device=dev)
        xin[:, : w_len - 1] = head.inputs(hs[:, : w_len - 1], trunk.embed(win[:, 1:]).float())
        xin[r, p] = head.inputs(hs[r, p], trunk.embed(g[0]).float())
        drafts = []
        for j in range(1, depth + 1):
            ln = int(p.max()) + j
            xo = head.layer(xin[:, :ln], trunk.rotary)[r, p + j - 1]
            d = head.logits(xo, trunk.lm_head).float().argmax(-1)
            drafts.append(d)
            if j < depth:
                xin[r, p + j] = head.inputs(xo, trunk.embed(d).float())
        match_all.append(torch.stack([drafts[j] == g[j + 1] for j in range(depth)], -1).cpu())
    m = torch.cat(match_all).numpy()
    lead = np.cumprod(m, axis=1)  # drafts 1..j all accepted
    acc = lead.mean(0)
    return {
        "positions": n_pos,
        "acceptance": {str(j + 1): float(acc[j]) for j in range(depth)},
        "mean_accepted": {str(k): float(acc[:k].sum()) for k in range(1, depth + 1)},
        "conditional": {str(j + 1): float(lead[:, j].sum() / max(1, (lead[:, j - 1] if j else np.ones(len(m))).sum()))
                        for j in range(depth)},
    }


# ----------------------------------------------------------------------------------------------
# Export and fixture
# ----------------------------------------------------------------------------------------------
def export(head: MtpHead, src: Path, out: Path, dtype: torch.dtype, src_layer: int) -> dict:
    from safetensors.torch import save_file

    if out.resolve() == src.resolve():
        raise SystemExit("--out must differ from --hf (the input is never modified)")
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file():
            shutil.copy2(f, out / f.name)
    tensors = {f"mtp.{k}": v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()}
    # The layer's and mixer's suffixes must be exactly the checkpoint's layer `src_layer` / mixer ones.
    index_path = out / INDEX
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:  # a single-file checkpoint: give it an index so the head can have a shard of its own
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "pt") as f:
            names = list(f.keys())
        index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}
    wm = index["weight_map"]
    lp, mp = f"model.language_model.layers.{src_layer}.", "model.language_model.hyper_connection_mixer."
    want_layer = sorted(k[len(lp):] for k in wm if k.startswith(lp))
    want_mixer = sorted(k[len(mp):] for k in wm if k.startswith(mp))
    got_layer = sorted(k[len("mtp.layers.0."):] for k in tensors if k.startswith("mtp.layers.0."))
    got_mixer = sorted(k[len("mtp.hyper_connection_mixer."):] for k in tensors
                       if k.startswith("mtp.hyper_connection_mixer."))
    if want_layer != got_layer or want_mixer != got_mixer:
        raise RuntimeError(f"mtp suffixes differ from the checkpoint's: layer {set(want_layer) ^ set(got_layer)}, "
                           f"mixer {set(want_mixer) ^ set(got_mixer)}")
    stale = [k for k in wm if k.startswith("mtp.")]
    for k in stale:
        del wm[k]
    save_file(tensors, str(out / MTP_SHARD), metadata={"format": "pt"})
    for k in tensors:
        wm[k] = MTP_SHARD
    index["weight_map"] = dict(sorted(wm.items()))
    if "total_size" in index.get("metadata", {}):
        index["metadata"]["total_size"] = int(index["metadata"]["total_size"]) + sum(
            t.numel() * t.element_size() for t in tensors.values())
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    return {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in tensors.items()}


def load_exported_head(out: Path, text_cfg) -> MtpHead:
    from safetensors.torch import load_file

    sd = load_file(str(out / MTP_SHARD))
    head = MtpHead(text_cfg)
    head.load_state_dict({k[len("mtp."):]: v.float() for k, v in sd.items()}, strict=True)
    return head.eval()


@torch.no_grad()
def write_fixture(fixture: Path, out_hf: Path, held: torch.Tensor, offset: int, log: dict):
    import fast_indexer

    from transformers.models.qwen4_exp import modeling_qwen4_exp as mq

    mq.Qwen4ExpTextQSAIndexer.forward = fast_indexer._reference_forward  # the unpatched reference
    fixture.mkdir(parents=True, exist_ok=True)
    model = load_trunk(out_hf, torch.device("cpu"))
    trunk = Trunk(model)
    head = load_exported_head(out_hf, model.config)
    n, p0, steps = 40, 20, 3
    ids = held[offset : offset + n].clone()
    x = ids[None]
    hs, _ = trunk.streams(x)
    xin = head.inputs(hs[:, : n - 2], trunk.embed(x[:, 1 : n - 1]))
    xo = head.layer(xin, trunk.rotary)
    logits = head.logits(xo, trunk.lm_head)[0]
    # chained from p0: the teacher-forced entries 0..p0-1, then step 1 (Hs_p0, ids[p0+1]), ...
    seq = torch.cat([xin[0, :p0], head.inputs(hs[0, p0], trunk.embed(ids[p0 + 1]))[None]])
    chain, toks = [], []
    for j in range(steps):
        xo_j = head.layer(seq[None], trunk.rotary)[0, -1]
        lg = head.logits(xo_j, trunk.lm_head)
        chain.append(lg)
        toks.append(int(lg.argmax()))
        seq = torch.cat([seq, head.inputs(xo_j, trunk.embed(torch.tensor(toks[-1])))[None]])
    chain = torch.stack(chain)
    d1 = (chain[0] - logits[p0]).abs().max().item()
    H, D = head.H, head.D
    save = lambda name, a: np.save(fixture / name, a, allow_pickle=False)  # noqa: E731
    save("mtp_ids.npy", ids.numpy().astype(np.int64))
    save("mtp_logits.npy", logits.float().numpy())
    save("mtp_chain.npy", chain.float().numpy())
    save("mtp_chain_tokens.npy", np.asarray(toks, dtype=np.int64))
    save("mtp_trunk_streams.npy", hs[0].reshape(n, H, D).float().numpy())
    save("mtp_layer_in.npy", xin[0].reshape(n - 2, H, D).float().numpy())
    save("mtp_layer_out.npy", xo[0].reshape(n - 2, H, D).float().numpy())
    log["fixture"] = {"dir": str(fixture), "heldout_offset": offset, "tokens": n, "chain_from": p0,
                      "chain_tokens": toks, "chain_step1_vs_teacher_forced_max_abs": d1,
                      "mtp_top1_on_window": float((logits[: n - 2].argmax(-1) == ids[2:]).float().mean())}
    print(f"fixture: {fixture} (chain step 1 vs teacher forced: max|diff| {d1:.2e}; chained tokens {toks})")
    if d1 > 1e-4:
        raise RuntimeError("chained step 1 differs from the teacher-forced logits")


# ----------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", type=Path, default=Path("fixtures/shakespeare/hf"))
    ap.add_argument("--data", type=Path, default=Path(".demo"))
    ap.add_argument("--out", type=Path, required=True, help="output hf dir (copy of --hf plus mtp.*)")
    ap.add_argument("--fixture", type=Path, help="write the Rust parity fixture here")
    ap.add_argument("--fixture-offset", type=int, default=1024, help="first held-out id of the fixture window")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--embed-init", choices=["identity", "small"], default="identity")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-windows", type=int, default=0, help="limit held-out windows (0: all)")
    ap.add_argument("--eval-batch", type=int, default=64)
    ap.add_argument("--accept-positions", type=int, default=1000)
    ap.add_argument("--accept-depth", type=int, default=4)
    args = ap.parse_args()
    import transformers
    from tokenizers import Tokenizer
    from transformers.models.qwen4_exp import modeling_qwen4_exp as mq

    import fast_indexer

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    dev = torch.device(args.device)
    hf_cfg = json.loads((args.hf / "config.json").read_text())
    if "indexed_attention" not in hf_cfg.get("text_config", hf_cfg).get("layer_types", []):
        raise SystemExit("expected a qwen4_exp checkpoint with indexed_attention layers")
    try:
        model = load_trunk(args.hf, dev)
    except ValueError as e:
        raise SystemExit(f"transformers {transformers.__version__} cannot load {args.hf} ({e}); "
                         "use transformers 5.24 (tools/reference/requirements.txt)")
    text_cfg = model.config
    rows, ties = fast_indexer.check(text_cfg, seq_len=args.seq_len, batch=2)
    print(f"batched QSA indexer agrees with the reference on {rows} queries ({ties} differ only by ties)")
    fast_indexer.install()
    trunk = Trunk(model)
    head = MtpHead(text_cfg)
    src_layer = init_head(head, trunk, text_cfg, args.embed_init, args.seed)
    head.to(dev)
    n_head = sum(p.numel() for p in head.parameters())
    print(f"transformers {transformers.__version__} torch {torch.__version__}; head {n_head / 1e6:.3f} M parameters "
          f"(layer from trunk layer {src_layer}); device {dev}", flush=True)

    tk = Tokenizer.from_file(str(args.data / "tokenizer.json"))
    held = torch.tensor(tk.encode((args.data / "heldout.txt").read_text(), add_special_tokens=False).ids,
                        dtype=torch.int64)
    wins = heldout_windows(held, args.seq_len, args.eval_windows or None)
    data = torch.from_numpy(np.fromfile(args.data / "train.u16", dtype=np.uint16).astype(np.int64))
    seq = args.seq_len
    gen_rng = torch.Generator().manual_seed(args.seed)

    def batch():
        starts = torch.randint(0, data.numel() - seq, (args.batch,), generator=gen_rng)
        return data[starts[:, None] + torch.arange(seq)[None, :]].to(dev, non_blocking=True)

    router_logits = []
    head.layers[0].mlp.gate.register_forward_hook(lambda m, a, o: router_logits.append(o[0]))
    decay = [p for p in head.parameters() if p.dim() >= 2]
    no_decay = [p for p in head.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=dev.type == "cuda")
    E, K, coef = text_cfg.num_experts, text_cfg.num_experts_per_tok, text_cfg.router_aux_loss_coef
    amp = dict(device_type=dev.type, dtype=torch.bfloat16)

    def step(lr):
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch()
        with torch.no_grad(), torch.autocast(**amp):
            hs, _ = trunk.streams(x)
            emb = trunk.embed(x[:, 1 : seq - 1])
        router_logits.clear()
        with torch.autocast(**amp):
            xin = head.inputs(hs[:, : seq - 2], emb)
            logits = head.logits(head.layer(xin, trunk.rotary), trunk.lm_head).float()
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 2:].reshape(-1))
            aux = mq.load_balancing_loss_func(tuple(router_logits), E, K, None)
            loss = ce + coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        return ce.item(), float(aux.detach())

    log = {"transformers": transformers.__version__, "torch": torch.__version__, "device": str(dev),
           "hf": str(args.hf), "head_parameters": n_head, "init": {
               "layer": f"copy of model.layers.{src_layer}", "mixer": "copy of model.hyper_connection_mixer",
               "fc_hidden": "identity", "fc_embedding": "identity" if args.embed_init == "identity" else "N(0, 0.02)",
               "pre_fc_norms": "weight 0 (unit gain)"},
           "recipe": {k: getattr(args, k) for k in ("steps", "batch", "seq_len", "lr", "min_lr", "warmup",
                                                    "weight_decay", "seed", "embed_init")},
           "loss": "mean CE of logits_p vs t_{p+2}, p = 0..T-3 of each window, + router_aux_loss_coef * "
                   "load-balancing loss of the head's router; bf16 autocast, trunk frozen (eval, no grad)",
           "history": []}
    ev = heldout_ce(head, trunk, wins, dev, args.eval_batch)
    log["heldout_at_init"] = ev
    print(f"init: held-out MTP CE {ev['mtp_ce']:.4f} (top-1 {ev['mtp_top1']:.3f}); trunk next-token CE "
          f"{ev['trunk_next_token_ce']:.4f}", flush=True)
    head.train()
    t0 = time.time()
    for s in range(args.steps):
        if s < args.warmup:
            lr = args.lr * (s + 1) / args.warmup
        else:
            frac = (s - args.warmup) / max(1, args.steps - args.warmup)
            lr = args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * frac))
        ce, aux = step(lr)
        rec = {"step": s + 1, "train_ce": round(ce, 4), "router_aux": round(aux, 4), "lr": lr,
               "seconds": round(time.time() - t0, 1)}
        if args.eval_every and ((s + 1) % args.eval_every == 0) and s + 1 < args.steps:
            rec["heldout_mtp_ce"] = round(heldout_ce(head, trunk, wins, dev, args.eval_batch)["mtp_ce"], 4)
            head.train()
        log["history"].append(rec)
        if (s + 1) % 10 == 0 or s < 3 or "heldout_mtp_ce" in rec or s + 1 == args.steps:
            print(json.dumps(rec), flush=True)
    log["train_seconds"] = round(time.time() - t0, 1)
    print(f"trained {args.steps} steps in {log['train_seconds']} s", flush=True)
    log["seconds_per_step"] = round(log["train_seconds"] / max(1, args.steps), 4)

    # Round to the export dtype in place: every figure from here on is of the exported head.
    src_dtype = _trunk_dtype(args.hf)
    with torch.no_grad():
        for t in head.parameters():
            t.copy_(t.to(src_dtype).float())
    head.eval()
    ev = heldout_ce(head, trunk, wins, dev, args.eval_batch)
    log["heldout"] = ev
    log["heldout_mtp_ce"] = ev["mtp_ce"]
    print(f"held-out MTP CE {ev['mtp_ce']:.4f} (top-1 {ev['mtp_top1']:.3f}; {ev['targets']} targets in "
          f"{ev['windows']} windows of {seq}); trunk next-token CE {ev['trunk_next_token_ce']:.4f}", flush=True)
    eos = text_cfg.eos_token_id[0] if isinstance(text_cfg.eos_token_id, list) else text_cfg.eos_token_id
    if args.accept_positions:
        acc = acceptance(head, trunk, wins, args.accept_positions, args.accept_depth, args.seed, dev,
                         args.eval_batch, eos)
        acc["definition"] = (
            "greedy speculative decoding from held-out prompts: for each sampled (window, p) the prompt is "
            "window[0..p]; g_1..g_{k+1} is the trunk's own greedy continuation; the head's cache holds "
            "teacher-forced entries (Hs_q, t_{q+1}) for q < p and (Hs_p, g_1) at p; draft 1 = argmax of that "
            "step, draft j+1 = argmax of the chained step (X'_j, draft j) at p+j. acceptance[j] = fraction of "
            "positions where drafts 1..j all equal g_2..g_{j+1}; mean_accepted[k] = sum_{j<=k} acceptance[j] "
            "= mean number of leading accepted drafts at draft depth k; conditional[j] = "
            "acceptance[j] / acceptance[j-1]. float32, no autocast.")
        log["acceptance"] = acc
        print("acceptance (drafts 1..j all equal the trunk's greedy): "
              + ", ".join(f"j={j}: {v:.3f}" for j, v in acc["acceptance"].items())
              + "; mean accepted at depth k: "
              + ", ".join(f"k={k}: {v:.3f}" for k, v in acc["mean_accepted"].items()), flush=True)

    shapes = export(head, args.hf, args.out, src_dtype, src_layer)
    reread = load_exported_head(args.out, text_cfg)
    for k, v in head.state_dict().items():
        if not torch.equal(reread.state_dict()[k], v.detach().cpu().float()):
            raise RuntimeError(f"exported mtp.{k} does not read back bit-exact")
    log["exported"] = {"shard": MTP_SHARD, "dtype": str(src_dtype).replace("torch.", ""), "tensors": shapes}
    print(f"exported {len(shapes)} mtp.* tensors to {args.out / MTP_SHARD} (read back bit-exact)")
    if args.fixture:
        write_fixture(args.fixture, args.out, held, args.fixture_offset, log)
    (args.out / "mtp_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"wrote {args.out / 'mtp_log.json'}")


def _trunk_dtype(hf: Path) -> torch.dtype:
    from safetensors import safe_open

    index = hf / INDEX
    name = "lm_head.weight"
    f = json.loads(index.read_text())["weight_map"][name] if index.exists() else "model.safetensors"
    with safe_open(str(hf / f), "pt") as st:
        code = st.get_slice(name).get_dtype()
    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[code]


if __name__ == "__main__":
    main()
