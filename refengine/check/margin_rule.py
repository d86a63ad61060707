"""The margin rule, and the Verdict every comparison in refengine returns.

A judged run's tokens must equal a baseline's, except that the FIRST divergence is forgiven where
the baseline's top-2 margin there is within the tolerance: the two best tokens were so close that
rounding may swap them. Comparison stops at the first divergence either way (every later token
follows from a different prefix). The tolerance is a calibrated noise bound times its safety factor
(refengine.check.calibrate), never something measured on the run being judged; 0 means bit-exact.

Two baselines use it: another run of the same request, with logits rows (check.comparison), and a
golden case, by token ids or, for servers that report none, by text (judge_ids / judge_text here).
"""
from __future__ import annotations

from dataclasses import dataclass

CONTEXT_CHARS = 40
SAFETY_FACTOR = 8  # every bound's multiplier: 2 (both logits of a pair move) x 4 (headroom; check.calibrate)


@dataclass(frozen=True)
class Verdict:
    id: str                              # the request or golden case judged
    kind: str                            # "match" | "explained" | "diverged" | "skipped"
    compared_by: str = "token_ids"       # "token_ids" | "text" | "prompt_logprobs"
    reason: str = ""                     # what differed, for a divergence; why, for "skipped"
    index: int | None = None             # generated-token index where the runs part (prompt_logprobs: prompt position)
    engine_step: int | None = None       # the engine step that produced that token in the judged run
    got: int | None = None               # judged token there (None: unknown, or the judged run had ended)
    want: int | None = None              # baseline token there (None: the baseline had ended)
    margin: float | None = None          # baseline top-2 margin there (None: the baseline had ended)
    tolerance: float | None = None       # the margin tolerance applied (0: bit-exact)
    deviation: float | None = None       # max |logit difference| at that token, where logits are known
    max_agreeing_deviation: float = 0.0  # max |logit difference| over the agreeing tokens before it
    noise_tolerance: float | None = None  # the bound on that deviation, where one applies
    want_text: str = ""                  # baseline text from the divergence on (golden cases)
    got_text: str = ""                   # judged text from the same position on

    @property
    def passed(self) -> bool:
        return self.kind != "diverged"

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None and v != ""}


def tolerance(calibration: dict, bound: str) -> float:
    """The margin rule's tolerance: a calibrated noise bound ("f32_batched_vs_serial" or "f32_vs_f64")
    times its safety factor. Golden headers carry the same dict as `noise`."""
    if calibration is None:
        raise ValueError(f"the margin rule needs a calibration (refengine.check.calibrate) for its {bound} bound")
    return calibration[bound] * calibration["safety_factor"]


def processed_noise_gain(params) -> float:
    """How much a request's logits processors can grow the noise of its rows: its margins are measured on
    the processed row (what the token is chosen from), in which the repetition penalty r scales every seen
    logit by r or 1/r; bias and the other penalties shift logits by the same amount on both sides of a
    comparison (computed in float64 there), so they leave the noise as it was."""
    r = params.repetition_penalty
    return max(r, 1 / r)


def first_divergence(margin: float | None, tolerance: float) -> str:
    """The rule itself: "explained" where the baseline margin is within tolerance, else "diverged"
    (also where the baseline had ended: there is no margin to explain a longer answer)."""
    return "explained" if margin is not None and margin <= tolerance else "diverged"


def _golden_divergence(case, index: int, tolerance: float, got_text: str, got: int | None,
                       compared_by: str) -> Verdict:
    golden_had_ended = index == len(case.token_ids)
    margin = None if golden_had_ended else case.margins[index]
    settled = len(case.text_before(index))
    return Verdict(case.id, first_divergence(margin, tolerance), compared_by, index=index, got=got,
                   want=None if golden_had_ended else case.token_ids[index], margin=margin, tolerance=tolerance,
                   want_text=case.text[settled:settled + CONTEXT_CHARS],
                   got_text=got_text[settled:settled + CONTEXT_CHARS])


def judge_ids(case, got_ids: list[int], got_text: str, tolerance: float) -> Verdict:
    """A golden case (refengine.check.golden.GoldenCase) against received token ids."""
    for index, expected in enumerate(case.token_ids):
        got = got_ids[index] if index < len(got_ids) else None
        if got != expected:
            return _golden_divergence(case, index, tolerance, got_text, got, "token_ids")
    if len(got_ids) > len(case.token_ids):
        return _golden_divergence(case, len(case.token_ids), tolerance, got_text, got_ids[len(case.token_ids)],
                                  "token_ids")
    return Verdict(case.id, "match", "token_ids", tolerance=tolerance)


