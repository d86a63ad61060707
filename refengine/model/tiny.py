"""Generate complete HF-format model folders with random weights, for tests and benchmarks.

Same arguments => byte-identical files. The weight scales are chosen so greedy decoding sees
realistic top-2 logit margins: mostly clear decisions (median around 1) with a tail of near-ties,
so tests meet both (docs/concepts/tiny-models.md shows the distribution `refengine margins` prints).
"""
from __future__ import annotations

import json
import math
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..data import shipped
from ..errors import RefengineError
from .safetensors_io import streamed_file
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
    # the seeds' largest dense model's shape (Qwen3-8B: an untied head), for the cost of a golden refresh
    "qwen3-8b-shape": TinySpec(arch="qwen3", layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                               intermediate=12288, vocab=151936, tie=False, max_position_embeddings=40960,
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


# A tensor of a model being written: its name, its shape and how to make it. Made one at a time, in
# list order, a model larger than memory is written holding one tensor (safetensors_io.streamed_file).
LazyTensor = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]
ROWS_PER_DRAW = 4096  # a large tensor is drawn this many rows at a time (the same stream: the same values)


def in_memory(tensors: dict[str, np.ndarray]) -> list[LazyTensor]:
    return [(name, tuple(np.shape(t)), lambda t=t: t) for name, t in tensors.items()]


def random_weights(spec: TinySpec, seed: int) -> list[LazyTensor]:
    """Random tensors in HF names; scales keep the residual stream mixing across layers. They draw from one
    generator in list order, which every preset's bytes depend on: make them in that order."""
    rng = np.random.default_rng(seed)
    h, i, d = spec.hidden, spec.intermediate, spec.head_dim
    q, kv = spec.heads * d, spec.kv_heads * d
    head = "model.embed_tokens.weight" if spec.tie else "lm_head.weight"

    def normal(name, shape, std):
        def make():
            out = np.empty(shape, np.float32)
            rows = out.reshape(-1, shape[-1])
            for start in range(0, len(rows), ROWS_PER_DRAW):
                block = rows[start:start + ROWS_PER_DRAW]
                block[...] = (rng.standard_normal(block.shape) * std).astype(np.float32)
            if name == head:
                out *= np.float32(LOGIT_SCALE / np.sqrt(h))
            return out
        return name, tuple(shape), make

    def norm_weight(name, size):
        return name, (size,), lambda: (1.0 + rng.standard_normal(size) * 0.1).astype(np.float32)

    def swiglu(prefix, width):
        return [normal(prefix + "gate_proj.weight", (width, h), 1.0 / np.sqrt(h)),
                normal(prefix + "up_proj.weight", (width, h), 1.0 / np.sqrt(h)),
                normal(prefix + "down_proj.weight", (h, width), RESIDUAL_SCALE / np.sqrt(width))]

    tensors = [normal("model.embed_tokens.weight", (spec.vocab, h), 1.0), norm_weight("model.norm.weight", h)]
    for n in range(spec.layers):
        p = f"model.layers.{n}."
        tensors += [
            norm_weight(p + "input_layernorm.weight", h),
            norm_weight(p + "post_attention_layernorm.weight", h),
            normal(p + "self_attn.q_proj.weight", (q, h), 1.5 / np.sqrt(h)),
            normal(p + "self_attn.k_proj.weight", (kv, h), 1.5 / np.sqrt(h)),
            normal(p + "self_attn.v_proj.weight", (kv, h), 1.0 / np.sqrt(h)),
            normal(p + "self_attn.o_proj.weight", (h, q), RESIDUAL_SCALE / np.sqrt(q)),
        ]
        if spec.arch == "qwen3_moe" and n not in spec.mlp_only_layers:
            # router logits of spread ~2, so tokens split between experts with clear preferences
            tensors.append(normal(p + "mlp.gate.weight", (spec.experts, h), 2.0 / np.sqrt(h)))
            for e in range(spec.experts):
                tensors += swiglu(f"{p}mlp.experts.{e}.", spec.moe_intermediate)
        else:
            tensors += swiglu(p + "mlp.", i)
        if spec.arch in ("qwen3", "qwen3_moe"):
            tensors += [norm_weight(p + "self_attn.q_norm.weight", d), norm_weight(p + "self_attn.k_norm.weight", d)]
        if spec.arch == "qwen2":
            tensors += [normal(p + "self_attn.q_proj.bias", (q,), 0.1), normal(p + "self_attn.k_proj.bias", (kv,), 0.1),
                        normal(p + "self_attn.v_proj.bias", (kv,), 0.1)]
    if not spec.tie:
        tensors.append(normal("lm_head.weight", (spec.vocab, h), 1.0))
    return tensors


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_weights(out: Path, tensors: list[LazyTensor], dtype: str, shards: int) -> None:
    """The tensors in one file, or in `shards` files (the sorted names dealt round) with an index; each
    tensor made when its turn comes and written at once."""
    shapes = {name: shape for name, shape, _ in tensors}
    names = sorted(shapes)
    files = [SINGLE_FILE] if shards <= 1 else \
        [f"model-{k:05d}-of-{shards:05d}.safetensors" for k in range(1, shards + 1)]
    weight_map = {name: files[n % len(files)] for n, name in enumerate(names)}
    with ExitStack() as stack:
        puts = {file: stack.enter_context(streamed_file(out / file, {n: shapes[n] for n in names
                                                                     if weight_map[n] == file}, dtype))
                for file in files}
        for name, _, make in tensors:
            puts[weight_map[name]](name, make())
    if shards > 1:
        itemsize = 2 if dtype in ("BF16", "F16") else 4
        total = sum(math.prod(shape) for shape in shapes.values()) * itemsize
        _write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def render_chatml(role: str, content: str) -> tuple[str, str]:
    """One message as CHAT_TEMPLATE renders it: (the head a reply follows, the body the reply is)."""
    return f"<|im_start|>{role}\n", f"{content}<|im_end|>\n"


