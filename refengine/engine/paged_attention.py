"""Attention over the paged KV cache, compiled (engine/jit.py): one call per layer for the step's query
rows, reading the sequences' blocks where they lie.

The cache is laid out for this kernel, in two arrays per layer. Keys are transposed within a block,
[blocks, kv_heads, head_dim, block_size], so a query's scores against a block's keys are one vector
per head_dim step. Values are [blocks, kv_heads, block_size, head_dim], so the weighted sum adds
whole value rows.

Why a row's result cannot depend on the batch, the chunking or the phase: a query row at position p
reads exactly keys and values 0..p of its own sequence, and every sum runs in an order written here.
A score is a fixed combination of four chains over head_dim (_scores). The softmax's max and its
denominator run over positions in order, and so does the output's sum of value rows (_values).
Nothing depends on the other rows of the step, on how they are split into chunks or threads, or on
whether the row is a prefill or a decode: the same position of the same sequence gets the same
bits. tests/test_paged_attention.py checks this.

How it reads memory, which is what a decode step's attention waits on: a row goes through its
blocks in order, and in each block through every kv head, whose tiles lie next to each other in the
cache: one sweep of a block's keys, then later of its values, which the hardware prefetcher follows
(prefetching the next block in the code as well read no faster). The scores' and the sums'
accumulators stay in registers (engine/ir.py says why numba's would not).
"""
from __future__ import annotations

import numpy as np
from numba import get_num_threads, prange, types
from numba.extending import intrinsic

from .exp import exp32
from .ir import LANES, ZERO, Emitter, float32_arrays, tuples
from .jit import WIDE_VECTORS, jit

# Below this many score multiply-adds a call runs on the calling thread (packed.THREADED_BYTES says why).
THREADED_WORK = 1 << 18
# Heads per body, sized to the vector registers: a score body holds four chains a head and a value
# body up to eight vectors a head, so two heads take 8 and 16 of the 32 512-bit registers; a
# narrower CPU has 16 registers a quarter the size, and one head (a value body of four vectors) fits.
SCORE_HEADS = VALUE_HEADS = 2 if WIDE_VECTORS else 1


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
    args = (np.ascontiguousarray(q), k_cache, v_cache, tables, row_seq, row_keys, np.float32(scale),
            np.float32(flatten), out)
    if int(row_keys.sum()) * heads * head_dim < THREADED_WORK:
        _attend(*args)
    else:  # a task a row where every thread gets two or more, else a task a kv head, so that few rows use every thread
        _attend_threaded(*args, 1 if rows >= 2 * get_num_threads() else k_cache.shape[1])
    return out.reshape(rows, heads * head_dim)


@intrinsic
def _scores(typingctx, q, row, first_head, heads, count, k_cache, block, kv_head, p0, scores, column, scale):
    """scores[heads[j], column:column + n] for j < count, n = min(LANES, block_size - p0): query row `row`,
    head first_head + heads[j], against positions p0.. of cache block `block` (kv head `kv_head`), one
    lane a position. Each is four chains over head_dim (d mod 4; the dims past the last whole four
    continue the first), combined as ((c0 + c1) + (c2 + c3)) * scale."""
    if not (float32_arrays(q, k_cache, scores) and tuples(heads)):
        return None

    def codegen(context, builder, signature, args):
        e = Emitter(context, builder, signature, args)
        (qs, (_, num_heads, head_dim)), (ks, (_, num_kv_heads, _, block_size)), (ss, (_, width)) = \
            e.array(0), e.array(5), e.array(9)
        row, first_head, heads, count = e.index(1), e.index(2), e.indices(3), e.index(4)
        block, kv_head, p0, column = e.index(6), e.index(7), e.index(8), e.index(10)
        lanes = e.mask(builder.sub(block_size, p0))
        keys = e.at(ks, e.add(e.mul(e.add(e.mul(block, num_kv_heads), kv_head), head_dim, block_size), p0))
        queries = [e.at(qs, e.mul(e.add(e.mul(row, num_heads), first_head, h), head_dim)) for h in heads]

        def dims(d, acc, chains):  # dims d.. (one per chain) into the first `chains` chains of every head
            stepped = list(acc)
            for c in range(chains):
                k = e.load(e.at(keys, e.mul(e.add(d, e.const(c)), block_size)), lanes)
                for j, query in enumerate(queries):
                    qd = e.splat(builder.load(e.at(query, e.add(d, e.const(c))), align=4))
                    stepped[4 * j + c] = e.fma(qd, k, acc[4 * j + c])
            return stepped

        whole = builder.sdiv(head_dim, e.const(4))
        acc = e.loop(e.const(0), whole, [ZERO] * (4 * len(queries)), lambda i, a: dims(e.mul(i, e.const(4)), a, 4))
        acc = e.loop(e.mul(whole, e.const(4)), head_dim, acc, lambda d, a: dims(d, a, 1))
        factor = e.splat(e.args[11])
        for j, h in enumerate(heads):
            c = acc[4 * j:4 * j + 4]
            combined = builder.fmul(builder.fadd(builder.fadd(c[0], c[1]), builder.fadd(c[2], c[3])), factor)
            with e.when(e.below(e.const(j), count)):
                e.store(combined, e.at(ss, e.add(e.mul(h, width), column)), lanes)
        return context.get_dummy_value()
    return types.void(q, row, first_head, heads, count, k_cache, block, kv_head, p0, scores, column, scale), codegen


