"""What a loaded answer is judged against, by the one margin rule (check.margin_rule):

- golden: the float64 reference's tokens in a golden file; a divergence is explained at a golden
  top-2 margin within the calibrated float32 noise bound (or --margin-tolerance).
- serial: the same server's answer to the same request sent alone, nothing else in flight: batch
  invariance ON the device, for any precision, with no golden file or model folder. A divergence is
  explained only at the server's OWN top-2 margin there (from the logprobs of its alone answer)
  within the tolerance, 0 by default (bit-identical). A server without logprobs (or without ids) is
  held strictly, unless validate has the model's folder: then the float64 reference measures the
  margin there, along the alone answer's tokens (validate.margins).

Each baseline turns (planned request, completion) into the report's verdict fields (FORMATS.md).
"""
from __future__ import annotations

from dataclasses import replace

from ..check.golden import Golden
from ..check.margin_rule import (
    CONTEXT_CHARS,
    Verdict,
    first_divergence,
    judge_ids,
    judge_text,
)
from ..sampling import SamplingParams, processor_params
from .client import Completion
from .dialect import unstripped
from .margins import LocalMargins, text_divergence
from .plan import Planned


def record_fields(v: Verdict, margin_from: str | None = None) -> dict:
    """A verdict as the validation report's request fields (FORMATS.md): `step` is the generated-token
    index; `margin_from` what measured the margin (golden, server, model; None: no margin)."""
    if v.kind == "match":  # a text match may note golden tokens left unsettled at the end (judge_text)
        return {"verdict": "match", "compared_by": v.compared_by, **({"note": v.reason} if v.reason else {})}
    return {"verdict": v.kind, "compared_by": v.compared_by, "step": v.index, "margin": v.margin,
            "margin_from": margin_from if v.margin is not None else None,
            "expected": v.want, "got": v.got, "expected_text": v.want_text, "got_text": v.got_text,
            **({"note": v.reason} if v.reason else {})}


def prompt_mismatch(want: list[int] | None, got: list[int] | None, what: str) -> str | None:
    if got is None or want is None or got == want:
        return None
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return (f"the server's prompt ids differ from the {what} at position {at} "
            f"({len(got)} vs {len(want)} ids): different tokenizer or chat template")


def error(message: str) -> dict:
    return {"verdict": "error", "error": message}


class GoldenBaseline:
    name = "golden"

    def __init__(self, golden: Golden, tolerance: float):
        self.golden, self.tolerance = golden, tolerance

    def expected_tokens(self, case_id: str, api: str) -> int | None:
        return next((len(c.token_ids) for c in self.golden.cases if c.id == case_id), None)

    def judge(self, p: Planned, completion: Completion) -> dict:
        case = p.case
        mismatch = prompt_mismatch(case.prompt_ids, completion.prompt_token_ids, "golden prompt")
        if mismatch:
            return error(mismatch)
        if completion.token_ids is None and case.text_offsets is None:
            return error("the server reports no token ids and the golden file has no text_offsets to align "
                         "its text with; refresh it")
        restored, rendered = [], []
        if completion.token_ids is not None:  # by ids: the server's text, whatever it did to it, is context only
            verdict = judge_ids(case, completion.token_ids, completion.text, self.tolerance)
        else:
            case, rendered = rendering_special_tokens(case, self.golden.special_tokens, completion.text)
            text, restored = unstripped(case.text, completion.text)
            verdict = judge_text(case, text, self.tolerance)
        at_limit = verdict.kind == "match" and at_max_tokens(case, completion.finish_reason)
        if verdict.kind == "match" and completion.finish_reason != case.finish_reason and not at_limit:
            return error(f"the answer matches but finish_reason is {completion.finish_reason!r}, "
                         f"golden {case.finish_reason!r}")
        return record_fields(verdict, "golden") | ({"whitespace_restored": restored} if restored else {}) | \
            ({"special_tokens_rendered": rendered} if rendered else {}) | \
            ({"finish_reason_at_max_tokens": completion.finish_reason} if at_limit else {})


def rendering_special_tokens(case, specials: dict[int, str], got_text: str) -> tuple:
    """A server may decode its answer without skipping special tokens (HF `transformers serve` writes
    `<|im_start|>` into its text); the golden text skips them. Where the received text holds the text
    of a special token the golden answer generated, it is compared with the golden answer decoded that
    way, those tokens written (a server that writes them may still leave out the eos it stopped on):
    (the case to judge by, the texts written). By ids nothing changes: the text is context there."""
    shown = {t: specials[t] for t in case.token_ids if t in specials and specials[t] in got_text}
    return (case.with_special_tokens(shown), sorted(set(shown.values()))) if shown else (case, [])


def at_max_tokens(case, finish_reason: str | None) -> bool:
    """Is a `length` finish the other name of the golden `stop`? A golden answer that stopped (eos or a
    stop id) on the last token max_tokens allows has both reasons; servers name it either way (refengine
    and vLLM: stop; transformers serve: length). Not the other way round: a golden answer that ran to
    max_tokens ended on no stop token."""
    return len(case.token_ids) == case.max_tokens and (case.finish_reason, finish_reason) == ("stop", "length")


