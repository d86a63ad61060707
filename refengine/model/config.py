"""HF `config.json` (+ `generation_config.json`) -> the one ModelConfig both forwards use.

A vision-language checkpoint (Qwen3-VL) is read as its language model: the fields come from its
`text_config`, its tensors from under `model.language_model.`, and the vision tower is left on disk.
Text-only prompts never reach the tower, and their multimodal RoPE is the 1-D one (`_rope_theta`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import RefengineError

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}
QK_NORM_ARCHS = ("qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe")
MOE_ARCHS = ("qwen3_moe", "qwen3_vl_moe")
VISION_LANGUAGE = {arch: ("model.language_model.", "model.visual.")  # arch -> (its LM's prefix, the tower's)
                   for arch in ("qwen3_vl", "qwen3_vl_moe")}
# Mixture-of-experts fields of other families' routers (shared experts, grouped or scaled routing) that the
# Qwen3-MoE forward does not implement, with the value that means "absent". The router's aux-loss fields
# (router_aux_loss_coef, output_router_logits) are training-only and read by nobody.
UNSUPPORTED_MOE_FIELDS = {"shared_expert_intermediate_size": 0, "n_shared_experts": 0, "num_shared_experts": 0,
                          "first_k_dense_replace": 0, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
                          "scoring_func": "softmax", "topk_method": "greedy", "moe_layer_freq": 1}
MAX_REPLAYED_TOP_K = 17  # model.routing replays torch.topk's tie order for k <= 17 (every Qwen3-MoE: 8)


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "qwen3" | "qwen3_moe" | "qwen3_vl" | "qwen2" | "llama"
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
    # Mixture of experts (Qwen3-MoE): the layers in sparse_layers replace the MLP by num_experts SwiGLU
    # experts of width moe_intermediate_size, num_experts_per_tok of them per token.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()
    fused_experts: bool = False         # a layer's experts in two 3-D tensors (model/experts.py)
    weight_prefix: str = "model."       # where the language model's tensors are named
    ignored_prefix: str | None = None   # tensors of the checkpoint that are not the language model

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
        experts = self.num_experts * (h + 3 * h * self.moe_intermediate_size)  # router row + SwiGLU per expert
        layers = self.num_layers * (attn + 2 * h) + len(self.sparse_layers) * experts
        layers += (self.num_layers - len(self.sparse_layers)) * mlp
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + layers + h + head


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


def _rope_theta(cfg: dict, where: Path | str, multimodal: bool) -> float:
    # transformers 5 moved rope settings into `rope_parameters`; older files use
    # `rope_theta` plus an optional `rope_scaling` dict. Both are checked: either can carry a scaling.
    # Qwen3-VL's multimodal RoPE (mrope_section, mrope_interleaved) gives each frequency the position of
    # one of three axes (t, h, w); a text-only prompt has all three equal to the token's position, so
    # every frequency sees that position and the 1-D RoPE is exact (tests/test_parity_moe_vl.py checks it).
    for field in ("rope_parameters", "rope_scaling"):
        params = cfg.get(field) or {}
        if not isinstance(params, dict):
            raise RefengineError(f"{where}: field {field} must be an object, got {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise RefengineError(f"{where}: field {field}.rope_type={rope_type!r} is not supported (only 'default' RoPE)")
        if "mrope_section" in params and not multimodal:
            raise RefengineError(f"{where}: field {field}.mrope_section is not supported (multimodal RoPE: "
                                 f"only in a vision-language checkpoint, for text-only prompts)")
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    return float(theta)


def _refuse_unsupported(cfg: dict, where: Path | str, moe: bool) -> None:
    if cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None:
        raise RefengineError(
            f"{where}: field use_sliding_window=true (sliding_window={cfg['sliding_window']}) is not supported")
    layer_types = cfg.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        other = sorted({t for t in layer_types if t != "full_attention"})
        raise RefengineError(f"{where}: field layer_types contains {other} (only full_attention is supported)")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise RefengineError(f"{where}: field hidden_act={act!r} is not supported (only 'silu')")
    if cfg.get("pretraining_tp", 1) != 1:
        raise RefengineError(f"{where}: field pretraining_tp={cfg['pretraining_tp']} is not supported")
    for moe_field in () if moe else ("num_experts", "num_local_experts", "n_routed_experts"):
        if cfg.get(moe_field):
            raise RefengineError(f"{where}: field {moe_field}={cfg[moe_field]} (mixture of experts) is not supported "
                                 f"for this architecture")
    for moe_field, absent in UNSUPPORTED_MOE_FIELDS.items():
        if cfg.get(moe_field, absent) not in (absent, None):
            raise RefengineError(f"{where}: field {moe_field}={cfg[moe_field]!r} is not supported (the Qwen3-MoE "
                                 f"router: softmax top-k over routed experts only)")


def _experts(cfg: dict, where: Path | str, num_layers: int) -> dict:
    """The Qwen3-MoE fields, with the layers that are sparse as transformers decides it
    (Qwen3MoeDecoderLayer): layer n is sparse iff n is not in mlp_only_layers, there are experts and
    (n + 1) % decoder_sparse_step == 0; the other layers are dense MLPs of intermediate_size."""
    try:
        # transformers writes num_local_experts (its attribute_map); Hub checkpoints say num_experts
        experts = int(cfg["num_local_experts"] if "num_local_experts" in cfg else cfg["num_experts"])
        top_k, width = int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"])
    except KeyError as e:
        raise RefengineError(f"{where}: required field {e.args[0]} is missing") from None
    step, dense = int(cfg.get("decoder_sparse_step", 1)), cfg.get("mlp_only_layers") or []
    if not 1 <= top_k <= min(experts, MAX_REPLAYED_TOP_K):
        raise RefengineError(f"{where}: field num_experts_per_tok={top_k} is not supported "
                             f"(1 to min(num_experts, {MAX_REPLAYED_TOP_K}))")
    if step < 1:
        raise RefengineError(f"{where}: field decoder_sparse_step={step} must be >= 1")
    sparse = tuple(n for n in range(num_layers) if n not in dense and experts > 0 and (n + 1) % step == 0)
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), sparse_layers=sparse)


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
    top = cfg
    if arch in VISION_LANGUAGE:
        cfg = top.get("text_config")
        if not isinstance(cfg, dict):
            raise RefengineError(f"{where}: required field text_config is missing (or not an object)")
        where_fields = f"{where}: text_config"
    else:
        where_fields = where
    _refuse_unsupported(cfg, where_fields, moe=arch in MOE_ARCHS)
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        required = {k: cfg[k] for k in ("vocab_size", "num_hidden_layers", "intermediate_size")}
    except KeyError as e:
        raise RefengineError(f"{where_fields}: required field {e.args[0]} is missing") from None
    head_dim = cfg.get("head_dim") or hidden // heads
    gen_path = model_dir / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.exists() else {}
    # A VL checkpoint may put its token ids at the top level or in text_config; either names them.
    eos = _ids(gen.get("eos_token_id")) + _ids(top.get("eos_token_id")) + _ids(cfg.get("eos_token_id"))
    bos = top.get("bos_token_id", cfg.get("bos_token_id"))
    attention_bias = bool(cfg.get("attention_bias", arch == "qwen2"))
    num_layers = int(required["num_hidden_layers"])
    moe = _experts(cfg, where_fields, num_layers) if arch in MOE_ARCHS else {}
    if arch == "qwen3_vl_moe":  # its router always renormalizes (Qwen3VLMoeTextTopKRouter has no flag)
        moe |= dict(norm_topk_prob=True, fused_experts=True)
    prefix, ignored = VISION_LANGUAGE.get(arch, ("model.", None))
    return ModelConfig(
        arch=arch,
        vocab_size=int(required["vocab_size"]),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        intermediate_size=int(required["intermediate_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg, where_fields, multimodal=arch in VISION_LANGUAGE),
        # transformers ties by the top-level field only (a VL text_config's own is not read; default False)
        tie_word_embeddings=bool(top.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias and never o bias; Qwen3/Llama put both under attention_bias.
        qkv_bias=True if arch == "qwen2" else attention_bias,
        o_bias=False if arch == "qwen2" else attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch in QK_NORM_ARCHS,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        bos_token_id=bos,
        weight_prefix=prefix,
        ignored_prefix=ignored,
        **moe,
    )
