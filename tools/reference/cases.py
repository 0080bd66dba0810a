"""The fixture cases: tiny configs that together cover every layer kind of both families, their
prompts, generation defaults, and the generated fixtures/README.md."""
from __future__ import annotations

import json
from pathlib import Path

from corpus import ALICE, GETTYSBURG, MOBY, PRIDE

WEIGHTS_NOTE = {
    "qwen4_exp": "All floating tensors stored BF16 (official BF16 release layout); the reference ran in "
                 "float32 on exactly those BF16 values.",
    "deepseek_v4": "Stored as the V4-Flash release does: FP8 e4m3 + ue8m0 128x128 block scales (`.scale`, "
                   "F8_E8M0) for wq_a/wq_b/wkv/wo_a/wo_b/indexer.wq_b/shared_experts; routed experts packed "
                   "FP4 e2m1 (int8, low nibble = even element) + ue8m0 scale per 32 inputs; hc_*/attn_sink/ape/"
                   "gate.bias F32; tid2eid I64; everything else BF16. The reference ran in float32 on the "
                   "exactly dequantised values.",
}


def _qwen(name, seed, desc, covers, vocab, shards=1, **kw):
    return dict(name=name, family="qwen4_exp", seed=seed, description=desc, covers=covers,
                vocab_size=vocab, shards=shards, cfg=kw)


def _ds(name, seed, desc, covers, vocab, shards=1, scale_params=None, **kw):
    return dict(name=name, family="deepseek_v4", seed=seed, description=desc, covers=covers,
                vocab_size=vocab, shards=shards, cfg=kw, scale_params=scale_params or {})


