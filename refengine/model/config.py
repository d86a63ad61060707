"""HF `config.json` (+ `generation_config.json`) -> the one ModelConfig both forwards use."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import RefengineError

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "qwen3" | "qwen2" | "llama"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size) * self.qkv_bias + h * self.o_bias
        attn += 2 * self.head_dim * self.qk_norm
        mlp = 3 * h * i + (2 * i + h) * self.mlp_bias
        per_layer = attn + mlp + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RefengineError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RefengineError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise RefengineError(f"{path}: expected a JSON object")
    return data


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _rope_theta(cfg: dict, where: Path) -> float:
    # transformers 5 moved rope settings into `rope_parameters`; older files use
    # `rope_theta` plus an optional `rope_scaling` dict. Both are checked: either can carry a scaling.
    for field in ("rope_parameters", "rope_scaling"):
        params = cfg.get(field) or {}
        if not isinstance(params, dict):
            raise RefengineError(f"{where}: field {field} must be an object, got {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise RefengineError(f"{where}: field {field}.rope_type={rope_type!r} is not supported (only 'default' RoPE)")
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    return float(theta)


def _refuse_unsupported(cfg: dict, where: Path) -> None:
    if cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None:
        raise RefengineError(
            f"{where}: field use_sliding_window=true (sliding_window={cfg['sliding_window']}) is not supported")
    layer_types = cfg.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        other = sorted({t for t in layer_types if t != "full_attention"})
        raise RefengineError(f"{where}: field layer_types contains {other} (only full_attention is supported)")
    for moe_field in ("num_experts", "num_local_experts", "n_routed_experts"):
        if cfg.get(moe_field):
            raise RefengineError(f"{where}: field {moe_field}={cfg[moe_field]} (mixture of experts) is not supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise RefengineError(f"{where}: field hidden_act={act!r} is not supported (only 'silu')")
    if cfg.get("pretraining_tp", 1) != 1:
        raise RefengineError(f"{where}: field pretraining_tp={cfg['pretraining_tp']} is not supported")


def load_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise RefengineError(f"{model_dir}: model folder does not exist")
    where = model_dir / "config.json"
    cfg = _read_json(where)
    archs = cfg.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise RefengineError(
            f"{where}: field architectures={archs!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    arch = SUPPORTED_ARCHITECTURES[archs[0]]
    _refuse_unsupported(cfg, where)
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        required = {k: cfg[k] for k in ("vocab_size", "num_hidden_layers", "intermediate_size")}
    except KeyError as e:
        raise RefengineError(f"{where}: required field {e.args[0]} is missing") from None
    head_dim = cfg.get("head_dim") or hidden // heads
    gen_path = model_dir / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.exists() else {}
    eos = _ids(gen.get("eos_token_id")) + _ids(cfg.get("eos_token_id"))
    attention_bias = bool(cfg.get("attention_bias", arch == "qwen2"))
    return ModelConfig(
        arch=arch,
        vocab_size=int(required["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(required["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        intermediate_size=int(required["intermediate_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg, where),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias and never o bias; Qwen3/Llama put both under attention_bias.
        qkv_bias=True if arch == "qwen2" else attention_bias,
        o_bias=False if arch == "qwen2" else attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch == "qwen3",
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        bos_token_id=cfg.get("bos_token_id"),
    )
