"""Property 8: finish semantics. How a request ends is part of its output, whatever else runs.

For every request of a join/leave schedule, batched, from what the engine streams (TokenEvents):
- exactly one final event (finish_reason set), and nothing after it; the output's finish_reason is
  that event's;
- an abort that comes after the request finished changes nothing: the request keeps its natural
  finish_reason ("stop" / "length"), and gets no abort event; "abort" is the final word only of a
  request that was still unfinished at its abort_step;
- the usage counts equal what was streamed: the streamed token ids are the output's token ids (as
  many as its steps; a server's `usage.completion_tokens` is their count), the streamed text deltas
  concatenate to its text, and the engine's `tokens_generated` is the sum over requests.
And once a schedule has run, aborting every (finished, not yet released) request again is a no-op:
`abort` returns False, no event follows, outputs and KV use stay as they were; once released, a
request is unknown to `abort` (RefengineError).
"""
from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import Phase, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from ..check.driver import configured, run_batched
from ..check.schedule import parse_schedule
from ..errors import RefengineError
from ..strategies import tiny_model, tiny_model_names
from ..strategies.models import DEFAULT_MODEL
from .corners import with_corners
from .harness import any_mode_schedules, fail, observe, prepared

pytestmark = pytest.mark.invariants
NAME = "finish-semantics"
DEV_EXAMPLES = 25  # the dev profile's budget, for the reachability test
LATE_ABORT = 10  # steps after its arrival a late abort may come: mostly after the request has finished
LATE_ABORTS = st.one_of(st.none(), st.integers(1, LATE_ABORT))


@st.composite
def finish_schedules(draw) -> dict:
    """The engine properties' schedules (any mode), where each request that leaves by max_tokens may
    also get a late abort, 1-LATE_ABORT steps after it arrived (shrinking towards none): most land
    after it finished but before the run ends, the finished-but-not-released window."""
    schedule = draw(any_mode_schedules)
    for request in schedule["requests"]:
        delay = draw(LATE_ABORTS, label=f"late abort of {request['id']}")
        if delay is not None and "abort_step" not in request:
            request["abort_step"] = request["arrival_step"] + delay
    return schedule


def finish_problems(request, out, streamed: list) -> list[str]:
    """What is wrong with how `request` (check.schedule.ScheduledRequest) ended, given its output and
    its TokenEvents in the order they were streamed."""
    rid, problems = request.id, []
    finals = [e for e in streamed if e.finish_reason is not None]
    if len(finals) != 1:
        problems.append(f"{rid}: {len(finals)} final events "
                        f"{[(e.step, e.finish_reason) for e in finals]}, expected exactly one")
    elif finals[0] is not streamed[-1]:
        problems.append(f"{rid}: events after its final event (step {finals[0].step}): "
                        f"{[(e.step, e.token_id) for e in streamed[streamed.index(finals[0]) + 1:]]}")
    if finals and out.finish_reason != finals[0].finish_reason:
        problems.append(f"{rid}: finish_reason {out.finish_reason!r}, but its final event (step {finals[0].step}) "
                        f"said {finals[0].finish_reason!r}")
    if finals and finals[0].finish_reason != "abort" and out.finish_step != finals[0].step:
        problems.append(f"{rid}: finish_step {out.finish_step}, but it finished at step {finals[0].step}")
    natural = [e for e in finals if e.finish_reason != "abort"]
    abort_step = request.abort_step
    if natural and abort_step is not None and natural[0].step < abort_step and \
            (out.finish_reason != natural[0].finish_reason or len(finals) > 1):
        problems.append(f"{rid}: finished ({natural[0].finish_reason}) at step {natural[0].step}; the abort at "
                        f"step {abort_step} came after that and changed it: finish_reason {out.finish_reason!r}, "
                        f"final events {[(e.step, e.finish_reason) for e in finals]}")
    if any(e.finish_reason == "abort" and (abort_step is None or e.step < abort_step) for e in finals):
        problems.append(f"{rid}: an abort event before any abort (abort_step {abort_step}): final events "
                        f"{[(e.step, e.finish_reason) for e in finals]}")
    tokens = [e.token_id for e in streamed if e.token_id is not None]
    if tokens != out.token_ids or len(out.steps) != len(tokens):
        problems.append(f"{rid}: streamed {len(tokens)} tokens {tokens}, the output has {len(out.token_ids)} "
                        f"{out.token_ids} ({len(out.steps)} steps)")
    text = "".join(e.text_delta for e in streamed)
    if text != out.text:
        problems.append(f"{rid}: streamed text {text!r} != output text {out.text!r}")
    return problems


