"""Attention over the paged KV cache, compiled (engine/jit.py): one call per layer for the step's query
rows, reading the sequences' blocks where they lie.

The cache is laid out for this kernel, in two arrays per layer. Keys are transposed within a block,
[blocks, kv_heads, head_dim, block_size], so a query's scores against a block's keys are one vector
per head_dim step. Values are [blocks, kv_heads, block_size, head_dim], so the weighted sum adds
whole value rows.

Why a row's result cannot depend on the batch, the chunking or the phase: a query row at position p
reads exactly keys and values 0..p of its own sequence, and every sum runs in an order written here.
A score is a fixed combination of four chains over head_dim (_attend_one). The softmax's max and
its denominator run over positions in order, and so does the output's sum of value rows. Nothing
depends on the other rows of the step, on how they are split into chunks or threads, or on whether
the row is a prefill or a decode: the same position of the same sequence gets the same bits.
tests/test_paged_attention.py checks this.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from .exp import exp32
from .jit import fma, jit

# Below this many score multiply-adds a call runs on the calling thread (packed.THREADED_BYTES says why).
THREADED_WORK = 1 << 18
SMALL_BLOCK = 8  # below this block size a vector over a block's positions is mostly empty lanes


def write(k_cache, v_cache, slots, k, v) -> None:
    """Store the step's keys and values [tokens, kv_heads, head_dim] at their slots (block * size + offset)."""
    _write(k_cache, v_cache, np.asarray(slots, dtype=np.int64), k, v)


@jit
def _write(k_cache, v_cache, slots, k, v):
    block_size = k_cache.shape[-1]
    for t in range(k.shape[0]):
        block, offset = slots[t] // block_size, slots[t] % block_size
        for h in range(k.shape[1]):
            for d in range(k.shape[2]):
                k_cache[block, h, d, offset] = k[t, h, d]
                v_cache[block, h, offset, d] = v[t, h, d]


