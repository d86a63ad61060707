"""`refengine bench --scenario suite`: how many schedules per second the invariants properties check.

Suite throughput is what decides how many examples a CI budget buys, so it is measured the same way
on every run: every engine property of refengine.suite (a @given test drawing a model and a
schedule, and every RuleBasedStateMachine) runs in this process with a fixed example count (the dev
profile's, unless told), derandomized (the same examples every run of the same code), generation
only (no explicit examples, database, targeting or shrinking), each on the default tiny model: the
drawn model name is replaced by it, since the schedule strategies do not depend on it. Examples are
counted by our own wrapper around each test body (Hypothesis's `inner_test`, which it lets callers
replace), never read from Hypothesis's or pytest's output; the HTTP properties need a server and
are left out.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from ..errors import RefengineError

PROFILE = "refengine-bench"


@dataclass(frozen=True)
class Property:
    name: str                          # as pytest names it: test_batching.py::test_invariant_mode_is_exact
    run: Callable[[Callable[[], None]], None]  # runs every example, calling `counted()` after each


def _given_property(test) -> Callable:
    """Run the @given `test` on the default tiny model, counting the examples its body ran."""
    from ..strategies.models import DEFAULT_MODEL

    def run(counted):
        body = test.hypothesis.inner_test

        def pinned(*args, **kwargs):
            body(*args, **{**kwargs, "model": DEFAULT_MODEL})
            counted()

        test.hypothesis.inner_test = pinned
        try:
            test()
        finally:
            test.hypothesis.inner_test = body
    return run


def _machine_property(machine, bench_settings) -> Callable:
    """Run the state machine `machine` (it builds its engines on the default tiny model), counting the
    runs that reached teardown: runs Hypothesis then discards (out of data mid-run) were checked as far
    as they went and count too, so a machine reports somewhat more than max_examples."""
    from hypothesis.stateful import run_state_machine_as_test

    def run(counted):
        class Counted(machine):
            def teardown(self):
                super().teardown()
                counted()

        run_state_machine_as_test(Counted, settings=bench_settings)
    return run


def suite_properties(bench_settings) -> list[Property]:
    """Every engine property of refengine.suite, in module order."""
    from hypothesis.stateful import RuleBasedStateMachine

    from .. import suite

    found = []
    for info in sorted(pkgutil.iter_modules(suite.__path__), key=lambda m: m.name):
        if not info.name.startswith("test_"):
            continue
        module = importlib.import_module(f"{suite.__name__}.{info.name}")
        marks = getattr(module, "pytestmark", [])
        if any(mark.name == "http" for mark in (marks if isinstance(marks, list) else [marks])):
            continue
        for name, obj in vars(module).items():
            where = f"{info.name}.py::{name}"
            if callable(obj) and hasattr(obj, "hypothesis") and name.startswith("test_"):
                if {"model", "schedule"} <= set(inspect.signature(obj.hypothesis.inner_test).parameters):
                    found.append(Property(where, _given_property(obj)))
            elif (isinstance(obj, type) and issubclass(obj, RuleBasedStateMachine)
                  and obj.__module__ == module.__name__):
                found.append(Property(where, _machine_property(obj, bench_settings)))
    return found


@contextmanager
def suite_settings(examples: int | None) -> Iterator:
    """The bench's Hypothesis settings (`examples` per property, default the dev profile's) loaded as
    the current profile, with the default tiny model loaded, widened, calibrated and run once in each
    mode, and one trivial Hypothesis test run, beforehand (once-per-process costs: the invariant-mode
    probe, loading compiled kernels, Hypothesis's first test), so no property's clock pays for them;
    the previous profile is loaded back after."""
    try:
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import strategies as st

        from ..suite.plugin import PROFILES
    except ImportError as e:
        raise RefengineError(f"scenario: suite needs pytest and hypothesis (pip install 'refengine[test]'): "
                             f"{e}") from None
    from ..check.calibrate import calibration_for
    from ..strategies.models import DEFAULT_MODEL, tiny_model

    bench_settings = settings(max_examples=examples or PROFILES["dev"]["max_examples"], derandomize=True,
                              database=None, phases=[Phase.generate], deadline=None, print_blob=False,
                              suppress_health_check=list(HealthCheck))
    from ..engine import EngineConfig, LLMEngine
    from ..sampling import SamplingParams

    model = tiny_model(DEFAULT_MODEL)
    model.weights(np.float64)
    calibration_for(model, DEFAULT_MODEL)
    for mode in ("fast", "invariant"):  # the invariant-mode probe, and the compiled kernels loaded
        engine = LLMEngine(model, EngineConfig(mode=mode))
        engine.add_request("warm-up", [1, 2, 3], params=SamplingParams(max_tokens=2))
        engine.run()

    # Hypothesis's own once-per-process costs, paid by whichever test runs first: its scan of local
    # modules for constants, the full garbage collection when it first registers numpy's random state
    given(st.integers())(settings(bench_settings, max_examples=1)(lambda _: None))()
    previous = getattr(settings, "get_current_profile_name", lambda: "default")()  # Hypothesis >= 6.135
    settings.register_profile(PROFILE, bench_settings)
    settings.load_profile(PROFILE)
    try:
        yield bench_settings
    finally:
        settings.load_profile(previous)


def time_property(prop: Property) -> dict:
    """One property's examples (counted by our wrapper), seconds and schedules per second."""
    from ..suite.harness import baselines

    baselines.runs.clear()  # each property pays for its own alone and float64 runs, whatever ran before
    count = 0

    def counted():
        nonlocal count
        count += 1

    started = time.perf_counter()
    prop.run(counted)
    seconds = time.perf_counter() - started
    return {"property": prop.name, "examples": count, "seconds": seconds, "schedules_per_s": count / seconds}


def run_suite(examples: int | None) -> dict:
    """Every engine property with `examples` examples each: a row per property and the total."""
    from ..strategies.models import DEFAULT_MODEL

    with suite_settings(examples) as bench_settings:
        rows = [time_property(prop) for prop in suite_properties(bench_settings)]
    total_examples, total_s = sum(r["examples"] for r in rows), sum(r["seconds"] for r in rows)
    return {"model": DEFAULT_MODEL, "max_examples": bench_settings.max_examples, "properties": rows,
            "total": {"examples": total_examples, "seconds": total_s, "schedules_per_s": total_examples / total_s}}


def print_suite(result: dict) -> None:
    print(f"suite throughput: {result['max_examples']} examples per property (derandomized, generation only), "
          f"model {result['model']}")
    width = max(len(r["property"]) for r in result["properties"])
    print(f"  {'property':<{width}} {'examples':>8} {'seconds':>8} {'schedules/s':>11}")
    for row in [*result["properties"], {"property": "total", **result["total"]}]:
        print(f"  {row['property']:<{width}} {row['examples']:>8} {row['seconds']:>8.2f} "
              f"{row['schedules_per_s']:>11.2f}")
