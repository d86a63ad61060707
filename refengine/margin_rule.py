"""The margin rule: another run's tokens must equal the golden tokens, except that the first
divergence is forgiven where the golden top-2 margin there is within the noise tolerance (the two
best tokens were so close that float32 rounding may swap them). Comparison stops at the first
divergence either way: every later token follows from a different prefix.
"""
from __future__ import annotations

from dataclasses import dataclass

from .golden import GoldenCase

CONTEXT_CHARS = 40


@dataclass(frozen=True)
class Verdict:
    kind: str                   # "match" | "explained" | "diverged"
    compared_by: str            # "token_ids" | "text"
    step: int | None = None     # first divergent generated token
    margin: float | None = None  # golden top-2 margin at `step`; None where the golden answer had ended
    expected: int | None = None  # golden token id at `step` (None: the golden answer had ended)
    got: int | None = None       # token id received at `step` (None: unknown, or the answer had ended)
    expected_text: str = ""     # golden text from the divergence on
    got_text: str = ""          # received text from the same position on

    @property
    def passed(self) -> bool:
        return self.kind != "diverged"

    def as_dict(self) -> dict:
        if self.kind == "match":
            return {"verdict": "match", "compared_by": self.compared_by}
        return {"verdict": self.kind, "compared_by": self.compared_by, "step": self.step, "margin": self.margin,
                "expected": self.expected, "got": self.got, "expected_text": self.expected_text,
                "got_text": self.got_text}


def _divergence(case: GoldenCase, step: int, tolerance: float, got_text: str, got: int | None,
                compared_by: str) -> Verdict:
    golden_had_ended = step == len(case.token_ids)
    margin = None if golden_had_ended else case.margins[step]
    kind = "explained" if margin is not None and margin <= tolerance else "diverged"
    settled = len(case.text_before(step))
    return Verdict(kind, compared_by, step, margin, None if golden_had_ended else case.token_ids[step], got,
                   case.text[settled:settled + CONTEXT_CHARS], got_text[settled:settled + CONTEXT_CHARS])


def judge_ids(case: GoldenCase, got_ids: list[int], got_text: str, tolerance: float) -> Verdict:
    for step, expected in enumerate(case.token_ids):
        got = got_ids[step] if step < len(got_ids) else None
        if got != expected:
            return _divergence(case, step, tolerance, got_text, got, "token_ids")
    if len(got_ids) > len(case.token_ids):
        return _divergence(case, len(case.token_ids), tolerance, got_text, got_ids[len(case.token_ids)], "token_ids")
    return Verdict("match", "token_ids")


def judge_text(case: GoldenCase, got_text: str, tolerance: float) -> Verdict:
    """Align received text to the golden tokens: the first token whose settled golden text is no
    longer a prefix of `got_text` is where the answers part. Tokens that settled no text of their own
    (part of a multi-byte character, a special token) are unconfirmed until a later token shows
    text, so the divergence may lie at any of them: the first one within tolerance explains it."""
    unconfirmed_from = 0
    for step, end in enumerate(case.text_offsets):
        if not got_text.startswith(case.text[:end]):
            window = range(unconfirmed_from, step + 1)
            near_tie = next((s for s in window if case.margins[s] <= tolerance), step)
            return _divergence(case, near_tie, tolerance, got_text, None, "text")
        if case.piece(step):
            unconfirmed_from = step + 1
    if len(got_text) > len(case.text):
        return _divergence(case, len(case.token_ids), tolerance, got_text, None, "text")
    return Verdict("match", "text")


def describe(case_id: str, verdict: Verdict, tolerance: float, decode=None) -> str:
    """A readable diff of one divergence; `decode(id) -> str` adds token text when available."""
    def token(token_id):
        if token_id is None:
            return "(end)"
        return f"{token_id} {decode(token_id)!r}" if decode else str(token_id)

    if verdict.margin is None:
        why = "the golden answer had already ended"
    else:
        relation = "<=" if verdict.kind == "explained" else ">"
        why = f"golden top-2 margin {verdict.margin:.6g} {relation} tolerance {tolerance:.6g}"
    head = f"{case_id}: {verdict.kind} at step {verdict.step}"
    if verdict.compared_by == "token_ids":
        head += f": expected token {token(verdict.expected)}, got {token(verdict.got)}"
    return (f"{head}; {why}\n"
            f"    expected text from there: {verdict.expected_text!r}\n"
            f"    got text from there:      {verdict.got_text!r}")
