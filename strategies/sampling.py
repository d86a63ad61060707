"""Sampling parameters: greedy, or seeded sampling whose draws depend on (seed, token index) only.

Returned as the schedule format's `sampling` object; greedy is the empty object (the default).
Seeded requests are the majority where allowed (two of them sampling in one step is where draws
could leak between requests); each list starts with its most random value, so shrinking keeps a
request's tokens sensitive to its draws.
"""
from __future__ import annotations

from hypothesis import strategies as st

GREEDY: dict = {}

seeded = st.fixed_dictionaries({
    "temperature": st.sampled_from([1.5, 1.0, 0.6]),
    "top_k": st.sampled_from([0, 40, 2]),
    "top_p": st.sampled_from([1.0, 0.9, 0.5]),
    "seed": st.integers(0, 2**16 - 1),
})


def sampling(allow_seeded: bool = True) -> st.SearchStrategy[dict]:
    """Greedy first (shrinks to it); seeded only where the property is exact (invariant mode)."""
    if not allow_seeded:
        return st.just(GREEDY)
    return st.sampled_from([False, True, True]).flatmap(lambda is_seeded: seeded if is_seeded else st.just(GREEDY))
