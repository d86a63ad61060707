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
from .config import load_config
from .safetensors_io import streamed_file
from .weights import INDEX_FILE, SINGLE_FILE, Checkpoint

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_vl": "Qwen3VLForConditionalGeneration"}
MODEL_TYPES = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama", "qwen3_moe": "qwen3_moe", "qwen3_vl": "qwen3_vl"}
# qwen3_vl: Qwen3-VL's placeholder tokens, and a small tower of fixed shape (its output width the text
# model's hidden size): two blocks, deepstack after both, a 4x4 learned position grid, 4-pixel patches
# merged 2x2, images resized to at most 32x32 pixels (16 tokens)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=4,
                   spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                   hidden_act="gelu_pytorch_tanh", deepstack_visual_indexes=[1, 0])
TINY_PREPROCESSOR = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 64, "max_pixels": 1024,
                     "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
TINY_RECIPE = "refengine_tiny.json"  # how make-tiny built a folder: its arguments
TRAINED_RECIPE = "refengine_trained.json"  # how model.train trained one: data, settings, versions
MOE_FIELDS = ("experts", "experts_per_tok", "moe_intermediate", "mlp_only_layers")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# ChatML whose message content may be a list of text and image parts, an image written as Qwen3-VL's
# template writes it
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% else %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
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


