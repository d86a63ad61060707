"""Schedules whose prompts share prefixes, with prefix caching on: what a cache hit must survive.

A drawn join/leave schedule (schedules.py: every setting, pool pressure, preemption, aborts, seeded
sampling, logprobs) with its prompts rewritten: each later request may take an earlier one's first
tokens, cut at a block edge, one token either side of one, or at the shorter prompt's end (the same
prompt, when the lengths agree). Lengths stay as drawn, so the fitted pool still fits. Each request
is one more draw (which earlier one, or none: the simplest, what shrinking aims at) and, when it
shares, the cut.
"""
from __future__ import annotations

import functools

from hypothesis import strategies as st

from .models import VOCAB_SIZE
from .schedules import schedules


def cuts(shorter: int, block_size: int) -> list[int]:
    """Where a shared prefix may end: the shorter prompt's end, every block edge and one token either side."""
    edges = {shorter} | {b * block_size + d for b in range(1, shorter // block_size + 1) for d in (-1, 0, 1)}
    return sorted(k for k in edges if 1 <= k <= shorter)


@functools.cache  # one strategy per mode (prompts.py says why)
@st.composite
def shared_prefix_schedules(draw, mode: str = "invariant") -> dict:
    schedule = draw(schedules(VOCAB_SIZE, mode))
    block, reqs = schedule["engine"]["block_size"], schedule["requests"]
    for n in range(1, len(reqs)):
        source = draw(st.integers(-1, n - 1))
        if source < 0:
            continue
        theirs, mine = reqs[source]["prompt_ids"], reqs[n]["prompt_ids"]
        k = draw(st.sampled_from(cuts(min(len(theirs), len(mine)), block)))
        reqs[n]["prompt_ids"] = theirs[:k] + mine[k:]
    schedule["engine"]["enable_prefix_caching"] = True
    return schedule
