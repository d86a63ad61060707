"""Judging one request's run against a baseline run of the same request: exact, or by the margin rule.

Exact (invariant mode): every token id and every logits row (its sha256) must be identical, and so
must the row a request's logits processors made from it, where it has any (StepRecord.adjusted).
Margin-explained (fast mode, float32 vs float64): tokens must be identical, except at a first
divergence the margin rule (check.margin_rule) forgives; on every agreeing step the largest logit
deviation must stay within `noise_tolerance`, and a processed row's within `margin_tolerance` (the
noise as processing can grow it: check.margin_rule.processed_noise_gain). Both tolerances come from a calibration
(check.calibrate), never from the runs being judged.
An aborted run's tokens need only be a prefix of the other's.

Prompt logprobs, where the request asked for them (`num_prompt_logprobs`), before any generated token:
the same positions, each naming the same prompt token; exact mode, every value (logprob, rank,
alternatives, the row's sha256) bit-identical; otherwise the row within `noise_tolerance`, the logprob
and alternatives within logprob_tolerance of the baseline row's float64 log-softmax, and the rank
between the ranks that tolerance allows there. A run aborted before its first token need only have
scored a prefix of the other's.

Logprobs, where the request asked for them (`num_logprobs`: the alternatives requested, 0 for the
chosen token's only), on every agreeing step: exact mode, the chosen token's logprob and the
alternatives (ids, order, values) bit-identical to the baseline's; otherwise each reported value
within `logprob_tolerance` of the float64 log-softmax of the baseline's logits row at the same id,
and every reported alternative among the baseline's top-K up to that tolerance.
"""
from __future__ import annotations

import numpy as np

from ..sampling import log_softmax, ranked_logprobs
from .margin_rule import Verdict, first_divergence
from .output_oracle import log_softmax as oracle_log_softmax


def logprob_tolerance(logit_tolerance: float) -> float:
    """The bound on a log-probability given the bound on its logits row: a logprob is its logit minus
    the row's logsumexp, and a row within d (max |difference|) of another moves each of the two by at
    most d, so its logprobs by at most 2 d (the log-softmax itself is float64: exact at this scale)."""
    return 2 * logit_tolerance


def _value(x) -> str:
    return "none" if x is None else repr(float(x))


def logprob_difference(got, want, num_logprobs: int, *, exact: bool, tolerance: float = 0.0,
                       names: tuple[str, str] = ("got", "baseline")) -> str | None:
    """None when step `got`'s reported logprobs (sampling.StepRecord: logprob, top_logprobs) agree with
    the baseline step `want` (same token): its chosen token's, and its first `num_logprobs`
    alternatives; else what differs, naming the token, both values and the bound."""
    got_name, want_name = names
    alternatives = list(got.top_logprobs[:num_logprobs])
    if got.logprob is None:
        return f"no logprob reported, {num_logprobs} alternatives requested"
    expected = num_logprobs if got.logits is None else min(num_logprobs, len(got.logits))
    if len(alternatives) != expected:
        return f"{len(alternatives)} alternatives reported, {num_logprobs} requested"
    if exact:  # batched against alone: the engine's own arithmetic on both sides, bit for bit
        if want.logits is not None and want.logprob is None:
            want_own, want_alternatives = ranked_logprobs(log_softmax(np.asarray(want.logits, np.float64)),
                                                          want.token_id, num_logprobs)
        else:
            want_own, want_alternatives = want.logprob, list(want.top_logprobs[:num_logprobs])
        if got.logprob != want_own:
            return (f"logprob of the chosen token {got.token_id} not bit-identical: {got_name} {_value(got.logprob)}, "
                    f"{want_name} {_value(want_own)} (bound 0)")
        for rank, (g, w) in enumerate(zip(alternatives, want_alternatives)):
            if g != w:
                return (f"top_logprobs[{rank}] not bit-identical: {got_name} token {g[0]} {_value(g[1])}, "
                        f"{want_name} token {w[0]} {_value(w[1])} (bound 0)")
        if len(alternatives) != len(want_alternatives):
            return f"{len(alternatives)} alternatives, {want_name} {len(want_alternatives)}"
        return None
    row = None if want.logits is None else oracle_log_softmax(want.logits)  # defined apart (check.output_oracle)
    if row is None:  # no baseline row: compare by id where the baseline reported one
        known = dict(want.top_logprobs)
        pairs = [(got.token_id, got.logprob, want.logprob)] + [(i, v, known.get(i)) for i, v in alternatives]
    else:
        pairs = [(got.token_id, got.logprob, row[got.token_id])] + [(i, v, row[i]) for i, v in alternatives]
    for n, (token, g, w) in enumerate(pairs):
        if w is not None and not abs(g - w) <= tolerance:
            what = "logprob of the chosen token" if n == 0 else f"top_logprobs[{n - 1}], token"
            return (f"{what} {token}: {got_name} {_value(g)}, {want_name} {_value(w)}, |difference| "
                    f"{abs(g - w):.3g} > bound {tolerance:.3g}")
    if row is not None and alternatives:
        kth = float(np.partition(row, len(row) - len(alternatives))[len(row) - len(alternatives)])
        for rank, (token, g) in enumerate(alternatives):
            if row[token] < kth - tolerance:
                return (f"top_logprobs[{rank}] is token {token} ({_value(g)}), not among the {want_name}'s top "
                        f"{len(alternatives)}: its logprob there {_value(row[token])} < the {len(alternatives)}th "
                        f"best {_value(kth)} - bound {tolerance:.3g}")
    return None


