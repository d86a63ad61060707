"""Property 3: the float32 engine, batched, agrees with the float64 serial reference.

Tokens must be identical except where the reference's top-2 margin at the first differing token is
within the calibrated f32-vs-f64 tolerance (after such an explained divergence the request is no
longer compared); on every agreeing token the logit deviation from float64 stays within it.
Where a request asks for logprobs, each agreeing step's reported logprob and alternatives must lie
within twice that tolerance of the float64 log-softmax of the reference's logits for the same prefix.
Both kernel modes; greedy requests (the reference does not sample).
"""
import pytest
from hypothesis import given

from ..strategies import tiny_model_names
from .harness import check, greedy_schedules

pytestmark = pytest.mark.invariants


@given(model=tiny_model_names(), schedule=greedy_schedules)
def test_engine_agrees_with_the_float64_reference(model, schedule):
    check("reference-agreement", model, schedule, against="reference")
