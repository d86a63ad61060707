"""Sampling parameters: greedy, or seeded sampling whose draws depend on (seed, token index) only.

Returned as the schedule format's `sampling` object; greedy is the absence of one. A seeded
sampler is one of SAMPLERS plus a seed; SAMPLERS lists the most random first, so shrinking keeps
a request's tokens sensitive to its draws (where a leaked seed would show).
"""
from __future__ import annotations

from hypothesis import strategies as st

SAMPLERS = [{"temperature": t, "top_k": k, "top_p": p}
            for t in (1.5, 1.0, 0.6) for k in (0, 40, 2) for p in (1.0, 0.9, 0.5)]

seeded = st.builds(lambda sampler, seed: {**sampler, "seed": seed}, st.sampled_from(SAMPLERS), st.integers(0, 2**16 - 1))
