"""Engine settings: the schedule format's `engine` object, minus the pool (fitted to the requests).

- `max_num_seqs` 1-8: 1 is serial operation, anything more batches.
- `max_num_batched_tokens`: 64 lets whole prompts through in one step; 8-32 chunk long prompts;
  tiny budgets (1-16) force chunked prefill and starve decodes of a seat.
- `block_size` 1-32, mostly small: 1 puts every token in its own block, 32 holds most sequences in one.
- `max_model_len` is fixed at MAX_MODEL_LEN, well above any generated request.
- `scheduling_policy`: the order of a step's chunks, shrinking towards "fcfs" (running first, a
  partial prefill chunk last); "prefill-first" (prefill chunks, a partial one included, before decodes)
  and "shuffled" (any permutation, by `scheduling_seed`), so every row order reaches the runner.
  The seed is drawn whatever the policy (a fixed number of draws, so shrinking the policy to "fcfs"
  moves no other draw) and written only with "shuffled".
- `num_speculative_tokens`: off in half the examples, else 1-4 draft tokens (never more than the budget
  leaves beside the decode's own token), by prompt lookup or, in half of those, by a draft model (DRAFT_MODEL,
  another tiny model of the same vocabulary), shrinking towards off and prompt lookup; written only when
  on. Drawn last, so the draws before it mean what they meant before speculation existed.
Under pressure (burst schedules) several sequences run at once on small blocks: max_num_seqs >= 2,
budget >= 8, block_size <= 8, so growing sequences cross block boundaries and exhaust a tight pool.
Seats and budget shrink towards the roomiest engine (8 seats, 64 tokens), so a shrunk schedule
keeps only the constraints its failure needs, and requests that merely occupied seats can go.
"""
from __future__ import annotations

import functools

from hypothesis import strategies as st

from ..engine.config import SCHEDULING_POLICIES
from .models import tiny_model_dir

MAX_MODEL_LEN = 128
MODES = ("invariant", "fast")
MAX_SCHEDULING_SEED = 2**16 - 1
SPECULATIVE_TOKENS = st.one_of(st.just(0), st.integers(1, 4))
DRAFT_MODEL = "qwen3-mqa-tied"


def roomiest_first(low: int, high: int) -> st.SearchStrategy[int]:
    """Integers in [low, high] that shrink towards high."""
    return st.integers(low, high).map(lambda n: low + high - n)


# (max_num_seqs, max_num_batched_tokens, block_size) under pressure and not; built once (prompts.py says why)
PRESSURE = (roomiest_first(2, 8), st.one_of(st.just(64), roomiest_first(8, 32)), st.integers(1, 8))
ROOMY = (roomiest_first(1, 8), st.one_of(st.just(64), roomiest_first(8, 32), roomiest_first(1, 16)),
         st.one_of(st.integers(1, 8), st.integers(1, 4), st.sampled_from([16, 32])))


@functools.cache
@st.composite
def engine_settings(draw, mode: str = "invariant", pressure: bool = False) -> dict:
    seqs, budget, block = PRESSURE if pressure else ROOMY
    settings = {"mode": mode, "max_num_seqs": draw(seqs), "max_num_batched_tokens": draw(budget),
                "block_size": draw(block), "max_model_len": MAX_MODEL_LEN}
    policy, seed = draw(scheduling_policies())
    settings["scheduling_policy"] = policy
    if policy == "shuffled":
        settings["scheduling_seed"] = seed
    speculative = min(draw(SPECULATIVE_TOKENS), settings["max_num_batched_tokens"] - 1)
    if speculative:
        settings["num_speculative_tokens"] = speculative
        if draw(st.booleans()):
            settings["speculative_model"] = draft_model_dir()
    return settings


@functools.cache  # drawn in every speculating example: one look at the model cache per process
def draft_model_dir() -> str:
    """The draft model the strategies speculate with: a tiny model every suite model shares a vocabulary with."""
    return str(tiny_model_dir(DRAFT_MODEL))


@functools.cache
def scheduling_policies() -> st.SearchStrategy[tuple[str, int]]:
    """(policy, seed): SCHEDULING_POLICIES, "fcfs" first, and a seed (used by "shuffled" only)."""
    return st.tuples(st.sampled_from(SCHEDULING_POLICIES), st.integers(0, MAX_SCHEDULING_SEED))