def _rank_bounds(row: np.ndarray, token: int, tolerance: float) -> tuple[int, int]:
    """The ranks `token` may report in a row known up to `tolerance` per logprob: 1 + the other ids surely
    more likely, to 1 + the other ids that may be."""
    own, others = row[token], np.delete(row, token)
    surely, maybe = np.count_nonzero(others > own + 2 * tolerance), np.count_nonzero(others > own - 2 * tolerance)
    return 1 + int(surely), 1 + int(maybe)


def prompt_difference(got, want, num_logprobs: int, *, exact: bool, noise_tolerance: float = 0.0,
                      names: tuple[str, str] = ("got", "baseline")) -> tuple[int, str] | None:
    """None when the prompt logprobs of `got` (sampling.PromptLogprob list) agree with `want`'s (module
    docstring), else (the prompt position, what differs there)."""
    got_name, want_name = names
    for g, w in zip(got, want):
        if (g.position, g.token_id) != (w.position, w.token_id):
            return w.position, (f"prompt logprob for token {g.token_id} at position {g.position}, {want_name}'s for "
                                f"token {w.token_id} at position {w.position}")
        if exact:
            if g.logits_sha256 is not None and w.logits_sha256 is not None and g.logits_sha256 != w.logits_sha256:
                return g.position, "its logits row differs (bitwise)"
            fields = [(name, getattr(g, name), getattr(w, name)) for name in ("logprob", "rank", "top_logprobs")]
            for name, a, b in fields:
                if a != b:
                    return g.position, f"{name} not bit-identical: {got_name} {a!r}, {want_name} {b!r} (bound 0)"
            continue
        deviation = logit_deviation(g.logits, w.logits)
        if deviation is not None and deviation > noise_tolerance:
            return g.position, f"logit deviation {deviation:.3g} above the noise tolerance {noise_tolerance:.3g}"
        tolerance = logprob_tolerance(noise_tolerance)
        problem = logprob_difference(g, w, num_logprobs, exact=False, tolerance=tolerance, names=names)
        if problem:
            return g.position, problem
        if w.logits is not None:
            low, high = _rank_bounds(oracle_log_softmax(w.logits), g.token_id, tolerance)
            if not low <= g.rank <= high:
                return g.position, f"rank {g.rank}, {want_name}'s row allows {low}-{high} (bound {tolerance:.3g})"
    return None