def late_aborts(parsed, streamed, num_steps: int) -> list[str]:
    """Requests the driver aborted after they had finished (at their abort_step, within the run)."""
    return [r.id for r in parsed.requests if r.abort_step is not None and r.abort_step < num_steps and any(
        e.finish_reason not in (None, "abort") and e.step < r.abort_step for e in streamed[r.id])]


def check_finish(name: str, model_name: str, schedule: dict, fault: str | None = None):
    """Run `schedule` batched (the one driver) and judge how each request ended (finish_problems);
    PropertyFailure (with a repro file) when anything is off. Returns the engine."""
    schedule = prepared(model_name, schedule)
    parsed = parse_schedule(schedule, name)
    streamed = defaultdict(list)

    def collect(events):
        for e in events:
            streamed[e.request_id].append(e)

    engine, failure = run_batched(tiny_model(model_name), parsed, configured(parsed.engine, fault=fault),
                                  keep_logits=False, on_events=collect)
    observe(schedule, engine.trace)
    problems = [f"engine failure: {failure}"] if failure else []
    outputs = engine.outputs()
    for request in parsed.requests:
        out = outputs.get(request.id)
        if failure and (out is None or out.finish_reason is None):
            continue  # the driver stopped the run at the failure: this one never arrived, or never finished
        problems += finish_problems(request, out, streamed[request.id])
    if late_aborts(parsed, streamed, engine.num_steps) and currently_in_test_context():
        event("abort after finish")
    generated = sum(e.token_id is not None for events in streamed.values() for e in events)
    if engine.metrics["tokens_generated"] != generated:
        problems.append(f"metrics: tokens_generated {engine.metrics['tokens_generated']}, {generated} streamed")
    if problems:
        fail(name, model_name, schedule, "\n".join(problems), fault)
    return engine


@with_corners(NAME)
@given(model=tiny_model_names(), schedule=finish_schedules())
def test_one_final_event_per_request_and_aborts_after_finish_change_nothing(model, schedule):
    check_finish(NAME, model, schedule)


@with_corners(NAME)
@given(model=tiny_model_names(), schedule=finish_schedules())
def test_aborting_finished_requests_is_a_no_op(model, schedule):
    engine = check_finish(NAME, model, schedule)
    before, used = engine.outputs(), engine.block_manager.num_used_blocks
    problems = [f"abort({rid!r}) of a finished request returned True" for rid in before if engine.abort(rid)]
    events = engine.step() if engine.has_unfinished() or problems else []
    problems += [f"{e.request_id}: event after its end ({e.finish_reason}, token {e.token_id})" for e in events]
    after = engine.outputs()
    problems += [f"{rid}: output changed by abort after finish: finish_reason {before[rid].finish_reason!r} -> "
                 f"{after[rid].finish_reason!r}, finish_step {before[rid].finish_step} -> {after[rid].finish_step}"
                 for rid in before if (before[rid].finish_reason, before[rid].finish_step, before[rid].token_ids)
                 != (after[rid].finish_reason, after[rid].finish_step, after[rid].token_ids)]
    if engine.block_manager.num_used_blocks != used:
        problems.append(f"KV blocks in use {used} -> {engine.block_manager.num_used_blocks}")
    for rid in before:
        engine.release(rid)
        try:
            engine.abort(rid)
            problems.append(f"abort({rid!r}) after release did not raise")
        except RefengineError:
            pass
    if problems:
        fail("abort-after-finish-is-a-no-op", model, schedule, "\n".join(problems))


def test_finish_schedules_reach_aborts_after_finish():
    """Within the dev profile's budget, some schedules abort a request after it finished (before it
    is released): otherwise the first property would prove nothing about that window."""
    reached = []

    @settings(max_examples=DEV_EXAMPLES, derandomize=True, database=None, phases=[Phase.generate])
    @given(schedule=finish_schedules())
    def run(schedule):
        parsed = parse_schedule(prepared(DEFAULT_MODEL, schedule), "coverage")
        streamed = defaultdict(list)
        engine, failure = run_batched(tiny_model(), parsed, parsed.engine, keep_logits=False,
                                      on_events=lambda events: [streamed[e.request_id].append(e) for e in events])
        assert failure is None, failure
        reached.extend(late_aborts(parsed, streamed, engine.num_steps))

    run()
    assert reached, f"no schedule of {DEV_EXAMPLES} aborted a request after it had finished"
