"""The strategies reach every batching situation the properties are about, within the dev profile's
example budget: otherwise a passing suite would prove little. (`--hypothesis-show-statistics`
shows the same situations as events of each property.)"""
from collections import Counter

import pytest
from hypothesis import Phase, given, settings

from ..check.driver import run_batched
from ..check.schedule import parse_schedule
from ..strategies import schedules, tiny_model
from ..strategies.models import DEFAULT_MODEL, VOCAB_SIZE
from .harness import COVERAGE, coverage, prepared

pytestmark = pytest.mark.invariants
DEV_EXAMPLES = 25


def test_schedules_reach_preemption_chunking_mixed_steps_aborts_and_batches():
    seen = Counter()

    @settings(max_examples=DEV_EXAMPLES, derandomize=True, database=None, phases=[Phase.generate])
    @given(schedule=schedules(VOCAB_SIZE))
    def run(schedule):
        schedule = prepared(DEFAULT_MODEL, schedule)
        parsed = parse_schedule(schedule, "coverage")
        engine, failure = run_batched(tiny_model(), parsed, parsed.engine)
        assert failure is None, failure
        seen.update(coverage(schedule, engine.trace))

    run()
    assert set(seen) == set(COVERAGE), f"reached only {dict(seen)} in {DEV_EXAMPLES} schedules"
