"""The forward's kernels at batch 1, 8 and 32, both modes: projections, decode attention over the
paged KV cache, and the lm_head. `extra_info` carries the rate each one reaches."""
from __future__ import annotations

import numpy as np
import pytest
from bench_models import BATCH_SIZES, MID_SPEC, MODES

from refengine.engine.kernels import (
    attend_fast,
    attend_invariant,
    fast_layout,
    linear_fast,
    linear_invariant,
)

LINEAR = {"fast": linear_fast, "invariant": linear_invariant}

ATTEND = {"fast": attend_fast, "invariant": attend_invariant}
CONTEXT = 128   # the mean KV prefix of the workload (prompt 64, 128 new tokens)
BLOCK_SIZE = 16


def _projection_case(benchmark, weight, mode, batch):
    x = np.random.default_rng(batch).standard_normal((batch, weight.shape[1]), dtype=np.float32)
    batching_fast = mode == "fast" and batch > 1  # the layout the runner gives such an engine
    benchmark(LINEAR[mode], x, fast_layout(weight) if batching_fast else weight)
    seconds = benchmark.stats.stats.min
    benchmark.extra_info.update(gflops=2 * weight.size * batch / seconds / 1e9,
                                weight_gb_s=weight.nbytes / seconds / 1e9)


@pytest.mark.parametrize("batch", BATCH_SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_projection_gate_up(benchmark, mid_weights, mode, batch):
    layer = mid_weights.layers[0]
    _projection_case(benchmark, np.concatenate([layer.gate_proj, layer.up_proj]), mode, batch)


@pytest.mark.parametrize("batch", BATCH_SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_projection_down(benchmark, mid_weights, mode, batch):
    _projection_case(benchmark, np.array(mid_weights.layers[0].down_proj), mode, batch)


@pytest.mark.parametrize("batch", BATCH_SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_lm_head(benchmark, mid_weights, mode, batch):
    _projection_case(benchmark, np.array(mid_weights.lm_head), mode, batch)


@pytest.mark.parametrize("batch", BATCH_SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_decode_attention_over_paged_kv(benchmark, mode, batch):
    """One layer's decode attention: gather each sequence's blocks from the pool, then attend.
    Sequences own scattered blocks, as after a while of joins and leaves."""
    rng = np.random.default_rng(0)
    kv_heads, heads, head_dim = MID_SPEC.kv_heads, MID_SPEC.heads, MID_SPEC.head_dim
    blocks_per_seq = CONTEXT // BLOCK_SIZE
    tables = rng.permutation(2 * batch * blocks_per_seq)[:batch * blocks_per_seq].reshape(batch, blocks_per_seq)
    kv_cache = rng.standard_normal((2 * batch * blocks_per_seq, BLOCK_SIZE, 2, kv_heads, head_dim), dtype=np.float32)
    q = rng.standard_normal((batch, heads, head_dim), dtype=np.float32)
    scale = 1 / np.sqrt(head_dim)

    def attend():  # as the runner does: one sequence at a time
        for n in range(batch):
            context = kv_cache[tables[n]].reshape(CONTEXT, 2, kv_heads, head_dim)
            ATTEND[mode](q[n:n + 1], context[:, 0], context[:, 1], CONTEXT - 1, scale)

    benchmark(attend)
    kv_bytes = 2 * batch * CONTEXT * kv_heads * head_dim * 4
    benchmark.extra_info.update(kv_gb_s=kv_bytes / benchmark.stats.stats.min / 1e9)
