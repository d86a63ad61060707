"""The fault catalog is the suite's negative control. With any catalogued bug switched on, the dev
profile's example budget finds a failing schedule, shrinks it to at most 3 requests and writes a
repro that `refengine replay` (fault set through REFENGINE_FAULT) reproduces, while the same repro
replays clean without the fault. Each fault is hunted by a property that catches it; the scheduler+KV
state machine also catches the six that break the KV accounting or share a block that is not to be
shared. Two are reachable only through the scheduling policies other than fcfs (a decode after a prefill
chunk in one step):
chunk-order-dependent-logits-row and decode-context-after-prefill. abort-after-finish-rewrites-finish
is caught by the finish-semantics property (refengine/suite/test_finish.py); `refengine replay` sees it
as an engine failure (the engine's own check: exactly one final event per finished request).
hang-up-without-abort and slot-leak live in the serve layer (no engine schedule shows them): the HTTP
properties catch and shrink them, in tests/test_invariants_http.py."""
import json

import pytest
from hypothesis import Phase, find, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from refengine.cli import main
from refengine.cli.common import FAULT_ENV as ENV_VAR
from refengine.engine import FAULTS
from refengine.strategies import DEFAULT_MODEL, shared_prefix_schedules, tiny_model_names
from refengine.suite.harness import (
    REPRO_DIR_VAR,
    PropertyFailure,
    any_mode_schedules,
    check,
    forked_schedules,
    greedy_schedules,
    invariant_schedules,
    other_budgets,
)
from refengine.suite.test_finish import check_finish, finish_schedules
from refengine.suite.test_state_machine import SchedulerKVMachine

pytestmark = pytest.mark.invariants
MAX_SHRUNK_REQUESTS = 3


class SmallEnough(BaseException):
    """Carries the first failing example that is already as small as a hunt asserts, out of Hypothesis
    (a BaseException is not a test failure to it, so it neither shrinks nor replays it). Shrinking from
    there only makes the example smaller and costs most of a hunt: the shrinker reaching an example this
    small within the budget is what the hunt shows."""

    def __init__(self, example, failure: PropertyFailure | None = None):
        super().__init__()
        self.example, self.failure = example, failure

PROPERTIES = {  # property -> (what Hypothesis draws, one run of the property with a fault switched on)
    "invariant-mode-is-exact": (
        st.tuples(tiny_model_names(), invariant_schedules),
        lambda example, fault: check("invariant-mode-is-exact", *example, fault=fault)),
    "chunking-consistency": (
        st.tuples(tiny_model_names(), any_mode_schedules, other_budgets),
        lambda example, fault: check("chunking-consistency", example[0], example[1], against="budget",
                                     other_budget=example[2], fault=fault)),
    "reference-agreement": (
        st.tuples(tiny_model_names(), greedy_schedules),
        lambda example, fault: check("reference-agreement", *example, against="reference", fault=fault)),
    "finish-semantics": (
        st.tuples(tiny_model_names(), finish_schedules()),
        lambda example, fault: check_finish("finish-semantics", *example, fault=fault)),
    "prefix-caching-is-exact": (
        st.tuples(tiny_model_names(), shared_prefix_schedules("invariant")),
        lambda example, fault: check("prefix-caching-is-exact", *example, fault=fault)),
    "n-answers-are-exact": (
        st.tuples(tiny_model_names(), forked_schedules),
        lambda example, fault: check("n-answers-are-exact", *example, fault=fault)),
    "prefix-caching-scores-whole-prompts": (
        st.tuples(tiny_model_names(), shared_prefix_schedules("invariant", scoring=True)),
        lambda example, fault: check("prefix-caching-scores-whole-prompts", *example, fault=fault)),
}
CAUGHT_BY = {
    "stale-block-table-after-preemption": "invariant-mode-is-exact",
    "position-off-by-one-on-join": "invariant-mode-is-exact",
    "logits-rows-misassigned-after-leave": "invariant-mode-is-exact",
    "chunked-prefill-past-off-by-one": "chunking-consistency",
    "no-recompute-on-resume": "invariant-mode-is-exact",
    "seed-leak": "invariant-mode-is-exact",
    "kv-write-block-boundary-off-by-one": "reference-agreement",
    "abort-leaks-blocks": "invariant-mode-is-exact",
    "abort-after-finish-rewrites-finish": "finish-semantics",
    "chunk-order-dependent-logits-row": "invariant-mode-is-exact",
    "decode-context-after-prefill": "invariant-mode-is-exact",
    "attention-bound-inflating": "reference-agreement",
    "logprob-normalization": "invariant-mode-is-exact",
    "top-p-excludes-crossing-token": "sampling-distribution",  # not schedule-shaped: tests/test_sampling_oracle.py
    "hang-up-without-abort": "http-hang-ups-are-aborts",  # serve layer: caught by tests/test_invariants_http.py
    "slot-leak": "http-server-drains",  # serve layer: caught by tests/test_invariants_http.py
    "prefix-hash-not-chained": "prefix-caching-is-exact",
    "cached-block-not-refcounted": "prefix-caching-is-exact",
    "evicted-block-still-cached": "prefix-caching-is-exact",
    "cached-block-left-on-free-list": "prefix-caching-is-exact",
    "cached-prefix-last-block-dropped": "prefix-caching-is-exact",
    "cache-salt-ignored": "prefix-caching-is-exact",
    "cached-block-with-uncomputed-token": "prefix-caching-is-exact",
    "penalty-counts-by-batch-row": "invariant-mode-is-exact",
    "logit-bias-wrong-row": "invariant-mode-is-exact",
    "penalty-counts-lost-on-resume": "invariant-mode-is-exact",
    "frequency-penalty-counts-prompt": "reference-agreement",
    "repetition-penalty-ignores-sign": "reference-agreement",
    "min-tokens-counts-prompt": "reference-agreement",
    "logits-processors-ignored": "http-applies-what-it-accepts",  # serve layer: tests/test_invariants_http.py
    "prompt-logprobs-shifted-by-one": "reference-agreement",
    "prompt-logprobs-chunk-end-dropped": "chunking-consistency",
    "prompt-logprobs-rescored-on-resume": "invariant-mode-is-exact",
    "prompt-logprobs-from-cached-blocks": "prefix-caching-scores-whole-prompts",
    "prompt-logprobs-rows-from-step-start": "invariant-mode-is-exact",
    "echo-ignored": "http-applies-what-it-accepts",  # serve layer: tests/test_invariants_http.py
    "n-children-share-seed": "n-answers-are-exact",
    "forked-partial-block-shared": "n-answers-are-exact",
    "fork-copy-skipped": "n-answers-are-exact",
    "forked-blocks-not-refcounted": "n-answers-are-exact",
    "fork-before-prefill-done": "n-answers-are-exact",
}
STATE_MACHINE_CATCHES = {"abort-leaks-blocks": "KV accounting", "stale-block-table-after-preemption": "KV accounting",
                         "evicted-block-still-cached":
                             "holds other KV than when it was registered|reads KV computed for something else",
                         "forked-partial-block-shared": "a full block of the prompt siblings forked|holds other KV",
                         "forked-blocks-not-refcounted": "KV accounting",
                         "cache-salt-ignored": "reads KV computed for something else"}


