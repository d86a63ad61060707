"""The forward's kernels at batch 1, 8 and 32, each against what it replaced: the packed weight product
(engine/packed.py) against numpy's BLAS `x @ w.T` for projections and the lm_head, and decode attention
over the paged KV cache (engine/paged_attention.py) against gathering each sequence's context and
attending it with fast mode's numpy form (kernels.attend_fast), and a seeded token's ranking of a real
vocabulary (sampling.sampling_order) against the stable argsort it replaced. `extra_info` carries the
rate each one reaches."""
from __future__ import annotations

import numpy as np
import pytest
from bench_models import BATCH_SIZES, MID_SPEC

from refengine.engine import packed, paged_attention
from refengine.engine.kernels import attend_fast
from refengine.sampling import sampling_order

PRODUCTS = ("packed", "blas")
ATTENTIONS = ("paged", "gathered")
ORDERS = ("keys", "stable argsort")
VOCAB = 151936  # Qwen3's
CONTEXT = 128   # the mean KV prefix of the workload (prompt 64, 128 new tokens)
BLOCK_SIZE = 16


def _projection_case(benchmark, weight, kernel, batch):
    x = np.random.default_rng(batch).standard_normal((batch, weight.shape[1]), dtype=np.float32)
    if kernel == "packed":
        benchmark(packed.matmul, x, packed.pack(weight))   # packed once, at load, as the runner does
    else:
        benchmark(np.matmul, x, weight.T)
    _rates(benchmark, gflops=2 * weight.size * batch / 1e9, weight_gb_s=weight.nbytes / 1e9)


def _rates(benchmark, **per_call):
    """extra_info: each amount per call over the fastest call. Under --benchmark-disable (a smoke run)
    the function ran once, untimed, and there is no rate."""
    if benchmark.stats is not None:
        benchmark.extra_info.update({name: amount / benchmark.stats.stats.min for name, amount in per_call.items()})


@pytest.mark.parametrize("batch", BATCH_SIZES)
@pytest.mark.parametrize("kernel", PRODUCTS)
def test_projection_gate_up(benchmark, mid_weights, kernel, batch):
    layer = mid_weights.layers[0]
    _projection_case(benchmark, np.concatenate([layer.gate_proj, layer.up_proj]), kernel, batch)


@pytest.mark.parametrize("batch", BATCH_SIZES)
@pytest.mark.parametrize("kernel", PRODUCTS)
def test_projection_down(benchmark, mid_weights, kernel, batch):
    _projection_case(benchmark, np.array(mid_weights.layers[0].down_proj), kernel, batch)


@pytest.mark.parametrize("batch", BATCH_SIZES)
@pytest.mark.parametrize("kernel", PRODUCTS)
def test_lm_head(benchmark, mid_weights, kernel, batch):
    _projection_case(benchmark, np.array(mid_weights.lm_head), kernel, batch)


@pytest.mark.parametrize("batch", BATCH_SIZES)
@pytest.mark.parametrize("kernel", ATTENTIONS)
def test_decode_attention_over_paged_kv(benchmark, kernel, batch):
    """One layer's decode attention, one query row per sequence at position CONTEXT - 1. Sequences own
    scattered blocks, as after a while of joins and leaves."""
    rng = np.random.default_rng(0)
    kv_heads, heads, head_dim = MID_SPEC.kv_heads, MID_SPEC.heads, MID_SPEC.head_dim
    blocks_per_seq = CONTEXT // BLOCK_SIZE
    num_blocks = 2 * batch * blocks_per_seq
    tables = rng.permutation(num_blocks)[:batch * blocks_per_seq].reshape(batch, blocks_per_seq)
    k_cache = rng.standard_normal((num_blocks, kv_heads, head_dim, BLOCK_SIZE), dtype=np.float32)
    v_cache = rng.standard_normal((num_blocks, kv_heads, BLOCK_SIZE, head_dim), dtype=np.float32)
    q = rng.standard_normal((batch, heads, head_dim), dtype=np.float32)
    row_seq, row_keys = np.arange(batch), np.full(batch, CONTEXT)
    scale = 1 / np.sqrt(head_dim)

    def gathered():  # one sequence at a time, as fast mode attends a prefill chunk
        for n in range(batch):
            keys, values = paged_attention.gather(k_cache, v_cache, tables[n], CONTEXT)
            attend_fast(q[n:n + 1], keys, values, CONTEXT - 1, scale)

    if kernel == "paged":
        benchmark(paged_attention.attend, q, k_cache, v_cache, tables, row_seq, row_keys, scale)
    else:
        benchmark(gathered)
    _rates(benchmark, kv_gb_s=2 * batch * CONTEXT * kv_heads * head_dim * 4 / 1e9)


@pytest.mark.parametrize("top_k", [0, 20])
@pytest.mark.parametrize("kernel", ORDERS)
def test_sampling_order_of_a_real_vocabulary(benchmark, kernel, top_k):
    """The ids a seeded token samples over, for one float32 logits row at temperature 0.6: all of them
    ranked (top_k 0) or the 20 best (Qwen3's recommended sampler)."""
    row = np.random.default_rng(0).standard_normal(VOCAB, dtype=np.float32) * 3

    def stable():
        order = np.argsort(-(row.astype(np.float64) / 0.6), kind="stable")
        return order[:top_k] if top_k else order

    if kernel == "keys":
        benchmark(sampling_order, row, 0.6, top_k)
    else:
        benchmark(stable)
    _rates(benchmark, rows_per_s=1)
