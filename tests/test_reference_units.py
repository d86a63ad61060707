"""Hand-checked cases for the reference's building blocks; every expected value is worked out here."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refengine.errors import RefengineError
from refengine.reference import apply_rope, causal_attention, rms_norm
from refengine.sampling import (
    SamplingParams,
    greedy_token,
    log_softmax,
    ranked_logprobs,
    sample_token,
    sampling_order,
    token_uniform,
    top2_margin,
    top_logprobs,
)


def test_rms_norm_divides_by_root_mean_square_then_scales():
    x = np.array([2.0, -2.0, 2.0, -2.0])  # root mean square exactly 2
    weight = np.array([1.0, 2.0, 3.0, 4.0])
    np.testing.assert_allclose(rms_norm(x, weight, eps=0.0), [1.0, -2.0, 3.0, -4.0], rtol=0, atol=1e-15)


def test_rms_norm_adds_eps_inside_the_root():
    x = np.array([3.0, 4.0])  # mean square 12.5; with eps 0.5 the divisor is sqrt(13)
    out = rms_norm(x, np.ones(2), eps=0.5)
    np.testing.assert_allclose(out, [3 / math.sqrt(13), 4 / math.sqrt(13)], rtol=1e-15)


def test_rms_norm_normalizes_each_row_on_its_own():
    x = np.array([[3.0, 4.0], [0.3, 0.4]])  # the second row is the first scaled by 0.1
    out = rms_norm(x, np.array([1.0, -1.0]), eps=0.0)
    expected = np.array([3.0, -4.0]) / math.sqrt(12.5)
    np.testing.assert_allclose(out, [expected, expected], rtol=1e-14)
    assert out.dtype == np.float64


@pytest.mark.parametrize("position", [0, 1, 3, 10])
def test_rope_on_a_2d_head_is_a_rotation_by_the_position(position):
    # head_dim 2 has a single frequency theta^0 = 1: the angle is the position itself.
    x = np.array([[[1.0, 0.0]], [[0.6, 0.8]]])  # [seq 2, heads 1, head_dim 2]
    out = apply_rope(x, np.array([position, position]), theta=10000.0)
    c, s = math.cos(position), math.sin(position)
    np.testing.assert_allclose(out[0, 0], [c, s], atol=1e-15)
    np.testing.assert_allclose(out[1, 0], [0.6 * c - 0.8 * s, 0.8 * c + 0.6 * s], atol=1e-15)


def test_rope_on_a_4d_head_rotates_split_half_pairs_at_their_own_frequencies():
    # Pairs are (0, 2) and (1, 3) (rotate_half); pair i turns by pos * theta^(-2i/4): here 1 and 1/10.
    theta = 100.0
    a, b, c, d = 1.0, 2.0, -0.5, 0.25
    positions = np.array([0, 1, 5])
    x = np.tile([a, b, c, d], (3, 1))[:, None, :]  # [seq 3, heads 1, head_dim 4]
    out = apply_rope(x, positions, theta)[:, 0]
    for row, pos in zip(out, positions):
        slow = pos / 10.0
        expected = [a * math.cos(pos) - c * math.sin(pos), b * math.cos(slow) - d * math.sin(slow),
                    c * math.cos(pos) + a * math.sin(pos), d * math.cos(slow) + b * math.sin(slow)]
        np.testing.assert_allclose(row, expected, atol=1e-15)
    np.testing.assert_array_equal(out[0], [a, b, c, d])  # position 0 is the identity


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, 1, 8))  # each [seq 1, heads 1, head_dim 8]

    def score(q_pos, k_pos):
        return float(np.sum(apply_rope(q, np.array([q_pos]), 1e4) * apply_rope(k, np.array([k_pos]), 1e4)))

    assert score(7, 3) == pytest.approx(score(4, 0), abs=1e-13)
    assert score(20, 13) == pytest.approx(score(7, 0), abs=1e-13)
    assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-3)


# Two tokens, one head, head_dim 2. The second query scores the keys 0 and ln 3 after the
# 1/sqrt(2) scaling, so its softmax weights are exactly 1/4 and 3/4.
Q1 = [math.sqrt(2) * math.log(3), 0.0]
KEYS = [[0.0, 1.0], [1.0, 0.0]]
VALUES = [[4.0, 0.0], [0.0, 8.0]]  # 1/4 * v0 + 3/4 * v1 = [1, 6]


def test_attention_on_two_tokens_is_causal():
    q = np.array([[[5.0, -3.0]], [Q1]])  # the first query must not matter: it sees only itself
    k, v = np.array(KEYS)[:, None, :], np.array(VALUES)[:, None, :]
    out = causal_attention(q, k, v, q_positions=np.array([0, 1]))
    np.testing.assert_allclose(out[0, 0], VALUES[0], atol=1e-15)
    np.testing.assert_allclose(out[1, 0], [1.0, 6.0], atol=1e-14)


def test_attention_of_a_decode_step_sees_every_cached_key():
    k, v = np.array(KEYS)[:, None, :], np.array(VALUES)[:, None, :]
    out = causal_attention(np.array([[Q1]]), k, v, q_positions=np.array([1]))
    np.testing.assert_allclose(out[0, 0], [1.0, 6.0], atol=1e-14)


def test_gqa_query_heads_share_kv_heads_in_consecutive_groups():
    # 4 query heads over 2 kv heads: heads 0,1 read kv head 0 and heads 2,3 read kv head 1 (HF repeat_kv).
    # kv head 0 keeps the keys above (weights 1/4, 3/4); kv head 1 has equal keys (weights 1/2, 1/2).
    # Values differ per kv head so a wrong mapping shows in the first token too.
    q = np.array([[[1.0, 1.0]] * 4, [Q1] * 4])                      # [seq 2, heads 4, hd 2]
    k = np.array([[KEYS[0], [0.0, 1.0]], [KEYS[1], [0.0, 1.0]]])    # [seq 2, kv heads 2, hd 2]
    v = np.array([[VALUES[0], [40.0, 0.0]], [VALUES[1], [0.0, 80.0]]])
    out = causal_attention(q, k, v, q_positions=np.array([0, 1]))
    np.testing.assert_allclose(out[0], [[4.0, 0.0], [4.0, 0.0], [40.0, 0.0], [40.0, 0.0]], atol=1e-14)
    np.testing.assert_allclose(out[1], [[1.0, 6.0], [1.0, 6.0], [20.0, 40.0], [20.0, 40.0]], atol=1e-13)


@pytest.mark.parametrize("logits, expected", [
    ([0.0, 5.0, 5.0, 1.0], 1),
    ([3.0, 1.0, 3.0], 0),
    ([-2.0, -1.0, -1.0, -1.0], 1),
    ([7.0], 0),
])
def test_greedy_lowest_id_wins_exact_ties(logits, expected):
    assert greedy_token(np.array(logits)) == expected


def test_greedy_picks_the_strict_maximum():
    assert greedy_token(np.array([1.0, 2.0, 2.0 + 1e-12, 0.0])) == 2


@pytest.mark.parametrize("logits, expected", [
    ([1.0, 4.0, 2.5], 1.5),
    ([2.5, 1.0, 4.0], 1.5),
    ([3.0, 3.0, -1.0], 0.0),
    ([-5.0, -7.25], 2.25),
])
def test_top2_margin_is_best_minus_second_best(logits, expected):
    assert top2_margin(np.array(logits)) == expected


def test_top_logprobs_are_the_log_probabilities_of_the_best_ids():
    logits = np.log([0.1, 0.2, 0.3, 0.4]) + 7.0  # softmax ignores the shift
    result = top_logprobs(logits, 2)
    assert [i for i, _ in result] == [3, 2]
    np.testing.assert_allclose([lp for _, lp in result], np.log([0.4, 0.3]), rtol=1e-14)


def test_top_logprobs_break_ties_by_lower_id():
    logits = np.log([0.2, 0.1, 0.2, 0.5])
    result = top_logprobs(logits, 3)
    assert [i for i, _ in result] == [3, 0, 2]
    np.testing.assert_allclose([lp for _, lp in result], np.log([0.5, 0.2, 0.2]), rtol=1e-14)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.sampled_from([-np.inf, -3.0, -1.0, -0.5, 0.0, np.nan, 2.0]) | st.floats(-5, 5),
                       min_size=1, max_size=40),
       k=st.integers(0, 45))
def test_ranked_logprobs_rank_like_a_full_sort_by_value_then_id(values, k):
    """Ties at the k-th place, NaNs (ranked last) and k beyond the row: the same ids and values as
    sorting the whole row by (-value, id)."""
    row = np.array(values)
    expected = sorted(range(len(row)), key=lambda i: (np.isnan(row[i]), -row[i] if not np.isnan(row[i]) else 0, i))[:k]
    own, ranked = ranked_logprobs(row, 0, k)
    assert [i for i, _ in ranked] == expected
    assert [v for _, v in ranked] == pytest.approx([row[i] for i in expected], nan_ok=True)
    assert own == pytest.approx(row[0], nan_ok=True)


SPECIAL = [0.0, -0.0, 1.0, -1.0, 2.5, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3e38, -3e38]
# around both ends of the order-safe range, inside and out; where finite logits overflow (1e-300) or
# underflow (1e300) in float64; and ordinary ones
TEMPERATURES = [1e-300, 1e-31, 1e-30, 1e-20, 0.3, 0.7, 1.0, 1.5, 1e20, 1e30, 1e31, 1e300, np.inf]


def the_definition(logits, params, token_index):
    """sample_token as its rule reads, with the whole row stably sorted."""
    scaled = logits.astype(np.float64) / params.temperature
    order = np.argsort(-scaled, kind="stable")[:params.top_k or None]
    probs = np.exp(scaled[order] - scaled[order[0]])
    probs /= probs.sum()
    if params.top_p < 1:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
        probs = probs[:keep] / probs[:keep].sum()
    cdf = np.cumsum(probs)
    return int(order[min(int(np.searchsorted(cdf, token_uniform(params.seed, token_index) * cdf[-1], side="right")),
                         len(order) - 1)])


@settings(max_examples=400, deadline=None)
@given(values=st.lists(st.sampled_from(SPECIAL) | st.floats(-4, 4, width=32), min_size=1, max_size=60),
       spread=st.sampled_from([1, 0, 5000]), dtype=st.sampled_from([np.float32, np.float64]),
       temperature=st.sampled_from(TEMPERATURES), k=st.integers(0, 70), top_p=st.sampled_from([1.0, 0.9, 0.3]),
       seed=st.integers(0, 2**64 - 1))
def test_sampling_order_and_draw_are_the_stable_sorts(values, spread, dtype, temperature, k, top_p, seed):
    """Ties, +-0, infinities, NaN, subnormals and the largest float32s, at temperatures inside and outside
    the range where a float32 row is ranked on its own values; rows padded with 5000 random values go
    through the partition and the key sort at a size where they pay: the ids must be exactly the
    stable argsort's, and the drawn token the one the definition draws."""
    rng = np.random.default_rng(seed % 2**32)
    row = np.concatenate([np.array(values), rng.standard_normal(spread if spread > 1 else 0)]).astype(dtype)
    row = row if spread else np.repeat(row, 3)  # spread 0: every value three times, tied
    with np.errstate(all="ignore"):  # finite logits overflow or underflow at the extreme temperatures
        want = np.argsort(-(row.astype(np.float64) / temperature), kind="stable")
        assert sampling_order(row, temperature, k).tolist() == (want[:k] if k else want).tolist()
        params = SamplingParams(temperature=temperature, top_k=k, top_p=top_p, seed=seed)
        for index in (0, 7):
            assert sample_token(row, params, index) == the_definition(row, params, index)


