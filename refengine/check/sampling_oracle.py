"""The sampling oracle: which tokens a seeded request may draw from one float64 logits row, and with
what probability. Written afresh from the HF / vLLM definitions; it shares no code with
refengine.sampling (which the engine and the reference both use), so a wrong nucleus, top-k or
temperature there cannot also be wrong here.

The definition (transformers' TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper, and
vLLM's sampler: temperature, then `_apply_top_k_top_p`, which does top-k then top-p):
- temperature: s = logits / T (T = 0 is greedy: the argmax, as top_k = 1);
- top-k: keep every token with s >= the k-th largest s (ties at the k-th value are all kept);
- top-p, on the softmax of the top-k survivors: sort by probability descending; a token is kept
  iff the mass strictly before it is < top_p. So the token whose cumulative probability reaches or
  crosses top_p is INSIDE the nucleus (HF/vLLM sort ascending and drop tokens whose ascending
  cumulative sum is <= 1 - top_p: the same set); top_p = 1 keeps all;
- the target distribution is the softmax of s over the kept tokens.

Ties the float32 engine may flip: its logits differ from float64 by at most `logit_noise` each (the
calibrated bound the suite enforces), so each scaled logit by eps = logit_noise / T and each
unnormalized weight exp(s) by a factor within exp(+-eps). `Nucleus.inside` holds the tokens kept
under every such perturbation, `Nucleus.allowed` those kept under at least one; a token in between
(`ambiguous`) sits within noise of a boundary and may be in or out. With logit_noise = 0 and no
exact ties, inside == allowed == (probs > 0).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Nucleus:
    probs: np.ndarray    # [vocab] float64: the target distribution by the exact float64 definition
    inside: np.ndarray   # [vocab] bool: kept whatever the float32 noise does
    allowed: np.ndarray  # [vocab] bool: kept for some admissible noise (what a draw may be)

    @property
    def ambiguous(self) -> np.ndarray:
        return self.allowed & ~self.inside

    @property
    def support(self) -> np.ndarray:
        """The exact float64 support: the token ids the target gives positive probability."""
        return np.flatnonzero(self.probs > 0)


def nucleus(logits, temperature: float, top_k: int = 0, top_p: float = 1.0, logit_noise: float = 0.0) -> Nucleus:
    """The oracle for one logits row (any float dtype; computed in float64)."""
    logits = np.asarray(logits, dtype=np.float64)
    vocab = logits.shape[-1]
    if temperature == 0:  # greedy is the argmax: top-1 at any temperature
        temperature, top_k, top_p = 1.0, 1, 1.0
    s = logits / temperature
    eps = logit_noise / temperature
    order = np.argsort(-s, kind="stable")           # descending, lower id first on ties
    desc = s[order]
    neg = -desc                                      # ascending: searchsorted counts the tokens above a value
    k = top_k if 0 < top_k < vocab else vocab        # top-k off: every token is kept
    in_k = s >= desc[k - 1]                          # exact top-k (ties at the k-th value kept)
    # a token is dropped when k others end up strictly above it; others that can (s_j > s - 2 eps,
    # which counts the token itself when eps > 0) and others that must (s_j > s + 2 eps):
    in_k_surely = np.searchsorted(neg, -(s - 2 * eps), side="left") - (eps > 0) < k
    in_k_maybe = np.searchsorted(neg, -(s + 2 * eps), side="left") < k
    weights = np.exp(s - desc[0])                    # unnormalized softmax; the max weighs 1

    probs = np.where(in_k, weights, 0.0)
    probs /= probs.sum()
    if top_p < 1:
        ranked = probs[order]
        before = np.concatenate([[0.0], np.cumsum(ranked)[:-1]])  # mass strictly before each token
        kept = np.zeros(vocab, dtype=bool)
        kept[order] = before < top_p
        probs = np.where(kept, probs, 0.0)
        probs /= probs.sum()

    if top_p >= 1:
        return Nucleus(probs, in_k_surely, in_k_maybe)
    lo, hi = _mass_before_bounds(s, order, neg, weights, in_k_surely, in_k_maybe, eps)
    inside, allowed = in_k_surely & (hi < top_p), in_k_maybe & (lo < top_p)
    if eps == 0:  # no noise: the exact rule (same rounding as probs) decides every token not in an exact tie
        untied = np.searchsorted(neg, -s, side="right") - np.searchsorted(neg, -s, side="left") == 1
        inside, allowed = np.where(untied, probs > 0, inside), np.where(untied, probs > 0, allowed)
    return Nucleus(probs, inside, allowed)


def _mass_before_bounds(s, order, neg, weights, surely_k, maybe_k, eps):
    """Per token j, bounds on the top-p mass before j after any admissible perturbation:
    `lo` counts only tokens surely ranked above j (s_i > s_j + 2 eps) and surely in the top-k, at
    weight exp(-eps), against everything else at exp(+eps); `hi` counts every token possibly ranked
    above j (s_i >= s_j - 2 eps, ties included) that may be in the top-k, at exp(+eps), against j and
    the tokens surely below it at exp(-eps). The fraction A / (A + R) grows with A and falls with R."""
    up, down = math.exp(eps), math.exp(-eps)
    n_surely_above = np.searchsorted(neg, -(s + 2 * eps), side="left")  # count of desc > s + 2 eps
    n_maybe_above = np.searchsorted(neg, -(s - 2 * eps), side="right")  # count of desc >= s - 2 eps (j too)
    cum_surely = np.concatenate([[0.0], np.cumsum(np.where(surely_k, weights, 0.0)[order])])
    cum_maybe = np.concatenate([[0.0], np.cumsum(np.where(maybe_k, weights, 0.0)[order])])
    above_lo = down * cum_surely[n_surely_above]
    rest_hi = up * (cum_maybe[-1] - cum_maybe[n_surely_above])
    above_hi = up * (cum_maybe[n_maybe_above] - np.where(maybe_k, weights, 0.0))
    rest_lo = down * (weights + cum_surely[-1] - cum_surely[n_maybe_above])
    return above_lo / (above_lo + rest_hi), above_hi / (above_hi + rest_lo)


# ---- goodness of fit: draws against a target distribution ------------------------------------------

def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df), exactly (closed forms for integer df; no scipy):
    even df: exp(-x/2) sum_{i<df/2} (x/2)^i / i!; odd df: erfc(sqrt(x/2)) plus the half-integer terms."""
    if x <= 0:
        return 1.0
    half = x / 2
    if df % 2 == 0:
        terms = (i * math.log(half) - math.lgamma(i + 1) for i in range(df // 2))
        return min(1.0, sum(math.exp(t - half) for t in terms))
    terms = ((i + 0.5) * math.log(half) - math.lgamma(i + 1.5) for i in range((df - 1) // 2))
    return min(1.0, math.erfc(math.sqrt(half)) + sum(math.exp(t - half) for t in terms))


@dataclass(frozen=True)
class Fit:
    statistic: float      # Pearson's X^2 over the pooled bins
    df: int
    p_value: float
    bins: int
    outside: dict         # token id -> count, for draws the target gives probability 0
    worst: list           # the bins contributing most: (token ids, observed, expected)

    def passed(self, alpha: float) -> bool:
        return not self.outside and self.p_value >= alpha

    def describe(self) -> str:
        worst = "; ".join(f"tokens {ids[:6]}{'...' if len(ids) > 6 else ''}: observed {o}, expected {e:.1f}"
                          for ids, o, e in self.worst)
        outside = f"draws outside the support {self.outside}; " if self.outside else ""
        return f"{outside}X^2 = {self.statistic:.1f} on {self.df} df, p = {self.p_value:.3g} ({worst})"


def goodness_of_fit(draws, probs, min_expected: float = 20.0) -> Fit:
    """Pearson's chi-square of `draws` (token ids) against `probs`. Tokens are pooled in order of
    probability (descending) into bins of expected count >= min_expected (the last partial bin joins
    the one before). At 20 the chi-square tail is accurate far out: simulated at 1000 draws, nominal
    1e-4 / 1e-5 gave 1.1-1.3e-4 / <= 1e-5 (at 5 the tail is 2-4x heavier). A draw outside the support is reported
    apart (`outside`): under the target it has probability 0, so no test statistic is needed."""
    draws = np.asarray(draws)
    n = len(draws)
    counts = np.bincount(draws, minlength=len(probs))
    outside = {int(t): int(counts[t]) for t in np.flatnonzero((probs <= 0) & (counts > 0))}
    ranked = [int(t) for t in np.argsort(-probs, kind="stable") if probs[t] > 0]
    bins, current, mass = [], [], 0.0
    for token in ranked:
        current.append(token)
        mass += probs[token]
        if mass * n >= min_expected:
            bins.append(current)
            current, mass = [], 0.0
    if current:
        if bins:
            bins[-1] += current
        else:
            bins.append(current)
    observed = np.array([counts[b].sum() for b in bins], dtype=np.float64)
    expected = np.array([probs[b].sum() * n for b in bins])
    terms = (observed - expected) ** 2 / expected
    statistic = float(terms.sum())
    df = max(len(bins) - 1, 1)
    worst = [(bins[i], int(observed[i]), float(expected[i])) for i in np.argsort(-terms)[:3]]
    return Fit(statistic, df, chi2_sf(statistic, df) if len(bins) > 1 else 1.0, len(bins), outside, worst)
