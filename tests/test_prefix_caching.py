"""Prefix caching (EngineConfig.enable_prefix_caching, engine/block_manager.py) on fixed examples:
which tokens a hit covers, the counters, a preempted request taking its own blocks back, and that the
shipped property (refengine/suite/test_prefix_caching.py) reaches hits, also under preemption."""
from __future__ import annotations

import pytest
from hypothesis import given, settings

from refengine.check.driver import run_batched
from refengine.check.schedule import parse_schedule
from refengine.engine import EngineConfig, LLMEngine
from refengine.sampling import SamplingParams
from refengine.strategies import DEFAULT_MODEL, shared_prefix_schedules
from refengine.suite.harness import prepared


def test_the_property_reaches_cache_hits_and_hits_under_preemption(tiny_model):
    """Within the dev profile's budget the drawn schedules hit the cache, some while preempting, and some
    take blocks that hold an earlier request's answer (a conversation resent with it)."""
    seen = {"hit": False, "hit while preempting": False, "hit on an answer's blocks": False}

    @settings(max_examples=25, database=None, derandomize=True)
    @given(schedule=shared_prefix_schedules("invariant"))
    def look(schedule):
        resolved = prepared(DEFAULT_MODEL, schedule)
        engine, failure = run_batched(tiny_model, parse_schedule(resolved, "coverage"),
                                      parse_schedule(resolved, "coverage").engine, keep_logits=False)
        assert failure is None, failure
        status = engine.status()
        seen["hit"] |= status["prefix_cache_hits"] > 0
        seen["hit while preempting"] |= status["prefix_cache_hits"] > 0 and status["preemptions"] > 0
        prompts = {r["id"]: len(r["prompt_ids"]) for r in resolved["requests"]}
        seen["hit on an answer's blocks"] |= any(engine.output(r["id"]).num_cached_tokens > prompts[r["continues"]]
                                                for r in schedule["requests"] if "continues" in r)

    look()
    assert all(seen.values()), seen


def run(model, config: EngineConfig, prompts: dict[str, list[int]], max_tokens: int = 6) -> LLMEngine:
    """Each prompt in turn, each run to its end before the next joins."""
    engine = LLMEngine(model, config, keep_logits=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params=SamplingParams(max_tokens=max_tokens))
        engine.run()
        engine.check_invariants()
    return engine


@pytest.mark.parametrize("shared", [15, 16, 17, 32, 40])
def test_cached_tokens_are_the_full_blocks_shared_and_never_the_last_token(tiny_model, shared):
    """block_size 16: a prefix shared up to `shared` tokens hits its full blocks, and never the
    prompt's last token (it yields the logits row the first token is sampled from)."""
    base = [(7 * i + 3) % 500 for i in range(40)]
    other = base[:shared] + [(11 * i + 5) % 500 for i in range(40 - shared)]
    config = EngineConfig(mode="invariant", block_size=16, enable_prefix_caching=True)
    engine = run(tiny_model, config, {"a": base, "b": other})
    want = min(shared, len(other) - 1) // 16 * 16
    assert engine.output("a").num_cached_tokens == 0 and engine.output("b").num_cached_tokens == want
    assert (engine.status()["prefix_cache_queries"], engine.status()["prefix_cache_hits"]) == (80, want)
    cold = run(tiny_model, EngineConfig(mode="invariant", block_size=16), {"b": other})
    hot, alone = engine.output("b"), cold.output("b")
    assert hot.token_ids == alone.token_ids
    assert [s.logits_sha256 for s in hot.steps] == [s.logits_sha256 for s in alone.steps]


def test_without_prefix_caching_nothing_is_shared(tiny_model):
    prompt = list(range(3, 43))
    engine = run(tiny_model, EngineConfig(mode="invariant", block_size=16), {"a": prompt, "b": prompt})
    assert engine.output("b").num_cached_tokens == 0 and engine.status()["prefix_cache_hits"] == 0


def test_a_preempted_request_finds_its_own_blocks_again(tiny_model):
    """Two long requests in a pool that holds one: the younger is preempted (its blocks freed, still
    registered) and on readmission takes back what is still cached; both answers equal their cold ones."""
    prompts = {"a": [(5 * i + 1) % 500 for i in range(30)], "b": [(3 * i + 2) % 500 for i in range(30)]}
    config = EngineConfig(mode="invariant", block_size=4, num_blocks=16, max_num_seqs=2,
                          enable_prefix_caching=True)
    engine = LLMEngine(tiny_model, config, keep_logits=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params=SamplingParams(max_tokens=24))
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    status = engine.status()
    assert status["preemptions"] > 0 and status["prefix_cache_hits"] > 0  # nothing shared but its own KV
    assert all(engine.output(rid).num_cached_tokens == 0 for rid in prompts)  # first admissions: cold
    for rid, prompt in prompts.items():
        cold = run(tiny_model, EngineConfig(mode="invariant", block_size=4), {rid: prompt}, max_tokens=24)
        assert [s.logits_sha256 for s in engine.output(rid).steps] == \
            [s.logits_sha256 for s in cold.output(rid).steps], rid