def _prompt_verdict(request_id: str, got, want, num_logprobs: int, exact: bool, noise_tolerance: float,
                    names: tuple[str, str]) -> Verdict | None:
    got_list, want_list = getattr(got, "prompt_logprobs", None), getattr(want, "prompt_logprobs", None)
    if got_list is None or want_list is None:
        missing = names[0] if got_list is None else names[1]
        return Verdict(request_id, "diverged", "prompt_logprobs", reason=f"{missing}: no prompt logprobs reported")
    part = next((i for i, (g, w) in enumerate(zip(got_list, want_list)) if g.position != w.position), None)
    cut_short = [run.finish_reason == "abort" and not run.token_ids for run in (got, want)]
    if part is None and len(got_list) != len(want_list) and not any(cut_short):
        part = min(len(got_list), len(want_list))
    if part is not None:
        def at(lst):
            return "(none)" if part >= len(lst) else f"position {lst[part].position} (token {lst[part].token_id})"
        return Verdict(request_id, "diverged", "prompt_logprobs", index=part + 1,
                       reason=f"{len(got_list)} prompt logprobs, {names[1]} {len(want_list)}: entry {part} is "
                              f"{at(got_list)} in {names[0]}, {at(want_list)} in {names[1]}")
    problem = prompt_difference(got_list, want_list, num_logprobs, exact=exact, noise_tolerance=noise_tolerance,
                                names=names)
    if problem:
        return Verdict(request_id, "diverged", "prompt_logprobs", index=problem[0], reason=problem[1],
                       tolerance=0.0 if exact else logprob_tolerance(noise_tolerance))
    return None


def logit_deviation(got, want) -> float | None:
    if got is None or want is None:
        return None
    return float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))


def adjusted_deviation(got, want) -> float | None:
    """The largest |difference| between two processed rows (StepRecord.adjusted); ids both rows rule out
    (-inf) agree, an id only one rules out is infinitely far. None where either row is not known."""
    if got is None or want is None:
        return None
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    both = np.isneginf(g) & np.isneginf(w)
    return float(np.max(np.abs(np.subtract(g, w, out=np.zeros_like(g), where=~both)), initial=0.0))


def compare_request(request_id: str, got, want, *, exact: bool, margin_tolerance: float = 0.0,
                    noise_tolerance: float = 0.0, num_logprobs: int | None = None,
                    num_prompt_logprobs: int | None = None, names: tuple[str, str] = ("got", "baseline")) -> Verdict:
    """`got` / `want`: objects with token_ids, finish_reason and steps (sampling.StepRecord: token_id,
    top2_margin, logits_sha256 and logits where kept, logprob and top_logprobs where asked for, `step`
    on an engine's records). `num_logprobs`: the alternatives the request asked for (None: no logprobs,
    nothing to compare); judged on every agreeing step, bit-exact or within
    logprob_tolerance(noise_tolerance). `num_prompt_logprobs`: the alternatives per prompt token the
    request asked for (None: no prompt logprobs), judged first."""
    if num_prompt_logprobs is not None:
        prompt_verdict = _prompt_verdict(request_id, got, want, num_prompt_logprobs, exact, noise_tolerance, names)
        if prompt_verdict is not None:
            return prompt_verdict
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
        processed = adjusted_deviation(g.adjusted, w.adjusted)
        if processed is not None and (processed != 0 if exact else processed > margin_tolerance):
            return verdict("diverged", f"same token but the row its penalties, bias and min_tokens made differs by "
                           f"{processed:.3g} (bound {0 if exact else margin_tolerance:.3g})", i, deviation,
                           g.token_id, w.token_id)
        if not exact and deviation is not None and deviation > noise_tolerance:
            return verdict("diverged", "logit deviation above the noise tolerance", i, deviation,
                           g.token_id, w.token_id)
        if num_logprobs is not None:
            problem = logprob_difference(g, w, num_logprobs, exact=exact, names=names,
                                         tolerance=logprob_tolerance(noise_tolerance))
            if problem:
                return verdict("diverged", problem, i, deviation, g.token_id, w.token_id)
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
