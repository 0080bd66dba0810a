"""A batched QSA indexer for training, equal in result to transformers' reference.

`Qwen4ExpTextQSAIndexer.forward` loops in Python over every (sequence, query) pair, about 30
kernel launches each: at batch 256 x 256 tokens that is ~4 M launches per step, which made the
reference unusable for training (machines.md §4 saw the symptom). The selection is a boolean mask
(no gradient flows through it), so replacing the loop by the same arithmetic over all queries at
once changes nothing the optimiser sees. Only the plain causal case without a cache is batched (what
training runs); anything else falls through to the reference. `check()` compares the two masks
on random inputs and is run before every training run.
"""
from __future__ import annotations

import math

import torch
from transformers.models.qwen4_exp import modeling_qwen4_exp as mq

_reference_forward = mq.Qwen4ExpTextQSAIndexer.forward


def _batched_forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kw):
    if cache is not None or kw:
        return _reference_forward(self, hidden_states, position_embeddings, attention_mask, cache, **kw)
    b, t, _ = hidden_states.shape
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    causal = torch.ones(t, t, dtype=torch.bool, device=hidden_states.device).tril()
    if visible.shape[-1] != t or not torch.equal(visible[:, 0], causal.expand(b, t, t)):
        return _reference_forward(self, hidden_states, position_embeddings, attention_mask, cache)
    d, r = self.index_head_dim, self.compress_ratio
    full_cos, full_sin = position_embeddings
    qk = self.index_qk_proj(hidden_states)
    q, token_k = torch.split(qk, [self.index_n_heads * d, self.index_kv_heads * d], dim=-1)
    q, raw_keys = q.reshape(b, t, -1, d), token_k.reshape(b, t, -1, d).squeeze(2)
    q = self.q_layernorm(q)
    q = mq.apply_rotary_pos_emb(q, cos=full_cos[:, -t:], sin=full_sin[:, -t:], unsqueeze_dim=2)

    pos = torch.arange(t, device=hidden_states.device)
    n_complete = (pos + 1) // r  # complete blocks visible to each query
    nb = t // r
    token_mask = torch.zeros(b, t, t, dtype=torch.bool, device=hidden_states.device)
    if nb > 0:
        pooled = raw_keys[:, : nb * r].reshape(b, nb, r, d).float().mean(dim=2).to(raw_keys.dtype)
        pooled = self.k_layernorm(pooled)
        starts = torch.arange(nb, device=hidden_states.device) * r
        keys = mq.apply_rotary_pos_emb(pooled.unsqueeze(2), cos=full_cos[:, starts], sin=full_sin[:, starts],
                                       unsqueeze_dim=2).squeeze(2)
        scores = torch.einsum("bthd,bnd->btnh", q.float(), keys.float()).relu().sum(-1) / math.sqrt(d)
        self._last_scores = scores.detach() if getattr(self, "_keep_scores", False) else None
        valid = torch.arange(nb, device=hidden_states.device)[None, :] < n_complete[:, None]  # [t, nb]
        scores = scores.masked_fill(~valid, float("-inf"))
        k = min(self.block_topk, nb)
        idx = scores.topk(k, dim=-1).indices
        chosen = torch.gather(valid.expand(b, t, nb), -1, idx)  # only complete blocks count
        block_sel = torch.zeros(b, t, nb, dtype=torch.bool, device=hidden_states.device)
        block_sel.scatter_(-1, idx, chosen)
        token_mask[..., : nb * r] = block_sel.repeat_interleave(r, dim=-1)
    tail = (pos[None, :] >= (n_complete * r)[:, None]) & causal  # the open block after the last complete one
    return (token_mask | tail).unsqueeze(1)


def install():
    mq.Qwen4ExpTextQSAIndexer.forward = _batched_forward


def check(config, seq_len: int = 97, batch: int = 2, seed: int = 0):
    """Both forwards on random inputs; raises unless the masks agree everywhere except where blocks
    tie at the k-th score (ReLU makes exact-zero scores common; which of the tied blocks a topk
    returns is up to the implementation, and differs between torch's CPU and CUDA kernels too).
    Returns (rows compared, rows that differed only by a tie)."""
    torch.manual_seed(seed)
    idx = mq.Qwen4ExpTextQSAIndexer(config, layer_idx=0).eval()
    rope = mq.Qwen4ExpTextRotaryEmbedding(config=config)
    h = torch.randn(batch, seq_len, config.hidden_size)
    pos = torch.arange(seq_len)[None].expand(batch, seq_len)
    cos, sin = rope(h, pos)
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()[None, None].expand(batch, 1, seq_len, seq_len)
    idx._keep_scores = True
    with torch.no_grad():
        a = _reference_forward(idx, h, (cos, sin), mask, None)
        bm = _batched_forward(idx, h, (cos, sin), mask, None)
    if a.shape != bm.shape:
        raise RuntimeError(f"batched indexer mask shape {tuple(bm.shape)} != reference {tuple(a.shape)}")
    r, nb, ties = idx.compress_ratio, seq_len // idx.compress_ratio, 0
    for bi in range(batch):
        for ti in range(seq_len):
            x, y = a[bi, 0, ti], bm[bi, 0, ti]
            if torch.equal(x, y):
                continue
            s = idx._last_scores[bi, ti]
            diff_blocks = ((x != y)[: nb * r].view(nb, r).any(-1)).nonzero().flatten()
            kth = s[x[: nb * r].view(nb, r).all(-1)].min()
            if (x[nb * r:] != y[nb * r:]).any() or not torch.all(s[diff_blocks] == kth) or x.sum() != y.sum():
                raise RuntimeError(f"batched indexer differs from the reference at batch {bi}, query {ti}")
            ties += 1
    return batch * seq_len, ties