def test_untruthful_cached_tokens_fail_the_property(monkeypatch, tmp_path):
    """The property's cached_tokens check can fail: an engine that computes right but reports no hit."""
    from refengine.engine.scheduler import Scheduler
    from refengine.strategies import DEFAULT_MODEL
    from refengine.suite.harness import REPRO_DIR_VAR, PropertyFailure, check

    monkeypatch.setenv(REPRO_DIR_VAR, str(tmp_path))
    prompt = [(7 * i + 3) % 500 for i in range(20)]
    schedule = {"engine": {"mode": "invariant", "block_size": 4, "max_model_len": 128, "enable_prefix_caching": True},
                "requests": [{"id": "r0", "prompt_ids": prompt, "max_tokens": 2, "arrival_step": 0},
                             {"id": "r1", "prompt_ids": prompt, "max_tokens": 2, "arrival_step": 4}]}
    check("prefix-caching-is-exact", DEFAULT_MODEL, schedule)  # r1 hits 16 tokens, truthfully
    take = Scheduler._take_cached

    def forgets(self, seq, hit, cached):
        take(self, seq, hit, cached)
        seq.num_cached_tokens = 0

    monkeypatch.setattr(Scheduler, "_take_cached", forgets)
    with pytest.raises(PropertyFailure, match="r1: reports 0 cached tokens, its first chunk started at 16"):
        check("prefix-caching-is-exact", DEFAULT_MODEL, schedule)


def test_a_continuation_is_the_earlier_prompt_its_answer_alone_and_a_next_turn():
    """suite.harness.resolve_continuations: what a chat client resends, when it would send it."""
    from refengine.check.driver import run_alone
    from refengine.strategies import DEFAULT_MODEL, tiny_model
    from refengine.strategies.shared_prefixes import edge_answer
    from refengine.suite.harness import resolve_continuations

    engine = {"mode": "invariant", "block_size": 4, "num_blocks": 4, "max_model_len": 24, "enable_prefix_caching": True}
    first = {"id": "r0", "prompt_ids": [5, 6, 7], "max_tokens": 4, "arrival_step": 2}
    plain = {"engine": engine, "requests": [first]}
    assert resolve_continuations(DEFAULT_MODEL, plain) is plain  # nothing to resolve
    schedule = {"engine": engine, "requests": [
        first,
        {"id": "r1", "prompt_ids": [9, 9], "max_tokens": 3, "arrival_step": 1, "abort_step": 4, "continues": "r0"},
        {"id": "r2", "prompt_ids": list(range(1, 20)), "max_tokens": 3, "arrival_step": 0, "continues": "r1"}]}
    resolved = resolve_continuations(DEFAULT_MODEL, schedule)
    parsed = parse_schedule({"engine": engine, "requests": [first]}, "t")
    alone = run_alone(tiny_model(DEFAULT_MODEL), parsed.engine, parsed.requests[0])
    r0, r1, r2 = resolved["requests"]
    assert r0 == first and "continues" not in r1 and "continues" not in r2
    assert r1["prompt_ids"] == [5, 6, 7] + alone.token_ids + [9, 9]
    assert r1["arrival_step"] == 2 + alone.finish_step + 1 + 1 and r1["abort_step"] - r1["arrival_step"] == 3
    assert len(r2["prompt_ids"]) == 24 - 3 and r2["prompt_ids"][:len(r1["prompt_ids"])] == r1["prompt_ids"]
    assert resolved["engine"]["num_blocks"] == 6 and schedule["engine"]["num_blocks"] == 4  # grown, on a copy
    assert [edge_answer(3, 8, 4), edge_answer(3, 8, 16), edge_answer(4, 8, 1)] == [5, 8, 8]


@pytest.mark.parametrize("salt", ["", 7])
def test_a_bad_cache_salt_is_refused_naming_it_and_the_engine_stays_usable(tiny_model, salt):
    from refengine.errors import RefengineError

    schedule = {"engine": {}, "requests": [{"id": "r0", "prompt_ids": [1, 2], "cache_salt": salt}]}
    with pytest.raises(RefengineError, match=r"request 'r0'\.cache_salt"):
        parse_schedule(schedule, "s.json")
    engine = LLMEngine(tiny_model, EngineConfig(enable_prefix_caching=True))
    with pytest.raises(RefengineError, match="cache_salt"):
        engine.add_request("r0", [1, 2], params=SamplingParams(max_tokens=2), cache_salt=salt)
    engine.add_request("r0", [1, 2], params=SamplingParams(max_tokens=2), cache_salt="ok")
    assert len(engine.run()["r0"].token_ids) == 2
