"""Fast mode's attention for a prefill chunk (kernels.attend_fast, via kernels.attention): one masked
product for all of a chunk's queries. Unlike the paged kernel (tests/test_paged_attention.py) its bits
may depend on the chunking, so it is held only to a float64 attention written here, for every chunking.
A step's greedy tokens and top-2 margins (kernels.top2), held to the reference's rules. And the
engine's RMS norm (kernels.rms_norm), held bit for bit to its definition written here."""
import math

import numba
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refengine.engine.faults import Fault
from refengine.engine.kernels import SMALL_VOCAB, _sum_of_squares, attend_fast, attention, rms_norm, top2
from refengine.sampling import greedy_token, top2_margin


def reference(q, k, v, start, scale, flatten=1.0):
    """q [n, H, D] at positions start.., k, v [start + n, KVH, D], in float64, one query at a time."""
    n, heads, head_dim = q.shape
    group = heads // k.shape[1]
    out = np.empty((n, heads, head_dim))
    for t in range(n):
        for h in range(heads):
            keys, values = k[:start + t + 1, h // group].astype(np.float64), v[:start + t + 1, h // group]
            scores = keys @ q[t, h].astype(np.float64) * scale
            weights = np.exp(flatten * (scores - scores.max()))
            out[t, h] = weights @ values.astype(np.float64) / weights.sum()
    return out.reshape(n, heads * head_dim)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 16), (4, 4, 24), (6, 1, 7)])
def test_attend_fast_matches_float64_attention_for_any_chunking(heads, kv_heads, head_dim):
    rng = np.random.default_rng(1)
    length = 29
    q = rng.standard_normal((length, heads, head_dim), dtype=np.float32)
    k = rng.standard_normal((length, kv_heads, head_dim), dtype=np.float32)
    v = rng.standard_normal((length, kv_heads, head_dim), dtype=np.float32)
    scale = 1 / math.sqrt(head_dim)
    exact = reference(q, k, v, 0, scale)
    for cuts in ([0, 29], [0, 5, 6, 20, 29], [0, 13, 29], list(range(30))):   # the last: decode rows
        for a, b in zip(cuts, cuts[1:]):
            out = attend_fast(q[a:b], k[:b], v[:b], a, scale)
            assert out.shape == (b - a, heads * head_dim) and out.dtype == np.float32
            assert np.allclose(out, exact[a:b], rtol=1e-5, atol=2e-6)


def test_attention_injects_the_inflated_bound_fault_in_both_forms():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((9, heads, 16), dtype=np.float32) for heads in (4, 2, 2))
    q *= 3                                                   # peaked scores, so the flattening shows
    scale = 0.25
    assert attention(False) == (1.0, attend_fast) and attention(True) == (1.0, None)
    assert attention(True, Fault.ATTENTION_BOUND_INFLATING) == (math.log(2), None)
    faulty = attention(False, Fault.ATTENTION_BOUND_INFLATING).chunk(q[4:], k, v, 4, scale)
    assert np.allclose(faulty, reference(q[4:], k, v, 4, scale, flatten=math.log(2)), rtol=1e-5, atol=2e-6)
    assert not np.allclose(faulty, reference(q[4:], k, v, 4, scale), atol=1e-3)


@given(st.lists(st.lists(st.floats(-1e4, 1e4, width=32) | st.sampled_from([-np.inf, np.inf, np.nan]),
                         min_size=4, max_size=4), min_size=1, max_size=6), st.sampled_from([0, SMALL_VOCAB]))
def test_a_steps_top2_is_each_rows_own(rows, pad):
    """The engine takes a step's greedy tokens and margins in one call: each row's token must be
    greedy_token's, and its margin the best minus the best of the other ids, worked out here (nan
    where a row has a nan, as the row's own arithmetic gives), and top2_margin's. Padded with -inf
    past SMALL_VOCAB, the rows take the other path (the padding can be the second best only where
    the row's others are all -inf, and then it is -inf as well)."""
    matrix = np.array(rows, dtype=np.float32)
    matrix = np.concatenate([matrix, np.full((len(matrix), pad), -np.inf, dtype=np.float32)], axis=1)
    with np.errstate(invalid="ignore"):  # inf - inf
        best, margins = top2(matrix)
    assert margins.dtype == np.float32
    for row, token, margin in zip(matrix, best, margins):
        assert token == greedy_token(row)
        rest = [float(v) for i, v in enumerate(row[:4]) if i != token]
        with np.errstate(invalid="ignore"):  # inf - inf
            expected = np.float32(row[token]) - np.float32(max(rest))
            alone = top2_margin(row)
        assert (np.isnan(margin) and (np.isnan(row).any() or np.isnan(expected))) or margin == expected
        assert (np.isnan(margin) and np.isnan(alone)) or margin == alone


def rms_norm_definition(row, weight, eps):
    """kernels._rms_norm_rows' rule for one row, in numpy: the float64 squares summed into sixteen
    partial sums (element i into sum i mod 16, in order), the partial sums added in order from zero,
    then float32 arithmetic. -> (the float64 sum of squares, the normed row)"""
    squares = row.astype(np.float64) ** 2                                # exact: a float32 squared fits
    squares = np.concatenate([squares, np.zeros(-len(row) % 16)]).reshape(-1, 16)
    lanes = np.zeros(16)
    for part in squares:
        lanes = lanes + part
    total = 0.0
    for lane in lanes:
        total += lane
    inverse = np.float32(1) / np.sqrt(np.float32(total / len(row)) + np.float32(eps))
    return total, row * inverse * weight


@numba.njit
def sums_of_squares(x):
    return np.array([_sum_of_squares(x, r) for r in range(x.shape[0])])


@pytest.mark.parametrize("dim", [1, 15, 16, 17, 100, 128, 1030])
def test_rms_norm_is_its_definition_row_by_row(dim):
    """Bit for bit, the float64 sum of squares too (a float32 result hides its order: float64 keeps 29
    bits more)."""
    rng = np.random.default_rng(dim)
    scales = 10.0 ** rng.integers(-30, 30, (12, 1))
    x = (rng.standard_normal((12, dim)) * scales).astype(np.float32)
    x[1] = 0
    x[2, ::3] = np.nan
    x[3, ::5] = np.inf
    x[4] = np.float32(1e-42) * rng.integers(-9, 9, dim)                 # subnormal
    weight = rng.standard_normal(dim, dtype=np.float32)
    out = rms_norm(x, weight, 1e-6)
    with np.errstate(all="ignore"):
        totals, rows = zip(*(rms_norm_definition(row, weight, 1e-6) for row in x))
    np.testing.assert_array_equal(sums_of_squares(x), np.array(totals))
    np.testing.assert_array_equal(out, np.stack(rows))
    for lo, hi in ((0, 1), (5, 12), (3, 4)):                            # any rows of a call: the same bits
        assert rms_norm(x[lo:hi], weight, 1e-6).tobytes() == out[lo:hi].tobytes()