def train_tokenizer(vocab_size: int, special_tokens: list[str] = SPECIAL_TOKENS) -> Tokenizer:
    """Byte-level BPE trained on the corpus shipped with the package."""
    corpus = shipped("corpus.txt").read_text(encoding="utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False,
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
    if spec.arch == "qwen3_vl":  # Qwen3-VL's layout: the language model's fields under text_config
        text = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "rope_theta",
                                                             "tie_word_embeddings", "torch_dtype")}
        half = spec.head_dim // 2
        section = [half - 2 * (half // 4), half // 4, half // 4]  # t, h, w frequencies, interleaved
        text |= {"model_type": "qwen3_vl_text", "rope_parameters": {
            "rope_type": "default", "rope_theta": spec.rope_theta, "mrope_section": section, "mrope_interleaved": True}}
        config = {key: config[key] for key in ("architectures", "model_type", "tie_word_embeddings", "torch_dtype",
                                                "bos_token_id", "eos_token_id")}
        config |= {"text_config": text, "vision_config": {**TINY_VISION, "out_hidden_size": spec.hidden,
                                                          "model_type": "qwen3_vl"},
                   "image_token_id": special_ids["<|image_pad|>"], "video_token_id": special_ids["<|video_pad|>"],
                   "vision_start_token_id": special_ids["<|vision_start|>"],
                   "vision_end_token_id": special_ids["<|vision_end|>"]}
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
    text = "model.language_model." if spec.arch == "qwen3_vl" else "model."  # a VL checkpoint's language model
    head = f"{text}embed_tokens.weight" if spec.tie else "lm_head.weight"

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

    tensors = [normal(f"{text}embed_tokens.weight", (spec.vocab, h), 1.0), norm_weight(f"{text}norm.weight", h)]
    for n in range(spec.layers):
        p = f"{text}layers.{n}."
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
        if spec.arch in ("qwen3", "qwen3_moe", "qwen3_vl"):
            tensors += [norm_weight(p + "self_attn.q_norm.weight", d), norm_weight(p + "self_attn.k_norm.weight", d)]
        if spec.arch == "qwen2":
            tensors += [normal(p + "self_attn.q_proj.bias", (q,), 0.1), normal(p + "self_attn.k_proj.bias", (kv,), 0.1),
                        normal(p + "self_attn.v_proj.bias", (kv,), 0.1)]
    if not spec.tie:
        tensors.append(normal("lm_head.weight", (spec.vocab, h), 1.0))
    if spec.arch == "qwen3_vl":
        tensors += _tower(spec, normal)
    return tensors


def _tower(spec: TinySpec, normal) -> list[LazyTensor]:
    """TINY_VISION's tensors under model.visual. (model.vision's names and shapes): weights of fan-in
    scale, LayerNorm weights near 1, small biases, and the mergers' output at the embeddings' scale, so
    an image's tokens move the language model as much as text does."""
    v = dict(TINY_VISION)
    h, i, merged = v["hidden_size"], v["intermediate_size"], v["hidden_size"] * v["spatial_merge_size"] ** 2
    patch = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    p = "model.visual."
    tensors = [normal(p + "patch_embed.proj.weight", (h, v["in_channels"], v["temporal_patch_size"], v["patch_size"],
                                                      v["patch_size"]), 1.0 / np.sqrt(patch)),
               normal(p + "patch_embed.proj.bias", (h,), 0.1),
               normal(p + "pos_embed.weight", (v["num_position_embeddings"], h), 0.5)]

    def layer_norm(prefix, size):
        return [(prefix + "weight", (size,), lambda: np.ones(size, np.float32)), normal(prefix + "bias", (size,), 0.1)]

    for n in range(v["depth"]):
        b = f"{p}blocks.{n}."
        tensors += [*layer_norm(b + "norm1.", h),
                    normal(b + "attn.qkv.weight", (3 * h, h), 1.0 / np.sqrt(h)),
                    normal(b + "attn.qkv.bias", (3 * h,), 0.1),
                    normal(b + "attn.proj.weight", (h, h), 1.0 / np.sqrt(h)), normal(b + "attn.proj.bias", (h,), 0.1),
                    *layer_norm(b + "norm2.", h),
                    normal(b + "mlp.linear_fc1.weight", (i, h), 1.0 / np.sqrt(h)),
                    normal(b + "mlp.linear_fc1.bias", (i,), 0.1),
                    normal(b + "mlp.linear_fc2.weight", (h, i), 1.0 / np.sqrt(i)),
                    normal(b + "mlp.linear_fc2.bias", (h,), 0.1)]
    for prefix, norm_size in [("merger.", h)] + [(f"deepstack_merger_list.{n}.", merged)
                                                  for n in range(len(v["deepstack_visual_indexes"]))]:
        m = p + prefix
        tensors += [*layer_norm(m + "norm.", norm_size),
                    normal(m + "linear_fc1.weight", (merged, merged), 1.0 / np.sqrt(merged)),
                    normal(m + "linear_fc1.bias", (merged,), 0.1),
                    normal(m + "linear_fc2.weight", (spec.hidden, merged), 1.0 / np.sqrt(merged)),
                    normal(m + "linear_fc2.bias", (spec.hidden,), 0.1)]
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
    vision = spec.arch == "qwen3_vl"
    special_ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS + (VISION_TOKENS if vision else [])}
    config = hf_config(spec, special_ids)
    config["torch_dtype"] = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[dtype]
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": special_ids["<|endoftext|>"],
        "eos_token_id": [special_ids["<|im_end|>"], special_ids["<|endoftext|>"]],
        "do_sample": False,
    })
    _write_json(out / "tokenizer_config.json", {
        "chat_template": VL_CHAT_TEMPLATE if vision else CHAT_TEMPLATE, "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": spec.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    if vision:
        _write_json(out / "preprocessor_config.json", TINY_PREPROCESSOR)
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
    specials = SPECIAL_TOKENS + (VISION_TOKENS if spec.arch == "qwen3_vl" else [])
    tokenizer = train_tokenizer(min(spec.vocab, 4096), specials)
    return write_folder(Path(out_dir), spec, tokenizer, random_weights(spec, seed), recipe_name=TINY_RECIPE,
                        recipe={"seed": seed, "dtype": dtype, "shards": shards, **spec.recipe()},
                        dtype=dtype, shards=shards)


def first_layers(source: str | Path, out: str | Path, layers: int) -> Path:
    """`source`'s first `layers` decoder layers with its embedding, final norm, head and tokenizer: a
    draft model that needs no training (layer skipping cut at the end, as self-speculative decoding
    drafts), whose vocabulary is the target's by construction. Float32, one file."""
    source, out = Path(source), Path(out)
    cfg = load_config(source)
    if cfg.arch not in ("qwen3", "qwen2", "llama"):
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
