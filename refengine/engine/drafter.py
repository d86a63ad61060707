"""Prompt lookup: the draft tokens of speculative decoding, proposed from a request's own tokens.

vLLM's n-gram speculator (and llama.cpp's lookup decoding): find an earlier occurrence of the last n
tokens, longest n first, and propose the tokens that followed it. No model runs, so a draft costs
nothing but the positions it adds to the verifying forward, and it is a function of the request's
tokens alone: a request proposes the same drafts batched or alone, which is what lets the suite hold
a speculating engine to "same answer as alone" (suite/test_speculation.py).
"""
from __future__ import annotations


def prompt_lookup(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the earliest occurrence of the longest suffix n-gram (n from max_n
    down to min_n) of `token_ids` that starts before the suffix does; none where no suffix recurs. The
    earliest has the most tokens after it: in a run of one repeated token the latest would offer one."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n:]
        for start in range(length - n):
            if token_ids[start:start + n] == suffix:
                return token_ids[start + n:start + n + k]
    return []