CASES = [
    _qwen("qwen4_exp_a", 1001,
          "Release-like layer pattern (3 GDN + 1 QSA attention), PLE on the 2nd linear layer, 4 HC streams, "
          "8 experts top-2 + gated shared expert; safetensors sharded in 3 files with an index.",
          ["gated_deltanet", "indexed_attention(QSA, budget 8 = 2 blocks of 4)", "ple(layer 1, ngram 3)",
           "moe+shared_expert", "gated_residual_hc(4 streams)", "eos inside prompt", "sharded checkpoint"],
          vocab=512, shards=3,
          hidden_size=64, num_hidden_layers=4,
          layer_types=["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.5,
                           "mrope_section": [2, 1, 1], "mrope_interleaved": True},
          linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
          linear_num_key_heads=2, linear_num_value_heads=4,
          moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
          norm_topk_prob=True, hc_count=4, hc_lowrank=16,
          indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
          ple_layer_ids=[2], ple_embed_dim=64, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=101,
          make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4, output_gate_type="sigmoid",
          initializer_range=0.06),
    _qwen("qwen4_exp_b", 2002,
          "Smallest geometry: PLE on the FIRST layer (ple_layer_ids=[1]) then a QSA layer with budget 4 = 2 "
          "blocks of 2; GDN with 3 value heads per key head (the release ratio), 2 HC streams, top-2 of 4 "
          "experts WITHOUT top-k renormalisation.",
          ["gated_deltanet(GQA 3)", "indexed_attention(QSA, ratio 2, budget 4)", "ple(layer 0, ngram 3)",
           "moe(norm_topk_prob=false)+shared_expert", "gated_residual_hc(2 streams)", "eos inside prompt"],
          vocab=384,
          hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "indexed_attention"],
          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
          rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                           "mrope_section": [2, 1, 1], "mrope_interleaved": True},
          linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
          linear_num_key_heads=1, linear_num_value_heads=3,
          moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
          norm_topk_prob=False, hc_count=2, hc_lowrank=8,
          indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4, indexer_compress_ratio=2,
          ple_layer_ids=[1], ple_embed_dim=32, ngram_size=3, heads_per_ngram=1, ngram_vocab_size_base=53,
          make_ngram_vocab_size_divisible_by=4, split_ngram_parts=2, output_gate_type="sigmoid",
          initializer_range=0.08),
    _qwen("qwen4_exp_c", 3003,
          "Attention first and last around a PLE linear layer; bigram-only PLE (ngram_size 2, conv dilation 2), "
          "3 HC streams, top-3 of 6 experts, QSA with 8 indexer heads and budget 12 = 3 blocks of 4, vocab 1024.",
          ["indexed_attention(QSA, budget 12) x2", "gated_deltanet", "ple(layer 1, ngram 2)",
           "moe+shared_expert", "gated_residual_hc(3 streams)", "eos inside prompt"],
          vocab=1024,
          hidden_size=48, num_hidden_layers=3,
          layer_types=["indexed_attention", "linear_attention", "indexed_attention"],
          num_attention_heads=3, num_key_value_heads=1, head_dim=16,
          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5,
                           "mrope_section": [2, 1, 1], "mrope_interleaved": True},
          linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
          linear_num_key_heads=2, linear_num_value_heads=6,
          moe_intermediate_size=24, shared_expert_intermediate_size=24, num_experts=6, num_experts_per_tok=3,
          norm_topk_prob=True, hc_count=3, hc_lowrank=12,
          indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=12, indexer_compress_ratio=4,
          ple_layer_ids=[2], ple_embed_dim=48, ngram_size=2, heads_per_ngram=3, ngram_vocab_size_base=211,
          make_ngram_vocab_size_divisible_by=16, split_ngram_parts=4, output_gate_type="sigmoid",
          initializer_range=0.07),
    _ds("deepseek_v4_a", 4004,
        "Flash-like schedule [sliding, CSA, HCA, CSA] with rates CSA 4 / HCA 8, two hash-routed MoE layers "
        "then two sqrtsoftplus+bias routed layers, 4 mHC streams with 20 Sinkhorn iterations, sinks, "
        "2-group output projection, 8 indexer heads choosing top-3 compressed entries.",
        ["sliding_attention", "compressed_sparse_attention(rate 4, lightning indexer 8 heads, top-3)",
         "heavily_compressed_attention(rate 8)", "hash_moe x2", "moe(sqrtsoftplus, bias)", "shared expert",
         "mhc(4 streams, sinkhorn 20)", "attention sink", "grouped o-proj (2 groups)", "fp8 block + fp4 experts"],
        vocab=512,
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        qk_rope_head_dim=16, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1,
        moe_intermediate_size=32, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        hc_mult=4, hc_sinkhorn_iters=20, sliding_window=8, o_groups=2, o_lora_rank=16,
        index_n_heads=8, index_head_dim=16, index_topk=3, initializer_range=0.06),
    _ds("deepseek_v4_b", 5005,
        "Release compress rates (CSA 4, HCA 128) with a 140-token prompt so the HCA layer emits an entry; "
        "8 attention heads (wq_b has a 2x1 FP8 scale grid), 4 output groups, 2 mHC streams, 16 indexer "
        "heads choosing top-4, one hash layer; safetensors sharded in 2 files.",
        ["sliding_attention", "compressed_sparse_attention(rate 4, lightning indexer 16 heads, top-4)",
         "heavily_compressed_attention(rate 128)", "hash_moe", "moe(sqrtsoftplus, bias)", "shared expert",
         "mhc(2 streams, sinkhorn 20)", "attention sink", "grouped o-proj (4 groups)",
         "fp8 multi-block scale grid", "sharded checkpoint"],
        vocab=512, shards=2,
        hidden_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=1, head_dim=32,
        qk_rope_head_dim=16, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
        moe_intermediate_size=32, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        mlp_layer_types=["hash_moe", "moe", "moe"],
        hc_mult=2, hc_sinkhorn_iters=20, sliding_window=16, o_groups=4, o_lora_rank=16,
        index_n_heads=16, index_head_dim=16, index_topk=4, initializer_range=0.06,
        # with ~35 candidate entries and top-4, default-scale indexer scores come within 1e-4 of a tie;
        # x100 on weights_proj spreads them (min gap 2.4e-4)
        scale_params={"scorer.weights_proj": 100.0}),
    _ds("deepseek_v4_c", 6006,
        "Active SwiGLU clamp (swiglu_limit 0.4: a large share of routed and shared expert gate/up "
        "activations is clamped) and YaRN on the compressed layers given as nested rope_parameters "
        "(factor 4, original_max_position_embeddings 1024, so the 8-frequency ramp is partial: "
        "correction range [1, 4]) with attention_factor derived by transformers (0.1 ln 4 + 1 = 1.1386, "
        "multiplying cos/sin); [HCA, CSA, sliding] schedule.",
        ["swiglu_limit(0.4, clamp active)", "yarn(compress: factor 4, orig 1024, partial ramp, "
         "attention_factor 1.1386)", "heavily_compressed_attention(rate 8)",
         "compressed_sparse_attention(rate 4, lightning indexer 8 heads, top-3)", "sliding_attention",
         "hash_moe", "moe(sqrtsoftplus, bias)", "shared expert", "mhc(4 streams, sinkhorn 20)"],
        vocab=512,
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        qk_rope_head_dim=16, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1,
        moe_intermediate_size=32, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
        swiglu_limit=0.4,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "moe", "moe"],
        rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                         "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 0.5,
                                      "factor": 4.0, "original_max_position_embeddings": 1024,
                                      "beta_fast": 32, "beta_slow": 1}},
        hc_mult=4, hc_sinkhorn_iters=20, sliding_window=8, o_groups=2, o_lora_rank=16,
        index_n_heads=8, index_head_dim=16, index_topk=3, initializer_range=0.06,
        # default-scale indexer scores come within 1.2e-5 of a tie; x100 on weights_proj spreads them
        scale_params={"scorer.weights_proj": 100.0}),
]