@given(seed=st.integers(-2**63, 2**64 - 1), index=st.integers(0, 2**20))
def test_a_tokens_draw_is_philox_keyed_by_seed_and_index(seed, index):
    """token_uniform keeps one generator per thread and re-keys it: each draw must be the first double
    of a fresh numpy Philox keyed by (seed mod 2**64, index), whatever was drawn before it."""
    for i in (index, index + 1):
        key = np.array([seed % 2**64, i], dtype=np.uint64)
        assert token_uniform(seed, i) == np.random.Generator(np.random.Philox(key=key)).random()


def test_seeds_from_two_to_the_63_keep_their_own_draws():
    """A key given to Philox as a Python list of a large int and a small one went through float64, so
    neighbouring seeds above 2**63 (negative seeds among them, taken mod 2**64) drew alike."""
    draws = {token_uniform(seed, 0) for seed in [2**63 + 1, 2**63 + 2, 2**64 - 1, -2, -3]}
    assert len(draws) == 5


def test_log_softmax_of_uniform_logits_is_minus_log_vocab():
    np.testing.assert_allclose(log_softmax(np.full(5, 3.0)), np.full(5, -math.log(5)), rtol=1e-15)


def test_the_building_blocks_keep_float32_inputs_in_float32():
    """The calibration's float32 reference: one float64 constant would promote everything after it."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((3, 2, 4)).astype(np.float32) for _ in range(3))  # [seq 3, heads 2, head_dim 4]
    positions = np.arange(3)
    assert apply_rope(q, positions, theta=10000.0).dtype == np.float32
    assert causal_attention(q, k, v, positions).dtype == np.float32
    assert rms_norm(q, np.ones(4, dtype=np.float32), eps=1e-6).dtype == np.float32
    np.testing.assert_allclose(causal_attention(q, k, v, positions),
                               causal_attention(*(a.astype(np.float64) for a in (q, k, v)), positions), rtol=1e-5)


@pytest.mark.parametrize("field, kwargs", [("temperature", {"temperature": -1.0}), ("max_tokens", {"max_tokens": 0}),
                                           ("top_k", {"top_k": -1}), ("top_p", {"top_p": 0.0})])
def test_bad_sampling_params_are_refused_naming_the_field(field, kwargs):
    with pytest.raises(RefengineError, match=f"^{field}:"):
        SamplingParams(**kwargs)
