"""Every decoder layer of a small dense model in one compiled call per step.

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
paged_attention.THREADED_WORK. It also needs every row paged (invariant mode, or a fast-mode step
without a prefill chunk that attend_fast takes whole) and a dense MLP.
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
    loop indexes; the runner's per-layer PackedWeights are views of these arrays, not copies. A
    missing bias or q/k norm is a zero-width array."""
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


def stack(layers: list[dict]) -> StackedLayers:
    """The layers (as ModelRunner fuses them: qkv, gate_up, [out, in]; None where absent) stacked."""
    def vectors(name):
        present = [w[name] for w in layers if w[name] is not None]
        return np.stack(present) if present else np.zeros((len(layers), 0), dtype=np.float32)

    def blocks(name):
        return np.stack([pack(w[name]).blocks for w in layers])

    first = layers[0]
    widths = np.array([len(first["qkv"]), len(first["o_proj"]), len(first["gate_up"])], dtype=np.int64)
    return StackedLayers(vectors("input_norm"), blocks("qkv"), vectors("qkv_bias"), vectors("q_norm"),
                         vectors("k_norm"), blocks("o_proj"), vectors("o_bias"), vectors("post_norm"),
                         blocks("gate_up"), vectors("gate_up_bias"), blocks("down"), vectors("down_bias"), widths)


def run_layers(x, s: StackedLayers, heads: tuple[int, int, int], eps, cos, sin, k_cache, v_cache, slots,
               tables, row_seq, row_keys, scale, flatten):
    """x [tokens, hidden] through every layer; returns the new x. heads: (num_heads, num_kv_heads,
    head_dim); the rest as ModelRunner.execute and paged_attention.attend take them."""
    return _layers(np.ascontiguousarray(x, dtype=np.float32), s.input_norm, s.qkv, s.qkv_bias, s.q_norm, s.k_norm,
                   s.o_proj, s.o_bias, s.post_norm, s.gate_up, s.gate_up_bias, s.down, s.down_bias, s.widths,
                   heads[0], heads[1], heads[2], np.float32(eps), cos, sin, k_cache, v_cache,
                   np.asarray(slots, dtype=np.int64), tables, row_seq, row_keys, np.float32(scale),
                   np.float32(flatten))


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


@jit
def _layers(x, input_norm, qkv, qkv_bias, q_norm, k_norm, o_proj, o_bias, post_norm, gate_up, gate_up_bias,
            down, down_bias, widths, num_heads, num_kv_heads, head_dim, eps, cos, sin, k_cache, v_cache, slots,
            tables, row_seq, row_keys, scale, flatten):
    tokens = x.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    for layer in range(qkv.shape[0]):
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
        attended = np.empty_like(q_roped)
        _attend(q_roped, k_cache[layer], v_cache[layer], tables, row_seq, row_keys, scale, flatten, attended)
        x = x + _project(attended.reshape(tokens, q_size), o_proj[layer], o_bias[layer], widths[1])
        both = _project(_normed(x, post_norm[layer], eps), gate_up[layer], gate_up_bias[layer], widths[2])
        product = np.empty((tokens, widths[2] // 2), dtype=np.float32)
        _silu_mul(both, product)
        x = x + _project(product, down[layer], down_bias[layer], widths[1])
    return x
