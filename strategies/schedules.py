"""Join/leave schedules: the JSON schedule dicts of FORMATS.md that every property runs.

A schedule is engine settings, then requests, then who samples and who leaves, then a KV pool:
- requests (1-MAX_REQUESTS; a burst has at least 2): a prompt (see prompts), `max_tokens`
  1-MAX_TOKENS (a small one is an early leave) and an `arrival_step` (joins mid-batch);
- sampling: some requests sample with a seed (see sampling); the others are greedy;
- leaves: any request may get an `abort_step` 0-MAX_ABORT_DELAY steps after its arrival (0 = before
  it ran), drawn with the request;
- the pool always holds the largest request (each request fits alone, so each is admissible).
Two shapes:
- staggered: arrivals 0-MAX_ARRIVAL, aborts, a pool from the largest request alone up to three
  times it (tight pools preempt when requests happen to overlap);
- burst: every request joins in the first two steps and runs to max_tokens >= MAX_TOKENS / 2, no
  aborts, under pressure settings (see engine_settings) on a pool that holds the first max_num_seqs
  of them only until each has generated 1-MAX_TOKENS/2 tokens: requests admitted together run out
  of blocks while decoding, preempt, and resume by recomputing prompt and generated tokens.
Every request is a handful of draws, its leave included, and sampling is drawn apart from it, so the
shrinker can delete whole requests; a shrunk schedule is one greedy request or the few its
failure needs, on the roomiest engine settings that still fail.
"""
from __future__ import annotations

from hypothesis import strategies as st

from .engine_settings import engine_settings
from .prompts import prompts
from .sampling import seeded

MAX_REQUESTS = 5
MAX_TOKENS = 8
MAX_ARRIVAL = 12
MAX_ABORT_DELAY = 10


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def requests(vocab_size: int, block_size: int, token_budget: int, burst: bool = False,
             may_abort: bool = False) -> st.SearchStrategy[dict]:
    """A leave is drawn with its request, so deleting another request never moves it."""
    return st.fixed_dictionaries({
        "prompt_ids": prompts(vocab_size, block_size, token_budget),
        "max_tokens": st.integers(MAX_TOKENS // 2 if burst else 1, MAX_TOKENS),
        "arrival_step": st.integers(0, 1 if burst else MAX_ARRIVAL),
        "abort_delay": st.none() | st.integers(0, MAX_ABORT_DELAY) if may_abort else st.none(),
    })


def fitted_pool(draw, reqs: list[dict], engine: dict, burst: bool) -> int:
    block_size = engine["block_size"]
    largest = max(blocks_for(len(r["prompt_ids"]) + r["max_tokens"], block_size) for r in reqs)
    if burst:
        headroom = draw(st.integers(1, MAX_TOKENS // 2))  # tokens each resident generates before the pool runs out
        residents = sorted(reqs, key=lambda r: r["arrival_step"])[:engine["max_num_seqs"]]
        return max(largest, sum(blocks_for(len(r["prompt_ids"]) + headroom, block_size) for r in residents))
    return largest + draw(st.one_of(st.integers(0, 2), st.integers(0, 2 * largest)))


@st.composite
def schedules(draw, vocab_size: int, mode: str = "invariant", max_requests: int = MAX_REQUESTS,
              allow_seeded: bool | None = None, allow_abort: bool = True) -> dict:
    """Seeded sampling defaults to invariant mode only: a top-2 margin explains greedy flips, not draws."""
    if allow_seeded is None:
        allow_seeded = mode == "invariant"
    burst = draw(st.booleans())
    engine = draw(engine_settings(mode, pressure=burst))
    may_abort = allow_abort and not burst
    reqs = draw(st.lists(requests(vocab_size, engine["block_size"], engine["max_num_batched_tokens"], burst,
                                  may_abort),
                         min_size=min(2, max_requests) if burst else 1, max_size=max_requests))
    pick = st.integers(0, max_requests - 1)  # a request, counted modulo how many there are
    if allow_seeded:
        for n, params in draw(st.lists(st.tuples(pick, seeded), max_size=max_requests)):
            reqs[n % len(reqs)]["sampling"] = params
    for r in reqs:
        delay = r.pop("abort_delay")
        if delay is not None:
            r["abort_step"] = r["arrival_step"] + delay
    engine["num_blocks"] = fitted_pool(draw, reqs, engine, burst)
    return {"engine": engine, "requests": [{"id": f"r{n}", **r} for n, r in enumerate(reqs)]}
