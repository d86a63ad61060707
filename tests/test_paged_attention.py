"""Attention over the paged KV cache (engine/paged_attention.py), the kernel every step's rows use in
invariant mode and every decode row uses in fast mode.

Its claim is that a row's result depends only on its own sequence's first row_keys keys: the same
bits alone, in its whole sequence, in any chunking, threaded or not, and mixed in one call with
other sequences' rows in any order. The sequences here own scattered blocks in no particular
order, as after a while of joins and leaves, and every slot nobody wrote holds NaN, so a read
outside a row's keys would show. Values are checked against a float64 softmax attention written
here, and against fast mode's masked numpy form (kernels.attend_fast) on the gathered keys.
"""
import math

import numpy as np
import pytest

from refengine.engine import numerics, paged_attention
from refengine.engine.faults import Fault
from refengine.engine.kernels import attend_fast, attention

# (heads, kv_heads, head_dim, block_size): MHA, GQA, MQA; head_dim off a multiple of 16; blocks of 1 and 32.
SHAPES = [(4, 4, 16, 1), (8, 2, 24, 32), (6, 3, 20, 4), (2, 1, 7, 5), (8, 4, 64, 16)]
LENGTHS = (1, 7, 33, 50)


class Pool:
    """Sequences of LENGTHS written through paged_attention.write into shuffled blocks of one pool."""

    def __init__(self, heads, kv_heads, head_dim, block_size, seed=0, lengths=LENGTHS):
        rng = np.random.default_rng(seed)
        self.heads, self.block_size, self.scale = heads, block_size, 1 / math.sqrt(head_dim)
        counts = [-(-n // block_size) for n in lengths]
        num_blocks = 2 * sum(counts) + 1                        # spare blocks nobody writes
        self.k_cache = np.full((num_blocks, kv_heads, head_dim, block_size), np.nan, dtype=np.float32)
        self.v_cache = np.full((num_blocks, kv_heads, block_size, head_dim), np.nan, dtype=np.float32)
        ids = rng.permutation(num_blocks)
        self.tables = np.full((len(lengths), max(counts) + 2), ids[-1], dtype=np.int64)  # padding: a NaN block
        self.q, self.k, self.v = [], [], []
        for s, (n, count) in enumerate(zip(lengths, counts)):
            self.tables[s, :count] = ids[:count]
            ids = ids[count:]
            self.q.append(rng.standard_normal((n, heads, head_dim), dtype=np.float32))
            self.k.append(rng.standard_normal((n, kv_heads, head_dim), dtype=np.float32))
            self.v.append(rng.standard_normal((n, kv_heads, head_dim), dtype=np.float32))
            # Written in a shuffled order, as chunks and decode steps would not.
            order = rng.permutation(n)
            slots = self.tables[s, order // block_size] * block_size + order % block_size
            paged_attention.write(self.k_cache, self.v_cache, slots, self.k[s][order], self.v[s][order])

    def attend(self, seqs, positions, flatten=1.0):
        """Rows: sequence seqs[r] at position positions[r], seeing keys 0..positions[r]."""
        seqs, positions = np.asarray(seqs, dtype=np.int64), np.asarray(positions, dtype=np.int64)
        q = np.stack([self.q[s][p] for s, p in zip(seqs, positions)])
        return paged_attention.attend(q, self.k_cache, self.v_cache, self.tables, seqs, positions + 1,
                                      self.scale, flatten)

    def alone(self, s, p):
        """Row p of sequence s with nothing else in the call: a one-row table of just its own blocks."""
        table = np.ascontiguousarray(self.tables[s:s + 1, :-(-(p + 1) // self.block_size)])
        q = self.q[s][p:p + 1]
        return paged_attention.attend(q, self.k_cache, self.v_cache, table, np.zeros(1, dtype=np.int64),
                                      np.array([p + 1]), self.scale)


def reference(q, k, v, scale, flatten=1.0):
    """Causal softmax attention in float64: q [n, H, D] at positions 0..n-1, k, v [n, KVH, D]."""
    n, heads, head_dim = q.shape
    group = heads // k.shape[1]
    k, v = (np.repeat(a.astype(np.float64), group, axis=1) for a in (k, v))   # head h reads kv head h // group
    scores = np.einsum("qhd,khd->hqk", q.astype(np.float64), k) * scale
    scores[:, np.triu(np.ones((n, n), dtype=bool), 1)] = -np.inf
    probs = np.exp(flatten * (scores - scores.max(axis=-1, keepdims=True)))
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * head_dim)


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: "h{}-kv{}-d{}-b{}".format(*s))
def pool(request):
    return Pool(*request.param)


def test_matches_float64_attention(pool):
    for s, n in enumerate(LENGTHS):
        out = pool.attend([s] * n, range(n))
        assert not np.isnan(out).any()
        assert np.allclose(out, reference(pool.q[s], pool.k[s], pool.v[s], pool.scale), rtol=1e-5, atol=2e-6)


def test_a_rows_bits_do_not_depend_on_the_call(pool):
    alone = {(s, p): pool.alone(s, p) for s, n in enumerate(LENGTHS) for p in range(n)}
    rng = np.random.default_rng(1)
    for s, n in enumerate(LENGTHS):
        whole = pool.attend([s] * n, range(n))
        assert whole.tobytes() == np.concatenate([alone[s, p] for p in range(n)]).tobytes()
        cuts = np.unique(np.concatenate([[0, n], rng.integers(0, n + 1, 4)]))
        for lo, hi in zip(cuts, cuts[1:]):                      # chunked prefill
            assert pool.attend([s] * (hi - lo), range(lo, hi)).tobytes() == whole[lo:hi].tobytes()
    # Every row of every sequence in one call, in shuffled order, with repeats: a mixed step.
    rows = list(alone)
    picks = np.concatenate([rng.permutation(len(rows)), rng.integers(0, len(rows), 20)])
    mixed = pool.attend([rows[i][0] for i in picks], [rows[i][1] for i in picks])
    assert mixed.tobytes() == np.concatenate([alone[rows[i]] for i in picks]).tobytes()


@pytest.mark.parametrize("rows", [430, 3])
def test_serial_and_threaded_kernels_give_the_same_bits(rows):
    """Threads take a row at a time, or for few rows a range of kv heads at a time: both give the
    serial kernel's bits."""
    pool = Pool(8, 2, 64, 16, seed=2, lengths=(300, 1, 129))
    seqs = np.repeat(np.arange(3), (300, 1, 129))
    positions = np.concatenate([np.arange(300), [0], np.arange(129)])
    order = np.random.default_rng(3).permutation(len(seqs))[:rows]
    seqs, positions = seqs[order], positions[order]
    q = np.stack([pool.q[s][p] for s, p in zip(seqs, positions)])
    outs = []
    for kernel, spans in ((paged_attention._attend, ()), (paged_attention._attend_threaded, (1,)),
                          (paged_attention._attend_threaded, (2,))):
        out = np.empty(q.shape, dtype=np.float32)
        kernel(q, pool.k_cache, pool.v_cache, pool.tables, seqs, positions + 1, np.float32(pool.scale),
               np.float32(1.0), out, *spans)
        outs.append(out.tobytes())
    assert outs[0] == outs[1] == outs[2]
    assert outs[0] == pool.attend(seqs, positions).tobytes()
    assert (positions + 1).sum() * 8 * 64 >= paged_attention.THREADED_WORK  # attend() itself picks threads here


def test_gather_returns_the_written_keys_and_values(pool):
    for s, n in enumerate(LENGTHS):
        for end in sorted({1, n // 2 + 1, n}):
            keys, values = paged_attention.gather(pool.k_cache, pool.v_cache, pool.tables[s], end)
            assert keys.shape == values.shape == (end,) + pool.k[s].shape[1:]
            assert np.array_equal(keys, pool.k[s][:end]) and np.array_equal(values, pool.v[s][:end])


def test_flatten_ln2_is_the_inflated_bound_fault():
    """Fault.ATTENTION_BOUND_INFLATING: scores count ln 2 times what they should. With one-hot values the
    output is the attention weights themselves, so the flattening can be seen in them."""
    heads, kv_heads, length = 4, 2, 12
    pool = Pool(heads, kv_heads, 16, 4, seed=4, lengths=(length,))
    onehot = np.zeros((length, kv_heads, 16), dtype=np.float32)
    onehot[np.arange(length), :, np.arange(length)] = 1
    slots = pool.tables[0, np.arange(length) // 4] * 4 + np.arange(length) % 4
    paged_attention.write(pool.k_cache, pool.v_cache, slots, pool.k[0], onehot)
    pool.k_cache *= 3                                        # peaked scores, so the flattening is large
    k = pool.k[0] * 3
    sharp = pool.attend([0] * length, range(length)).reshape(length, heads, 16)
    flat = pool.attend([0] * length, range(length), flatten=math.log(2)).reshape(length, heads, 16)
    assert np.allclose(flat.reshape(length, -1), reference(pool.q[0], k, onehot, pool.scale, math.log(2)),
                       rtol=1e-5, atol=2e-6)
    assert np.allclose(flat.sum(axis=-1), 1, atol=1e-5)
    assert np.all(flat[1:].max(axis=-1) < sharp[1:].max(axis=-1))
    # Fast mode's prefill form of the same fault (exp2 without log2 e) agrees with it.
    keys, values = paged_attention.gather(pool.k_cache, pool.v_cache, pool.tables[0], length)
    fast = attention(False, Fault.ATTENTION_BOUND_INFLATING).chunk(pool.q[0], keys, values, 0, pool.scale)
    assert np.allclose(fast, flat.reshape(length, -1), atol=1e-5)


def test_fast_modes_masked_form_on_gathered_keys_agrees(pool):
    for s, n in enumerate(LENGTHS):
        paged = pool.attend([s] * n, range(n))
        for lo, hi in ((0, n), (n // 2, n), (n - 1, n)):
            keys, values = paged_attention.gather(pool.k_cache, pool.v_cache, pool.tables[s], hi)
            assert np.allclose(attend_fast(pool.q[s][lo:hi], keys, values, lo, pool.scale), paged[lo:hi], atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_the_start_up_probes_attention_check_holds(block_size):
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((10, heads, 24), dtype=np.float32) for heads in (6, 2, 2))
    assert numerics.attention_rows_are_independent(q, k, v, block_size)
