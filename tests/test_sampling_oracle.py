"""The sampling oracle (refengine.check.sampling_oracle) on rows whose answers are known by hand, against
the HF formula, and as a negative control: the catalogued fault `top-p-excludes-crossing-token` must
make the sampling properties fail, and a clean engine must pass them."""
from dataclasses import replace

import numpy as np
import pytest

from refengine.check.sampling_oracle import chi2_sf, goodness_of_fit, nucleus
from refengine.engine import llm_engine
from refengine.sampling import SamplingParams, sample_token
from refengine.strategies import SAMPLERS
from refengine.suite.harness import PropertyFailure
from refengine.suite.test_sampling import (
    check_first_token_distribution,
    check_sampled_support,
)

FAULT = "top-p-excludes-crossing-token"
# Probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625 exactly (these powers of two survive log/exp/sum
# unrounded): cumulative sums 0.5, 0.75, 0.875, 0.9375, 1; the last two tie.
DYADIC = np.log([8.0, 4.0, 2.0, 1.0, 1.0])
PROBS = np.array([0.5, 0.25, 0.125, 0.0625, 0.0625])


def kept(logits, **params):
    return np.flatnonzero(nucleus(logits, **params).probs > 0).tolist()


@pytest.mark.parametrize("top_p, expected", [
    (0.75, [0, 1]),             # exactly at a cumulative sum: the token that reaches it is in, the next out
    (0.75 - 1e-9, [0, 1]),      # just below: token 1 crosses it, so it is in
    (0.75 + 1e-9, [0, 1, 2]),   # just above: token 2 is the one that crosses
    (0.5, [0]), (0.5 + 1e-9, [0, 1]), (0.3, [0]), (0.875, [0, 1, 2]), (1.0, [0, 1, 2, 3, 4]),
])
def test_top_p_boundary(top_p, expected):
    assert kept(DYADIC, temperature=1.0, top_p=top_p) == expected
    n = nucleus(DYADIC, 1.0, top_p=top_p)
    assert n.inside.tolist() == n.allowed.tolist() == [i in expected for i in range(5)]
    np.testing.assert_allclose(n.probs[expected], PROBS[expected] / PROBS[expected].sum())


def test_top_p_boundary_inside_an_exact_tie():
    """Tokens 3 and 4 tie: past 0.875 one of them crosses, and either may be the one."""
    n = nucleus(DYADIC, 1.0, top_p=0.9)
    assert n.inside.tolist() == [True, True, True, False, False]
    assert n.allowed.tolist() == [True] * 5


def test_top_k_keeps_ties_at_the_kth_value_and_runs_before_top_p():
    logits = np.array([3.0, 1.0, 2.0, 2.0, 0.0])
    assert kept(logits, temperature=1.0, top_k=1) == [0]
    assert kept(logits, temperature=1.0, top_k=2) == [0, 2, 3]   # HF / vLLM: `scores < kth` is dropped
    assert kept(logits, temperature=1.0, top_k=3) == [0, 2, 3]
    # top-p on the top-k survivors, renormalized: with k = 1 the nucleus is the argmax whatever top_p
    assert kept(logits, temperature=1.0, top_k=1, top_p=0.99) == [0]
    renormalized = np.exp([3.0, 2.0, 2.0]) / np.exp([3.0, 2.0, 2.0]).sum()   # 0.576, 0.212, 0.212
    assert renormalized[0] < 0.7 < renormalized[:2].sum()
    # 2 and 3 tie: the exact target breaks the tie by id (0.576 + 0.212 crosses 0.7), the support allows either
    assert kept(logits, temperature=1.0, top_k=2, top_p=0.7) == [0, 2]
    assert nucleus(logits, 1.0, top_k=2, top_p=0.7).ambiguous.tolist() == [False, False, True, True, False]


def test_temperature_scales_before_the_cut():
    logits = np.log([0.6, 0.3, 0.1])
    hot, cold = nucleus(logits, 2.0).probs, nucleus(logits, 0.5).probs
    np.testing.assert_allclose(hot, np.sqrt([0.6, 0.3, 0.1]) / np.sqrt([0.6, 0.3, 0.1]).sum())
    np.testing.assert_allclose(cold, np.square([0.6, 0.3, 0.1]) / np.square([0.6, 0.3, 0.1]).sum())
    assert kept(logits, temperature=1.0, top_p=0.85) == [0, 1]
    assert kept(logits, temperature=2.0, top_p=0.85) == [0, 1, 2]   # flatter: 0.44 + 0.31 < 0.85
    assert kept(logits, temperature=1.0, top_p=0.75) == [0, 1]      # 0.6 < 0.75: token 1 crosses
    assert kept(logits, temperature=0.5, top_p=0.75) == [0]         # sharper: token 0 alone is 0.78
    assert kept(logits, temperature=0.0) == [0]                     # greedy