def judge_text(case, got_text: str, tolerance: float) -> Verdict:
    """Align received text to the golden tokens: the first token whose settled golden text is no
    longer a prefix of `got_text` is where the answers part. Tokens that settled no text of their own
    (part of a multi-byte character, a special token) are unconfirmed until a later token shows
    text, so the divergence may lie at any of them: the first one within tolerance explains it.

    At the END of the answer such tokens are never confirmed: the golden text then ends in U+FFFD
    from the final flush of an incomplete character, which a server may hold back (vLLM, refengine
    streams) or replace. Those trailing tokens are "unsettled": the received text may stop anywhere
    in their golden text, or end in U+FFFD of its own there, and still match; the match notes them."""
    n = len(case.token_ids)
    tail = n  # the first unsettled token at the end
    if case.text.endswith("\ufffd"):  # the last token's text is the flush: it settled none by itself
        tail = n - 1
        while tail > 0 and not case.piece(tail - 1):
            tail -= 1
    unconfirmed_from = 0
    for index, end in enumerate(case.text_offsets[:tail]):
        if not got_text.startswith(case.text[:end]):
            window = range(unconfirmed_from, index + 1)
            near_tie = next((i for i in window if case.margins[i] <= tolerance), index)
            return _golden_divergence(case, near_tie, tolerance, got_text, None, "text")
        if case.piece(index):
            unconfirmed_from = index + 1
    if tail < n:
        settled = len(case.text_before(tail))
        got_rest, golden_rest = got_text[settled:], case.text[settled:]
        if golden_rest.startswith(got_rest.rstrip("\ufffd")):
            return Verdict(case.id, "match", "text", tolerance=tolerance,
                           reason=f"golden tokens {tail}-{n - 1} settled no text of their own at the end (an "
                                  f"incomplete character): not compared by text")
        if not got_rest.startswith(golden_rest):
            near_tie = next((i for i in range(unconfirmed_from, n) if case.margins[i] <= tolerance), n - 1)
            return _golden_divergence(case, near_tie, tolerance, got_text, None, "text")
    if len(got_text) > len(case.text):
        return _golden_divergence(case, len(case.token_ids), tolerance, got_text, None, "text")
    return Verdict(case.id, "match", "text", tolerance=tolerance)


def describe(v: Verdict, got_name: str = "got", want_name: str = "expected", decode=None) -> str:
    """A readable account of one verdict; `decode(id) -> str` adds token text when available."""
    if v.kind == "match":
        return f"{v.id}: match" + (f" (max logit deviation {v.max_agreeing_deviation:.3g})"
                                   if v.noise_tolerance is not None else "")
    if v.kind == "skipped":
        return f"{v.id}: not compared ({v.reason})"

    def token(token_id):
        if token_id is None:
            return "(end)"
        return f"{token_id} {decode(token_id)!r}" if decode else str(token_id)

    def fmt(x):
        return "-" if x is None else f"{x:.6g}"

    if v.compared_by == "prompt_logprobs":  # the prompt's tokens are given: no margin to explain anything
        where = "its prompt logprobs" if v.index is None else f"prompt token {v.index}"
        return f"{v.id}: {v.kind} at {where}: {v.reason}"
    where = "the text" if v.index is None else f"generated token {v.index}" + (
        "" if v.engine_step is None else f" (engine step {v.engine_step})")
    lines = [f"{v.id}: {v.kind} at {where}" + (f": {v.reason}" if v.reason else "")]
    if v.compared_by == "token_ids":
        lines.append(f"  {got_name} token {token(v.got)}, {want_name} token {token(v.want)}")
    if v.margin is None and v.index is None:
        lines.append(f"  no {want_name} top-2 margin known (compared by text): held strictly")
    elif v.margin is None and v.want is not None:
        lines.append(f"  no {want_name} top-2 margin known there: held strictly")
    elif v.margin is None:
        lines.append(f"  the {want_name} answer had already ended")
    else:
        relation = "<=" if v.margin <= (v.tolerance or 0.0) else ">"
        lines.append(f"  {want_name} top-2 margin there {fmt(v.margin)} {relation} tolerance {fmt(v.tolerance)}")
    if v.deviation is not None or v.noise_tolerance is not None:
        lines.append(f"  logit deviation there {fmt(v.deviation)}; max on the agreeing tokens before "
                     f"{v.max_agreeing_deviation:.3g}" + ("" if v.noise_tolerance is None
                                                          else f" (noise tolerance {v.noise_tolerance:.3g})"))
    if v.want_text or v.got_text:
        lines.append(f"  {want_name} text from there: {v.want_text!r}")
        lines.append(f"  {got_name} text from there: {v.got_text!r}")
    return "\n".join(lines)
