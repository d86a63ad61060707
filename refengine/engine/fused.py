"""A small dense model's whole step forward in one compiled call: embedding, every decoder layer,
the final norm and the head.

On the suite's tiny models each of the calls a layer makes from Python (norms, products, rotary,
cache write, attention, SwiGLU, residual adds) costs more than its arithmetic: a step was mostly
call overhead, and the suite runs thousands of steps. Here one compiled function walks the layers
and calls the same compiled kernels the layer-by-layer path calls (packed._product,
kernels._rms_norm_rows / _rope / _silu_mul, paged_attention._write / _attend), in the same order, on
the same float32 values, with the same float32 bias and residual adds. So each row gets the bits
the layer-by-layer path gives it (tests/test_fused.py holds the two equal on every dense tiny
model, in both modes), and whatever made a kernel batch-invariant there makes it so here.

Only the serial kernels are called: a cached compiled caller of a parallel kernel is loaded broken
(jit.py). That is why this path is taken only where the layer-by-layer path would run on the
calling thread too: every weight below packed.THREADED_BYTES and the step's attention below
paged_attention.THREADED_WORK (a head above it is left to the caller). It also needs every row
paged (invariant mode, or a fast-mode step without a prefill chunk that attend_fast takes whole)
and a dense MLP. Where a stacked model's step is not taken whole, its layers still run in two
compiled calls each, before and after an attention the runner computes (before_attention,
after_attention: the halves _layers itself is made of).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model.weights import LayerWeights
from .jit import jit
from .kernels import _rms_norm_rows, _rope, _silu_mul
from .packed import BLOCK, THREADED_BYTES, _product, pack
from .paged_attention import _attend, _write


@dataclass(frozen=True)
class StackedLayers:
    """Every layer's weights stacked on a leading layer axis ([layers, ...]), which the compiled
    loop indexes, and the model's embedding, final norm and head; the runner's PackedWeights are
    views of these arrays, not copies. A missing bias or q/k norm is a zero-width array."""
    input_norm: np.ndarray     # [layers, hidden]
    qkv: np.ndarray            # [layers, blocks, hidden, BLOCK]
    qkv_bias: np.ndarray       # [layers, q_size + 2 * kv_size] or [layers, 0]
    q_norm: np.ndarray         # [layers, head_dim] or [layers, 0]
    k_norm: np.ndarray         # [layers, head_dim] or [layers, 0]
    o_proj: np.ndarray         # [layers, blocks, q_size, BLOCK]
    o_bias: np.ndarray         # [layers, hidden] or [layers, 0]
    post_norm: np.ndarray      # [layers, hidden]
    gate_up: np.ndarray        # [layers, blocks, hidden, BLOCK]
    gate_up_bias: np.ndarray   # [layers, 2 * intermediate] or [layers, 0]
    down: np.ndarray           # [layers, blocks, intermediate, BLOCK]
    down_bias: np.ndarray      # [layers, hidden] or [layers, 0]
    widths: np.ndarray         # int64 [q_size + 2 * kv_size, hidden, 2 * intermediate]: unpadded outputs
    # What the step does before and after the layers, so that all of it is one call:
    embed: np.ndarray          # [n, hidden, embed_block]: token t is embed[t // embed_block, :, t % embed_block]
    embed_block: int           # a tied head's packed blocks (BLOCK), or an untied embedding as [vocab, hidden, 1]
    norm: np.ndarray           # [hidden], the final norm
    head: np.ndarray           # the packed head's blocks; zero blocks where the head is threaded (the caller's)


OPTIONAL = ("q_bias", "o_bias", "gate_bias", "down_bias", "q_norm")  # present in every layer or in none


def stackable(layers: list[LayerWeights]) -> bool:
    """Whether the layers are dense, alike (each optional tensor in all of them or in none) and every
    product is small enough to run on the calling thread (module docstring)."""
    def packed_bytes(*parts):  # the PackedWeight of these [out, in] weights concatenated
        return -(-sum(p.shape[0] for p in parts) // BLOCK) * BLOCK * parts[0].shape[1] * 4

    alike = len({tuple(getattr(w, name) is None for name in OPTIONAL) for w in layers}) == 1
    return alike and all(w.router is None and max(
        packed_bytes(w.q_proj, w.k_proj, w.v_proj), packed_bytes(w.o_proj), packed_bytes(w.gate_proj, w.up_proj),
        packed_bytes(w.down_proj)) <= THREADED_BYTES for w in layers)


def stack(layers: list[dict], embed: np.ndarray, embed_block: int, norm: np.ndarray,
          head: np.ndarray) -> StackedLayers:
    """The layers (as ModelRunner fuses them: qkv, gate_up, [out, in]; None where absent) stacked, with
    the embedding, norm and packed head as StackedLayers holds them (a threaded head: pass its blocks,
    a zero-block array is kept instead)."""
    def vectors(name):
        present = [w[name] for w in layers if w[name] is not None]
        return np.stack(present) if present else np.zeros((len(layers), 0), dtype=np.float32)

    def blocks(name):
        return np.stack([pack(w[name]).blocks for w in layers])

    first = layers[0]
    widths = np.array([len(first["qkv"]), len(first["o_proj"]), len(first["gate_up"])], dtype=np.int64)
    return StackedLayers(vectors("input_norm"), blocks("qkv"), vectors("qkv_bias"), vectors("q_norm"),
                         vectors("k_norm"), blocks("o_proj"), vectors("o_bias"), vectors("post_norm"),
                         blocks("gate_up"), vectors("gate_up_bias"), blocks("down"), vectors("down_bias"), widths,
                         embed, embed_block, norm, head if head.nbytes <= THREADED_BYTES else head[:0])


def forward(ids, s: StackedLayers, heads: tuple[int, int, int], eps, positions, cos, sin, k_cache, v_cache,
            slots, tables, row_seq, row_keys, sampling_rows, scale, flatten) -> np.ndarray:
    """The step's forward from token ids: the embedding, every layer, the final norm of the sampling
    rows and their head product. Returns logits [sampling rows, s.head blocks * BLOCK] (padded), or
    where the head is threaded (s.head has no blocks) the normed rows [sampling rows, hidden] for the
    caller to multiply. heads: (num_heads, num_kv_heads, head_dim); cos, sin: the whole rotary tables;
    the rest as ModelRunner.execute and paged_attention.attend take them."""
    return _forward(ids, s.embed, s.embed_block, positions, cos, sin, s.input_norm, s.qkv, s.qkv_bias, s.q_norm,
                    s.k_norm, s.o_proj, s.o_bias, s.post_norm, s.gate_up, s.gate_up_bias, s.down, s.down_bias,
                    s.widths, heads[0], heads[1], heads[2], np.float32(eps), k_cache, v_cache, slots, tables,
                    row_seq, row_keys, sampling_rows, s.norm, s.head, np.float32(scale), np.float32(flatten))


@jit
def _forward(ids, embed, embed_block, positions, cos_table, sin_table, input_norm, qkv, qkv_bias, q_norm, k_norm,
             o_proj, o_bias, post_norm, gate_up, gate_up_bias, down, down_bias, widths, num_heads, num_kv_heads,
             head_dim, eps, k_cache, v_cache, slots, tables, row_seq, row_keys, sampling_rows, norm, head, scale,
             flatten):
    tokens, hidden = ids.shape[0], embed.shape[1]
    x = np.empty((tokens, hidden), dtype=np.float32)
    cos = np.empty((tokens, cos_table.shape[1]), dtype=np.float32)
    sin = np.empty_like(cos)
    for t in range(tokens):
        x[t] = embed[ids[t] // embed_block, :, ids[t] % embed_block]
        cos[t] = cos_table[positions[t]]
        sin[t] = sin_table[positions[t]]
    x = _layers(x, input_norm, qkv, qkv_bias, q_norm, k_norm, o_proj, o_bias, post_norm, gate_up, gate_up_bias,
                down, down_bias, widths, num_heads, num_kv_heads, head_dim, eps, cos, sin, k_cache, v_cache, slots,
                tables, row_seq, row_keys, scale, flatten)
    picked = np.empty((sampling_rows.shape[0], hidden), dtype=np.float32)
    for r in range(sampling_rows.shape[0]):
        picked[r] = x[sampling_rows[r]]
    final = _normed(picked, norm, eps)
    if head.shape[0] == 0 or final.shape[0] == 0:
        return final
    logits = np.empty((final.shape[0], head.shape[0] * BLOCK), dtype=np.float32)
    _product(final, head, logits)
    return logits


@jit
def _project(x, blocks, bias, width):
    """packed.matmul(x, weight) [+ bias] as ModelRunner._project computes it: [rows, width], C order."""
    padded = np.empty((x.shape[0], blocks.shape[0] * BLOCK), dtype=np.float32)
    _product(x, blocks, padded)
    out = np.ascontiguousarray(padded[:, :width])
    if bias.shape[0]:
        for r in range(out.shape[0]):
            for o in range(width):
                out[r, o] = out[r, o] + bias[o]
    return out


@jit
def _normed(x, weight, eps):
    out = np.empty_like(x)
    _rms_norm_rows(x, weight, eps, out)
    return out


def before_attention(x, s: StackedLayers, layer: int, heads: tuple[int, int, int], eps, cos, sin, k_cache,
                     v_cache, slots) -> np.ndarray:
    """Layer `layer` of x [tokens, hidden] (float32, C order) up to its attention: the normed qkv
    product, q/k norms, rotary, the cache write. Returns the queries [tokens, heads, head_dim]. With
    after_attention, the layer-by-layer path of a stacked model where its attention is not this
    module's (a prefill chunk attend_fast takes whole, or a threaded step): the same compiled halves
    as in _layers."""
    return _before_attention(x, layer, s.input_norm, s.qkv, s.qkv_bias, s.q_norm, s.k_norm, s.widths, heads[0],
                             heads[1], heads[2], np.float32(eps), cos, sin, k_cache, v_cache, slots)


def after_attention(x, attended, s: StackedLayers, layer: int, eps) -> np.ndarray:
    """Layer `layer` from its attention [tokens, heads * head_dim] on: the output product, the residual,
    the MLP and its residual. Returns the layer's output [tokens, hidden]."""
    return _after_attention(x, np.ascontiguousarray(attended, dtype=np.float32), layer, s.o_proj, s.o_bias,
                            s.post_norm, s.gate_up, s.gate_up_bias, s.down, s.down_bias, s.widths, np.float32(eps))


