"""How a sparse layer's experts are stored, and reading them into [experts, ...] stacks.

Two layouts, each as its checkpoints have it:

- one tensor per expert (Qwen3-MoE: as transformers 5.24 saves it and as the Hub's Qwen3-30B-A3B
  has it): `mlp.experts.{e}.gate_proj.weight` [moe_intermediate, hidden], `up_proj`, and `down_proj`
  [hidden, moe_intermediate];
- fused 3-D tensors (Qwen3-VL-MoE): `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`.
  transformers 5.24 saves them as its model holds them, [experts, 2 * moe_intermediate, hidden] (the
  gate's rows first) and [experts, hidden, moe_intermediate]; the Hub's checkpoints store each
  transposed. transformers' loader (conversion_mapping "qwen3_vl_moe": Transpose(1, 2,
  check_dims=True)) keeps a tensor whose shape is its own and transposes any other, and so does this:
  a square one (hidden == 2 * moe_intermediate) is taken as stored, as transformers takes it.

A layer's experts are stacked when the layer is read, so a streamed forward holds one layer at a time.
"""
from __future__ import annotations

import numpy as np

from .config import ModelConfig

_PER_EXPERT = {"expert_gate": "gate_proj.weight", "expert_up": "up_proj.weight", "expert_down": "down_proj.weight"}


def _per_expert_name(cfg: ModelConfig, layer: int, expert: int, field: str) -> str:
    return f"{cfg.weight_prefix}layers.{layer}.mlp.experts.{expert}.{_PER_EXPERT[field]}"


def _fused_names(cfg: ModelConfig, layer: int) -> tuple[str, str]:
    prefix = f"{cfg.weight_prefix}layers.{layer}.mlp.experts."
    return prefix + "gate_up_proj", prefix + "down_proj"


def expert_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Sparse layer `layer`'s expert tensors -> their shape as transformers' model holds them."""
    e, h, mi = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    if cfg.fused_experts:
        gate_up, down = _fused_names(cfg, layer)
        return {gate_up: (e, 2 * mi, h), down: (e, h, mi)}
    shapes = {"expert_gate": (mi, h), "expert_up": (mi, h), "expert_down": (h, mi)}
    return {_per_expert_name(cfg, layer, x, field): shape for x in range(e) for field, shape in shapes.items()}


def transposed_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The other shape a fused expert tensor may be stored in (the Hub's): dims 1 and 2 swapped."""
    if not cfg.fused_experts:
        return {}
    return {name: (s[0], s[2], s[1]) for name, s in expert_shapes(cfg, layer).items()}


def read_experts(checkpoint, layer: int, dtype) -> dict[str, np.ndarray]:
    """LayerWeights' expert_gate, expert_up [experts, moe_intermediate, hidden] and expert_down
    [experts, hidden, moe_intermediate] of sparse layer `layer`, in `dtype`."""
    cfg = checkpoint.cfg
    if cfg.fused_experts:
        held = expert_shapes(cfg, layer)
        gate_up, down = (checkpoint.tensor(name, dtype) for name in held)
        gate_up, down = (t if t.shape == shape else t.transpose(0, 2, 1) for t, shape in zip((gate_up, down), held.values()))
        mi = cfg.moe_intermediate_size
        return {"expert_gate": np.ascontiguousarray(gate_up[:, :mi]), "expert_up": np.ascontiguousarray(gate_up[:, mi:]),
                "expert_down": np.ascontiguousarray(down)}
    stacks = {}
    for field in _PER_EXPERT:
        first = checkpoint.tensor(_per_expert_name(cfg, layer, 0, field), dtype)
        # filled expert by expert: a 128-expert layer is never held twice (a list and its stack)
        stacked = stacks[field] = np.empty((cfg.num_experts, *first.shape), dtype=dtype)
        stacked[0] = first
        for x in range(1, cfg.num_experts):
            stacked[x] = checkpoint.tensor(_per_expert_name(cfg, layer, x, field), dtype)
    return stacks