def test_noise_allows_only_ties_it_can_flip():
    logits = np.array([1.0, 1.0 - 1e-5, 0.0, -5.0])
    strict, noisy = nucleus(logits, 1.0, top_k=1), nucleus(logits, 1.0, top_k=1, logit_noise=1e-5)
    assert strict.allowed.tolist() == [True, False, False, False]
    assert noisy.allowed.tolist() == [True, True, False, False] and not noisy.inside.any()
    # top-p: the mass before token 1 is 0.5; a boundary that close to it leaves token 1 undecided
    near = nucleus(DYADIC, 1.0, top_p=0.5 + 1e-6, logit_noise=1e-5)
    assert near.inside.tolist() == [True, False, False, False, False]
    assert near.allowed.tolist() == [True, True, False, False, False]
    far = nucleus(DYADIC, 1.0, top_p=0.6, logit_noise=1e-5)
    assert far.inside.tolist() == far.allowed.tolist() == [True, True, False, False, False]


@pytest.mark.parametrize("seed", range(20))
def test_agrees_with_the_hf_formula_and_contains_sample_token(seed):
    """HF's TopK/TopP warpers written out in numpy (ascending sort, drop cumsum <= 1 - top_p, keep the
    last); and refengine's sample_token never draws outside the exact support."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(64) * rng.uniform(0.5, 4)
    temperature, top_k, top_p = rng.choice([0.6, 1.0, 1.5]), int(rng.choice([0, 1, 5, 20])), rng.uniform(0.05, 1)
    scores = logits / temperature
    if top_k:
        scores = np.where(scores < np.sort(scores)[-top_k], -np.inf, scores)
    ascending = np.argsort(scores, kind="stable")
    probs = np.exp(scores[ascending] - scores.max())
    removed = np.cumsum(probs / probs.sum()) <= 1 - top_p
    removed[-1] = False
    scores[ascending[removed]] = -np.inf
    assert kept(logits, temperature=temperature, top_k=top_k, top_p=top_p) == np.flatnonzero(scores > -np.inf).tolist()
    support = set(kept(logits, temperature=temperature, top_k=top_k, top_p=top_p))
    params = SamplingParams(temperature=float(temperature), top_k=top_k, top_p=float(top_p), seed=seed)
    assert {sample_token(logits, params, i) for i in range(50)} <= support


def test_chi2_tail_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 10, 51, 200):
        for x in (0.5, df, df + 5 * np.sqrt(2 * df), 4 * df + 40):
            assert chi2_sf(x, df) == pytest.approx(stats.chi2.sf(x, df), rel=1e-9, abs=1e-300)


def test_goodness_of_fit_flags_a_missing_token_and_a_draw_outside():
    probs = np.array([0.5, 0.3, 0.2, 0.0])
    fair = np.repeat([0, 1, 2], [500, 300, 200])
    assert goodness_of_fit(fair, probs).passed(1e-6)
    assert not goodness_of_fit(np.repeat([0, 1], [620, 380]), probs).passed(1e-6)   # token 2 never drawn
    outside = goodness_of_fit(np.append(fair, 3), probs)
    assert not outside.passed(1e-6) and outside.outside == {3: 1}


# ---- the fault catalog's sampling fault ------------------------------------------------------------

CAUGHT_SAMPLER = {"temperature": 1.0, "top_k": 40, "top_p": 0.5}   # a small nucleus: its crossing token is big


def test_distribution_catches_a_nucleus_that_stops_before_the_crossing_token():
    check_first_token_distribution(CAUGHT_SAMPLER)
    with pytest.raises(PropertyFailure, match="observed 0"):
        check_first_token_distribution(CAUGHT_SAMPLER, fault=FAULT)


def test_the_fault_is_caught_by_several_samplers_and_spares_the_rest():
    caught = []
    for sampler in SAMPLERS:
        try:
            check_first_token_distribution(sampler, fault=FAULT)
        except PropertyFailure:
            caught.append(sampler)
    assert len(caught) >= 3 and all(s["top_p"] < 1 for s in caught), caught


SCHEDULE = {"engine": {"mode": "invariant", "max_num_seqs": 2, "max_num_batched_tokens": 16, "block_size": 4,
                       "max_model_len": 128, "num_blocks": 16},
            "requests": [{"id": f"r{n}", "prompt_ids": [5 + n, 9, 13, 21], "max_tokens": 8, "ignore_eos": True,
                          "sampling": {"temperature": 1.5, "top_k": 2, "top_p": 1.0, "seed": n}} for n in range(3)]}


def test_support_property_catches_a_draw_outside_top_k(monkeypatch):
    """Excluding a token never draws outside the support (the distribution sees that fault); a
    nucleus one token too wide does, and the support property must name it."""
    assert check_sampled_support("qwen3-gqa2-tied", SCHEDULE) == 24
    wide = lambda logits, params, index: sample_token(logits, replace(params, top_k=params.top_k + 1), index)  # noqa: E731
    monkeypatch.setattr(llm_engine, "sample_token", wide)
    with pytest.raises(PropertyFailure, match="outside the float64 support"):
        check_sampled_support("qwen3-gqa2-tied", SCHEDULE)
