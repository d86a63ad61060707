"""Qwen3-VL's vision tower as the checkpoint holds it: its config and its tensors.

Both forwards read this (the float64 reference in refengine/vision_reference.py; the engine in
engine/vision.py and engine/multimodal.py), and nothing more: each computes the tower and the positions
on its own, so the code under test cannot move the oracle. It is read only when an image arrives: a
text-only request never parses `vision_config` nor converts a `model.visual.` tensor, so the language
model of a checkpoint whose tower is broken still loads and runs text; the tower's tensors are
validated (names and shapes, all problems in one error) when first asked for.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import RefengineError
from .config import VISION_LANGUAGE, ModelConfig

# Qwen3VLVisionConfig's defaults (transformers 5.24): what a field absent from vision_config means
VISION_DEFAULTS = dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304,
                       num_heads=16, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                       out_hidden_size=3584, num_position_embeddings=2304, deepstack_visual_indexes=(8, 16, 24))
# Qwen3VLConfig's defaults for the special token ids
TOKEN_DEFAULTS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                      vision_end_token_id=151653)
VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")  # the block MLP's (the mergers' is always exact GELU)
VISION_ROPE_THETA = 10000.0
LAYER_NORM_EPS = 1e-6  # every LayerNorm of the tower (transformers hard-codes it)


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    hidden_act: str
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    rope_theta: float
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_section: tuple[int, int, int]  # the language model's: frequencies of h and w (the rest: t)
    prefix: str = "model.visual."

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:  # one flattened patch: channels * temporal_patch_size * patch_size**2
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merged_dim(self) -> int:  # spatial_merge_size**2 neighbouring patches side by side
        return self.hidden_size * self.spatial_merge_size ** 2

    @property
    def grid_side(self) -> int:  # the learned position embeddings are a square grid
        return int(self.num_position_embeddings ** 0.5)

    def image_tokens(self, grid_thw) -> int:
        """Placeholder tokens of an image of that patch grid: one per spatial_merge_size**2 patches."""
        t, h, w = grid_thw
        return t * h * w // self.spatial_merge_size ** 2


def load_vision_config(model_dir: str | Path, cfg: ModelConfig) -> VisionConfig:
    where = Path(model_dir) / "config.json"
    if cfg.arch not in VISION_LANGUAGE:
        raise RefengineError(f"{where}: architecture {cfg.arch} has no vision tower (images need Qwen3-VL)")
    top = json.loads(where.read_text(encoding="utf-8"))
    raw = top.get("vision_config")
    if not isinstance(raw, dict):
        raise RefengineError(f"{where}: required field vision_config is missing (or not an object)")
    v = {key: raw.get(key, default) for key, default in VISION_DEFAULTS.items()}
    for key, value in v.items():
        if key not in ("hidden_act", "deepstack_visual_indexes") and (not isinstance(value, int) or value < 1):
            raise RefengineError(f"{where}: vision_config.{key}={value!r} is not supported (a positive integer)")
    if v["hidden_act"] not in VISION_ACTIVATIONS:
        raise RefengineError(f"{where}: vision_config.hidden_act={v['hidden_act']!r} is not supported "
                             f"(supported: {', '.join(VISION_ACTIVATIONS)})")
    if v["hidden_size"] % v["num_heads"] or (v["hidden_size"] // v["num_heads"]) % 4:
        raise RefengineError(f"{where}: vision_config.hidden_size={v['hidden_size']} must be num_heads="
                             f"{v['num_heads']} times a multiple of 4 (2-D rotary positions)")
    if int(v["num_position_embeddings"] ** 0.5) ** 2 != v["num_position_embeddings"]:
        raise RefengineError(f"{where}: vision_config.num_position_embeddings={v['num_position_embeddings']} "
                             f"must be a square (a grid of learned positions)")
    if v["out_hidden_size"] != cfg.hidden_size:
        raise RefengineError(f"{where}: vision_config.out_hidden_size={v['out_hidden_size']} must equal "
                             f"text_config.hidden_size={cfg.hidden_size}")
    deepstack = tuple(int(i) for i in v["deepstack_visual_indexes"])
    if any(not 0 <= i < v["depth"] for i in deepstack) or len(deepstack) > cfg.num_layers:
        raise RefengineError(f"{where}: vision_config.deepstack_visual_indexes={list(deepstack)} must be blocks "
                             f"of the tower (0 to {v['depth'] - 1}), at most one per decoder layer")
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise RefengineError(f"{where}: vision_config.rope_parameters.rope_type={rope['rope_type']!r} is not "
                             f"supported (only 'axial')")
    text_rope = top["text_config"].get("rope_parameters") or top["text_config"].get("rope_scaling") or {}
    section = tuple(int(s) for s in text_rope.get("mrope_section", (24, 20, 20)))
    if len(section) != 3 or min(section) < 0:
        raise RefengineError(f"{where}: text_config.rope_parameters.mrope_section={list(section)} must be 3 counts "
                             f"(t, h, w)")
    if text_rope.get("mrope_interleaved", True) is not True:
        # transformers' Qwen3-VL interleaves (t h w t h w ...) whatever the field says; the chunked layout
        # (Qwen2-VL's) would have no transformers forward to be checked against
        raise RefengineError(f"{where}: text_config.rope_parameters.mrope_interleaved="
                             f"{text_rope['mrope_interleaved']!r} is not supported (only interleaved)")
    tokens = {key: int(top.get(key, default)) for key, default in TOKEN_DEFAULTS.items()}
    for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
        if not 0 <= tokens[key] < cfg.vocab_size:
            raise RefengineError(f"{where}: field {key}={tokens[key]} is outside the vocabulary [0, {cfg.vocab_size})")
    return VisionConfig(**{key: v[key] for key in VISION_DEFAULTS if key != "deepstack_visual_indexes"},
                        deepstack_visual_indexes=deepstack,
                        rope_theta=float(rope.get("rope_theta", VISION_ROPE_THETA)),
                        image_token_id=tokens["image_token_id"],
                        vision_start_token_id=tokens["vision_start_token_id"],
                        vision_end_token_id=tokens["vision_end_token_id"],
                        mrope_section=section, prefix=VISION_LANGUAGE[cfg.arch][1])


@dataclass(frozen=True)
class MergerWeights:
    """spatial_merge_size**2 neighbouring patches -> one language-model token: LayerNorm (over each
    patch, or over the merged row for a deepstack merger), then a GELU MLP."""
    norm: np.ndarray       # [hidden] or [merged]
    norm_bias: np.ndarray
    fc1: np.ndarray        # [merged, merged]
    fc1_bias: np.ndarray   # [merged]
    fc2: np.ndarray        # [out_hidden, merged]
    fc2_bias: np.ndarray   # [out_hidden]


@dataclass(frozen=True)
class VisionBlockWeights:
    norm1: np.ndarray      # [hidden]
    norm1_bias: np.ndarray
    qkv: np.ndarray        # [3 * hidden, hidden]: q, k, v stacked
    qkv_bias: np.ndarray   # [3 * hidden]
    proj: np.ndarray       # [hidden, hidden]
    proj_bias: np.ndarray
    norm2: np.ndarray
    norm2_bias: np.ndarray
    fc1: np.ndarray        # [intermediate, hidden]
    fc1_bias: np.ndarray
    fc2: np.ndarray        # [hidden, intermediate]
    fc2_bias: np.ndarray


@dataclass(frozen=True)
class VisionWeights:
    patch_embed: np.ndarray       # [hidden, patch_dim]: the Conv3d whose stride is its kernel, a linear map
    patch_bias: np.ndarray        # [hidden]
    pos_embed: np.ndarray         # [num_position_embeddings, hidden]: a grid_side x grid_side grid
    blocks: list[VisionBlockWeights]
    merger: MergerWeights
    deepstack_mergers: list[MergerWeights]  # one per deepstack_visual_indexes entry


_BLOCK_TENSORS = {  # VisionBlockWeights field -> tensor name suffix
    "norm1": "norm1.weight", "norm1_bias": "norm1.bias", "qkv": "attn.qkv.weight", "qkv_bias": "attn.qkv.bias",
    "proj": "attn.proj.weight", "proj_bias": "attn.proj.bias", "norm2": "norm2.weight", "norm2_bias": "norm2.bias",
    "fc1": "mlp.linear_fc1.weight", "fc1_bias": "mlp.linear_fc1.bias",
    "fc2": "mlp.linear_fc2.weight", "fc2_bias": "mlp.linear_fc2.bias",
}
_MERGER_TENSORS = {"norm": "norm.weight", "norm_bias": "norm.bias", "fc1": "linear_fc1.weight",
                   "fc1_bias": "linear_fc1.bias", "fc2": "linear_fc2.weight", "fc2_bias": "linear_fc2.bias"}


def _merger_shapes(v: VisionConfig, postshuffle: bool) -> dict[str, tuple[int, ...]]:
    norm = v.merged_dim if postshuffle else v.hidden_size
    return {"norm": (norm,), "norm_bias": (norm,), "fc1": (v.merged_dim, v.merged_dim), "fc1_bias": (v.merged_dim,),
            "fc2": (v.out_hidden_size, v.merged_dim), "fc2_bias": (v.out_hidden_size,)}


def _vision_names(v: VisionConfig) -> dict[tuple, tuple[str, tuple[int, ...]]]:
    """(part, index, field) -> (tensor name, shape), for every tensor the tower has."""
    h, i, p = v.hidden_size, v.intermediate_size, v.prefix
    names = {("patch_embed",): (f"{p}patch_embed.proj.weight", (h, v.in_channels, v.temporal_patch_size,
                                                               v.patch_size, v.patch_size)),
             ("patch_bias",): (f"{p}patch_embed.proj.bias", (h,)),
             ("pos_embed",): (f"{p}pos_embed.weight", (v.num_position_embeddings, h))}
    block = {"norm1": (h,), "norm1_bias": (h,), "qkv": (3 * h, h), "qkv_bias": (3 * h,), "proj": (h, h),
             "proj_bias": (h,), "norm2": (h,), "norm2_bias": (h,), "fc1": (i, h), "fc1_bias": (i,), "fc2": (h, i),
             "fc2_bias": (h,)}
    for n in range(v.depth):
        names |= {("block", n, f): (f"{p}blocks.{n}.{_BLOCK_TENSORS[f]}", s) for f, s in block.items()}
    names |= {("merger", 0, f): (f"{p}merger.{_MERGER_TENSORS[f]}", s) for f, s in _merger_shapes(v, False).items()}
    for n in range(len(v.deepstack_visual_indexes)):
        names |= {("deepstack", n, f): (f"{p}deepstack_merger_list.{n}.{_MERGER_TENSORS[f]}", s)
                  for f, s in _merger_shapes(v, True).items()}
    return names


def load_vision_weights(checkpoint, v: VisionConfig, dtype) -> VisionWeights:
    """The tower's tensors from an opened Checkpoint, in `dtype`, after checking every name and shape
    the config implies (and that the tower has no tensor the config does not)."""
    names = _vision_names(v)
    found = {name: f.tensors[name][1] for name, f in checkpoint.sources.items() if name.startswith(v.prefix)}
    expected = dict(names.values())
    problems = [f"missing tensor {n} {list(s)}" for n, s in expected.items() if n not in found]
    problems += [f"tensor {n} has shape {list(found[n])}, expected {list(s)}"
                 for n, s in expected.items() if n in found and tuple(found[n]) != s]
    problems += [f"unexpected tensor {n} {list(s)}" for n, s in found.items() if n not in expected]
    if problems:
        raise RefengineError(f"{checkpoint.files[0].parent}: vision tower weights do not match config.json's "
                             f"vision_config: " + "; ".join(problems))
    read = {key: checkpoint.tensor(name, dtype) for key, (name, _) in names.items()}
    blocks = [VisionBlockWeights(**{f: read["block", n, f] for f in _BLOCK_TENSORS}) for n in range(v.depth)]
    deepstack = [MergerWeights(**{f: read["deepstack", n, f] for f in _MERGER_TENSORS})
                 for n in range(len(v.deepstack_visual_indexes))]
    return VisionWeights(patch_embed=read["patch_embed",].reshape(v.hidden_size, v.patch_dim),
                         patch_bias=read["patch_bias",], pos_embed=read["pos_embed",], blocks=blocks,
                         merger=MergerWeights(**{f: read["merger", 0, f] for f in _MERGER_TENSORS}),
                         deepstack_mergers=deepstack)
