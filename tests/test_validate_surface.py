"""validate.surface: where a logits processor must change a greedy answer (derived by hand from the
answers' tokens and margins), the probe's verdicts against refengine serve, and the processed variants
of a case (ids that a repro resolves back)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from refengine.check.golden import GoldenCase
from refengine.validate.plan import Planned, request_body
from refengine.validate.repro import planned_from
from refengine.validate.surface import _reported, ignored, must_change_at, surface_notes
from refengine.validate.variants import ProcessedCase, variants
from refengine.validate.wire import Completion, Stream, TokenLogprob, whole


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
    penalties, scored, two, bias = variants(case())
    assert (penalties.id, scored.id, two.id, bias.id) == ("c+penalties", "c+prompt-logprobs", "c+n", "c+bias")
    assert two.fields == {"n": 2}
    assert scored.fields == {"prompt_logprobs": 2}
    assert bias.fields == {"logit_bias": {"7": -100.0}, "min_tokens": 2}  # against the golden first token
    assert bias.prompt_ids == [1, 2] and bias.max_tokens == 4 and bias.base.id == "c"
    data = {"source": "g.jsonl", "requests": [{"id": "r0", "case": "c+bias", "api": "completions", "streamed": False,
                                               "arrival_s": 0.0, "cancel_after": None}]}
    assert planned_from(data, [case()], "repro.json")[0].case == bias
    no_answer = ProcessedCase(case(token_ids=()), "x", "{}", 4)
    assert [v.variant for v in variants(no_answer.base)] == ["penalties", "prompt-logprobs", "n"]  # no token to bias


def test_a_variant_of_a_long_answer_asks_for_at_most_32_tokens():
    long = replace(case(), max_tokens=96)
    for variant in variants(long):
        assert variant.max_tokens == 32 and long.max_tokens == 96
        assert request_body(Planned("r0", variant, "completions", 0.0, False, None), "m")["max_tokens"] == 32


def text(value: str, prompt_ids=None, scored=None) -> Completion:
    return Completion(value, None, prompt_ids, "length", False, prompt_logprobs=scored)


@pytest.mark.parametrize("got, verdict", [
    (text("Hello world", [1, 2]), "ignored"),           # the plain text: no prompt before it
    (text("Hi, Hello world", [1, 2]), "applied"),
    (text("Hi, Hello worl", [1, 2]), "wrong"),           # not the plain answer's text at the end
])
def test_echo_is_applied_only_where_the_plain_answer_comes_after_more_text(got, verdict):
    assert _reported("echo", text("Hello world", [1, 2]), got)["verdict"] == verdict


@pytest.mark.parametrize("prompt_ids, scored, verdict", [
    ([1, 2, 3], None, "unsupported"),
    ([1, 2, 3], [None, {2: -1.0}, {3: -0.5, 9: -0.2}], "applied"),
    (None, [None, {2: -1.0}, {3: -0.5}], "applied"),         # no prompt ids to check the tokens against
    ([1, 2, 3], [None, {2: -1.0}], "wrong"),                 # one entry short
    ([1, 2, 3], [None, {2: -1.0}, {4: -0.5}], "wrong"),       # the last names another token than the prompt's
    ([1, 2, 3], [{1: -0.1}, {2: -1.0}, {3: -0.5}], "wrong"),  # the first token has nothing before it
    ([1, 2, 3], [None, None, {3: -0.5}], "wrong"),
    ([1, 2, 3], [], "wrong"),
])
def test_prompt_logprobs_are_applied_only_where_every_prompt_token_has_its_entry(prompt_ids, scored, verdict):
    assert _reported("prompt_logprobs", text("x", prompt_ids), text("x", prompt_ids, scored))["verdict"] == verdict
    if prompt_ids is None:  # the plain answer's ids stand in for the reply's
        assert _reported("prompt_logprobs", text("x", [1, 2, 4]), text("x", None, scored))["verdict"] == "wrong"


@pytest.mark.parametrize("choices, verdict", [(2, "applied"), (1, "ignored"), (3, "wrong")])
def test_n_is_applied_only_where_the_answer_carries_n_choices(choices, verdict):
    got = Completion("x", None, None, "length", False, others=(text("x"),) * (choices - 1))
    assert _reported("n", text("x"), got)["verdict"] == verdict


CHOICES = [{"index": 0, "text": "a", "token_ids": [5, 6], "finish_reason": "length"},  # as a server may send them:
           {"index": 2, "text": "c", "token_ids": [8, 9], "finish_reason": "length"},  # not in index order
           {"index": 1, "text": "b", "token_ids": [7], "finish_reason": "stop"}]


@pytest.mark.parametrize("count", [1, 2, 3])
def test_every_choice_is_read_in_index_order(count):
    choices = sorted(CHOICES[:count], key=lambda c: c["index"])
    got = whole({"choices": CHOICES[:count], "usage": {"completion_tokens": 99}})
    stream = Stream()
    for choice in CHOICES[:count]:  # streamed: the choices' pieces interleaved, a token per chunk
        for k, token in enumerate(choice["token_ids"]):
            piece = {"index": choice["index"], "text": choice["text"] if k == 0 else "", "token_ids": [token]}
            stream.add({"choices": [piece | ({"finish_reason": choice["finish_reason"]}
                                             if k == len(choice["token_ids"]) - 1 else {})]})
    streamed = stream.completion(False, True)
    for answer in (got, streamed):
        read = [(c.text, c.token_ids, c.finish_reason) for c in (answer, *answer.others)]
        assert read == [(c["text"], c["token_ids"], c["finish_reason"]) for c in choices]
        assert answer.num_choices == count


def test_usage_checks_logprob_ids_only_of_a_lone_choice():
    """usage counts every choice's tokens: against one choice's logprobs it would set its ids aside."""
    content = [{"id": 5, "logprob": -1.0}, {"id": 6, "logprob": -1.0}]
    choice = {"index": 0, "text": "ab", "logprobs": {"content": content}}
    usage = {"completion_tokens": 4}
    assert whole({"choices": [choice], "usage": usage}).token_ids is None
    assert whole({"choices": [choice, {**choice, "index": 1}], "usage": usage}).token_ids == [5, 6]
    for choices, ids in (([choice], None), ([choice, {**choice, "index": 1}], [5, 6])):  # streamed: the same
        stream = Stream()
        stream.add({"choices": choices})
        stream.add({"choices": [], "usage": usage})
        assert stream.completion(False, True).token_ids == ids


def test_a_wrong_answer_is_a_finding_and_an_unsupported_extension_a_note():
    surface = {"completions": {"echo": {"verdict": "wrong", "why": "w"},
                               "prompt_logprobs": {"verdict": "unsupported", "why": "u"}}}
    assert ignored(surface) == ["completions: echo"]
    notes = surface_notes(surface)
    assert notes[1].startswith("FINDING: completions: the server answers echo wrongly") and \
        notes[2].startswith("note: completions: prompt_logprobs unsupported") and len(notes) == 3


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


@pytest.mark.parametrize("entries, parsed", [
    ([None, {"5": {"logprob": -1.5, "rank": 2}, "7": {"logprob": -0.5}}], [None, {5: -1.5, 7: -0.5}]),
    ([None, {"5": {"logprob": "x"}}], None),     # a logprob that is not a number
    ([None, {"five": {"logprob": -1.0}}], None),  # a key that is not a token id
    ([None, [-1.0]], None),                       # an entry that is not an object
    ("no", None),
])
def test_prompt_logprobs_are_read_in_vllms_shape_or_not_at_all(entries, parsed):
    choice = {"text": "x", "finish_reason": "length", "prompt_logprobs": entries}
    assert whole({"choices": [choice]}).prompt_logprobs == parsed
    assert whole({"choices": [{"text": "x"}], "prompt_logprobs": entries}).prompt_logprobs == parsed  # chat's place
    stream = Stream()
    stream.add({"choices": [{"text": "x", "prompt_logprobs": entries}]})
    stream.add({"choices": [{"text": "y", "finish_reason": "length"}]})
    assert stream.completion(False, True).prompt_logprobs == parsed
