"""Join/leave schedules: the JSON schedule dicts of FORMATS.md that every property runs.

A schedule is engine settings, then requests, then who samples, then a KV pool:
- requests (1-MAX_REQUESTS; a burst has at least 2): a prompt (see prompts), an `arrival_step`
  (joins mid-batch) and how it leaves: after `max_tokens` 1-MAX_TOKENS (a small one is an early
  leave) or by an abort (`abort_step`) ABORT_DELAYS steps after its arrival (0 = before it ran);
- sampling: some requests sample with a seed (see sampling); the others are greedy;
- logprobs: some requests ask for logprobs (`"logprobs": K`, K of LOGPROB_COUNTS alternatives per
  step, 0 = the chosen token's only); the others ask for none, which is what the shrinker goes to;
- n (only where `forks`): two requests in three ask for 2 or 3 answers (FORKS), drawn in the same choice;
  one drawn greedy samples instead (the most random sampler, its index as the seed: answers that differ);
- prompt logprobs: a request in three asks for them (`"prompt_logprobs": K`, K of PROMPT_LOGPROB_COUNTS),
  drawn with how they leave (a pick by request number would move to another request as the shrinker
  deletes the ones before it);
- images: some requests get one or two generated images (IMAGES: where in the prompt, height and width
  around the tiny vision model's merge multiple, a seed), drawn as (request, images) picks after the rest;
  suite.harness.resolve_images places them as image tokens on a vision-language model and drops them on
  any other;
- the pool always holds the largest request (each request fits alone, so each is admissible);
- logits processors: about three requests in four ask for penalties, a logit bias or min_tokens
  (see processors), drawn with how they leave.
Two shapes, half of the schedules each:
- burst (first, so also what Hypothesis tries first and shrinks towards): every request joins in
  the first two steps and runs to max_tokens >= MAX_TOKENS / 2, no aborts, under pressure settings
  (see engine_settings) on a pool that holds the first max_num_seqs of them only until each has
  generated 1-MAX_TOKENS/2 tokens: requests admitted together run out of blocks while decoding,
  preempt, and resume by recomputing prompt and generated tokens;
- staggered: arrivals 0-MAX_ARRIVAL, aborts, a pool from the largest request alone up to three
  times it (tight pools preempt when requests happen to overlap).
A request is exactly four draws (prompt length, prompt bytes, arrival, leave with its processors and prompt logprobs) and sampling and
logprobs are drawn apart from it (each a list of (request, value) picks, after the requests): Hypothesis's shrinker deletes at most five consecutive choices at a time (a list
element plus the list's "one more?" flag), so this is what lets it delete whole requests. A shrunk
schedule is one greedy request or the few its failure needs, on the roomiest engine settings that
still fail.
"""
from __future__ import annotations

import functools

from hypothesis import strategies as st

from .engine_settings import engine_settings
from .processors import KINDS, processor_fields
from .prompts import MAX_PROMPT_LEN, prompts
from .sampling import SAMPLERS, seeded

