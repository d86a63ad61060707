"""Schedules whose prompts share prefixes, with prefix caching on: what a cache hit must survive.

A drawn join/leave schedule (schedules.py: every setting, pool pressure, preemption, aborts, seeded
sampling, logprobs) with its prompts rewritten: each later request may take an earlier one's first
tokens, cut at a block edge, one token either side of one, or at the shorter prompt's end (the same
prompt, when the lengths agree; lengths stay as drawn, so the fitted pool still fits), arriving at least
a step after it (so that its prefix may be computed by then, even in a burst) — or continue its
conversation: `"continues": "rM"`, the earlier request's prompt and its answer, then its own prompt as
the next turn (what a chat client resends; the answer is the model's, so the property resolves it:
suite.harness.resolve_continuations). Each request is one more draw (which earlier one, or none: the
simplest, what shrinking aims at), when it shares, how (a cut, the simpler, and where; or a
continuation, half the time, under the earlier one's salt, whose answer half the time ends at a block
edge, without a stop id forced or a bias: where a block registered too early shows), and then its
`cache_salt`: none (the simplest) or one of SALTS, so requests with equal prefixes and different salts
meet (they must not share a block). Last, half of the schedules get a pool that holds their largest
request and no more, in place of the fitted one: every block a later request needs evicts a cached one.

Prompt logprobs: a request still to score its prompt takes no hit (engine/prompt_logprobs.py), so they
would keep requests from meeting the cache. Schedules without `scoring` ask for none; with it, every
request that takes an earlier one's prefix asks for them, with one alternative (what must then hold:
each scores its whole prompt, whatever the cache holds); with `scoring` None, each such request asks
one time in four (SCORES), so hits and scoring sharers meet in one schedule and one property holds both.
"""
from __future__ import annotations

import functools

from hypothesis import strategies as st

from .models import VOCAB_SIZE
from .schedules import blocks_for, schedules

SALTS = ("tenant-a", "tenant-b")
EDGE = st.booleans()  # a continued answer ends at a block edge, half the time
# Whether a sharer asks for prompt logprobs (scoring None), one in four: such a sharer takes no hit, and
# the hits are what the other prefix-caching faults need (not asking: what the shrinker goes to)
SCORES = st.integers(0, 3).map(lambda n: n == 3)


def cuts(shorter: int, block_size: int) -> list[int]:
    """Where a shared prefix may end: the shorter prompt's end, every block edge and one token either side."""
    edges = {shorter} | {b * block_size + d for b in range(1, shorter // block_size + 1) for d in (-1, 0, 1)}
    return sorted(k for k in edges if 1 <= k <= shorter)


def edge_answer(prompt_len: int, max_tokens: int, block_size: int) -> int:
    """The largest max_tokens up to `max_tokens` whose answer, run to it, ends exactly at a block edge
    (its last token, sampled and never fed back, fills a block); `max_tokens` where none does. Only
    shorter: the fitted pool still fits."""
    return next((m for m in range(max_tokens, 0, -1) if (prompt_len + m) % block_size == 0), max_tokens)


def later(request: dict, step: int) -> None:
    """`request` arrives no earlier than `step` (its abort, if any, as long after its arrival as drawn)."""
    shift = max(0, step - request["arrival_step"])
    request["arrival_step"] += shift
    if "abort_step" in request:
        request["abort_step"] += shift


@functools.cache  # one strategy per mode (prompts.py says why)
@st.composite
def shared_prefix_schedules(draw, mode: str = "invariant", scoring: bool | None = False) -> dict:
    schedule = draw(schedules(VOCAB_SIZE, mode, prompt_logprobs=False))
    block, reqs = schedule["engine"]["block_size"], schedule["requests"]
    for n in range(len(reqs)):
        source = draw(st.integers(-1, n - 1))
        if source >= 0 and (draw(SCORES) if scoring is None else scoring):
            reqs[n]["prompt_logprobs"] = 1
        if source >= 0:
            theirs, mine = reqs[source]["prompt_ids"], reqs[n]["prompt_ids"]
            if draw(st.booleans()):  # the same client's next turn: its conversation, under its salt
                reqs[n]["continues"] = reqs[source]["id"]
                if "cache_salt" in reqs[source]:
                    reqs[n]["cache_salt"] = reqs[source]["cache_salt"]
                if draw(EDGE):  # and runs to it: no stop id forced after min_tokens
                    edged = reqs[source]
                    edged["max_tokens"] = edge_answer(len(theirs), edged["max_tokens"], block)
                    for key in ("min_tokens", "stop_token_ids", "logit_bias"):
                        edged.pop(key, None)
                continue
            k = draw(st.sampled_from(cuts(min(len(theirs), len(mine)), block)))
            reqs[n]["prompt_ids"] = theirs[:k] + mine[k:]
            later(reqs[n], reqs[source]["arrival_step"] + 1)
        salt = draw(st.sampled_from((None, *SALTS)))
        if salt is not None:
            reqs[n]["cache_salt"] = salt
    if draw(st.booleans()):  # eviction pressure: a pool that holds the largest request and no more
        schedule["engine"]["num_blocks"] = max(blocks_for(len(r["prompt_ids"]) + r["max_tokens"], block) for r in reqs)
    schedule["engine"]["enable_prefix_caching"] = True
    return schedule
