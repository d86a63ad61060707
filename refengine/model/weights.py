"""Load a checkpoint's tensors (single file or sharded), validate them against the config
(a sparse layer's experts: model/experts.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import RefengineError
from .config import ModelConfig
from .experts import expert_shapes, read_experts, transposed_shapes
from .safetensors_io import SafetensorsFile

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
HEAD_BLOCK_ROWS = 16384  # output-head rows widened at a time by StreamedWeights (128 MB of float64 at hidden 1024)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer; projections keep HF's [out_features, in_features] layout."""
    input_norm: np.ndarray       # [hidden]
    q_proj: np.ndarray           # [n_heads * head_dim, hidden]
    k_proj: np.ndarray           # [n_kv_heads * head_dim, hidden]
    v_proj: np.ndarray           # [n_kv_heads * head_dim, hidden]
    o_proj: np.ndarray           # [hidden, n_heads * head_dim]
    post_norm: np.ndarray        # [hidden]
    gate_proj: np.ndarray | None = None  # [intermediate, hidden]; None in a mixture-of-experts layer
    up_proj: np.ndarray | None = None    # [intermediate, hidden]
    down_proj: np.ndarray | None = None  # [hidden, intermediate]
    router: np.ndarray | None = None       # [experts, hidden]: mixture-of-experts layers only
    expert_gate: np.ndarray | None = None  # [experts, moe_intermediate, hidden]
    expert_up: np.ndarray | None = None    # [experts, moe_intermediate, hidden]
    expert_down: np.ndarray | None = None  # [experts, hidden, moe_intermediate]
    q_bias: np.ndarray | None = None
    k_bias: np.ndarray | None = None
    v_bias: np.ndarray | None = None
    o_bias: np.ndarray | None = None
    q_norm: np.ndarray | None = None  # [head_dim]
    k_norm: np.ndarray | None = None  # [head_dim]
    gate_bias: np.ndarray | None = None
    up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None


@dataclass(frozen=True)
class Weights:
    embed: np.ndarray    # [vocab, hidden]
    layers: list[LayerWeights]
    norm: np.ndarray     # [hidden]
    lm_head: np.ndarray  # [vocab, hidden]; the embedding itself when tied


_LAYER_FIELDS = {  # LayerWeights field -> HF tensor name suffix
    "input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias", "o_bias": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight",
    "gate_bias": "mlp.gate_proj.bias", "up_bias": "mlp.up_proj.bias", "down_bias": "mlp.down_proj.bias",
    "router": "mlp.gate.weight",
}
_DENSE_MLP = ("gate_proj", "up_proj", "down_proj", "gate_bias", "up_bias", "down_bias")


def _layer_shapes(cfg: ModelConfig, n: int) -> dict[str, tuple[int, ...]]:
    """LayerWeights field -> shape of the tensors layer n has besides its experts."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.q_size, cfg.kv_size
    layer = {
        "input_norm": (h,), "post_norm": (h,),
        "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
        "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
    }
    if cfg.qkv_bias:
        layer.update(q_bias=(q,), k_bias=(kv,), v_bias=(kv,))
    if cfg.o_bias:
        layer["o_bias"] = (h,)
    if cfg.qk_norm:
        layer.update(q_norm=(d,), k_norm=(d,))
    if cfg.mlp_bias:
        layer.update(gate_bias=(i,), up_bias=(i,), down_bias=(h,))
    if n in cfg.sparse_layers:
        layer = {field: shape for field, shape in layer.items() if field not in _DENSE_MLP}
        layer["router"] = (cfg.num_experts, h)
    return layer


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the config implies, with its shape."""
    h, p = cfg.hidden_size, cfg.weight_prefix
    shapes = {f"{p}embed_tokens.weight": (cfg.vocab_size, h), f"{p}norm.weight": (h,)}
    for n in range(cfg.num_layers):
        for field, shape in _layer_shapes(cfg, n).items():
            shapes[f"{p}layers.{n}.{_LAYER_FIELDS[field]}"] = shape
        if n in cfg.sparse_layers:
            shapes |= expert_shapes(cfg, n)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise RefengineError(f"{index}: not a valid safetensors index ({e!r})") from None
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / SINGLE_FILE
    if single.exists():
        return [single]
    raise RefengineError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")