@intrinsic
def _values(typingctx, weights, column, n, heads, count, v_cache, block, kv_head, dims, acc):
    """acc[heads[j], d:d + LANES] for j < count and d in dims (lanes past head_dim left alone), continued
    by positions 0..n-1 of cache block `block` (kv head `kv_head`), in order: one fma a position, of
    weights[heads[j], column + t] and that position's value row."""
    if not (float32_arrays(weights, v_cache, acc) and tuples(heads, dims)):
        return None

    def codegen(context, builder, signature, args):
        e = Emitter(context, builder, signature, args)
        (ws, (_, width)), (vs, (_, num_kv_heads, block_size, head_dim)), (accs, _) = e.array(0), e.array(5), e.array(9)
        column, n, heads, count = e.index(1), e.index(2), e.indices(3), e.index(4)
        block, kv_head, dims = e.index(6), e.index(7), e.indices(8)
        lanes = [e.mask(builder.sub(head_dim, d)) for d in dims]
        values = e.at(vs, e.mul(e.add(e.mul(block, num_kv_heads), kv_head), block_size, head_dim))
        sums = [e.at(accs, e.add(e.mul(h, head_dim), d)) for h in heads for d in dims]
        weight_rows = [e.at(ws, e.add(e.mul(h, width), column)) for h in heads]

        def position(t, acc):
            value_row = e.at(values, e.mul(t, head_dim))
            v = [e.load(e.at(value_row, d), mask) for d, mask in zip(dims, lanes)]
            stepped = []
            for weight_row in weight_rows:
                w = e.splat(builder.load(e.at(weight_row, t), align=4))
                for vd in v:
                    stepped.append(e.fma(w, vd, acc[len(stepped)]))
            return stepped

        initial = [e.load(s, lanes[k % len(dims)]) for k, s in enumerate(sums)]
        acc = e.loop(e.const(0), n, initial, position)
        for j in range(len(heads)):
            with e.when(e.below(e.const(j), count)):
                for k in range(len(dims)):
                    e.store(acc[j * len(dims) + k], sums[j * len(dims) + k], lanes[k])
        return context.get_dummy_value()
    return types.void(weights, column, n, heads, count, v_cache, block, kv_head, dims, acc), codegen


