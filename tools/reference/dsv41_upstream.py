"""Load transformers' main-branch `deepseek_v41` model code beside a released transformers (5.24).

The upstream files are NOT part of this repository: tools/reference/README.md says where to download
them (pinned commits) into the git-ignored `tools/reference/upstream/`. This module

  1. registers that folder as the package `transformers.models.deepseek_v41` (so the files' relative
     imports `from ...cache_utils import ...` resolve against the installed transformers),
  2. registers the three config classes with `AutoConfig` and `DeepseekV41ForCausalLM` with
     `AutoModelForCausalLM`,
  3. installs two shims for things main has and 5.24 lacks (each one is named here and in the README):
     - the checkpoint conversion rules for `deepseek_v41_text` (DeepSeek-native tensor names ->
       module names) are read from the upstream `conversion_mapping.py` (or the excerpt of it that
       holds only that entry) and registered with `register_checkpoint_conversion_mapping`;
     - `DynamicCache(config=...)` in 5.24 passes the config only to the V4 cache layer types; the
       V4.1 KV-source layer type `shared_compressed_attention` needs it too.

Nothing in the upstream model code is modified.
"""
from __future__ import annotations

import ast
import importlib
import sys
import types
from pathlib import Path

PKG = "transformers.models.deepseek_v41"
REQUIRED = ("configuration_deepseek_v41.py", "modeling_deepseek_v41.py")
MAPPING_FILES = ("conversion_mapping.py", "conversion_mapping.deepseek_v41_text.excerpt")


def _extract_mapping_entry(text: str, key: str = "deepseek_v41_text") -> str:
    """Return the source of the list literal `"<key>": [ ... ]` (bracket-matched, strings skipped)."""
    anchor = f'"{key}": ['
    start = text.find(anchor)
    if start < 0:
        raise RuntimeError(f"no {anchor!r} entry in the upstream conversion mapping")
    i = start + len(anchor) - 1
    depth, quote = 0, None
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == "#":
            i = text.index("\n", i)
            continue
        elif c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
            if depth == 0:
                return text[start + len(anchor) - 1 : i + 1]
        i += 1
    raise RuntimeError("unterminated conversion mapping entry")


def _conversion_rules(upstream: Path):
    from transformers import core_model_loading as cml

    for name in MAPPING_FILES:
        path = upstream / name
        if path.exists():
            src = _extract_mapping_entry(path.read_text(encoding="utf-8"))
            break
    else:
        raise FileNotFoundError(f"none of {MAPPING_FILES} in {upstream}")
    tree = ast.parse(src, mode="eval")
    allowed = {"WeightRenaming", "WeightConverter", "MergeModulelist", "Concatenate"}
    for node in ast.walk(tree):  # only constructor calls of the loader's own classes, nothing else
        if isinstance(node, ast.Call):
            if not (isinstance(node.func, ast.Name) and node.func.id in allowed):
                raise RuntimeError(f"unexpected call in the conversion mapping: {ast.dump(node.func)}")
        elif isinstance(node, (ast.Attribute, ast.Lambda, ast.Subscript)):
            raise RuntimeError("unexpected expression in the conversion mapping")
    env = {"__builtins__": {}, **{n: getattr(cml, n) for n in allowed}}
    return eval(compile(tree, "<deepseek_v41_text conversion mapping>", "eval"), env), src


def _patch_cache_layer_kwargs():
    from transformers import cache_utils

    orig = cache_utils.get_layer_types_and_kwargs
    if getattr(orig, "_dsv41_shim", False):
        return

    def get_layer_types_and_kwargs(config):
        layer_types, kwargs = orig(config)
        for i, t in enumerate(layer_types):
            if t == "shared_compressed_attention" and "config" not in kwargs[i]:
                kwargs[i] = dict(kwargs[i], config=config)
        return layer_types, kwargs

    get_layer_types_and_kwargs._dsv41_shim = True
    cache_utils.get_layer_types_and_kwargs = get_layer_types_and_kwargs


def load(upstream: Path):
    """Import the upstream package and register it. Returns (configuration module, modeling module,
    conversion-rule source text)."""
    upstream = Path(upstream).resolve()
    missing = [f for f in REQUIRED if not (upstream / f).exists()]
    if missing:
        raise FileNotFoundError(
            f"{upstream} lacks {missing}: download the upstream files first (tools/reference/README.md)")
    sys.dont_write_bytecode = True
    import transformers
    import transformers.models
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                 register_checkpoint_conversion_mapping)

    if PKG not in sys.modules:
        pkg = types.ModuleType(PKG)
        pkg.__path__ = [str(upstream)]
        pkg.__package__ = PKG
        pkg.__file__ = str(upstream / "__init__.py")
        sys.modules[PKG] = pkg
        transformers.models.deepseek_v41 = pkg
    cfg_mod = importlib.import_module(PKG + ".configuration_deepseek_v41")
    mdl_mod = importlib.import_module(PKG + ".modeling_deepseek_v41")

    # exist_ok=True: the auto mappings silently skip classes whose module lives under `transformers.` otherwise
    for cls in (cfg_mod.DeepseekV41Config, cfg_mod.DeepseekV41TextConfig, cfg_mod.DeepseekV41VisionConfig):
        AutoConfig.register(cls.model_type, cls, exist_ok=True)
    AutoModelForCausalLM.register(cfg_mod.DeepseekV41Config, mdl_mod.DeepseekV41ForCausalLM, exist_ok=True)

    rules, src = _conversion_rules(upstream)
    if get_checkpoint_conversion_mapping("deepseek_v41_text") is None:
        register_checkpoint_conversion_mapping("deepseek_v41_text", rules)
    _patch_cache_layer_kwargs()
    return cfg_mod, mdl_mod, src
