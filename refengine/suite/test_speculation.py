"""Property 11: speculative decoding changes no answer.

An engine that speculates (1-4 draft tokens by prompt lookup or a draft model, engine/drafter.py) verifies each decode's
drafts in the step's batched forward and keeps the longest run the target agrees with. What it must
give back is what it would give without speculating:
- greedy: every request batched with speculation on equals the same request alone with speculation off:
  in invariant mode bit for bit, token ids and each token's logits (a verification row is attended row
  by row, in either mode: it is the row a decode of that prefix computes), in fast mode within the
  calibrated noise (which fast mode's batching, its prefill chunks attended whole, adds). The schedules
  are the suite's, greedy only, with speculation forced on.
- seeded sampling: a verification row emits the draft with probability p(draft), else a draw from the
  residual; what it emits must be distributed as the target: for each sampler, the first-token draws of
  seeds 0..DRAWS-1 verifying the row's likeliest token (and, for the top-k 2 samplers, its second) fit
  the float64 target (the sampling-distribution property's test, through engine.verify_token); and so
  must what it emits from a draft model's own draws (the model itself, or the strategies' draft model),
  each verified against the distribution the draft model drew it from (accepted with min(1, p/q), else
  replaced from max(p - q, 0)).
- every speculating run, in every property (check.replay): what each verifying decode says it
  accepted is what its request received, and the engine's counters sum the same (check.speculation).
Batched == alone with speculation on is invariant-mode-is-exact's, whose engine settings speculate in
half the examples.
"""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ..strategies import SAMPLERS, schedules, tiny_model_names
from ..strategies.engine_settings import MODES, draft_model_dir
from ..strategies.models import VOCAB_SIZE
from .corners import with_corners
from .harness import check
from .test_sampling import check_first_token_distribution

pytestmark = pytest.mark.invariants


def speculating(schedule: dict, k: int, draft_model: bool) -> dict:
    """`schedule` with k draft tokens per decode (by the strategies' draft model, or prompt lookup), its
    budget raised to hold a verifying decode whole."""
    engine = {key: value for key, value in schedule["engine"].items() if key != "speculative_model"}
    return {**schedule, "engine": {**engine, "num_speculative_tokens": k,
                                   "max_num_batched_tokens": max(engine["max_num_batched_tokens"], 1 + k),
                                   **({"speculative_model": draft_model_dir()} if draft_model else {})}}


speculating_schedules = st.builds(
    speculating, st.sampled_from(MODES).flatmap(lambda mode: schedules(VOCAB_SIZE, mode, allow_seeded=False)),
    st.integers(1, 4), st.booleans())


@with_corners("speculation-changes-no-greedy-answer")
@given(model=tiny_model_names(), schedule=speculating_schedules)
def test_speculation_changes_no_greedy_answer(model, schedule):
    check("speculation-changes-no-greedy-answer", model, schedule, against="unspeculated")


# every sampler with the likeliest token as the draft; the second likeliest where top-k 2 leaves it likely
VERIFIED = [(s, 0) for s in SAMPLERS] + [(s, 1) for s in SAMPLERS if s["top_k"] == 2]


@pytest.mark.parametrize("sampler, draft_rank", VERIFIED,
                         ids=lambda v: "T{temperature}-k{top_k}-p{top_p}".format(**v) if isinstance(v, dict) else
                         f"draft{v}")
def test_a_verified_token_is_distributed_as_the_target(sampler, draft_rank):
    check_first_token_distribution(sampler, draft_rank=draft_rank)


# every sampler with the model as its own draft model; the untruncated ones with the strategies' draft model
DRAWN = [(s, "self") for s in SAMPLERS] + [(s, "draft") for s in SAMPLERS if s["top_p"] == 1.0 and s["top_k"] == 0]


@pytest.mark.parametrize("sampler, draft_model", DRAWN,
                         ids=lambda v: "T{temperature}-k{top_k}-p{top_p}".format(**v) if isinstance(v, dict) else v)
def test_a_draft_models_draw_verified_is_distributed_as_the_target(sampler, draft_model):
    check_first_token_distribution(sampler, draft_model=draft_model)
