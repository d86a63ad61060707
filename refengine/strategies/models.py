"""Tiny model configurations: the architectures and attention layouts schedules run on.

Every configuration is built once with `refengine.model.tiny.make_tiny` into the refengine cache
(`REFENGINE_CACHE`, default ~/.cache/refengine) and loaded once per process, so examples never pay
for a model. The first entry is the base random-weight model (the one `refengine make-tiny` writes,
cached as tiny-random); strategies shrink towards it. The embedded default model, tiny-chat, is not
among them: it is trained on a few dozen texts, so its margins are large wherever it was trained and
arbitrary elsewhere, and schedules of random prompts need the spread of margins random weights give.
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from hypothesis import strategies as st

from ..model import Model, load_model
from ..model.cache import cached_tiny_model, random_model_dir
from ..model.tiny import TinySpec

DEFAULT_MODEL = "qwen3-gqa2-tied"
VISION_MODEL = "qwen3vl-gqa2-tied"  # the one that takes images
VOCAB_SIZE = 512  # every configuration shares it, so one prompt strategy serves them all

TINY_CONFIGS = {
    DEFAULT_MODEL: TinySpec(),
    "qwen3-mha-untied": TinySpec(heads=4, kv_heads=4, tie=False),
    "qwen3-mqa-tied": TinySpec(heads=4, kv_heads=1),
    "qwen2-gqa2-untied": TinySpec(arch="qwen2", tie=False),
    "llama-gqa4-tied": TinySpec(arch="llama", heads=8, kv_heads=2, head_dim=8),
    "llama-mha-untied": TinySpec(arch="llama", layers=1, heads=2, kv_heads=2, head_dim=32, tie=False),
    # 4 experts, 2 per token, renormalized; layer 1 of 3 a dense MLP among the sparse ones
    "qwen3moe-e4k2": TinySpec(arch="qwen3_moe", layers=3, tie=False, experts=4, experts_per_tok=2,
                              moe_intermediate=32, mlp_only_layers=(1,)),
    # Qwen3-VL: the text model under a two-block vision tower (model.tiny.TINY_VISION); schedules' images
    # (strategies.schedules) run on it, every other model takes the requests without them
    VISION_MODEL: TinySpec(arch="qwen3_vl"),
}


def tiny_model_dir(name: str) -> Path:
    """The folder of configuration `name`, built into the cache on first use."""
    spec = TINY_CONFIGS[name]
    if spec == TinySpec():
        return random_model_dir()
    digest = hashlib.sha256(json.dumps(spec.recipe(), sort_keys=True).encode()).hexdigest()[:10]
    return cached_tiny_model(f"tiny-{name}-{digest}", spec)


def make_tiny_command(name: str) -> str:
    """The command that writes configuration `name` (the same bytes, so the same fingerprint)."""
    spec, default = TINY_CONFIGS[name], TinySpec()
    flags = [f"--{field.replace('_', '-')} {','.join(map(str, value)) if isinstance(value, list) else value}"
             for field, value in spec.recipe().items() if field != "tie" and value != default.recipe().get(field)]
    if spec.tie != default.tie:
        flags.append("--tie" if spec.tie else "--no-tie")
    return " ".join(["refengine make-tiny DIR", *flags])


@functools.cache
def tiny_model(name: str = DEFAULT_MODEL) -> Model:
    return load_model(tiny_model_dir(name))


def tiny_model_names() -> st.SearchStrategy[str]:
    """qwen3 / qwen2 / llama / qwen3_moe / qwen3_vl; GQA 2:1 and 4:1, MQA, MHA; tied and untied heads."""
    return st.sampled_from(list(TINY_CONFIGS))