PROMPT_LENGTHS = {  # (plain text, text with EOS inside) token counts; the chat prompt is as long as it renders
    "qwen4_exp_a": (40, 36), "qwen4_exp_b": (30, 28), "qwen4_exp_c": (48, 44),
    "deepseek_v4_a": (44, 40), "deepseek_v4_b": (140, 40),
    "deepseek_v4_c": (44, 40),
}


def make_config(case, special):
    """Returns (config the model is built from, dict written as hf/config.json in the release shape)."""
    kw = dict(case["cfg"])
    if case["family"] == "qwen4_exp":
        from transformers import Qwen4ExpConfig, Qwen4ExpTextConfig

        eos = special["<|endoftext|>"]
        text = Qwen4ExpTextConfig(vocab_size=case["vocab_size"], eos_token_id=eos, bos_token_id=eos,
                                  pad_token_id=None, tie_word_embeddings=False, rms_norm_eps=1e-6, **kw)
        # The release ships a composite config (text_config + vision_config, ForConditionalGeneration).
        # There are no vision weights in the fixtures; the vision config is tiny and only there for shape.
        full = Qwen4ExpConfig(
            text_config=text.to_dict(),
            vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                           "out_hidden_size": kw["hidden_size"]},
            image_token_id=special["<|image_pad|>"], video_token_id=special["<|video_pad|>"],
            vision_start_token_id=special["<|vision_start|>"], vision_end_token_id=special["<|vision_end|>"],
            tie_word_embeddings=False)
        d = full.to_dict()
        d["architectures"] = ["Qwen4ExpForConditionalGeneration"]
        d["torch_dtype"] = "bfloat16"
        d["text_config"]["torch_dtype"] = "bfloat16"
        d.pop("dtype", None)
        d["text_config"].pop("dtype", None)
        return text, d
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config(vocab_size=case["vocab_size"], bos_token_id=special["<｜begin▁of▁sentence｜>"],
                           eos_token_id=special["<｜end▁of▁sentence｜>"], pad_token_id=None,
                           tie_word_embeddings=False, num_nextn_predict_layers=0, max_position_embeddings=4096,
                           rms_norm_eps=1e-6, **kw)
    d = cfg.to_dict()
    d["architectures"] = ["DeepseekV4ForCausalLM"]
    d["torch_dtype"] = "bfloat16"
    d.pop("dtype", None)
    d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    d["expert_dtype"] = "fp4"  # top level, as in the V4-Flash config.json
    return cfg, d


def generation_config(case, special):
    if case["family"] == "qwen4_exp":
        return {"bos_token_id": special["<|endoftext|>"], "pad_token_id": special["<|endoftext|>"],
                "eos_token_id": [special["<|im_end|>"], special["<|endoftext|>"]],
                "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    return {"bos_token_id": special["<｜begin▁of▁sentence｜>"], "eos_token_id": special["<｜end▁of▁sentence｜>"],
            "do_sample": True, "temperature": 1.0, "top_p": 1.0}


def _text_ids(tok, text, n):
    ids = tok.encode(text)
    while len(ids) < n:
        ids = ids + tok.encode(" " + text)
    return ids[:n]


def _k_prefill(t):
    # split point not aligned to any block/window size (2, 4, 8), so caches hand over mid-window
    k = (2 * t) // 3
    return k - 1 if k % 2 == 0 else k


