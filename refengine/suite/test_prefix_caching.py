"""Property 11: a prefix-cache hit changes nothing, and is reported truthfully
(EngineConfig.enable_prefix_caching).

Join/leave schedules whose prompts share prefixes (strategies.shared_prefix_schedules), with prefix
caching on: every request, which may take full KV blocks another request computed (while that one
still runs, after it finished, after eviction pressure or its own preemption), is compared with the
same request run alone on a fresh engine, cold. Invariant mode must be bit-identical (a hit is a
prefill chunked at a block boundary); fast mode margin-explained. After every step the driver checks
the KV accounting with sharing (a block's count is its holders; a registered hash maps to one block).
And each request's `num_cached_tokens` (the server's usage.prompt_tokens_details.cached_tokens) is where
its first chunk started: the prompt tokens its first admission did not compute.
"""
import pytest
from hypothesis import given

from ..strategies import shared_prefix_schedules, tiny_model_names
from .harness import check, fail

pytestmark = pytest.mark.invariants


def check_prefix_caching(name: str, model_name: str, schedule: dict, fault: str | None = None) -> None:
    result = check(name, model_name, schedule, fault=fault)  # passed: the batched run ended without failure
    first = {}
    for entry in result.trace:
        for chunk in entry["scheduled"]:
            first.setdefault(chunk["id"], chunk["start"])
    wrong = [f"{rid}: reports {result.outputs[rid].num_cached_tokens} cached tokens, its first chunk started at "
             f"{start}" for rid, start in first.items() if result.outputs[rid].num_cached_tokens != start]
    if wrong:
        fail(name, model_name, schedule, "cached_tokens untruthful:\n" + "\n".join(wrong), fault)


@given(model=tiny_model_names(), schedule=shared_prefix_schedules("invariant"))
def test_a_cache_hit_is_bit_identical_to_the_cold_request(model, schedule):
    check_prefix_caching("prefix-caching-is-exact", model, schedule)


@given(model=tiny_model_names(), schedule=shared_prefix_schedules("fast"))
def test_a_cache_hit_is_margin_explained_in_fast_mode(model, schedule):
    check_prefix_caching("prefix-caching-is-margin-explained", model, schedule)