def judge_serial(case_id: str, alone: Completion, got: Completion, tolerance: float,
                 own_margins: bool = True) -> Verdict:
    """A loaded answer against the same server's alone answer: by token ids when both carry them,
    else by text (strict: the text has no token positions to find a margin at; only an incomplete
    character at the end, which one answer held back and the other flushed, may differ). Not
    `own_margins`: the server's logprobs are not of the row its tokens were chosen from (a request with
    logits processors: servers report the model's row), so they explain nothing."""
    parted = next((i for i, (a, b) in enumerate(zip(alone.text, got.text)) if a != b),
                  min(len(alone.text), len(got.text)))
    texts = {"want_text": alone.text[parted:parted + CONTEXT_CHARS], "got_text": got.text[parted:parted + CONTEXT_CHARS]}
    if alone.token_ids is None or got.token_ids is None:
        if got.text == alone.text:
            return Verdict(case_id, "match", "text", tolerance=tolerance)
        if got.text.rstrip("\ufffd") == alone.text.rstrip("\ufffd"):  # an incomplete last character held back
            return Verdict(case_id, "match", "text", tolerance=tolerance,
                           reason="the answers differ only in an incomplete character at the end")
        return Verdict(case_id, "diverged", "text", reason=f"the texts part at character {parted}",
                       tolerance=tolerance, **texts)
    want_ids, got_ids = alone.token_ids, got.token_ids
    index = next((i for i, (a, b) in enumerate(zip(want_ids, got_ids)) if a != b), min(len(want_ids), len(got_ids)))
    if want_ids == got_ids:
        return Verdict(case_id, "match", "token_ids", tolerance=tolerance)
    margins = [t.margin for t in alone.logprobs] if alone.logprobs is not None and own_margins else []
    margin = margins[index] if index < len(margins) and index < len(want_ids) else None
    reason = "" if margin is not None or index >= len(want_ids) else \
        "the server reports no top-2 logprobs there" if own_margins else \
        "its logprobs are of the model's row, not of the row its logits processors made"
    return Verdict(case_id, first_divergence(margin, tolerance), "token_ids", reason=reason, index=index,
                   got=got_ids[index] if index < len(got_ids) else None,
                   want=want_ids[index] if index < len(want_ids) else None, margin=margin, tolerance=tolerance,
                   **texts)


def processed(case) -> SamplingParams | None:
    """A processed case's logits processors (validate.variants.ProcessedCase: its `fields`) as the
    reference applies them; None for a case without any."""
    processors = processor_params(getattr(case, "fields", None) or {})
    return SamplingParams(max_tokens=case.max_tokens, **processors) if processors else None


def prompt_logprobs_difference(alone: Completion, got: Completion, tolerance: float) -> str | None:
    """None where a loaded answer's prompt logprobs are its alone answer's: the same positions, the same
    ids reported at each (where `tolerance` is 0; else at least those both report), each logprob within
    2 x tolerance (a logprob is its logit minus the row's logsumexp: each moves by the logit bound);
    else what differs."""
    want, have = alone.prompt_logprobs, got.prompt_logprobs
    if (want is None) != (have is None):
        return f"prompt logprobs reported {'alone only' if have is None else 'under load only'}"
    if want is None:
        return None
    if len(want) != len(have):
        return f"{len(have)} prompt logprob entries, alone {len(want)}"
    bound = 2 * tolerance
    for position, (w, h) in enumerate(zip(want, have)):
        if (w is None) != (h is None) or (w is not None and tolerance == 0 and set(w) != set(h)):
            return f"prompt position {position}: ids {None if h is None else sorted(h)}, alone {None if w is None else sorted(w)}"
        for token in set(w or ()) & set(h or ()):
            if not abs(h[token] - w[token]) <= bound:
                return (f"prompt position {position}, token {token}: logprob {h[token]!r}, alone {w[token]!r}, "
                        f"|difference| {abs(h[token] - w[token]):.3g} > bound {bound:.3g}")
    return None