def make_prompts(case, tok):
    n_text, n_eos = PROMPT_LENGTHS[case["name"]]
    eos_name = "<|endoftext|>" if case["family"] == "qwen4_exp" else "<｜end▁of▁sentence｜>"
    eos = tok.special_ids[eos_name]
    p0 = _text_ids(tok, MOBY + GETTYSBURG, n_text)
    a = _text_ids(tok, PRIDE, n_eos // 2)
    b = _text_ids(tok, ALICE, n_eos - len(a) - 1)
    p1 = a + [eos] + b  # EOS inside: PLE n-gram contexts must restart after it
    messages = [{"role": "user", "content": "Who said: call me Ishmael?"},
                {"role": "assistant", "content": "The narrator of Moby Dick."},
                {"role": "user", "content": "And four score and seven years ago?"}]
    chat_text = tok.render_chat(messages, add_generation_prompt=True)
    p2 = tok.encode(chat_text)
    out = []
    for label, ids in (("plain_text", p0), ("eos_inside", p1), ("chat_template", p2)):
        text = chat_text if label == "chat_template" else tok.decode(ids)
        out.append({"label": label, "ids": [int(i) for i in ids], "text": text, "k_prefill": _k_prefill(len(ids))})
    return out


DSV41_README_MARKER = "<!-- deepseek_v41 section: written by tools/reference/make_dsv41_fixtures.py -->"


def write_readme(out_root: Path, metas):
    L = ["# Reference fixtures (generated — do not edit)", "",
         "Written by `python tools/reference/make_fixtures.py --out fixtures` (see tools/reference/README.md).",
         "Every expected number is Hugging Face transformers' own forward pass, run in float32 on the",
         "weights exactly as stored in `hf/`. Tiny random weights: logits are meaningless as language,",
         "but every formula is exercised.", "",
         "## Layout of one case", "",
         "- `hf/`: a checkpoint directory in the RELEASED layout (what a user downloads): `config.json`,",
         "  `generation_config.json`, `tokenizer.json` (byte-level BPE), `tokenizer_config.json` (chat",
         "  template + special tokens), and `model.safetensors` or sharded `model-0000i-of-0000n.safetensors`",
         "  + `model.safetensors.index.json`.",
         "- `expected/cases.json`: prompts (text, ids, K), generator versions, check results (reload,",
         "  decode-vs-prefill agreement, top-k gaps), special token ids.",
         "- `expected/pN_ids.npy` int64 `[T]`: prompt N's token ids.",
         "- `expected/pN_prefill_logits.npy` float32 `[T, vocab]`: logits at every position, one uncached forward.",
         "- `expected/pN_decode_logits.npy` float32 `[T-K, vocab]`: prefill `ids[:K]` into a cache, then feed",
         "  `ids[K]`, `ids[K+1]`, ... one token per forward; row i = logits after feeding `ids[K+i]`",
         "  (so it should match `prefill_logits[K+i]` to ~1e-5).",
         "- `expected/pN_greedy_ids.npy` int64 `[16]`: greedy continuation after the whole prompt (cached).",
         "- `expected/pN_greedy_logits.npy` float32 `[16, vocab]`: row i is the logits whose argmax is greedy id i",
         "  (row 0 = last prompt position).", "",
         "Prompts in every case: p0 `plain_text`, p1 `eos_inside` (an EOS token in the middle: PLE n-gram",
         "contexts restart after it), p2 `chat_template` (the chat template rendered with",
         "add_generation_prompt, then encoded with special tokens recognised).", "", "## Cases", ""]
    for m in metas:
        L.append(f"### `{m['case']}` ({m['family']})")
        L.append("")
        L.append(m["description"])
        L.append("")
        L.append(f"- covers: {', '.join(m['covers'])}")
        L.append(f"- layer_types: {m['layer_types']}" + (f"; mlp_layer_types: {m['mlp_layer_types']}"
                                                         if m["mlp_layer_types"] else ""))
        L.append(f"- vocab {m['vocab_size']}; special ids {json.dumps(m['special_token_ids'], ensure_ascii=False)}")
        L.append(f"- weights: {m['weights_note']}")
        L.append(f"- hf files: {', '.join(m['hf_files'])}")
        L.append(f"- randomised {m['randomised_constant_tensors']} constant-initialised tensors")
        for p in m["prompts"]:
            c = p["checks"]
            L.append(f"- p{m['prompts'].index(p)} `{p['label']}`: T={p['num_tokens']}, K={p['k_prefill']}, "
                     f"decode-vs-prefill max|diff| {c['decode_vs_prefill_max_abs']:.2e}, "
                     f"greedy {p['greedy_ids']}")
        for site, g in m["topk_gaps"].items():
            L.append(f"- top-k at `{site}`: {g['decisions']} decisions, min gap {g['min_gap']:.3e}")
        L.append("")
    text = "\n".join(L) + "\n"
    # keep the DeepSeek-V4.1 section that make_dsv41_fixtures.py appends (it is not rebuilt here)
    old = out_root / "README.md"
    if old.exists() and DSV41_README_MARKER in old.read_text():
        tail = old.read_text()
        text = text + "\n" + tail[tail.index(DSV41_README_MARKER):]
    (out_root / "README.md").write_text(text)
