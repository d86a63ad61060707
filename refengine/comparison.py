"""Judging one request's tokens against a baseline run of the same request: exact, or margin-explained.

Exact (invariant mode): every token id and every logits row (its sha256) must be identical.
Margin-explained (fast mode, float32 vs float64): tokens must be identical, except that at the first
differing token the baseline's top-2 margin may be within `margin_tolerance` (the two best tokens
were close enough for rounding to swap them); the comparison of that request stops there, since
every later token follows from a different prefix. On every agreeing step the largest logit
deviation must stay within `noise_tolerance`. Both tolerances come from a calibration
(refengine.calibrate), never from the runs being judged.
An aborted run's tokens need only be a prefix of the other's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .reference import KVCache, forward
from .sampling import greedy_token, top2_margin
from .stopping import finish_reason


@dataclass(frozen=True)
class Verdict:
    request_id: str
    kind: str                        # "match" | "explained" | "diverged" | "skipped"
    reason: str = ""                 # what differed, for a divergence
    index: int | None = None         # generated-token index where the runs part
    step: int | None = None          # engine step of that token in the judged run
    got: int | None = None           # judged run's token there (None: it had ended)
    want: int | None = None          # baseline's token there (None: it had ended)
    margin: float | None = None      # baseline top-2 margin there
    tolerance: float | None = None   # the margin tolerance applied (0 when exact)
    deviation: float | None = None   # max |logit difference| at that token
    max_agreeing_deviation: float = 0.0  # max |logit difference| over the agreeing tokens before it
    noise_tolerance: float | None = None

    @property
    def passed(self) -> bool:
        return self.kind != "diverged"

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def tolerance(calibration: dict, bound: str) -> float:
    """A calibrated noise bound ("f32_batched_vs_serial" or "f32_vs_f64") times its safety factor."""
    if calibration is None:
        raise ValueError(f"the margin rule needs a calibration (refengine.calibrate) for its {bound} bound")
    return calibration[bound] * calibration["safety_factor"]


def logit_deviation(got, want) -> float | None:
    if got is None or want is None:
        return None
    return float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))


def compare_request(request_id: str, got, want, *, exact: bool, margin_tolerance: float = 0.0,
                    noise_tolerance: float = 0.0) -> Verdict:
    """`got` / `want`: objects with token_ids, finish_reason and steps (token_id, top2_margin,
    logits_sha256, logits — None where not kept; `step` on the judged run's records)."""
    tolerance = 0.0 if exact else margin_tolerance
    seen = 0.0

    def verdict(kind, reason, i, deviation=None, got_token=None, want_token=None):
        margin = want.steps[i].top2_margin if i < len(want.steps) else None
        step = got.steps[i].step if i < len(got.steps) else None
        return Verdict(request_id, kind, reason, i, step, got_token, want_token, margin, tolerance, deviation,
                       seen, None if exact else noise_tolerance)

    for i, (g, w) in enumerate(zip(got.steps, want.steps)):
        deviation = logit_deviation(g.logits, w.logits)
        if g.token_id != w.token_id:
            if not exact and w.top2_margin <= margin_tolerance:
                return verdict("explained", "token differs where the baseline margin is within tolerance",
                               i, deviation, g.token_id, w.token_id)
            return verdict("diverged", "token differs", i, deviation, g.token_id, w.token_id)
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
    if (got_cut and (n_got <= n_want or want_cut)) or (want_cut and n_want <= n_got):
        return Verdict(request_id, "match", max_agreeing_deviation=seen)  # an aborted run is a prefix
    if n_got < n_want:
        return verdict("diverged", f"ended early ({got.finish_reason})", n_got, None, None, want.token_ids[n_got])
    if n_got > n_want:
        return verdict("diverged", f"ran past the baseline's end ({want.finish_reason})", n_want, None,
                       got.token_ids[n_want], None)
    if got.finish_reason != want.finish_reason:
        return verdict("diverged", f"finish_reason {got.finish_reason} != {want.finish_reason}",
                       n_got - 1, None, got.token_ids[-1], want.token_ids[-1])
    return Verdict(request_id, "match", max_agreeing_deviation=seen)


def describe(v: Verdict, got_name: str = "batched", want_name: str = "serial") -> str:
    if v.kind == "match":
        return f"{v.request_id}: match (max logit deviation {v.max_agreeing_deviation:.3g})"
    if v.kind == "skipped":
        return f"{v.request_id}: not compared ({v.reason})"

    def fmt(x):
        return "-" if x is None else f"{x:.6g}"

    lines = [f"{v.request_id}: {v.kind} at generated token {v.index} (engine step {fmt(v.step)}): {v.reason}",
             f"  {got_name} token {v.got}, {want_name} token {v.want}",
             f"  {want_name} top-2 margin there {fmt(v.margin)}, margin tolerance {fmt(v.tolerance)}",
             f"  logit deviation there {fmt(v.deviation)}; max on the agreeing tokens before "
             f"{v.max_agreeing_deviation:.3g}" + ("" if v.noise_tolerance is None
                                                  else f" (noise tolerance {v.noise_tolerance:.3g})")]
    return "\n".join(lines)


@dataclass(frozen=True)
class BaselineStep:
    token_id: int
    top2_margin: float
    logits: np.ndarray
    logits_sha256: str | None = None
    step: int | None = None


@dataclass(frozen=True)
class Baseline:
    token_ids: list[int]
    finish_reason: str
    steps: list[BaselineStep]


def reference_baseline(model, prompt_ids, params) -> Baseline:
    """The float64 reference's greedy run with every step's logits row, stopping as the engine stops."""
    if not params.greedy:
        raise ValueError("the reference decodes greedily; seeded requests have no float64 baseline")
    weights, cfg = model.weights(np.float64), model.config
    cache, detok = KVCache(), model.tokenizer.detokenizer()
    logits = forward(weights, cfg, model.check_prompt(prompt_ids), cache)[-1]
    steps = []
    while True:
        token = greedy_token(logits)
        steps.append(BaselineStep(token, top2_margin(logits), logits))
        detok.push(token)
        reason = finish_reason(token, len(steps), detok.text, params, cfg.eos_token_ids)
        if reason:
            return Baseline([s.token_id for s in steps], reason, steps)
        logits = forward(weights, cfg, [token], cache)[-1]
