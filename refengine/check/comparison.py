"""Judging one request's run against a baseline run of the same request: exact, or by the margin rule.

Exact (invariant mode): every token id and every logits row (its sha256) must be identical.
Margin-explained (fast mode, float32 vs float64): tokens must be identical, except at a first
divergence the margin rule (check.margin_rule) forgives; on every agreeing step the largest logit
deviation must stay within `noise_tolerance`. Both tolerances come from a calibration
(check.calibrate), never from the runs being judged.
An aborted run's tokens need only be a prefix of the other's.
"""
from __future__ import annotations

import numpy as np

from .margin_rule import Verdict, first_divergence


def logit_deviation(got, want) -> float | None:
    if got is None or want is None:
        return None
    return float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))


def compare_request(request_id: str, got, want, *, exact: bool, margin_tolerance: float = 0.0,
                    noise_tolerance: float = 0.0) -> Verdict:
    """`got` / `want`: objects with token_ids, finish_reason and steps (sampling.StepRecord: token_id,
    top2_margin, logits_sha256 and logits where kept, `step` on an engine's records)."""
    tolerance = 0.0 if exact else margin_tolerance
    seen = 0.0

    def verdict(kind, reason, i, deviation=None, got_token=None, want_token=None):
        return Verdict(request_id, kind, reason=reason, index=i,
                       engine_step=got.steps[i].step if i < len(got.steps) else None, got=got_token,
                       want=want_token, margin=want.steps[i].top2_margin if i < len(want.steps) else None,
                       tolerance=tolerance, deviation=deviation, max_agreeing_deviation=seen,
                       noise_tolerance=None if exact else noise_tolerance)

    for i, (g, w) in enumerate(zip(got.steps, want.steps)):
        deviation = logit_deviation(g.logits, w.logits)
        if g.token_id != w.token_id:
            kind = "diverged" if exact else first_divergence(w.top2_margin, margin_tolerance)
            reason = "token differs" + (" where the baseline margin is within tolerance" if kind == "explained" else "")
            return verdict(kind, reason, i, deviation, g.token_id, w.token_id)
        if exact and g.logits_sha256 is not None and w.logits_sha256 is not None \
                and g.logits_sha256 != w.logits_sha256:
            return verdict("diverged", "same token but the logits row differs (bitwise)", i, deviation,
                           g.token_id, w.token_id)
        if not exact and deviation is not None and deviation > noise_tolerance:
            return verdict("diverged", "logit deviation above the noise tolerance", i, deviation,
                           g.token_id, w.token_id)
        seen = max(seen, deviation or 0.0)
    n_got, n_want = len(got.token_ids), len(want.token_ids)
    got_cut, want_cut = got.finish_reason == "abort", want.finish_reason == "abort"
    match = Verdict(request_id, "match", max_agreeing_deviation=seen, tolerance=tolerance,
                    noise_tolerance=None if exact else noise_tolerance)
    if (got_cut and (n_got <= n_want or want_cut)) or (want_cut and n_want <= n_got):
        return match  # an aborted run is a prefix
    if n_got < n_want:
        return verdict("diverged", f"ended early ({got.finish_reason})", n_got, None, None, want.token_ids[n_got])
    if n_got > n_want:
        return verdict("diverged", f"ran past the baseline's end ({want.finish_reason})", n_want, None,
                       got.token_ids[n_want], None)
    if got.finish_reason != want.finish_reason:
        return verdict("diverged", f"finish_reason {got.finish_reason} != {want.finish_reason}",
                       n_got - 1, None, got.token_ids[-1], want.token_ids[-1])
    return match
