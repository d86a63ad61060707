"""Property 3: the float32 engine, batched, agrees with the float64 serial reference.

Tokens must be identical except where the reference's top-2 margin at the first differing token is
within the calibrated f32-vs-f64 tolerance (after such an explained divergence the request is no
longer compared); on every agreeing token the logit deviation from float64 stays within it.
Where a request asks for logprobs, each agreeing step's reported logprob and alternatives must lie
within twice that tolerance of the float64 log-softmax of the reference's logits for the same prefix.
And the reference itself ends each answer where check.output_oracle says its tokens end it: it shares
refengine/sampling.py's finish rule with the engine, so the oracle is what holds the golden answers.
Both kernel modes; greedy requests (the reference does not sample).
"""
import pytest
from hypothesis import given

from ..check.output_oracle import expected_finish
from ..check.schedule import parse_schedule
from ..strategies import tiny_model, tiny_model_names
from .corners import with_corners
from .harness import baselines, check, fail, greedy_schedules, prepared

pytestmark = pytest.mark.invariants
NAME = "reference-agreement"


@given(model=tiny_model_names(), schedule=greedy_schedules)
@with_corners(NAME)
def test_engine_agrees_with_the_float64_reference(model, schedule):
    schedule = prepared(model, schedule)
    result = check(NAME, model, schedule, against="reference")
    tiny, wrong = tiny_model(model), []
    for request in parse_schedule(schedule, NAME).requests:
        if request.id not in result.outputs:
            continue
        ref = baselines.reference(tiny, result.outputs[request.id].prompt_ids, request.params, request.images)
        ends = expected_finish(ref.token_ids, tiny.tokenizer.decode, request.params, tiny.config.eos_token_ids)
        if ends != (len(ref.token_ids), ref.finish_reason):
            wrong.append(f"{request.id}: the reference ended after {len(ref.token_ids)} tokens, {ref.finish_reason!r}; "
                         f"its tokens {ref.token_ids} end after {ends[0]}, {ends[1]!r}")
    if wrong:
        fail(NAME, model, schedule, "the float64 reference ends answers where the finish rule does not:\n"
             + "\n".join(wrong))