MAX_REQUESTS = 5
MAX_TOKENS = 8
MAX_ARRIVAL = 12
ABORT_DELAYS = (0, 1, 2, 3, 5, 8)
LOGPROB_COUNTS = (0, 1, 2, 5, 20)  # alternatives per step; 20 is the server's most (OpenAI's limit)
LOGPROBS = st.sampled_from(LOGPROB_COUNTS)
PROMPT_LOGPROB_COUNTS = (None, None, None, None, 0, 5)  # None: not asked for
FORKS = (1, 2, 3)  # n: answers to one prompt (schedules with `forks` only)
SHAPES = st.sampled_from([True, False])  # burst first
HEADROOM = st.integers(1, MAX_TOKENS // 2)  # tokens each burst resident generates before the pool runs out
# Image sides in pixels, around the tiny vision model's merge multiple of 8 (patches of 4 merged 2x2;
# max_pixels 32x32): 8 is one image token, where the shrinker goes; 16 the first with two rows or columns
IMAGE_SIDES = (8, 16, 24, 32, 7, 9, 15, 17, 40)
IMAGE = st.builds(lambda at, height, width, seed: {"at": at, "height": height, "width": width, "seed": seed},
                  st.integers(0, MAX_PROMPT_LEN), st.sampled_from(IMAGE_SIDES), st.sampled_from(IMAGE_SIDES),
                  st.integers(0, 255))
IMAGES = st.lists(IMAGE, min_size=1, max_size=2)  # a request's: `at` the prompt token the image goes before


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@functools.cache
def leaves(burst: bool, may_abort: bool, scored: bool, forked: bool = False) -> st.SearchStrategy[tuple]:
    """How a request leaves, simplest first: run to a max_tokens, or be aborted (running up to MAX_TOKENS);
    with which of processors.KINDS it asks for, its prompt logprobs and its n, in the same choice (each
    leave first without processors, each of those first without prompt logprobs, each of those first with
    n 1; no prompt logprobs where not `scored`, n 1 where not `forked`)."""
    by_length = [{"max_tokens": n} for n in range(MAX_TOKENS // 2 if burst else 1, MAX_TOKENS + 1)]
    by_abort = [{"max_tokens": MAX_TOKENS, "abort_delay": d} for d in ABORT_DELAYS] if may_abort else []
    counts = PROMPT_LOGPROB_COUNTS if scored else (None,)
    return st.sampled_from([(leave, kind, count, n) for n in (FORKS if forked else (1,)) for count in counts
                            for kind in KINDS for leave in by_length + by_abort])


@functools.cache  # one strategy per argument tuple (prompts.py says why)
@st.composite
def requests(draw, vocab_size: int, block_size: int, token_budget: int, burst: bool = False,
             may_abort: bool = True, scored: bool = True, forked: bool = False) -> dict:
    request = {"prompt_ids": draw(prompts(vocab_size, block_size, token_budget)),
               "arrival_step": draw(st.integers(0, 1 if burst else MAX_ARRIVAL))}
    leave, kind, count, n = draw(leaves(burst, may_abort, scored, forked))
    leave = dict(leave)
    if "abort_delay" in leave:
        request["abort_step"] = request["arrival_step"] + leave.pop("abort_delay")
    if count is not None:
        request["prompt_logprobs"] = count
    if n > 1:
        request["n"] = n
    return {**request, **leave, **processor_fields(kind, request["prompt_ids"], leave["max_tokens"])}


@functools.cache
def request_lists(vocab_size: int, block_size: int, token_budget: int, burst: bool, may_abort: bool,
                  max_requests: int, scored: bool = True, forked: bool = False) -> st.SearchStrategy[list[dict]]:
    request = requests(vocab_size, block_size, token_budget, burst, may_abort, scored, forked)
    return st.lists(request, min_size=min(2, max_requests) if burst else 1, max_size=max_requests)


@functools.cache
def spare_blocks(largest: int) -> st.SearchStrategy[int]:
    """Blocks a staggered schedule's pool holds beyond its largest request: few, or up to twice it."""
    return st.one_of(st.integers(0, 2), st.integers(0, 2 * largest))


@functools.cache
def picks(values: st.SearchStrategy, max_size: int) -> st.SearchStrategy[list[tuple[int, object]]]:
    """(request, value) pairs; the request counted modulo how many there are."""
    return st.lists(st.tuples(st.integers(0, max_size - 1), values), max_size=max_size)


def fitted_pool(draw, reqs: list[dict], engine: dict, burst: bool) -> int:
    block_size = engine["block_size"]
    largest = max(blocks_for(len(r["prompt_ids"]) + r["max_tokens"], block_size) for r in reqs)
    if burst:
        headroom = draw(HEADROOM)
        residents = sorted(reqs, key=lambda r: r["arrival_step"])[:engine["max_num_seqs"]]
        return max(largest, sum(blocks_for(len(r["prompt_ids"]) + headroom, block_size) for r in residents))
    return largest + draw(spare_blocks(largest))


@functools.cache  # the properties' flatmaps ask for it per draw
@st.composite
def schedules(draw, vocab_size: int, mode: str = "invariant", max_requests: int = MAX_REQUESTS,
              allow_seeded: bool | None = None, allow_abort: bool = True, prompt_logprobs: bool = True,
              forks: bool = False) -> dict:
    """Seeded sampling defaults to invariant mode only: a top-2 margin explains greedy flips, not draws.
    `prompt_logprobs` False: no request asks for them. `forks`: two requests in three ask for n of 2 or 3
    (FORKS), the others for one answer."""
    if allow_seeded is None:
        allow_seeded = mode == "invariant"
    burst = draw(SHAPES)
    engine = draw(engine_settings(mode, pressure=burst))
    reqs = draw(request_lists(vocab_size, engine["block_size"], engine["max_num_batched_tokens"], burst,
                              allow_abort and not burst, max_requests, prompt_logprobs, forks))
    if allow_seeded:
        for n, params in draw(picks(seeded, max_requests)):
            reqs[n % len(reqs)]["sampling"] = params
    for n, count in draw(picks(LOGPROBS, max_requests)):
        reqs[n % len(reqs)]["logprobs"] = count
    for n, request in enumerate(reqs):  # a greedy request's answers are all alike: where no sampler was drawn,
        if request.get("n", 1) > 1 and "sampling" not in request:  # one asking for several samples
            request["sampling"] = {**SAMPLERS[0], "seed": n}
    engine["num_blocks"] = fitted_pool(draw, reqs, engine, burst)
    for n, images in draw(picks(IMAGES, max_requests)):  # last: the draws before mean what they meant without
        reqs[n % len(reqs)]["images"] = images
    return {"engine": engine, "requests": [{"id": f"r{n}", **r} for n, r in enumerate(reqs)]}