class Checkpoint:
    """The opened, validated tensors of a model folder; converts to a float dtype on demand."""

    def __init__(self, model_dir: Path, cfg: ModelConfig):
        self.cfg = cfg
        self.files = weight_files(model_dir)
        self.sources: dict[str, SafetensorsFile] = {}
        for path in self.files:
            opened = SafetensorsFile(path)
            for name in opened.tensors:
                self.sources[name] = opened
        self._validate()

    def _validate(self) -> None:
        expected = expected_shapes(self.cfg)
        found = {name: f.tensors[name][1] for name, f in self.sources.items()}
        problems = [f"missing tensor {n} {list(s)}" for n, s in expected.items() if n not in found]
        ignored = self.cfg.ignored_prefix  # a VL checkpoint's vision tower: present, never read
        problems += [f"unexpected tensor {n} {list(found[n])}" for n in found if n not in expected
                     and not n.endswith("rotary_emb.inv_freq") and not (ignored and n.startswith(ignored))]
        also = {name: shape for n in self.cfg.sparse_layers for name, shape in transposed_shapes(self.cfg, n).items()}
        problems += [f"tensor {n} has shape {list(found[n])}, expected {list(s)}"
                     + (f" or {list(also[n])}" if also.get(n, s) != s else "")
                     for n, s in expected.items() if n in found and tuple(found[n]) not in (s, also.get(n))]
        if problems:
            where = self.files[0].parent
            raise RefengineError(f"{where}: weights do not match config.json: " + "; ".join(problems))

    @property
    def stored_dtypes(self) -> list[str]:
        return sorted({f.tensors[n][0] for n, f in self.sources.items()})

    def tensor(self, name: str, dtype, rows: slice | None = None, out: np.ndarray | None = None) -> np.ndarray:
        return self.sources[name].get_float(name, dtype, rows, out)

    def _reused(self, reuse: dict, key: str, name: str, dtype, rows: slice | None = None) -> np.ndarray:
        """The array `reuse` holds under `key` if it fits tensor `name` (or its `rows`), else a new one
        kept there: a streamed pass reads each layer into the previous one's memory, since new memory
        is paid for again in page faults on every pass."""
        shape = self.sources[name].rows_shape(name, rows)[1]
        held = reuse.get(key)
        if held is None or held.shape != shape or held.dtype != dtype:
            held = reuse[key] = np.empty(shape, dtype)
        return held

    def layer(self, n: int, dtype, reuse: dict | None = None) -> LayerWeights:
        """Layer n in `dtype`; with `reuse` (what the previous call was given), its dense tensors are
        read into the previous layer's arrays, whose values are then gone."""
        cfg = self.cfg
        names = {field: f"{cfg.weight_prefix}layers.{n}.{_LAYER_FIELDS[field]}" for field in _layer_shapes(cfg, n)}
        fields = {field: self.tensor(name, dtype, out=None if reuse is None else
                                     self._reused(reuse, field, name, dtype))
                  for field, name in names.items()}
        if n in cfg.sparse_layers:
            fields |= read_experts(self, n, dtype)
        return LayerWeights(**fields)

    @property
    def embed_name(self) -> str:
        return f"{self.cfg.weight_prefix}embed_tokens.weight"

    @property
    def norm_name(self) -> str:
        return f"{self.cfg.weight_prefix}norm.weight"

    @property
    def head_name(self) -> str:
        return self.embed_name if self.cfg.tie_word_embeddings else "lm_head.weight"

    def to_weights(self, dtype) -> Weights:
        # Each tensor is read on its own and its file mapping released at once, so the peak is the
        # converted weights plus one tensor in flight: read the largest (the embedding) first.
        embed = self.tensor(self.embed_name, dtype)
        lm_head = embed if self.cfg.tie_word_embeddings else self.tensor(self.head_name, dtype)
        layers = [self.layer(n, dtype) for n in range(self.cfg.num_layers)]
        norm = self.tensor(self.norm_name, dtype)
        return Weights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)


class _Rows:
    """A [rows, hidden] checkpoint tensor that is read, widened, and dropped on access: indexing with
    token ids reads just those rows; iterating yields it in blocks of HEAD_BLOCK_ROWS rows."""

    def __init__(self, checkpoint: Checkpoint, name: str, dtype):
        self.checkpoint, self.name, self.dtype = checkpoint, name, dtype
        self.rows = checkpoint.sources[name].tensors[name][1][0]

    def __getitem__(self, ids) -> np.ndarray:  # ids [seq] -> [seq, hidden]
        return np.stack([self.checkpoint.tensor(self.name, self.dtype, slice(i, i + 1))[0] for i in np.asarray(ids)])

    def __iter__(self):  # each block is read into the previous one's memory: use it before taking the next
        reuse = {}
        for start in range(0, self.rows, HEAD_BLOCK_ROWS):
            rows = slice(start, min(start + HEAD_BLOCK_ROWS, self.rows))
            yield self.checkpoint.tensor(self.name, self.dtype, rows,
                                         self.checkpoint._reused(reuse, "block", self.name, self.dtype, rows))


def row_blocks(head: np.ndarray | _Rows):
    """The output head [vocab, hidden] in blocks of HEAD_BLOCK_ROWS rows, in or out of memory alike:
    the reference multiplies block by block either way, so both give the same bits (a BLAS product
    split differently differs in the last bits)."""
    if not isinstance(head, np.ndarray):
        return iter(head)
    return (head[start:start + HEAD_BLOCK_ROWS] for start in range(0, head.shape[0], HEAD_BLOCK_ROWS))


class _Layers:
    def __init__(self, checkpoint: Checkpoint, dtype):
        self.checkpoint, self.dtype = checkpoint, dtype

    def __len__(self) -> int:
        return self.checkpoint.cfg.num_layers

    def __iter__(self):  # each layer is read into the previous one's memory: use it before taking the next
        reuse = {}
        return (self.checkpoint.layer(n, self.dtype, reuse) for n in range(len(self)))


@dataclass(frozen=True)
class StreamedWeights:
    """The checkpoint's tensors, widened to the dtype when a forward reaches them and dropped after:
    a forward holds one layer (or one block of the output head) at a time, not the model, which is
    how the float64 reference of a model bigger in float64 than the machine's memory runs. Every
    value is the one Weights holds (a widening is exact either way); tests/test_streamed_reference.py
    checks a streamed reference gives the in-memory one's results bit for bit."""
    embed: _Rows
    layers: _Layers
    norm: np.ndarray
    lm_head: _Rows

    @classmethod
    def of(cls, checkpoint: Checkpoint, dtype) -> StreamedWeights:
        norm = checkpoint.tensor(checkpoint.norm_name, dtype)
        return cls(_Rows(checkpoint, checkpoint.embed_name, dtype), _Layers(checkpoint, dtype), norm,
                   _Rows(checkpoint, checkpoint.head_name, dtype))
