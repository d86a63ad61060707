"""Properties 1 and 2: batching never changes a request's output.

Every request of a Hypothesis join/leave schedule is compared with the same request run alone
(max_num_seqs=1, same settings). Invariant mode must be bit-identical: token ids and every logits
row (sha256), seeded sampling included. Fast mode must give the same tokens except where the
request-alone top-2 margin at the first differing token is within the calibrated tolerance, and
on every agreeing token the logit deviation must stay within the calibrated noise tolerance.
"""
import pytest
from hypothesis import example, given

from ..strategies import tiny_model_names
from ..strategies.models import DEFAULT_MODEL
from .harness import check, fast_schedules, invariant_schedules

pytestmark = pytest.mark.invariants

# Fixed bugs, kept as regressions (their shrunk schedules, as Hypothesis reported them):
QK_NORM_LAYOUT = {  # two rows made linear_invariant return a column-major qkv; the q/k RMSNorm then
    # reduced in another order than for one row alone (invariant mode, qk-norm models)
    "engine": {"mode": "invariant", "max_num_seqs": 2, "max_num_batched_tokens": 8, "block_size": 1,
               "max_model_len": 128, "num_blocks": 5},
    "requests": [{"id": "r0", "prompt_ids": [0], "max_tokens": 4, "arrival_step": 0},
                 {"id": "r1", "prompt_ids": [0], "max_tokens": 4, "arrival_step": 0}]}


@given(model=tiny_model_names(), schedule=invariant_schedules)
@example(model=DEFAULT_MODEL, schedule=QK_NORM_LAYOUT)
def test_invariant_mode_is_exact(model, schedule):
    check("invariant-mode-is-exact", model, schedule)


@given(model=tiny_model_names(), schedule=fast_schedules)
def test_fast_mode_is_margin_explained(model, schedule):
    check("fast-mode-is-margin-explained", model, schedule)
