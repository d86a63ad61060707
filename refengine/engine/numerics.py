"""Whether the compiled kernels keep the guarantee invariant mode rests on: a row's result is the same
bits alone and anywhere in any batch. packed.py and paged_attention.py argue it from the code; this
probe checks the machine code numba built from it (an fma contracted in one body and not in another
would break it), once per process before an invariant engine is built.
"""
from __future__ import annotations

import functools

import numpy as np

from ..errors import RefengineError
from . import packed, paged_attention


def _slices(n: int):
    """Every prefix and suffix of n rows: each row at each position a batch can put it in."""
    return sorted({(0, hi) for hi in range(1, n + 1)} | {(lo, n) for lo in range(n)})


def product_rows_are_independent(weight, x) -> bool:
    """Every row of packed.matmul(x[lo:hi], pack(weight)), for every prefix and suffix of x, has exactly
    the bits of that row multiplied alone."""
    weight = packed.pack(weight)
    alone = np.concatenate([packed.matmul(x[i:i + 1], weight) for i in range(len(x))])
    return all(np.array_equal(packed.matmul(x[lo:hi], weight), alone[lo:hi]) for lo, hi in _slices(len(x)))


def attention_rows_are_independent(q, k, v, block_size) -> bool:
    """paged_attention.attend over one sequence [length, heads, head_dim]: every row of every prefix and
    suffix of the sequence's rows (a decode, a chunk, a whole prefill) has exactly the bits of that
    row attended alone."""
    length, kv_heads, head_dim = k.shape
    blocks = -(-length // block_size)
    k_cache = np.zeros((blocks + 1, kv_heads, head_dim, block_size), dtype=np.float32)
    v_cache = np.zeros((blocks + 1, kv_heads, block_size, head_dim), dtype=np.float32)
    table = np.arange(blocks, 0, -1)[None]                            # blocks in reverse, none at 0
    paged_attention.write(k_cache, v_cache, table[0, np.arange(length) // block_size] * block_size
                          + np.arange(length) % block_size, k, v)
    scale = 1 / np.sqrt(head_dim)

    def rows(lo, hi):
        return paged_attention.attend(q[lo:hi], k_cache, v_cache, table, np.zeros(hi - lo, dtype=np.int64),
                                      np.arange(lo, hi) + 1, scale)
    alone = np.concatenate([rows(t, t + 1) for t in range(length)])
    return all(np.array_equal(rows(lo, hi), alone[lo:hi]) for lo, hi in _slices(length))


# One product on the calling thread and one split between threads (packed.THREADED_BYTES), as the
# engine's real projections are.
PROBE_SHAPES = ((48, 64), (8224, 40))


@functools.cache  # once per process: engines are built by the hundred in a test run
def invariant_kernels_hold() -> bool:
    """The two checks above on small fixed data: 9 rows, so groups of eight, a group of one, smaller
    groups and threads all occur."""
    rng = np.random.default_rng(0)
    for out_features, in_features in PROBE_SHAPES:
        weight = rng.standard_normal((out_features, in_features), dtype=np.float32)
        if not product_rows_are_independent(weight, rng.standard_normal((9, in_features), dtype=np.float32)):
            return False
    q, k, v = (rng.standard_normal((9, heads, 16), dtype=np.float32) for heads in (4, 2, 2))
    # a block that fills a part of a vector of positions (masked lanes), and one that fills it
    return all(attention_rows_are_independent(q, k, v, block_size) for block_size in (4, paged_attention.LANES))


def require_invariant_kernels() -> None:
    """Refuse invariant mode where the compiled kernels would silently lose bit-exactness."""
    if not invariant_kernels_hold():
        raise RefengineError(
            "mode: invariant needs the compiled kernels (engine/packed.py, engine/paged_attention.py) to give "
            "a row the same bits alone and in any batch, and on this machine they do not (batched runs would "
            "not be bit-identical to serial ones); mode 'fast' still works")
