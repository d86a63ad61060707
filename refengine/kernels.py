"""Float32 building blocks of the batched forward, in two flavours.

`fast` uses BLAS gemm over all rows at once; a row's result then depends on how many rows share
the call and where it sits. `invariant` only uses operations whose result for a row depends on that
row alone: stacked single-row products (one gemv per row) and, in attention, one computation per
query token over exactly its own prefix of keys -- the same call, with the same shapes and strides,
that the token would get if its request ran alone. Row-wise norms, exp and elementwise ops are
invariant in both flavours.
"""
from __future__ import annotations

import numpy as np


def rms_norm(x, weight, eps):  # x [..., dim]
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * weight


def silu(x):
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for very negative x; x / inf = -0 is right
        return x / (np.float32(1) + np.exp(-x))


def rope_tables(max_positions, head_dim, theta):  # -> cos, sin [max_positions, head_dim] float32
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x, cos, sin):  # x [tokens, heads, head_dim]; cos, sin [tokens, head_dim]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def linear_fast(x, weight):  # x [rows, in], weight [out, in] -> [rows, out]
    return x @ weight.T


# Rows of weight per block in linear_invariant: about 512 KB, so a block stays in cache while every
# row of x is multiplied with it. It depends only on the weight's shape, never on the batch.
BLOCK_BYTES = 1 << 19


def linear_invariant(x, weight):
    """One gemv per row of x and per fixed block of weight rows: each output element comes from the
    same call on the same data whatever else is in the batch, and each block of the weight is read
    from memory once per step instead of once per row."""
    rows_per_block = max(16, BLOCK_BYTES // (4 * weight.shape[1]) // 16 * 16)
    out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
    column = x[:, :, None]
    for lo in range(0, weight.shape[0], rows_per_block):
        out[:, lo:lo + rows_per_block] = (weight[None, lo:lo + rows_per_block] @ column)[..., 0]
    return out


def _softmax_rows(scores):
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


def attend_fast(q, k, v, start, scale):
    """q [n, H, D] at positions start..start+n-1; k, v [start+n, KVH, D]. -> [n, H*D]

    All queries of the chunk in one batched product per kv head, future keys masked."""
    n, num_heads, head_dim = q.shape
    num_kv_heads, context = k.shape[1], k.shape[0]
    group = num_heads // num_kv_heads
    q_grouped = q.reshape(n, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)   # [KVH, G, n, D]
    scores = (q_grouped @ k.transpose(1, 2, 0)[:, None]) * np.float32(scale)     # [KVH, G, n, ctx]
    if n > 1:
        future = np.arange(context)[None, :] > start + np.arange(n)[:, None]      # [n, ctx]
        scores = np.where(future, np.float32(-np.inf), scores)
    out = _softmax_rows(scores) @ v.transpose(1, 0, 2)[:, None]                   # [KVH, G, n, D]
    return out.transpose(2, 0, 1, 3).reshape(n, num_heads * head_dim)


def attend_invariant(q, k, v, start, scale):
    """Like attend_fast, but each query token attends over exactly keys 0..its position, computed as
    the decode of that token alone would compute it: no masked or padded reductions."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    q_grouped = q.reshape(n, num_kv_heads, group, head_dim)                      # [n, KVH, G, D]
    out = np.empty((n, num_kv_heads, group, head_dim), dtype=np.float32)
    for t in range(n):
        keys = k[:start + t + 1].transpose(1, 2, 0)                              # [KVH, D, pos+1]
        values = v[:start + t + 1].transpose(1, 0, 2)                            # [KVH, pos+1, D]
        scores = (q_grouped[t] @ keys) * np.float32(scale)                       # [KVH, G, pos+1]
        out[t] = _softmax_rows(scores) @ values
    return out.reshape(n, num_heads * head_dim)
