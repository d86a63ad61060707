"""The invariant kernels: a row's result is the same bits whatever rows share the call."""
import numpy as np
import pytest

from refengine.engine.kernels import (
    attend_fast,
    attend_invariant,
    fast_layout,
    linear_fast,
    linear_invariant,
)
from refengine.engine.numerics import tile_assumption_holds, tile_rows_are_independent


@pytest.mark.parametrize("out_features, in_features", [(4096, 256), (1000, 96), (48, 64)])
def test_linear_invariant_rows_do_not_depend_on_the_batch(out_features, in_features):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((out_features, in_features), dtype=np.float32)
    x = rng.standard_normal((37, in_features), dtype=np.float32)
    orders = [rng.permutation(len(x))[:rng.integers(2, len(x) + 1)] for _ in range(5)]
    assert tile_rows_are_independent(weight, x, orders)  # the check invariant mode's start-up probe makes
    exact = x.astype(np.float64) @ weight.T.astype(np.float64)
    assert np.allclose(linear_invariant(x, weight), exact, rtol=1e-4, atol=1e-4)
    assert np.allclose(linear_fast(x, weight), exact, rtol=1e-4, atol=1e-4)
    column_major = fast_layout(weight)
    assert np.array_equal(column_major, weight) and column_major.flags.f_contiguous
    assert np.allclose(linear_fast(x, column_major), exact, rtol=1e-4, atol=1e-4)


def test_the_start_up_probe_finds_the_tile_assumption_holds_on_this_blas():
    """What an invariant-mode engine checks before it starts (engine.numerics.require_tile_assumption)."""
    assert tile_assumption_holds()


def test_attend_invariant_is_independent_of_chunking_and_matches_the_masked_form():
    rng = np.random.default_rng(1)
    heads, kv_heads, head_dim, length = 8, 2, 16, 29
    q = rng.standard_normal((length, heads, head_dim), dtype=np.float32)
    k = rng.standard_normal((length, kv_heads, head_dim), dtype=np.float32)
    v = rng.standard_normal((length, kv_heads, head_dim), dtype=np.float32)
    scale = 1 / np.sqrt(head_dim)
    one_by_one = np.concatenate([attend_invariant(q[t:t + 1], k[:t + 1], v[:t + 1], t, scale) for t in range(length)])
    for cuts in ([0, 29], [0, 5, 6, 20, 29], [0, 13, 29]):
        chunked = np.concatenate([attend_invariant(q[a:b], k[:b], v[:b], a, scale) for a, b in zip(cuts, cuts[1:])])
        assert np.array_equal(chunked, one_by_one)
    assert np.allclose(attend_fast(q, k, v, 0, scale), one_by_one, atol=1e-5)