@jit
def _before_attention(x, layer, input_norm, qkv, qkv_bias, q_norm, k_norm, widths, num_heads, num_kv_heads,
                      head_dim, eps, cos, sin, k_cache, v_cache, slots):
    tokens = x.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    mixed = _project(_normed(x, input_norm[layer], eps), qkv[layer], qkv_bias[layer], widths[0])
    q = np.ascontiguousarray(mixed[:, :q_size]).reshape(tokens, num_heads, head_dim)
    k = np.ascontiguousarray(mixed[:, q_size:q_size + kv_size]).reshape(tokens, num_kv_heads, head_dim)
    v = np.ascontiguousarray(mixed[:, q_size + kv_size:]).reshape(tokens, num_kv_heads, head_dim)
    if q_norm.shape[1]:
        q = _normed(q.reshape(tokens * num_heads, head_dim), q_norm[layer], eps).reshape(q.shape)
        k = _normed(k.reshape(tokens * num_kv_heads, head_dim), k_norm[layer], eps).reshape(k.shape)
    q_roped, k_roped = np.empty_like(q), np.empty_like(k)
    _rope(q, cos, sin, q_roped)
    _rope(k, cos, sin, k_roped)
    _write(k_cache[layer], v_cache[layer], slots, k_roped, v)
    return q_roped


