"""Property 11: a prefix-cache hit changes nothing, and is reported truthfully
(EngineConfig.enable_prefix_caching).

Join/leave schedules whose prompts share prefixes (strategies.shared_prefix_schedules), with prefix
caching on: every request, which may take full KV blocks another request computed (while that one
still runs, after it finished, after eviction pressure or its own preemption), is compared with the
same request run alone on a fresh engine, cold. Invariant mode must be bit-identical (a hit is a
prefill chunked at a block boundary); fast mode margin-explained. After every step the driver checks
the KV accounting with sharing (a block's count is its holders; a registered hash maps to one block).
And each request's `num_cached_tokens` (the server's usage.prompt_tokens_details.cached_tokens) is where
its first chunk started, and no hit is larger than what the request has in common with another request
of the same `cache_salt`: check.prefix_cache, which replay applies to every run with caching on.
And in invariant mode, a request that takes an earlier one's prefix asks for prompt logprobs one time
in four: it scores every token of its prompt as it does alone, whatever the cache
holds (vLLM computes such a request's prompt in full).
"""
import pytest
from hypothesis import given

from ..strategies import shared_prefix_schedules, tiny_model_names
from .corners import with_corners
from .harness import check

pytestmark = pytest.mark.invariants


@given(model=tiny_model_names(), schedule=shared_prefix_schedules("invariant", scoring=None))
@with_corners("prefix-caching-is-exact")
def test_a_cache_hit_is_bit_identical_to_the_cold_request(model, schedule):
    check("prefix-caching-is-exact", model, schedule)


@given(model=tiny_model_names(), schedule=shared_prefix_schedules("fast"))
def test_a_cache_hit_is_margin_explained_in_fast_mode(model, schedule):
    check("prefix-caching-is-margin-explained", model, schedule)