@jit
def _attend_one(q, k_cache, v_cache, tables, row_seq, row_keys, scale, flatten, out, row, kv0, kv1):
    """Query row `row`, the heads of kv heads kv0..kv1-1: the sums of the module docstring. A score's
    chain over head_dim runs as four interleaved partial sums (d mod 4), added in one fixed order at
    the end: the same for every score, and independent chains keep the fma units busy. A block's
    scores are computed a vector of positions at a time for SCORE_HEADS heads at once (_scores), the
    output's sum over positions a block at a time with its accumulators in registers (_values); each
    goes through a block's kv heads in turn, which lie next to each other in the cache."""
    num_kv_heads, head_dim, block_size = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    heads = (kv1 - kv0) * group
    keys = row_keys[row]
    table = tables[row_seq[row]]
    num_blocks = (keys + block_size - 1) // block_size
    scores = np.empty((heads, num_blocks * block_size), dtype=np.float32)
    for b in range(num_blocks):
        for kv_head in range(kv0, kv1):
            first = (kv_head - kv0) * group
            for p0 in range(0, block_size, LANES):
                for g in range(first, first + group, SCORE_HEADS):
                    if SCORE_HEADS == 2:
                        _scores(q, row, kv0 * group, (g, min(g + 1, first + group - 1)), first + group - g, k_cache,
                                table[b], kv_head, p0, scores, b * block_size + p0, scale)
                    else:
                        _scores(q, row, kv0 * group, (g,), 1, k_cache, table[b], kv_head, p0, scores,
                                b * block_size + p0, scale)
    totals = np.zeros(heads, dtype=np.float32)
    for h in range(heads):
        top = scores[h, 0]
        for p in range(keys):
            top = max(top, scores[h, p])
        for p in range(keys):  # apart from the sum below, so that this loop runs vectorized
            scores[h, p] = exp32((scores[h, p] - top) * flatten)
        for p in range(keys):
            totals[h] += scores[h, p]
    acc = np.zeros((heads, head_dim), dtype=np.float32)
    for b in range(num_blocks):
        for kv_head in range(kv0, kv1):
            _value_block(scores, b * block_size, min(block_size, keys - b * block_size), v_cache, table[b], kv_head,
                         (kv_head - kv0) * group, group, acc)
    for h in range(heads):
        for d in range(head_dim):
            out[row, kv0 * group + h, d] = acc[h, d] / totals[h]


@jit
def _value_block(weights, column, n, v_cache, block, kv_head, first, group, acc):
    """Rows first..first+group-1 of acc (kv head kv_head's heads) continued by the first n positions of
    one cache block: VALUE_HEADS heads at a time, in vectors of head_dim, as many as fit the registers
    (and no more than head_dim needs)."""
    head_dim = acc.shape[1]
    for g in range(first, first + group, VALUE_HEADS):
        if VALUE_HEADS == 2:
            heads, count = (g, min(g + 1, first + group - 1)), first + group - g
        else:
            heads, count = (g,), 1
        if head_dim <= LANES:
            _values(weights, column, n, heads, count, v_cache, block, kv_head, (0,), acc)
        elif head_dim <= 4 * LANES or not WIDE_VECTORS:
            for d in range(0, head_dim, 4 * LANES):
                _values(weights, column, n, heads, count, v_cache, block, kv_head,
                        (d, d + LANES, d + 2 * LANES, d + 3 * LANES), acc)
        else:
            for d in range(0, head_dim, 8 * LANES):
                _values(weights, column, n, heads, count, v_cache, block, kv_head,
                        (d, d + LANES, d + 2 * LANES, d + 3 * LANES, d + 4 * LANES, d + 5 * LANES, d + 6 * LANES,
                         d + 7 * LANES), acc)


@jit
def _attend(q, k_cache, v_cache, tables, row_seq, row_keys, scale, flatten, out):
    for row in range(q.shape[0]):
        _attend_one(q, k_cache, v_cache, tables, row_seq, row_keys, scale, flatten, out, row, 0, k_cache.shape[1])


@jit(parallel=True)
def _attend_threaded(q, k_cache, v_cache, tables, row_seq, row_keys, scale, flatten, out, spans):
    """Each row's kv heads in `spans` ranges, a range a task."""
    num_kv_heads = k_cache.shape[1]
    for item in prange(q.shape[0] * spans):
        row, span = item // spans, item % spans
        _attend_one(q, k_cache, v_cache, tables, row_seq, row_keys, scale, flatten, out, row,
                    span * num_kv_heads // spans, (span + 1) * num_kv_heads // spans)