@jit
def _after_attention(x, attended, layer, o_proj, o_bias, post_norm, gate_up, gate_up_bias, down, down_bias, widths,
                     eps):
    x = x + _project(attended, o_proj[layer], o_bias[layer], widths[1])
    both = _project(_normed(x, post_norm[layer], eps), gate_up[layer], gate_up_bias[layer], widths[2])
    product = np.empty((x.shape[0], widths[2] // 2), dtype=np.float32)
    _silu_mul(both, product)
    return x + _project(product, down[layer], down_bias[layer], widths[1])


@jit
def _layers(x, input_norm, qkv, qkv_bias, q_norm, k_norm, o_proj, o_bias, post_norm, gate_up, gate_up_bias,
            down, down_bias, widths, num_heads, num_kv_heads, head_dim, eps, cos, sin, k_cache, v_cache, slots,
            tables, row_seq, row_keys, scale, flatten):
    tokens = x.shape[0]
    for layer in range(qkv.shape[0]):
        q = _before_attention(x, layer, input_norm, qkv, qkv_bias, q_norm, k_norm, widths, num_heads, num_kv_heads,
                              head_dim, eps, cos, sin, k_cache, v_cache, slots)
        attended = np.empty_like(q)
        _attend(q, k_cache[layer], v_cache[layer], tables, row_seq, row_keys, scale, flatten, attended)
        x = _after_attention(x, attended.reshape(tokens, num_heads * head_dim), layer, o_proj, o_bias, post_norm,
                             gate_up, gate_up_bias, down, down_bias, widths, eps)
    return x
