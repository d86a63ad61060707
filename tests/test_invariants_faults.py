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
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from refengine.check import driver
from refengine.check.driver import EngineStuck, run_alone, run_engine
from refengine.check.schedule import parse_schedule
from refengine.cli import main
from refengine.cli.common import FAULT_ENV as ENV_VAR
from refengine.engine import FAULTS
from refengine.strategies import DEFAULT_MODEL, tiny_model
from refengine.suite.harness import REPRO_DIR_VAR, PropertyFailure, check
from refengine.suite.hunts import CAUGHT_BY, HUNTS, MAX_SHRUNK_REQUESTS, STATE_MACHINE_CATCHES, hunt, hunted
from refengine.suite.test_finish import check_finish
from refengine.suite.test_state_machine import SchedulerKVMachine

pytestmark = pytest.mark.invariants


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


@pytest.mark.parametrize("fault", hunted())
def test_dev_profile_finds_and_shrinks(fault, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(REPRO_DIR_VAR, str(tmp_path))
    shrunk = hunt(fault, dev_profile())
    assert shrunk is not None, f"{fault}: no failing example of at most {MAX_SHRUNK_REQUESTS} requests"
    with pytest.raises(PropertyFailure) as failure:
        HUNTS[CAUGHT_BY[fault]][1](shrunk, fault)
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


def test_a_baseline_that_never_ends_fails_the_property_instead_of_hanging_it(tmp_path, monkeypatch):
    """last-admission-slot-unused: batched, with two slots, the request runs; alone (one slot) the
    scheduler admits nothing. The alone run is watched as the batched one is: the property fails at
    once, naming the run that stalled, where it used to step forever."""
    monkeypatch.setenv(REPRO_DIR_VAR, str(tmp_path))
    schedule = {"engine": {"mode": "invariant", "max_num_seqs": 2, "max_num_batched_tokens": 64, "block_size": 4,
                           "num_blocks": 16, "max_model_len": 128},
                "requests": [{"id": "a", "prompt_ids": [1, 2, 3], "max_tokens": 4, "arrival_step": 0}]}
    with pytest.raises(PropertyFailure, match="a alone: step 0 scheduled nothing while 1 requests wait and 0 run"):
        check("invariant-mode-is-exact", DEFAULT_MODEL, schedule, fault="last-admission-slot-unused")
    with pytest.raises(PropertyFailure, match="a alone: step 0 scheduled nothing"):
        check("prefill-decode-consistency", DEFAULT_MODEL, schedule, against="prefill",
              fault="last-admission-slot-unused")
    check("invariant-mode-is-exact", DEFAULT_MODEL, schedule)  # and without the fault it holds
    engine, failure = run_engine(tiny_model(DEFAULT_MODEL),
                                 parse_schedule({**schedule, "engine": {**schedule["engine"],
                                                                        "fault": "last-admission-slot-unused"}}, "s"),
                                 serial=True)
    assert failure == "s: a serial: step 0 scheduled nothing while 1 requests wait and 0 run"


def test_a_run_alone_past_its_step_allowance_is_stuck(monkeypatch):
    """The other way a run stops making progress: steps that never bring it to an end. With no steps
    allowed per token, the first step of a run alone is already past its allowance."""
    request = parse_schedule({"engine": {"mode": "fast", "max_num_seqs": 2, "max_num_batched_tokens": 64,
                                         "block_size": 4, "num_blocks": 16, "max_model_len": 128},
                              "requests": [{"id": "a", "prompt_ids": [1, 2, 3], "max_tokens": 4, "arrival_step": 0}]},
                             "s")
    model = tiny_model(DEFAULT_MODEL)
    assert run_alone(model, request.engine, request.requests[0]).finish_reason == "length"
    monkeypatch.setattr(driver, "STEP_ALLOWANCE", 0)
    with pytest.raises(EngineStuck, match="a alone: no end after 1 steps"):
        run_alone(model, request.engine, request.requests[0])
