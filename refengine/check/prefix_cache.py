"""What a prefix-cache hit must be, beyond giving the cold request's answer: reported truthfully, and
taken only from a request that computed those very tokens under the same `cache_salt`.

Both are read from the run itself, never from the engine's cache: a request's first scheduled chunk
starts where its first admission's hit ended (the trace's `start`), which must be its
`num_cached_tokens` (what a server reports as usage.prompt_tokens_details.cached_tokens); and no hit
can be longer than the longest prefix its tokens share with another request of the same salt (their
prompts and answers as the run produced them), or KV came from nowhere or across salts
(Fault.CACHE_SALT_IGNORED, Fault.PREFIX_HASH_NOT_CHAINED). Guarded by
tests/test_prefix_caching.py::test_untruthful_cached_tokens_fail_the_property.
"""
from __future__ import annotations

from ..engine import RequestOutput
from .schedule import Schedule, children


def first_chunk_starts(trace: list[dict]) -> dict[str, int]:
    """Per request, the position its first scheduled chunk started at."""
    first = {}
    for entry in trace:
        for chunk in entry["scheduled"]:
            first.setdefault(chunk["id"], chunk["start"])
    return first


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def cache_problems(schedule: Schedule, outputs: dict[str, RequestOutput], trace: list[dict]) -> list[str]:
    """One line per request whose hit is misreported or has no source; empty when all are right."""
    first = first_chunk_starts(trace)
    runs = [c for r in schedule.requests for c in children(r)]  # an n > 1 request's children run apart
    tokens = {c.id: outputs[c.id].prompt_ids + outputs[c.id].token_ids for c in runs if c.id in outputs}
    salts = {c.id: c.cache_salt for c in runs}
    problems = []
    for rid, start in first.items():
        reported = outputs[rid].num_cached_tokens
        if reported != start:
            problems.append(f"{rid}: reports {reported} cached tokens, its first chunk started at {start}")
        shared = max((common_prefix(tokens[rid], tokens[other]) for other in tokens
                      if other != rid and salts[other] == salts[rid]), default=0)
        if start > shared:
            problems.append(f"{rid}: its first chunk started at {start}, but it shares only {shared} tokens with any "
                            f"other request of cache_salt {salts[rid]!r}: a cache hit with no source")
    return problems
