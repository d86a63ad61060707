"""Generate complete HF-format model folders with random weights, for tests and benchmarks.

Same arguments => byte-identical files. The weight scales are chosen so greedy decoding sees
realistic top-2 logit margins: mostly clear decisions (median around 1) with a tail of near-ties,
so tests meet both (docs/concepts/tiny-models.md shows the distribution `refengine margins` prints).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..data import shipped
from ..errors import RefengineError
from .safetensors_io import save_file
from .weights import INDEX_FILE, SINGLE_FILE

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
MODEL_TYPES = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama", "qwen3_moe": "qwen3_moe"}
TINY_RECIPE = "refengine_tiny.json"  # how make-tiny built a folder: its arguments
TRAINED_RECIPE = "refengine_trained.json"  # how model.train trained one: data, settings, versions
MOE_FIELDS = ("experts", "experts_per_tok", "moe_intermediate", "mlp_only_layers")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    arch: str = "qwen3"
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    vocab: int = 512
    tie: bool = True
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    # qwen3_moe only: experts per sparse layer, chosen per token, their width, and the dense layers
    experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate: int = 0
    mlp_only_layers: tuple[int, ...] = ()

    def recipe(self) -> dict:
        """The spec as refengine_tiny.json records it; a dense model's leaves the MoE fields out, so its
        recipe (and the golden headers and cache names made from it) predates them byte for byte."""
        spec = asdict(self)
        if self.arch != "qwen3_moe":
            spec = {k: v for k, v in spec.items() if k not in MOE_FIELDS}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in spec.items()}


# Residual branches large enough to move the stream away from the input embedding (otherwise
# tied heads loop on one token); the head scaled so greedy margins have a median near 1.
RESIDUAL_SCALE = 5.0
LOGIT_SCALE = 3.0

PRESETS = {
    "tiny": TinySpec(),
    "qwen3-0.6b-shape": TinySpec(arch="qwen3", layers=28, hidden=1024, heads=16, kv_heads=8, head_dim=128,
                                 intermediate=3072, vocab=151936, tie=True, max_position_embeddings=40960,
                                 rope_theta=1000000.0),
    "qwen3-1.7b-shape": TinySpec(arch="qwen3", layers=28, hidden=2048, heads=16, kv_heads=8, head_dim=128,
                                 intermediate=6144, vocab=151936, tie=True, max_position_embeddings=40960,
                                 rope_theta=1000000.0),
}


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained on the corpus shipped with the package."""
    corpus = shipped("corpus.txt").read_text(encoding="utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def hf_config(spec: TinySpec, special_ids: dict[str, int]) -> dict:
    config = {
        "architectures": [ARCHITECTURES[spec.arch]],
        "model_type": MODEL_TYPES[spec.arch],
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie,
        "attention_bias": False,
        "bos_token_id": special_ids["<|endoftext|>"],
        "eos_token_id": special_ids["<|im_end|>"],
        "torch_dtype": "float32",
    }
    if spec.arch == "qwen2":
        config["use_sliding_window"] = False
    if spec.arch == "qwen3_moe":  # the field names of the Hub's Qwen3-30B-A3B config.json
        config |= {"num_experts": spec.experts, "num_experts_per_tok": spec.experts_per_tok,
                   "moe_intermediate_size": spec.moe_intermediate, "norm_topk_prob": True,
                   "decoder_sparse_step": 1, "mlp_only_layers": list(spec.mlp_only_layers)}
    return config


def random_weights(spec: TinySpec, seed: int) -> dict[str, np.ndarray]:
    """Random tensors in HF names; scales keep the residual stream mixing across layers."""
    rng = np.random.default_rng(seed)
    h, i, d = spec.hidden, spec.intermediate, spec.head_dim
    q, kv = spec.heads * d, spec.kv_heads * d

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm_weight(size):
        return (1.0 + rng.standard_normal(size) * 0.1).astype(np.float32)

    def swiglu(prefix, width):
        return {prefix + "gate_proj.weight": normal((width, h), 1.0 / np.sqrt(h)),
                prefix + "up_proj.weight": normal((width, h), 1.0 / np.sqrt(h)),
                prefix + "down_proj.weight": normal((h, width), RESIDUAL_SCALE / np.sqrt(width))}

    tensors = {"model.embed_tokens.weight": normal((spec.vocab, h), 1.0), "model.norm.weight": norm_weight(h)}
    for n in range(spec.layers):
        p = f"model.layers.{n}."
        tensors |= {
            p + "input_layernorm.weight": norm_weight(h),
            p + "post_attention_layernorm.weight": norm_weight(h),
            p + "self_attn.q_proj.weight": normal((q, h), 1.5 / np.sqrt(h)),
            p + "self_attn.k_proj.weight": normal((kv, h), 1.5 / np.sqrt(h)),
            p + "self_attn.v_proj.weight": normal((kv, h), 1.0 / np.sqrt(h)),
            p + "self_attn.o_proj.weight": normal((h, q), RESIDUAL_SCALE / np.sqrt(q)),
        }
        if spec.arch == "qwen3_moe" and n not in spec.mlp_only_layers:
            # router logits of spread ~2, so tokens split between experts with clear preferences
            tensors[p + "mlp.gate.weight"] = normal((spec.experts, h), 2.0 / np.sqrt(h))
            for e in range(spec.experts):
                tensors |= swiglu(f"{p}mlp.experts.{e}.", spec.moe_intermediate)
        else:
            tensors |= swiglu(p + "mlp.", i)
        if spec.arch in ("qwen3", "qwen3_moe"):
            tensors[p + "self_attn.q_norm.weight"] = norm_weight(d)
            tensors[p + "self_attn.k_norm.weight"] = norm_weight(d)
        if spec.arch == "qwen2":
            tensors[p + "self_attn.q_proj.bias"] = normal((q,), 0.1)
            tensors[p + "self_attn.k_proj.bias"] = normal((kv,), 0.1)
            tensors[p + "self_attn.v_proj.bias"] = normal((kv,), 0.1)
    if not spec.tie:
        tensors["lm_head.weight"] = normal((spec.vocab, h), 1.0)
    head = "model.embed_tokens.weight" if spec.tie else "lm_head.weight"
    tensors[head] *= np.float32(LOGIT_SCALE / np.sqrt(h))
    return tensors



def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_weights(out: Path, tensors: dict[str, np.ndarray], dtype: str, shards: int) -> None:
    if shards <= 1:
        save_file(tensors, out / SINGLE_FILE, dtype)
        return
    names = sorted(tensors)
    groups = [names[k::shards] for k in range(shards)]
    weight_map = {}
    for k, group in enumerate(groups, start=1):
        filename = f"model-{k:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, out / filename, dtype)
        weight_map |= {n: filename for n in group}
    itemsize = 2 if dtype in ("BF16", "F16") else 4
    total = sum(t.size for t in tensors.values()) * itemsize
    _write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def render_chatml(role: str, content: str) -> tuple[str, str]:
    """One message as CHAT_TEMPLATE renders it: (the head a reply follows, the body the reply is)."""
    return f"<|im_start|>{role}\n", f"{content}<|im_end|>\n"


def write_folder(out: Path, spec: TinySpec, tokenizer: Tokenizer, tensors: dict[str, np.ndarray], *,
                 recipe_name: str, recipe: dict, dtype: str = "F32", shards: int = 1) -> Path:
    """A complete HF folder: config, generation config, tokenizer files with the ChatML template, the
    weights, and `recipe_name` recording how they were made."""
    out.mkdir(parents=True, exist_ok=True)
    special_ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    config = hf_config(spec, special_ids)
    config["torch_dtype"] = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[dtype]
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": special_ids["<|endoftext|>"],
        "eos_token_id": [special_ids["<|im_end|>"], special_ids["<|endoftext|>"]],
        "do_sample": False,
    })
    _write_json(out / "tokenizer_config.json", {
        "chat_template": CHAT_TEMPLATE, "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": spec.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    _write_json(out / recipe_name, recipe)
    write_weights(out, tensors, dtype, shards)
    return out


def make_tiny(out_dir: str | Path, spec: TinySpec = TinySpec(), seed: int = 0, dtype: str = "F32",
              shards: int = 1) -> Path:
    if spec.arch not in ARCHITECTURES:
        raise RefengineError(f"arch: unknown architecture {spec.arch!r} (choose {', '.join(ARCHITECTURES)})")
    if spec.vocab < 256 + len(SPECIAL_TOKENS):
        raise RefengineError(f"vocab: {spec.vocab} is too small for a byte-level tokenizer (at least 259)")
    if spec.heads % spec.kv_heads:
        raise RefengineError(f"heads: {spec.heads} is not a multiple of kv_heads {spec.kv_heads}")
    if spec.arch == "qwen3_moe" and not (spec.experts >= 2 and 1 <= spec.experts_per_tok <= spec.experts
                                         and spec.moe_intermediate >= 1):
        raise RefengineError(f"experts: qwen3_moe needs experts >= 2, 1 <= experts_per_tok <= experts and "
                             f"moe_intermediate >= 1 (got {spec.experts}, {spec.experts_per_tok}, "
                             f"{spec.moe_intermediate})")
    if spec.arch == "qwen3_moe" and not set(spec.mlp_only_layers) <= set(range(spec.layers)):
        raise RefengineError(f"mlp_only_layers: {list(spec.mlp_only_layers)} are not all layers of 0..{spec.layers - 1}")
    tokenizer = train_tokenizer(min(spec.vocab, 4096))
    return write_folder(Path(out_dir), spec, tokenizer, random_weights(spec, seed), recipe_name=TINY_RECIPE,
                        recipe={"seed": seed, "dtype": dtype, "shards": shards, **spec.recipe()},
                        dtype=dtype, shards=shards)
