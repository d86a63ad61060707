"""Prompts as token-id lists, with the lengths that break paged, chunked engines.

A length is either an edge — 1 token, `block_size - 1`, `block_size`, `block_size + 1`, two blocks,
one past the step's token budget (so prefill must be chunked) — or anything up to MAX_PROMPT_LEN.
Ids cover the whole vocabulary (special tokens included: a prompt may contain eos). Each prompt is
one draw of two bytes per token (generating and shrinking a list of ints one draw per token costs
more than running the engine); bytes shrink to zero, so ids shrink towards 0.
Strategies are built once per argument tuple (functools.cache): a strategy built afresh inside every
draw is validated afresh by Hypothesis, which cost more than the draws themselves.
"""
from __future__ import annotations

import functools

from hypothesis import strategies as st

MAX_PROMPT_LEN = 48


def edge_lengths(block_size: int, token_budget: int) -> list[int]:
    edges = [1, block_size - 1, block_size, block_size + 1, 2 * block_size, token_budget + 1]
    return sorted({n for n in edges if 1 <= n <= MAX_PROMPT_LEN})


@functools.cache
def prompt_lengths(block_size: int, token_budget: int) -> st.SearchStrategy[int]:
    """The edges, then every length: one draw (a one_of here would stop the shrinker from deleting
    whole requests), biased towards the front of the list."""
    return st.sampled_from(edge_lengths(block_size, token_budget) + list(range(1, MAX_PROMPT_LEN + 1)))


@functools.cache
def token_ids(vocab_size: int, length: int) -> st.SearchStrategy[list[int]]:
    return st.binary(min_size=2 * length, max_size=2 * length).map(
        lambda raw: [int.from_bytes(raw[i:i + 2], "little") % vocab_size for i in range(0, len(raw), 2)])


@functools.cache
def prompts(vocab_size: int, block_size: int, token_budget: int) -> st.SearchStrategy[list[int]]:
    return prompt_lengths(block_size, token_budget).flatmap(lambda n: token_ids(vocab_size, n))