def gather(k_cache, v_cache, table, end):
    """A sequence's first `end` keys and values out of its blocks, [end, kv_heads, head_dim] each
    (for kernels.attend_fast)."""
    blocks = table[:-(-end // k_cache.shape[-1])]
    keys = k_cache[blocks].transpose(0, 3, 1, 2)                                  # [blocks, size, KVH, D]
    values = v_cache[blocks].transpose(0, 2, 1, 3)                                # [blocks, size, KVH, D]
    return (keys.reshape(-1, *keys.shape[2:])[:end], values.reshape(-1, *values.shape[2:])[:end])


def attend(q, k_cache, v_cache, tables, row_seq, row_keys, scale, flatten=1.0) -> np.ndarray:
    """q [rows, heads, head_dim]; tables [seqs, max_blocks] (each sequence's block ids); row r belongs
    to sequence row_seq[r] and sees its first row_keys[r] keys. -> [rows, heads * head_dim].
    `flatten` < 1 scales every score's exponent (Fault.ATTENTION_BOUND_INFLATING)."""
    rows, heads, head_dim = q.shape
    out = np.empty((rows, heads, head_dim), dtype=np.float32)
    kernel = _attend_threaded if int(row_keys.sum()) * heads * head_dim >= THREADED_WORK else _attend
    kernel(np.ascontiguousarray(q), k_cache, v_cache, tables, row_seq, row_keys, np.float32(scale),
           np.float32(flatten), out)
    return out.reshape(rows, heads * head_dim)


@jit
def _attend_one(q, k_cache, v_cache, tables, row_seq, row_keys, scale, flatten, out, item):
    """Query row item // kv_heads, the heads of kv head item % kv_heads: the sums of the module docstring.
    A score's chain over head_dim runs as four interleaved partial sums (d mod 4), added in one fixed
    order at the end: the same for every score, and independent chains keep the fma units busy.
    Blocks of SMALL_BLOCK positions or more are scored a block at a time (a vector over its
    positions); smaller ones a key at a time, in the same chains."""
    num_kv_heads, head_dim, block_size = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    row, kv_head = item // num_kv_heads, item % num_kv_heads
    keys = row_keys[row]
    table = tables[row_seq[row]]
    num_blocks = (keys + block_size - 1) // block_size
    scores = np.zeros((group, num_blocks * block_size), dtype=np.float32)
    whole_dims = head_dim - head_dim % 4
    if block_size >= SMALL_BLOCK:
        part = np.zeros((4, block_size), dtype=np.float32)
        for b in range(num_blocks):
            block = table[b]
            for g in range(group):
                h = kv_head * group + g
                part[:] = 0
                for d in range(0, whole_dims, 4):
                    q0, q1, q2, q3 = q[row, h, d], q[row, h, d + 1], q[row, h, d + 2], q[row, h, d + 3]
                    for p in range(block_size):
                        part[0, p] = fma(q0, k_cache[block, kv_head, d, p], part[0, p])
                        part[1, p] = fma(q1, k_cache[block, kv_head, d + 1, p], part[1, p])
                        part[2, p] = fma(q2, k_cache[block, kv_head, d + 2, p], part[2, p])
                        part[3, p] = fma(q3, k_cache[block, kv_head, d + 3, p], part[3, p])
                for d in range(whole_dims, head_dim):
                    for p in range(block_size):
                        part[0, p] = fma(q[row, h, d], k_cache[block, kv_head, d, p], part[0, p])
                for p in range(block_size):
                    scores[g, b * block_size + p] = ((part[0, p] + part[1, p]) + (part[2, p] + part[3, p])) * scale
    else:
        for t in range(keys):
            block, p = table[t // block_size], t % block_size
            for g in range(group):
                h = kv_head * group + g
                s0 = s1 = s2 = s3 = np.float32(0)
                for d in range(0, whole_dims, 4):
                    s0 = fma(q[row, h, d], k_cache[block, kv_head, d, p], s0)
                    s1 = fma(q[row, h, d + 1], k_cache[block, kv_head, d + 1, p], s1)
                    s2 = fma(q[row, h, d + 2], k_cache[block, kv_head, d + 2, p], s2)
                    s3 = fma(q[row, h, d + 3], k_cache[block, kv_head, d + 3, p], s3)
                for d in range(whole_dims, head_dim):
                    s0 = fma(q[row, h, d], k_cache[block, kv_head, d, p], s0)
                scores[g, t] = ((s0 + s1) + (s2 + s3)) * scale
    totals = np.zeros(group, dtype=np.float32)
    for g in range(group):
        top = scores[g, 0]
        for p in range(keys):
            top = max(top, scores[g, p])
        for p in range(keys):  # apart from the sum below, so that this loop runs vectorized
            scores[g, p] = exp32((scores[g, p] - top) * flatten)
        for p in range(keys):
            totals[g] += scores[g, p]
    # The output's sum over positions, in position order; four value rows per load and store of the
    # accumulator, which does not change the order.
    acc = np.zeros((group, head_dim), dtype=np.float32)
    if block_size >= SMALL_BLOCK:
        for b in range(num_blocks):
            block, base = table[b], b * block_size
            n = min(block_size, keys - base)
            whole = n - n % 4
            for g in range(group):
                for o in range(0, whole, 4):
                    e0, e1 = scores[g, base + o], scores[g, base + o + 1]
                    e2, e3 = scores[g, base + o + 2], scores[g, base + o + 3]
                    v0, v1, v2, v3 = (v_cache[block, kv_head, o], v_cache[block, kv_head, o + 1],
                                      v_cache[block, kv_head, o + 2], v_cache[block, kv_head, o + 3])
                    for d in range(head_dim):
                        acc[g, d] = fma(e3, v3[d], fma(e2, v2[d], fma(e1, v1[d], fma(e0, v0[d], acc[g, d]))))
                for o in range(whole, n):
                    e = scores[g, base + o]
                    for d in range(head_dim):
                        acc[g, d] = fma(e, v_cache[block, kv_head, o, d], acc[g, d])
    else:  # the same chain, four positions at a time across blocks
        whole = keys - keys % 4
        for t in range(0, whole, 4):
            v0 = v_cache[table[t // block_size], kv_head, t % block_size]
            v1 = v_cache[table[(t + 1) // block_size], kv_head, (t + 1) % block_size]
            v2 = v_cache[table[(t + 2) // block_size], kv_head, (t + 2) % block_size]
            v3 = v_cache[table[(t + 3) // block_size], kv_head, (t + 3) % block_size]
            for g in range(group):
                e0, e1, e2, e3 = scores[g, t], scores[g, t + 1], scores[g, t + 2], scores[g, t + 3]
                for d in range(head_dim):
                    acc[g, d] = fma(e3, v3[d], fma(e2, v2[d], fma(e1, v1[d], fma(e0, v0[d], acc[g, d]))))
        for t in range(whole, keys):
            v = v_cache[table[t // block_size], kv_head, t % block_size]
            for g in range(group):
                e = scores[g, t]
                for d in range(head_dim):
                    acc[g, d] = fma(e, v[d], acc[g, d])
    for g in range(group):
        for d in range(head_dim):
            out[row, kv_head * group + g, d] = acc[g, d] / totals[g]


@jit
def _attend(q, k_cache, v_cache, tables, row_seq, row_keys, scale, flatten, out):
    for item in range(q.shape[0] * k_cache.shape[1]):
        _attend_one(q, k_cache, v_cache, tables, row_seq, row_keys, scale, flatten, out, item)


@jit(parallel=True)
def _attend_threaded(q, k_cache, v_cache, tables, row_seq, row_keys, scale, flatten, out):
    for item in prange(q.shape[0] * k_cache.shape[1]):
        _attend_one(q, k_cache, v_cache, tables, row_seq, row_keys, scale, flatten, out, item)

