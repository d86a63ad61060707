"""Join/leave schedules: the JSON schedule dicts of FORMATS.md that every property runs.

A schedule is engine settings, then 1-MAX_REQUESTS requests (a burst has at least 2), then a KV
pool fitted to them. Each request has a prompt (see prompts), sampling (see sampling), `max_tokens` 1-MAX_TOKENS
(a small one is an early leave) and an `arrival_step`; some get an `abort_step` 0-MAX_ABORT_DELAY
steps after arrival (a leave mid-flight; 0 = before it ran). Two shapes:
- staggered: arrivals 0-MAX_ARRIVAL (joins mid-batch), aborts, any pool from the largest request
  alone up to three times it (tight pools preempt only when requests happen to overlap);
- burst: every request joins in the first two steps and runs to max_tokens >= MAX_TOKENS / 2, under
  pressure settings (see engine_settings) on a pool that holds all of them only until each has
  generated 1-MAX_TOKENS/2 tokens, so requests admitted together run out of blocks while decoding
  and preempt, and resume by recomputing prompt and generated tokens.
Every pool holds at least the largest request, so each request fits alone and is admissible.
Everything shrinks towards one greedy request arriving at step 0 on a staggered schedule.
"""
from __future__ import annotations

from hypothesis import strategies as st

from .engine_settings import engine_settings
from .prompts import prompts
from .sampling import sampling

MAX_REQUESTS = 5
MAX_TOKENS = 8
MAX_ARRIVAL = 12
MAX_ABORT_DELAY = 10


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@st.composite
def requests(draw, vocab_size: int, block_size: int, token_budget: int, burst: bool = False,
             allow_seeded: bool = True, allow_abort: bool = True) -> dict:
    min_tokens = MAX_TOKENS // 2 if burst else 1
    request = {
        "prompt_ids": draw(prompts(vocab_size, block_size, token_budget)),
        "max_tokens": draw(st.one_of(st.integers(min_tokens, MAX_TOKENS), st.integers(MAX_TOKENS // 2, MAX_TOKENS))),
        "arrival_step": draw(st.integers(0, 1) if burst else st.one_of(st.integers(0, 2), st.integers(0, MAX_ARRIVAL))),
    }
    params = draw(sampling(allow_seeded))
    if params:
        request["sampling"] = params
    if allow_abort and not burst and draw(st.booleans()):
        request["abort_step"] = request["arrival_step"] + draw(st.integers(0, MAX_ABORT_DELAY))
    return request


def fitted_pool(draw, reqs: list[dict], block_size: int, burst: bool) -> int:
    largest = max(blocks_for(len(r["prompt_ids"]) + r["max_tokens"], block_size) for r in reqs)
    if burst:
        headroom = draw(st.integers(1, MAX_TOKENS // 2))  # tokens each request generates before the pool runs out
        together = sum(blocks_for(len(r["prompt_ids"]) + headroom, block_size) for r in reqs)
        return max(largest, together)
    return largest + draw(st.one_of(st.integers(0, 2), st.integers(0, 2 * largest)))


@st.composite
def schedules(draw, vocab_size: int, mode: str = "invariant", max_requests: int = MAX_REQUESTS,
              allow_seeded: bool | None = None, allow_abort: bool = True) -> dict:
    """Seeded sampling defaults to invariant mode only: a top-2 margin explains greedy flips, not draws."""
    if allow_seeded is None:
        allow_seeded = mode == "invariant"
    burst = draw(st.booleans())
    engine = draw(engine_settings(mode, pressure=burst))
    request = requests(vocab_size, engine["block_size"], engine["max_num_batched_tokens"], burst, allow_seeded,
                       allow_abort)
    reqs = draw(st.lists(request, min_size=min(2, max_requests) if burst else 1, max_size=max_requests))
    engine["num_blocks"] = fitted_pool(draw, reqs, engine["block_size"], burst)
    return {"engine": engine, "requests": [{"id": f"r{n}", **r} for n, r in enumerate(reqs)]}