class SerialBaseline:
    name = "serial"

    def __init__(self, alone: dict[tuple[str, str], Completion], tolerance: float,
                 failed: dict[tuple[str, str], str] | None = None, margins: LocalMargins | None = None):
        self.alone, self.tolerance = alone, tolerance  # (case id, api) -> the answer sent alone
        self.failed = failed or {}                    # (case id, api) -> why its alone request failed
        self.margins = margins                        # the local model's float64 margins, if given

    def expected_tokens(self, case_id: str, api: str) -> int | None:
        alone = self.alone.get((case_id, api))
        return None if alone is None or alone.token_ids is None else len(alone.token_ids)

    def judge(self, p: Planned, completion: Completion) -> dict:
        """The answer against its alone answer: each choice (`n`) against the alone answer's choice at its
        index (the first not matching gives the verdict, with its `choice` where it is not the first)."""
        if (p.case.id, p.api) in self.failed:
            return error(f"no alone answer to compare with ({self.failed[p.case.id, p.api]})")
        alone = self.alone[p.case.id, p.api]
        if completion.num_choices != alone.num_choices:
            return error(f"{completion.num_choices} choices, alone {alone.num_choices}")
        worst = None
        for k, (want, got) in enumerate(zip((alone, *alone.others), (completion, *completion.others))):
            fields = self.judge_choice(p, want, got)
            if k and fields["verdict"] != "match":
                fields = {**fields, "choice": k}
            if fields["verdict"] in ("diverged", "error"):
                return fields
            if worst is None or (worst["verdict"], fields["verdict"]) == ("match", "explained"):
                worst = fields
        return worst

    def judge_choice(self, p: Planned, alone: Completion, completion: Completion) -> dict:
        mismatch = prompt_mismatch(alone.prompt_token_ids, completion.prompt_token_ids, "prompt ids of its alone answer")
        if mismatch:
            return error(mismatch)
        verdict = judge_serial(p.case.id, alone, completion, self.tolerance, own_margins=processed(p.case) is None)
        if verdict.kind == "match" and completion.finish_reason != alone.finish_reason:
            return error(f"the answer matches but finish_reason is {completion.finish_reason!r}, "
                         f"alone {alone.finish_reason!r}")
        scored = prompt_logprobs_difference(alone, completion, self.tolerance) if not completion.cancelled else None
        if scored:
            return record_fields(Verdict(p.case.id, "diverged", "prompt_logprobs", reason=scored,
                                         tolerance=self.tolerance))
        if verdict.kind == "diverged" and verdict.margin is None and self.margins is not None:
            measured = self.measure(p.case, alone, completion, verdict)
            return record_fields(measured, "model")
        return record_fields(verdict, "server")

    def measure(self, case, alone: Completion, got: Completion, verdict: Verdict) -> Verdict:
        """The divergence judged again at the float64 margin of the local model, teacher-forced along
        the alone answer: its ids, or (a server without ids) its text's ids by the local tokenizer."""
        if verdict.compared_by == "token_ids":
            index, alone_ids = verdict.index, alone.token_ids
            if index >= len(alone_ids):  # the alone answer had ended: no margin can explain a longer one
                return verdict
            reason = ""
        else:
            parted = text_divergence(self.margins.model, alone.text, got.text)
            if parted.index is None:
                return replace(verdict, reason=f"{verdict.reason}; {parted.problem}")
            index, alone_ids = parted.index, parted.baseline_ids
            if index >= len(alone_ids):
                return replace(verdict, index=index, got=parted.got_ids[index])
            verdict = replace(verdict, index=index, want=alone_ids[index],
                              got=parted.got_ids[index] if index < len(parted.got_ids) else None)
            reason = f"{verdict.reason}; token index and ids from the answers' text, by the local tokenizer"
        margin = self.margins.margin(self.margins.prompt_ids(case, alone.prompt_token_ids), alone_ids, index,
                                     processed(case), case.images)
        return replace(verdict, kind=first_divergence(margin, self.tolerance), margin=margin, reason=reason)


class ThreeWay:
    """The golden baseline with both effects apart: each loaded answer judged against the golden file
    (its `verdict`) and against the same server's alone answer (its `batching` verdict). The alone
    answers were judged against the golden file when they were sent (the precision effect).

    Where the alone answer matched the golden file, loaded vs alone is loaded vs golden: the batching
    divergence is the golden one, at its float64 margin, held to the batching tolerance. Elsewhere the
    serial baseline judges it (the server's own margin, or the local model's)."""
    name = "golden"

    def __init__(self, golden: GoldenBaseline, serial: SerialBaseline, alone_records: list[dict]):
        self.golden, self.serial = golden, serial
        self.alone_matched = {(r["case"], r["api"]) for r in alone_records if r["verdict"] == "match"}

    def expected_tokens(self, case_id: str, api: str) -> int | None:
        """The golden answer's length; a variant's (no golden answer): its alone answer's."""
        golden = self.golden.expected_tokens(case_id, api)
        return golden if golden is not None else self.serial.expected_tokens(case_id, api)

    def judge(self, p: Planned, completion: Completion) -> dict:
        if getattr(p.case, "fields", None):  # a variant (validate.variants): no golden answer, its alone answer only
            fields = self.serial.judge(p, completion)
            return {**fields, "batching": fields}
        fields = self.golden.judge(p, completion)
        if (p.case.id, p.api) in self.alone_matched and fields["verdict"] in ("match", "explained", "diverged"):
            kind = "match" if fields["verdict"] == "match" else first_divergence(fields["margin"], self.serial.tolerance)
            batching = {**fields, "verdict": kind}
        else:
            batching = self.serial.judge(p, completion)
        return {**fields, "batching": batching}
