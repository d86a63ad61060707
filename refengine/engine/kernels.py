"""Float32 building blocks of the batched forward, in two flavours.

`fast` uses BLAS gemm over all rows at once; a row's result then depends on how many rows share
the call and where it sits. `invariant` only uses operations whose result for a row depends on that
row alone: gemms of one fixed shape (a 16-row tile of x against a fixed block of weight rows) and,
in attention, one computation per query token over exactly its own prefix of keys -- the same call,
with the same shapes and strides, that the token would get if its request ran alone. Row-wise
norms, exp and elementwise ops are invariant in both flavours.
"""
from __future__ import annotations

import numpy as np

from .faults import Fault


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


def fast_layout(weight):  # [out, in] -> the same [out, in], stored column-major
    """A batching engine's weights for linear_fast: OpenBLAS multiplies by a row-major [in, out]
    5-15% faster for 8-32 rows (the lm_head up to 30%) than by the transpose of a row-major [out, in],
    but a single row (matrix-vector) 7% slower, so a serial engine keeps the checkpoint's layout."""
    return np.ascontiguousarray(weight.T).T


def linear_fast(x, weight):  # x [rows, in], weight [out, in] in either memory order -> [rows, out]
    return x @ weight.T


# linear_invariant multiplies x in tiles of 16 rows: 16 is the row count of OpenBLAS's float32 gemm
# microkernel on x86-64 (16x4 on Haswell and Zen), so the rows of a tile are the lanes of the same
# vector registers, each accumulating its own products in the same order whatever the other lanes
# hold. Padding rows only fill lanes. (numerics.tile_assumption_holds checks this once per process before an
# invariant engine starts, refusing invariant mode where it fails; tests/test_kernels.py runs the same check.)
TILE_ROWS = 16
# Weight rows per block: about 4 MB, so a block stays in cache while every tile of the step passes
# over it (weight-stationary). Depends only on the weight's shape, never on the batch.
BLOCK_BYTES = 4 << 20
# A weight that fits in L2 is cut finer, into blocks OpenBLAS multiplies on one thread (it threads a
# gemm only above m*n*k = 65536 * GEMM_MULTITHREAD_THRESHOLD): a second thread cannot pay for its
# wake-up there, and when every core is busy (a test run on all cores) the wake-up costs a whole
# scheduler slice, milliseconds per call.
SMALL_WEIGHT_BYTES = 1 << 20
SINGLE_THREAD_MNK = 65536 * 4


def _block_rows(weight) -> int:
    budget = SINGLE_THREAD_MNK // TILE_ROWS if weight.nbytes <= SMALL_WEIGHT_BYTES else BLOCK_BYTES // 4
    return max(64, budget // weight.shape[1] // 64 * 64)


def linear_invariant(x, weight):
    """x @ weight.T as fixed-shape products: [block of weight rows] @ [16 rows of x]^T, one gemm per
    tile and block. Every output element comes from a call of the same shape on the same data
    whatever else is in the batch, and each weight block is read from memory once per step."""
    rows, size = x.shape
    tiles = -(-rows // TILE_ROWS)
    padded = np.zeros((tiles * TILE_ROWS, size), dtype=np.float32)
    padded[:rows] = x
    columns = padded.reshape(tiles, TILE_ROWS, size).transpose(0, 2, 1)            # [tiles, in, 16]
    out = np.empty((tiles, weight.shape[0], TILE_ROWS), dtype=np.float32)
    block = _block_rows(weight)
    for lo in range(0, weight.shape[0], block):
        np.matmul(weight[None, lo:lo + block], columns, out=out[:, lo:lo + block])
    # C order whatever the row count: a single tile would otherwise come back column-major, and a
    # reduction over the last axis (the q/k norms) then sums in another order than for one row alone.
    return np.ascontiguousarray(out.transpose(0, 2, 1).reshape(tiles * TILE_ROWS, weight.shape[0])[:rows])


def softmax_rows(scores):  # in place: a decode step calls this per sequence and layer, allocation shows
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def _softmax_rows_exp2_without_log2e(scores):
    """Fault.ATTENTION_BOUND_INFLATING: the exp2 form of the softmax (exp(s) = exp2(s * log2 e), as fused
    attention kernels write it) with the log2(e) factor dropped: exp2(s) = exp(s * ln 2), so every score
    counts ln 2 = 0.69 times what it should -- attention too flat, the same in every batch."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp2(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def attend_fast(q, k, v, start, scale, softmax=softmax_rows):
    """q [n, H, D] at positions start..start+n-1; k, v [start+n, KVH, D]. -> [n, H*D]

    All queries of the chunk in one batched product per kv head, future keys masked."""
    n, num_heads, head_dim = q.shape
    num_kv_heads, context = k.shape[1], k.shape[0]
    group = num_heads // num_kv_heads
    q_grouped = q.reshape(n, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)   # [KVH, G, n, D]
    scores = q_grouped @ k.transpose(1, 2, 0)[:, None]                           # [KVH, G, n, ctx]
    scores *= np.float32(scale)
    if n > 1:
        future = np.arange(context)[None, :] > start + np.arange(n)[:, None]      # [n, ctx]
        scores = np.where(future, np.float32(-np.inf), scores)
    out = softmax(scores) @ v.transpose(1, 0, 2)[:, None]                         # [KVH, G, n, D]
    return out.transpose(2, 0, 1, 3).reshape(n, num_heads * head_dim)


def attend_invariant(q, k, v, start, scale, softmax=softmax_rows):
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
        out[t] = softmax(scores) @ values
    return out.reshape(n, num_heads * head_dim)


def attention(invariant: bool, fault: Fault | None = None):
    """The attention kernel of a mode, `attend(q, k, v, start, scale)`: attend_invariant or attend_fast,
    with the softmax of Fault.ATTENTION_BOUND_INFLATING where that fault is injected."""
    attend = attend_invariant if invariant else attend_fast
    if fault is not Fault.ATTENTION_BOUND_INFLATING:
        return attend
    return lambda q, k, v, start, scale: attend(q, k, v, start, scale, softmax=_softmax_rows_exp2_without_log2e)
