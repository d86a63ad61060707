"""The one schedule driver: a schedule's requests join the engine at their arrival steps, leave at
their abort steps, and the engine steps until all have finished. Every batched run in refengine
(the properties, replay, calibration, golden check, run-schedule) goes through `run_batched`, and
every request-alone baseline through `run_alone`, so they all mean the same thing by a schedule.

The batched driver also watches the engine: it stops at the first engine failure and returns it
(KV accounting broken after a step, a step that schedules nothing while requests wait, no end after
STEP_ALLOWANCE steps per token, blocks still in use when everything has finished). The alone and serial
runs are watched for progress the same way, and raise EngineStuck: a scheduler that never admits a
request alone must fail the property that needs its alone answer within seconds, not hang it
(tests/test_invariants_faults.py: last-admission-slot-unused).
"""
from __future__ import annotations

import math
from dataclasses import replace

from ..engine import EngineConfig, LLMEngine, RequestOutput
from ..errors import RefengineError
from ..model import Model
from .schedule import Schedule, ScheduledRequest

STEP_ALLOWANCE = 10  # steps per prompt or generated token before a run counts as stuck (preemption recomputes)


class EngineStuck(RefengineError):
    """A run alone or serial that stopped making progress (`stalled`): the engine's failure."""


def settings_text(c: EngineConfig) -> str:
    """The settings a schedule's verdicts depend on, as reports and plots print them."""
    return (f"mode={c.mode}, max_num_seqs={c.max_num_seqs}, max_num_batched_tokens={c.max_num_batched_tokens}, "
            f"block_size={c.block_size}, num_blocks={c.num_blocks}" + (f", fault={c.fault}" if c.fault else ""))


def configured(config: EngineConfig, mode: str | None = None, fault: str | None = None) -> EngineConfig:
    """A schedule's engine settings with the caller's mode and fault overrides (None keeps the schedule's)."""
    if mode is not None:
        config = replace(config, mode=mode)
    return replace(config, fault=fault) if fault is not None else config


def _add(engine: LLMEngine, request: ScheduledRequest, source: str) -> None:
    try:
        engine.add_request(request.id, **request.prompt, params=request.params, cache_salt=request.cache_salt,
                           images=request.image_arrays())
    except RefengineError as e:
        raise RefengineError(f"{source}: {e}") from None


def allowance(engine: LLMEngine, request: ScheduledRequest) -> int:
    """The steps `request` may take once added to `engine` before its run counts as stuck."""
    prompt = engine.output(engine.request_ids(request.id)[0]).prompt_ids  # (an n > 1 request's first child)
    return STEP_ALLOWANCE * (len(prompt) + request.params.max_tokens) * request.params.n


def stalled(engine: LLMEngine, max_steps: float) -> str | None:
    """Why the engine's run has stopped making progress after its last step, or None: the step scheduled
    nothing while requests wait or run, or the run has taken more than `max_steps` steps."""
    status = engine.status()
    if not engine.trace[-1]["scheduled"] and status["running"] + status["waiting"]:
        return (f"step {engine.num_steps - 1} scheduled nothing while {status['waiting']} requests "
                f"wait and {status['running']} run")
    if engine.num_steps > max_steps:
        return f"no end after {engine.num_steps} steps"
    return None


def _run_watched(engine: LLMEngine, request: ScheduledRequest, source: str, what: str) -> None:
    """Step `engine` until it has nothing left to do, `request` its latest addition; EngineStuck naming
    `what` where it stops making progress."""
    max_steps = engine.num_steps + allowance(engine, request)
    while engine.has_unfinished():
        engine.step()
        problem = stalled(engine, max_steps)
        if problem:
            raise EngineStuck(f"{source}: {what}: {problem}")


def run_batched(model: Model, schedule: Schedule, config: EngineConfig, *, keep_logits: bool = True,
                on_events=None) -> tuple[LLMEngine, str | None]:
    """The schedule as written on an engine with `config`; `on_events(events)` sees each step's
    TokenEvents. Returns the engine and the first engine failure (None when there was none)."""
    engine = LLMEngine(model, config, keep_logits=keep_logits)
    pending = sorted(schedule.requests, key=lambda r: r.arrival_step)
    aborts = sorted((r.abort_step, r.id) for r in schedule.requests if r.abort_step is not None)
    max_steps = 0
    while pending or engine.has_unfinished():
        while pending and pending[0].arrival_step <= engine.num_steps:
            request = pending.pop(0)
            _add(engine, request, schedule.source)
            max_steps = max(max_steps, engine.num_steps) + allowance(engine, request)
        while aborts and aborts[0][0] <= engine.num_steps:
            engine.abort(aborts.pop(0)[1])
        events = engine.step()
        if on_events:
            on_events(events)
        problem = stalled(engine, math.inf if pending else max_steps)  # arrivals to come: no end yet
        if problem:
            return engine, problem
        try:
            engine.check_invariants()
        except AssertionError as e:
            return engine, f"after step {engine.num_steps - 1}: {e}"
    used = engine.block_manager.num_used_blocks
    return engine, f"{used} KV blocks still in use after every request finished" if used else None


def run_alone(model: Model, config: EngineConfig, request: ScheduledRequest, *, keep_logits: bool = True,
              source: str = "<schedule>") -> RequestOutput:
    """`request` alone (max_num_seqs=1, otherwise `config`), from its arrival to its natural stop:
    an aborted request's batched tokens must be a prefix of this."""
    engine = LLMEngine(model, replace(config, max_num_seqs=1), keep_logits=keep_logits)
    _add(engine, request, source)
    _run_watched(engine, request, source, f"{request.id} alone")
    return engine.output(request.id)


def run_engine(model: Model, schedule: Schedule, mode: str | None = None,
               serial: bool = False) -> tuple[LLMEngine, str | None]:
    """Run `schedule` batched, or with `serial` each request alone on one engine (abort steps
    ignored): the engine it ran on and its first engine failure."""
    config = configured(schedule.engine, mode)
    if not serial:
        return run_batched(model, schedule, config, keep_logits=False)
    engine = LLMEngine(model, replace(config, max_num_seqs=1))
    for request in schedule.requests:
        _add(engine, request, schedule.source)
        try:
            _run_watched(engine, request, schedule.source, f"{request.id} serial")
        except EngineStuck as e:
            return engine, str(e)
    return engine, None


def run_output(model: Model, engine: LLMEngine, failure: str | None, serial: bool) -> dict:
    """The run-output object of FORMATS.md (plus optional keys; docs/formats.md lists them)."""
    return {
        "model": model.fingerprint,
        "engine": engine.config.settings(),
        "serial": serial,
        "requests": {rid: out.to_json() for rid, out in engine.outputs().items()},
        "trace": engine.trace,
        "metrics": engine.metrics,
        **({"engine_failure": failure} if failure else {}),
    }


def run_schedule(model: Model, schedule: Schedule, mode: str | None = None, serial: bool = False) -> dict:
    """`run_engine`'s run as a run-output object."""
    return run_output(model, *run_engine(model, schedule, mode, serial), serial)