def write_folder(out: Path, spec: TinySpec, tokenizer: Tokenizer, tensors: list[LazyTensor], *,
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


def first_layers(source: str | Path, out: str | Path, layers: int) -> Path:
    """`source`'s first `layers` decoder layers with its embedding, final norm, head and tokenizer: a
    draft model that needs no training (layer skipping cut at the end, as self-speculative decoding
    drafts), whose vocabulary is the target's by construction. Float32, one file."""
    from .config import load_config  # the folder's validated config, only where a folder is cut
    from .weights import Checkpoint

    source, out = Path(source), Path(out)
    cfg = load_config(source)
    if cfg.arch not in ARCHITECTURES or cfg.sparse_layers:
        raise RefengineError(f"{source}: only a dense text model can be cut to its first layers (arch {cfg.arch})")
    if not 1 <= layers <= cfg.num_layers:
        raise RefengineError(f"layers: {layers} is not in 1..{cfg.num_layers}, the layers of {source}")
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name not in (INDEX_FILE, "config.json"):
            (out / path.name).write_bytes(path.read_bytes())
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    config["num_hidden_layers"] = layers
    if isinstance(config.get("layer_types"), list):  # newer transformers list a type per layer
        config["layer_types"] = config["layer_types"][:layers]
    config["torch_dtype"] = "float32"
    _write_json(out / "config.json", config)
    checkpoint = Checkpoint(source, cfg)
    kept = [name for name in sorted(checkpoint.sources)
            if not name.startswith(f"{cfg.weight_prefix}layers.")
            or int(name[len(f"{cfg.weight_prefix}layers."):].split(".")[0]) < layers]
    write_weights(out, [(name, checkpoint.sources[name].tensors[name][1],
                         lambda name=name: checkpoint.tensor(name, np.float32)) for name in kept], "F32", 1)
    return out
