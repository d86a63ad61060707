"""n answers to one prompt: each child is, bit for bit, the request alone with n 1 and seed + k (built here
from SamplingParams, not from the engine's forking); children fork their siblings' prompt KV (full blocks
shared, the partial one copied) and their prompt logprobs; an abort of the request ends every child; and
each catalogued fork fault fails the schedule the dev profile shrank it to, and only with the fault."""
from __future__ import annotations

import pytest

from refengine.check.replay import replay
from refengine.check.schedule import children, parse_schedule
from refengine.engine import EngineConfig, LLMEngine
from refengine.errors import RefengineError
from refengine.sampling import SamplingParams
from refengine.strategies import tiny_model

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]  # 11 tokens: 10 shared, 2 full blocks of 4 and a partial one
SAMPLED = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True, prompt_logprobs=2)


def alone(model, params: SamplingParams):
    engine = LLMEngine(model, EngineConfig(mode="invariant", max_num_seqs=1, block_size=4))
    engine.add_request("alone", PROMPT, params=params)
    return engine.run()["alone"]


def test_each_child_is_the_request_alone_with_seed_plus_k_and_forks_its_siblings_prompt(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(mode="invariant", max_num_seqs=4, block_size=4, num_blocks=16),
                       keep_logits=True)
    engine.add_request("r", PROMPT, params=SamplingParams(**{**SAMPLED.__dict__, "n": 3}))
    assert engine.request_ids("r") == ["0_r", "1_r", "2_r"]
    shared_seen = False
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
        tables = [engine.sequences[c].block_table.block_ids for c in engine.request_ids("r")
                  if engine.sequences[c].status.value == "running"]
        if len(tables) == 3:  # all run: the two full prompt blocks are the first's, the partial one each its own
            assert tables[1][:2] == tables[2][:2] == tables[0][:2] and len({t[2] for t in tables}) == 3
            shared_seen = True
    assert shared_seen and engine.status()["forks"] == 2
    for k in range(3):
        got, want = engine.output(f"{k}_r"), alone(tiny_model, SamplingParams(**{**SAMPLED.__dict__, "seed": 7 + k}))
        assert got.token_ids == want.token_ids
        assert [s.logits_sha256 for s in got.steps] == [s.logits_sha256 for s in want.steps]
        assert [(p.logprob, p.logits_sha256) for p in got.prompt_logprobs] == \
            [(p.logprob, p.logits_sha256) for p in want.prompt_logprobs]
    assert len({tuple(engine.output(f"{k}_r").token_ids) for k in range(3)}) == 3  # three different draws
    assert [engine.output(f"{k}_r").num_cached_tokens for k in range(3)] == [0, 10, 10]  # what forks did not compute


def test_greedy_children_are_the_greedy_answer_and_an_abort_ends_them_all(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(mode="invariant", max_num_seqs=4, block_size=4))
    engine.add_request("g", PROMPT, params=SamplingParams(max_tokens=6, ignore_eos=True, n=2))
    engine.add_request("cut", PROMPT, params=SamplingParams(max_tokens=6, ignore_eos=True, n=2, temperature=1.0,
                                                            seed=1))
    engine.step()
    assert engine.abort("cut") is True
    events = [e for _ in range(3) for e in engine.step()]
    assert sorted(e.request_id for e in events if e.finish_reason == "abort") == ["0_cut", "1_cut"]
    engine.run()
    greedy = alone(tiny_model, SamplingParams(max_tokens=6, ignore_eos=True))
    assert engine.output("0_g").token_ids == engine.output("1_g").token_ids == greedy.token_ids
    assert engine.abort("g") is False  # every child had finished
    engine.release("0_g")
    assert engine.abort("g") is False  # a server releases each answer as it ends: the rest are still asked
    engine.release("1_g")
    assert "g" not in engine.families


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_a_bad_n_is_refused_naming_it(value):
    with pytest.raises(RefengineError, match="^n: "):
        SamplingParams(n=value)
    with pytest.raises(RefengineError, match=r"request 'r0'\.n"):
        parse_schedule({"requests": [{"id": "r0", "prompt_ids": [1, 2], "n": value}]}, "s.json")


