"""validate.surface: where a logits processor must change a greedy answer (derived by hand from the
answers' tokens and margins), the probe's verdicts against refengine serve, and the processed variants
of a case (ids that a repro resolves back)."""
from __future__ import annotations

import pytest

from refengine.check.golden import GoldenCase
from refengine.validate.repro import planned_from
from refengine.validate.surface import ProcessedCase, ignored, must_change_at, surface_notes, variants
from refengine.validate.wire import Completion, TokenLogprob


def answer(ids: list[int], margins: list[float]) -> Completion:
    return Completion("", ids, None, "length", False, "token_ids",
                      logprobs=[TokenLogprob(0.0, (0.0, -m)) for m in margins])


@pytest.mark.parametrize("ids, margins, parameter, step", [
    ([5, 5], [3.0, 1.9], "frequency_penalty", None),    # 1.9 is not below half of 2 * 1
    ([5, 5], [3.0, 0.9], "frequency_penalty", 1),       # 5 seen once, nothing else: 0.9 < 1
    ([5, 5, 5], [3.0, 3.0, 1.9], "frequency_penalty", 2),  # seen twice: below half of 4
    ([5, 6, 5], [3.0, 3.0, 0.1], "frequency_penalty", None),  # 6 as often as 5: a rival may drop as much
    ([5, 6, 5, 5], [3.0, 3.0, 3.0, 0.9], "frequency_penalty", 3),  # 5 twice, 6 once: half of 2 * (2 - 1)
    ([5, 5], [3.0, 0.9], "presence_penalty", 1),
    ([5, 6, 5], [3.0, 3.0, 0.1], "presence_penalty", None),  # 6 was seen too: it drops as much
    ([5, 6, 7], [0.1, 0.1, 0.1], "frequency_penalty", None),  # nothing repeats
    ([5, 6, 7], [0.1, 0.1, 0.1], "presence_penalty", None),   # nothing seen before the first: no penalty yet
])
def test_a_penalty_must_change_the_answer_only_where_its_token_drops_by_more_than_any_rival(ids, margins, parameter,
                                                                                         step):
    assert must_change_at(answer(ids, margins), parameter) == step


def test_without_ids_or_top_two_logprobs_nothing_is_known():
    assert must_change_at(Completion("", None, None, "length", False), "frequency_penalty") is None
    one = Completion("", [5, 5], None, "length", False, "token_ids", logprobs=[TokenLogprob(0.0, (0.0,))] * 2)
    assert must_change_at(one, "frequency_penalty") is None


def case(case_id="c", token_ids=(7, 8)) -> GoldenCase:
    return GoldenCase(id=case_id, prompt="hi", messages=None, prompt_ids=[1, 2], max_tokens=4,
                      token_ids=list(token_ids), text="xy", finish_reason="length", margins=[1.0] * len(token_ids),
                      top_logprobs=[], text_offsets=None)


def test_a_processed_variant_is_its_case_with_fields_and_resolves_from_a_repro():
    penalties, bias = variants(case())
    assert (penalties.id, bias.id) == ("c+penalties", "c+bias")
    assert bias.fields == {"logit_bias": {"7": -100.0}, "min_tokens": 2}  # against the golden first token
    assert bias.prompt_ids == [1, 2] and bias.max_tokens == 4 and bias.base.id == "c"
    data = {"source": "g.jsonl", "requests": [{"id": "r0", "case": "c+bias", "api": "completions", "streamed": False,
                                               "arrival_s": 0.0, "cancel_after": None}]}
    assert planned_from(data, [case()], "repro.json")[0].case == bias
    no_answer = ProcessedCase(case(token_ids=()), "x", "{}")
    assert [v.variant for v in variants(no_answer.base)] == ["penalties"]  # no golden token to bias against


def test_only_an_ignored_parameter_is_a_finding():
    surface = {"chat": {"logit_bias": {"verdict": "ignored", "why": "w"}, "min_tokens": {"verdict": "refused",
                                                                                         "why": "r"},
                        "presence_penalty": {"verdict": "accepted", "why": "a"}},
               "completions": {"logit_bias": {"verdict": "applied", "why": "p"}}}
    assert ignored(surface) == ["chat: logit_bias"]
    notes = surface_notes(surface)
    assert notes[:2] == ["surface (chat): logit_bias ignored, min_tokens refused, presence_penalty accepted",
                         "surface (completions): logit_bias applied"]
    assert notes[2].startswith("FINDING: chat: the server accepts logit_bias and ignores it") and len(notes) == 4
