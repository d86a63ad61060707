"""Logits processors a request may ask for: penalties, a logit bias, min_tokens (the schedule format's
request keys; their float64 definition is reference.adjusted_logits).

A request's processors are one of KINDS, drawn with how it leaves in a single choice (schedules.leaves):
the shrinker deletes a whole request only while it is at most four draws, and it lowers that one
choice to the simplest leave without processors. Values are strong enough to move a tiny model's
greedy token (its top-2 margins are of order 1): penalties of 0.5-2, repetition penalties of 0.5-2,
biases of +-5 or +-100. A bias falls on the first token of the request's own prompt (so requests with
other prompts are biased differently, and a bias on the wrong row shows). "forced stop" is the
pattern min_tokens exists for: that token made a stop id and the greedy choice, so the answer is
exactly min_tokens tokens and then the stop id, unless min_tokens is counted wrong. Every kind but
the forced stop has a frequency penalty, so a request's output counts always show in its rows.
"""
from __future__ import annotations

KINDS = (
    None,
    None,
    {"frequency_penalty": 2.0},
    {"frequency_penalty": -2.0, "presence_penalty": 2.0},
    {"frequency_penalty": 1.0, "repetition_penalty": 2.0, "bias": 5.0},
    {"frequency_penalty": 0.5, "repetition_penalty": 0.5, "bias": -100.0},
    {"frequency_penalty": 2.0, "presence_penalty": -1.0, "repetition_penalty": 1.5, "bias": 100.0},
    {"forced_stop": 1},
    {"forced_stop": 3},
)


def processor_fields(kind: dict | None, prompt_ids: list[int], max_tokens: int) -> dict:
    """The request keys of one of KINDS for a request with this prompt and max_tokens."""
    if kind is None:
        return {}
    token = str(prompt_ids[0])
    if "forced_stop" in kind:
        return {"stop_token_ids": [prompt_ids[0]], "logit_bias": {token: 100.0},
                "min_tokens": min(kind["forced_stop"], max_tokens)}
    fields = {k: v for k, v in kind.items() if k != "bias"}
    if "bias" in kind:
        fields["logit_bias"] = {token: kind["bias"]}
    return fields
