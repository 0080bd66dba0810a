"""Tiny byte-level BPE tokenizers (trained here with `tokenizers`) and chat templates in the style of
each family, so the fixtures exercise tokenizer.json + chat template handling end to end."""
from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Qwen keeps its specials after the BPE vocabulary; DeepSeek puts BOS/EOS at ids 0/1.
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>", "<think>", "</think>"]
DS_BOS, DS_EOS, DS_PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
DS_SPECIALS = [DS_BOS, DS_EOS, DS_PAD, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]

QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
DS_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- message['content'] }}"
    "{%- elif message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<｜Assistant｜></think>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜></think>' }}{%- endif %}"
)


class TinyTokenizer:
    def __init__(self, family: str, tk: Tokenizer):
        self.family, self.tk = family, tk
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        if family == "qwen4_exp":
            self.template, self.bos, self.eos, self.pad = QWEN_CHAT_TEMPLATE, None, "<|im_end|>", "<|endoftext|>"
            names = QWEN_SPECIALS
        else:
            self.template, self.bos, self.eos, self.pad = DS_CHAT_TEMPLATE, DS_BOS, DS_EOS, DS_PAD
            names = DS_SPECIALS
        self.special_ids = {n: tk.token_to_id(n) for n in names}

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=False)

    def render_chat(self, messages, add_generation_prompt=True) -> str:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos or "",
            eos_token=self.eos)

    def write(self, hf_dir: Path):
        self.tk.save(str(hf_dir / "tokenizer.json"), pretty=True)
        added = {}
        for name, i in sorted(self.special_ids.items(), key=lambda kv: kv[1]):
            added[str(i)] = {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": name not in ("<think>", "</think>")}
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": False,
            "add_eos_token": False,
            "bos_token": self.bos,
            "eos_token": self.eos,
            "pad_token": self.pad,
            "unk_token": None,
            "model_max_length": 4096,
            "clean_up_tokenization_spaces": False,
            "chat_template": self.template,
            "added_tokens_decoder": added,
        }
        (hf_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def build_tokenizer(family: str, vocab_size: int, corpus: list[str]) -> TinyTokenizer:
    """Train a byte-level BPE whose total size (with specials) is exactly `vocab_size` if the corpus
    allows that many merges; the model's vocab_size is then set to the tokenizer's actual size."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    if family == "qwen4_exp":
        trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(QWEN_SPECIALS), min_frequency=1,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tk.train_from_iterator(corpus, trainer=trainer)
        tk.add_special_tokens(QWEN_SPECIALS[:7])
        tk.add_tokens(QWEN_SPECIALS[7:])
    else:
        trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(DS_SPECIALS) + 3, min_frequency=1,
                                      special_tokens=DS_SPECIALS[:3],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tk.train_from_iterator(corpus, trainer=trainer)
        tk.add_special_tokens(DS_SPECIALS[3:5])
        tk.add_tokens(DS_SPECIALS[5:])
    return TinyTokenizer(family, tk)
