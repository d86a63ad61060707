"""Property 4: prefill/decode and chunking consistency.

A decode step's logits equal those of a fresh prefill of the same prefix, and the same schedule
under another token budget (so other prefill chunk sizes and other batches) gives the same
outputs: bitwise in invariant mode, within the calibrated batched-vs-serial noise in fast mode;
requested logprobs included (within twice that noise in fast mode).
"""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ..strategies import schedules, tiny_model_names
from ..strategies.engine_settings import MODES
from ..strategies.models import VOCAB_SIZE
from .corners import with_corners
from .harness import any_mode_schedules, check, other_budgets

pytestmark = pytest.mark.invariants


@given(model=tiny_model_names(), schedule=st.sampled_from(MODES).flatmap(
    lambda mode: schedules(VOCAB_SIZE, mode, max_requests=2)))
def test_decode_logits_equal_a_fresh_prefill_of_the_prefix(model, schedule):
    check("decode-equals-prefill", model, schedule, against="prefill")


@given(model=tiny_model_names(), schedule=any_mode_schedules, other_budget=other_budgets)
@with_corners("chunking-consistency")
def test_any_chunk_size_gives_the_same_outputs(model, schedule, other_budget):
    check("chunking-consistency", model, schedule, against="budget", other_budget=other_budget)