def dev_profile():
    """The loaded profile's example budget (dev: 25), derandomized so the verdict is the same on every
    run, without the example database (every run must find the fault afresh) and without the explain
    phase (its report is not needed here). (Which modules are loaded moves Hypothesis's draws too: the
    suite's plugin loads them all first, suite.plugin.pytest_collection_finish.)"""
    return settings(settings.default, database=None, derandomize=True,
                    phases=[p for p in Phase if p is not Phase.explain])


def assert_small_and_replayable(failure: PropertyFailure, fault: str, monkeypatch, capsys):
    repro = json.loads(failure.repro.read_text())
    assert len(repro["requests"]) <= MAX_SHRUNK_REQUESTS, str(failure)
    monkeypatch.setenv(ENV_VAR, fault)
    assert main(["replay", str(failure.repro)]) == 1, capsys.readouterr().out
    assert "FAIL" in capsys.readouterr().out
    monkeypatch.delenv(ENV_VAR)
    assert main(["replay", str(failure.repro)]) == 0, capsys.readouterr().out


def test_every_fault_is_hunted_by_a_property():
    assert set(CAUGHT_BY) == set(FAULTS) and len(FAULTS) >= 6


@pytest.mark.parametrize("fault", [f for f, prop in CAUGHT_BY.items() if prop in PROPERTIES])
def test_dev_profile_finds_and_shrinks(fault, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(REPRO_DIR_VAR, str(tmp_path))
    strategy, run = PROPERTIES[CAUGHT_BY[fault]]

    def fails(example):
        try:
            run(example, fault)
        except PropertyFailure:
            if len(example[1]["requests"]) <= MAX_SHRUNK_REQUESTS:
                raise SmallEnough(example) from None
            return True
        return False

    with pytest.raises(SmallEnough) as found:
        find(strategy, fails, settings=dev_profile())
    shrunk = found.value.example
    with pytest.raises(PropertyFailure) as failure:
        run(shrunk, fault)
    assert_small_and_replayable(failure.value, fault, monkeypatch, capsys)


@pytest.mark.parametrize("fault", STATE_MACHINE_CATCHES)
def test_state_machine_finds_kv_faults(fault, tmp_path, monkeypatch):
    """The state machine's own invariants see these directly (no shrinking here: shrinking rule
    sequences is slow, and the shrunk repro of each comes from the test above)."""
    monkeypatch.setenv(REPRO_DIR_VAR, str(tmp_path))

    class FaultyEngine(SchedulerKVMachine):
        pass

    FaultyEngine.fault = fault
    with pytest.raises(PropertyFailure, match=STATE_MACHINE_CATCHES[fault]):
        run_state_machine_as_test(FaultyEngine, settings=settings(dev_profile(), phases=[Phase.generate]))


def test_a_request_after_an_early_engine_failure_is_skipped_not_an_error(tmp_path, monkeypatch):
    """The driver stops at the first engine failure (here a leaked block, after the abort at step 1),
    so a request due at step 6 never arrives: the properties report the failure, and skip that
    request instead of asking the engine for an output it never had."""
    monkeypatch.setenv(REPRO_DIR_VAR, str(tmp_path))
    schedule = {"engine": {"mode": "invariant", "max_num_seqs": 2, "max_num_batched_tokens": 64, "block_size": 4,
                           "num_blocks": 16, "max_model_len": 128},
                "requests": [{"id": "a", "prompt_ids": [1, 2, 3], "max_tokens": 4, "arrival_step": 0, "abort_step": 1},
                             {"id": "b", "prompt_ids": [4, 5], "max_tokens": 2, "arrival_step": 6}]}
    model = DEFAULT_MODEL
    with pytest.raises(PropertyFailure, match="engine failure: after step 1: a: finished but still holds blocks"):
        check("invariant-mode-is-exact", model, schedule, fault="abort-leaks-blocks")
    with pytest.raises(PropertyFailure, match="engine failure: after step 1: a: finished but still holds blocks"):
        check_finish("finish-semantics", model, schedule, fault="abort-leaks-blocks")
    replayed = json.loads((tmp_path / "invariant-mode-is-exact.json").read_text())
    assert [r["id"] for r in replayed["requests"]] == ["a", "b"]