def test_a_duplicate_child_id_is_refused_and_leaves_the_engine_usable(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(mode="invariant", max_num_seqs=4))
    engine.add_request("1_r", [1, 2], params=SamplingParams(max_tokens=2))
    with pytest.raises(RefengineError, match="'r': duplicate request id"):
        engine.add_request("r", [1, 2], params=SamplingParams(max_tokens=2, n=2))
    assert engine.request_ids("r") == ["r"] and list(engine.run()) == ["1_r"]


def test_the_children_the_judge_expects_are_defined_apart_from_the_engine():
    schedule = parse_schedule({"requests": [{"id": "r", "prompt_ids": [1, 2], "n": 3,
                                             "sampling": {"temperature": 1.0, "seed": 40}},
                                            {"id": "g", "prompt_ids": [1, 2], "n": 2},
                                            {"id": "one", "prompt_ids": [1]}]})
    sampled, greedy, one = (children(r) for r in schedule.requests)
    assert [(c.id, c.params.n, c.params.seed) for c in sampled] == [("0_r", 1, 40), ("1_r", 1, 41), ("2_r", 1, 42)]
    assert [(c.id, c.params.seed) for c in greedy] == [("0_g", None), ("1_g", None)]
    assert one == [schedule.requests[2]]


# --- the catalogued faults, on the schedules the dev profile shrank them to ---------------------------
ENGINE = {"mode": "invariant", "max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 1, "max_model_len": 128,
          "num_blocks": 6}
SHORT, SEEDED = {"id": "r0", "prompt_ids": [0], "max_tokens": 4}, {"temperature": 1.5, "seed": 0}
SHRUNK = {
    "n-children-share-seed": {"engine": {**ENGINE, "num_blocks": 5}, "requests": [
        {**SHORT, "n": 2, "sampling": SEEDED}, {**SHORT, "id": "r1"}]},
    "forked-partial-block-shared": {"engine": {**ENGINE, "block_size": 3, "num_blocks": 2}, "requests": [
        SHORT, {"id": "r1", "prompt_ids": [0, 0], "prompt_logprobs": 5, "n": 2, "max_tokens": 4,
                "stop_token_ids": [0], "logit_bias": {"0": 100.0}, "min_tokens": 3, "sampling": SEEDED}]},
    "fork-copy-skipped": {"engine": {**ENGINE, "block_size": 2, "num_blocks": 4}, "requests": [
        SHORT, {"id": "r1", "prompt_ids": [0, 0], "prompt_logprobs": 5, "n": 2, "max_tokens": 4,
                "stop_token_ids": [0], "logit_bias": {"0": 100.0}, "min_tokens": 1}]},
    "forked-blocks-not-refcounted": {"engine": ENGINE, "requests": [
        SHORT, {"id": "r1", "prompt_ids": [0, 0], "n": 2, "max_tokens": 4}]},
    "fork-before-prefill-done": {"engine": {**ENGINE, "max_num_batched_tokens": 25, "block_size": 2, "num_blocks": 15},
                                 "requests": [SHORT, {"id": "r1", "prompt_ids": [0] * 26, "n": 2, "max_tokens": 4}]},
}


@pytest.mark.parametrize("fault", SHRUNK)
def test_each_fork_fault_fails_its_shrunk_schedule_and_only_with_the_fault(fault):
    model = tiny_model("qwen3-gqa2-tied")
    for injected, passes in ((fault, False), (None, True)):
        result = replay(model, parse_schedule(SHRUNK[fault], fault), fault=injected)
        assert result.passed is passes, result.report()
        forked = "r0" if fault == "n-children-share-seed" else "r1"  # each child judged on its own
        assert set(result.verdicts) == {f"0_{forked}", f"1_{forked}", "r1" if forked == "r0" else "r0"}
