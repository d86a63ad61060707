"""check.policy: the scheduler's admission, running and preemption order, read from a run. A clean
engine keeps it under every scheduling policy, preempting, forking and aborting; a scheduler that puts a
preempted request behind later arrivals (preempted-requeued-last) answers every request exactly as
alone, and only this check fails it. Each rule is also shown failing on a hand-written trace."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from refengine.check.driver import run_batched
from refengine.check.policy import policy_problems
from refengine.check.replay import replay
from refengine.check.schedule import parse_schedule
from refengine.engine import EngineConfig
from refengine.strategies import DEFAULT_MODEL, tiny_model
from refengine.suite.corners import CORNERS

PREEMPTING = CORNERS["invariant-mode-is-exact"]["preempted-ahead-of-a-waiting-request"]


def schedule_of(requests: list[dict], policy: str = "fcfs", **engine) -> dict:
    return {"engine": {"mode": "invariant", "max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 1,
                       "num_blocks": 64, "max_model_len": 128, "scheduling_policy": policy, **engine},
            "requests": requests}


def request(rid: str, arrival: int = 0, **fields) -> dict:
    return {"id": rid, "prompt_ids": [0, 1], "max_tokens": 4, "arrival_step": arrival, **fields}


def run(schedule: dict, fault: str | None = None):
    parsed = parse_schedule(schedule, "test")
    engine, failure = run_batched(tiny_model(DEFAULT_MODEL), parsed, EngineConfig(**{**schedule["engine"],
                                                                                      "fault": fault}))
    assert failure is None
    return parsed, engine


@pytest.mark.parametrize("policy", ["fcfs", "prefill-first", "shuffled"])
def test_a_clean_engine_keeps_the_policy_preempting_forking_and_aborting(policy):
    schedule = schedule_of([request("r0"), request("r1", n=2, sampling={"temperature": 1.0, "seed": 3}),
                            request("r2", 1, abort_step=3), request("r3", 2), request("r4", 2)],
                           policy, num_blocks=12, max_num_seqs=3)
    parsed, engine = run(schedule)
    assert sum(len(e["preempted"]) for e in engine.trace) > 0  # the pool is tight enough to preempt
    assert policy_problems(parsed, engine.outputs(), engine.trace) == []


def test_a_preempted_request_queued_behind_a_later_arrival_fails_only_the_policy():
    """r0, r1 and r2 fill a pool of 5 one-token blocks while decoding: r1, preempted while r2 waits, must be
    readmitted ahead of it; with the fault r2 goes first. Each answer is still its answer alone: replay
    judges them all a match, and fails the run on the policy alone."""
    parsed, engine = run(PREEMPTING, "preempted-requeued-last")
    problems = policy_problems(parsed, engine.outputs(), engine.trace)
    assert problems == ["step 4: admitted ['r2', 'r1'] while the front of the waiting queue was ['r1', 'r2']"]
    result = replay(tiny_model(DEFAULT_MODEL), parsed, fault="preempted-requeued-last")
    assert {v.kind for v in result.verdicts.values()} == {"match"}
    assert result.engine_failure == "scheduling policy: " + problems[0] and not result.passed
    clean, engine = run(PREEMPTING)
    assert policy_problems(clean, engine.outputs(), engine.trace) == []


def judged(requests: list[dict], trace: list[dict], finish: dict[str, int] | None = None, policy: str = "fcfs"):
    """policy_problems of a hand-written run: `trace` entries as (scheduled ids, preempted, aborted)."""
    parsed = parse_schedule(schedule_of(requests, policy), "hand-written")
    outputs = {r["id"]: SimpleNamespace(finish_step=(finish or {}).get(r["id"])) for r in requests}
    entries = [{"step": step, "scheduled": [{"id": rid} for rid in scheduled], "preempted": preempted,
                "aborted": aborted} for step, (scheduled, preempted, aborted) in enumerate(trace)]
    return policy_problems(parsed, outputs, entries)


TWO = [request("a"), request("b")]


def test_admission_follows_arrival_and_readmission_comes_first():
    assert judged(TWO, [(["a", "b"], [], [])]) == []
    assert judged(TWO, [(["b"], [], [])]) == ["step 0: admitted ['b'] while the front of the waiting queue was ['a']"]
    # under fcfs the admitted come in queue order; the other policies reorder a step's chunks
    assert judged(TWO, [(["b", "a"], [], [])]) == \
        ["step 0: admitted ['b', 'a'] while the front of the waiting queue was ['a', 'b']"]
    assert judged(TWO, [(["b", "a"], [], [])], policy="shuffled") == []
    # a preempted request goes to the front: b, preempted at step 1, is readmitted before c (arrived at 1)
    three = TWO + [request("c", 1)]
    assert judged(three, [(["a", "b"], [], []), (["a"], ["b"], []), (["a", "b"], [], [])]) == []
    assert judged(three, [(["a", "b"], [], []), (["a"], ["b"], []), (["a", "c"], [], [])]) == \
        ["step 2: admitted ['c'] while the front of the waiting queue was ['b']"]


def test_the_most_recent_is_preempted_and_the_oldest_always_runs():
    assert judged(TWO, [(["a", "b"], [], []), (["b"], ["a"], [])]) == \
        ["step 1: preempted a, not the most recently admitted running request (b)"]
    assert judged(TWO, [(["a", "b"], [], []), (["b"], [], [])]) == \
        ["step 1: ran ['b'] of the running ['a', 'b'], skipping the older a"]
    assert judged(TWO, [(["a", "b"], [], []), (["a"], [], [])]) == []  # out of budget after a


def test_nothing_is_admitted_past_a_running_request_left_without_tokens_or_preempted():
    three = TWO + [request("c", 1)]
    assert judged(three, [(["a", "b"], [], []), (["a", "c"], [], [])]) == \
        ["step 1: admitted ['c'] in a step where a running request got no tokens"]
    assert judged(three, [(["a", "b"], [], []), (["a", "c"], ["b"], [])]) == \
        ["step 1: admitted ['c'] while the front of the waiting queue was ['b']"]
    four = three + [request("d")]
    assert judged(four, [(["a", "b"], [], []), (["a", "d"], ["b"], [])]) == \
        ["step 1: admitted ['d'] while the front of the waiting queue was ['b']"]
    # a, alone, preempted for want of blocks: nothing is admitted in that step, a itself neither
    assert judged([request("a"), request("b", 1)], [(["a"], [], []), (["a"], ["a"], [])]) == \
        ["step 1: admitted ['a'] in a step where a running request was preempted"]


def test_finished_and_aborted_requests_leave_the_queues():
    # a finished at step 0: at step 1 only b runs, and c may be admitted beside it
    three = TWO + [request("c", 1)]
    assert judged(three, [(["a", "b"], [], []), (["b", "c"], [], [])], finish={"a": 0}) == []
    assert judged(three, [(["a", "b"], [], []), (["b", "c"], [], [])]) == \
        ["step 1: ran ['b'] of the running ['a', 'b'], skipping the older a",
         "step 1: admitted ['c'] in a step where a running request got no tokens"]
    # a aborted while running, before step 1: b is the oldest running
    assert judged(TWO, [(["a", "b"], [], []), (["b"], [], ["a"])]) == []
    # a aborted before step 1 while waiting (one seat): b is the front
    assert judged(TWO, [([], [], []), (["b"], [], ["a"])]) == []
    assert judged(TWO, [([], [], []), (["b"], [], [])]) == \
        ["step 1: admitted ['b'] while the front of the waiting queue was ['a']"]


def test_an_n_request_queues_its_answers_in_order():
    forked = [request("r", n=2, sampling={"temperature": 1.0, "seed": 1})]
    assert judged(forked, [(["0_r"], [], []), (["0_r", "1_r"], [], [])]) == []
    assert judged(forked, [(["1_r"], [], [])]) == ["step 0: admitted ['1_r'] while the front of the waiting queue was "
                                                   "['0_r']"]
