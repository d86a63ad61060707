"""Board validation: send a prompts or golden file's cases to any OpenAI-compatible server the way
users do (concurrently, arriving at random, some hanging up mid-stream, streamed and whole answers
mixed) and judge every completed answer against a baseline (validate.baseline): the float64 golden
tokens, or the same server's answers sent alone. Every case is sent alone first; against a golden
file those answers are judged too, so the report separates precision from batching (validate.effects).

A run PASSes only under proven load (validate.load.overlap): unless given, the arrival spread comes
from the server's measured alone latency L, as N * L / (2 * concurrency) for N requests: arrivals
come twice as fast as `concurrency` servers working alone would finish them, so requests queue and
join a running batch while others leave it. A replayed repro (validate.repro) is sent as it was
found and needs no overlap. After the run the server must drain (validate.drain), and where it
counts aborts, every hang-up it had to abort must be one (validate.aborts; the status is read
throughout the run for it). The load goes in three prefix-cache groups, cold, shared and warm
(validate.plan): the report keeps them apart, with the prompt tokens the server says it served from
its prefix cache (validate.cache). Last, the request surface is probed (validate.surface): a server
that accepts a logits processor (penalties, logit_bias, min_tokens) and ignores it FAILs.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..check.golden import Golden, PromptCase
from ..errors import RefengineError
from .aborts import ABORT_SLACK, abort_accounting
from .baseline import GoldenBaseline, SerialBaseline, ThreeWay
from .bounds import Tolerances, tolerances
from .cache import cache_report
from .client import Completion, Endpoint, ServerError
from .dialect import REFUSAL_STATUSES, Dialect, probe
from .drain import StatusPoller, server_state, wait_drained
from .effects import effect_counts
from .load import VERDICTS, overlap, replay
from .margins import LocalMargins
from .plan import Planned, Settings, plan, probe_bodies
from .precision import precision
from .surface import ignored, probe_surface
from .variants import ProcessedCase

__all__ = ["Cases", "served_model", "validate"]
DRAIN_DEADLINE_S, DRAIN_POLL_S = 10.0, 0.05  # after the run: how long to wait for a server to settle
STATUS_POLL_S = 0.02  # during the run: how often the status is read (validate.aborts)


@dataclass(frozen=True)
class Cases:
    """What validate sends: a golden file's cases (any baseline) or a prompts file's (serial only)."""
    path: Path
    cases: list
    golden: Golden | None = None

    @classmethod
    def of_golden(cls, golden: Golden) -> Cases:
        return cls(golden.path, golden.cases, golden)

    @classmethod
    def of_prompts(cls, path, prompts: list[PromptCase]) -> Cases:
        return cls(Path(path), prompts)


def served_model(endpoint: Endpoint) -> dict:
    """The first entry of the server's /v1/models. Unreachable server or no model: RefengineError."""
    try:
        return endpoint.get_json("/v1/models")["data"][0]
    except (OSError, ServerError, KeyError, IndexError, TypeError) as e:
        raise RefengineError(f"{endpoint.url}: cannot list models at /v1/models ({type(e).__name__}: {e})") from None


class _Alone:
    """The first phase: keeps each answer sent alone; judges it against the golden file where there is
    one (the precision effect), else not at all (nor a variant: the golden file has no answer to it)."""

    def __init__(self, golden: GoldenBaseline | None = None):
        self.answers: dict[tuple[str, str], Completion] = {}
        self.golden = golden

    def judge(self, p: Planned, completion: Completion) -> dict:
        self.answers[p.case.id, p.api] = completion
        if self.golden is None or isinstance(p.case, ProcessedCase):
            return {"verdict": "answered"}
        return self.golden.judge(p, completion)


def refused_variants(alone_records: list[dict]) -> dict[tuple[str, str], str]:
    """(case id, api) -> the server's refusal, of every variant it refused alone (a 4xx: it does not take
    the variant's fields; validate.surface says which). The load sends its case instead."""
    return {(r["case"], r["api"]): r["error"] for r in alone_records
            if r.get("variant") and r["verdict"] == "error" and r.get("status") in REFUSAL_STATUSES}


def _alone_server(endpoint: Endpoint, served_name: str, dialect: Dialect, settings: Settings,
                  draft: list[Planned]) -> tuple[Endpoint, str, Dialect]:
    """Where the alone answers come from: the server under test, or --baseline-url's (its own model name
    and dialect, probed as the server's)."""
    if settings.baseline_url is None:
        return endpoint, served_name, dialect
    other = Endpoint(settings.baseline_url, settings.timeout)
    name, other_dialect = served_model(other)["id"], Dialect()
    probe(other, probe_bodies(draft, name), other_dialect)
    return other, name, other_dialect


def send_alone(endpoint: Endpoint, planned: list[Planned], served_name: str,
               dialect: Dialect | None, golden: GoldenBaseline | None = None) -> tuple[_Alone, list]:
    """Each (case, api) of the plan once, whole, one at a time: nothing else in flight. A variant the
    server refuses (refused_variants) goes as its case in the load: that case is sent alone too."""
    alone = _Alone(golden)
    records = _send_each(endpoint, planned, served_name, alone, dialect, set())
    refused = refused_variants(records)
    instead = [replace(p, case=p.case.base) for p in planned if (p.case.id, p.api) in refused]
    return alone, records + _send_each(endpoint, instead, served_name, alone, dialect,
                                       {(r["case"], r["api"]) for r in records})


def _send_each(endpoint: Endpoint, planned: list[Planned], served_name: str, alone: _Alone, dialect: Dialect | None,
               sent: set[tuple[str, str]]) -> list[dict]:
    seen = {}
    for p in planned:
        if (p.case.id, p.api) in sent:
            continue
        seen.setdefault((p.case.id, p.api), Planned(f"{p.case.id}@{p.api}", p.case, p.api, 0.0, False, None))
    return [replay(endpoint, [p], served_name, alone, 1, dialect)[0] for p in seen.values()]


def arrival_spread(settings: Settings, requests: int, alone_latency: float) -> float:
    if settings.arrival_spread is not None:
        return settings.arrival_spread
    return round(requests * alone_latency / (2 * settings.concurrency), 3)


def validate(url: str, cases: Cases, settings: Settings, planned: list[Planned] | None = None,
             margins: LocalMargins | None = None) -> dict:
    """Run the schedule — `planned` (a repro's, validate.repro) or the seeded random one; the report
    (FORMATS.md). `margins`: the local model's float64 margins, for the serial baseline's divergences
    where the server reports none. Unreachable server: RefengineError."""
    if settings.baseline == "golden" and cases.golden is None:
        raise RefengineError(f"baseline: golden needs a golden file; {cases.path} is a prompts file (no "
                             f"expected answers): use serial")
    endpoint = Endpoint(url, settings.timeout)
    served = served_model(endpoint)
    bounds = tolerances(settings.precision, settings.margin_tolerance, settings.batch_invariant, cases.golden,
                        None if margins is None else margins.model)
    tolerance = bounds.precision_tolerance if settings.baseline == "golden" else bounds.batching
    draft, dialect = planned or plan(cases.cases, settings, 0.0, cases.path), Dialect()
    bodies = probe_bodies(draft, served["id"])
    probe(endpoint, bodies, dialect)
    replaying = planned is not None
    try:
        drain_baseline = server_state(endpoint)  # None: the server exposes no status
    except (OSError, ServerError):
        drain_baseline = None
    golden = GoldenBaseline(cases.golden, tolerance) if settings.baseline == "golden" else None
    alone_endpoint, alone_name, alone_dialect = _alone_server(endpoint, served["id"], dialect, settings, draft)
    kept, alone_records = send_alone(alone_endpoint, draft, alone_name, alone_dialect, golden)
    refused = refused_variants(alone_records)  # sent as their case: its answer alone is among alone_records
    failed = {(r["case"], r["api"]): r["error"] for r in alone_records if r["verdict"] == "error"}
    serial = SerialBaseline(kept.answers, bounds.batching, failed, margins)
    baseline = serial if golden is None else ThreeWay(golden, serial, alone_records)
    alone_latency = statistics.median(r["latency_s"] for r in alone_records) if alone_records else None
    lone = None if planned or not settings.cancel_rate or drain_baseline is None else \
        lone_hang_up(endpoint, draft, served["id"], baseline, dialect, drain_baseline.path)
    if planned:
        spread, spread_from = max(p.arrival_s for p in planned), "repro"
    else:
        spread = arrival_spread(settings, len(draft), alone_latency)
        spread_from = "settings" if settings.arrival_spread is not None else "alone latency"
        planned = plan(cases.cases, settings, spread, cases.path, frozenset(refused))
    poller = StatusPoller(endpoint, drain_baseline.path, STATUS_POLL_S) if drain_baseline is not None else None
    with poller or contextlib.nullcontext():
        start = time.monotonic()
        requests = replay(endpoint, planned, served["id"], baseline, settings.concurrency, dialect, start)
    wall_s = round(time.monotonic() - start, 3)
    counts = {kind: sum(r["verdict"] == kind for r in requests) for kind in VERDICTS}
    effects = effect_counts(requests, alone_records) if golden is not None else None
    alone_errors = sum(r["verdict"] == "error" and (r["case"], r["api"]) not in refused for r in alone_records)
    drained, state, note = wait_drained(endpoint, drain_baseline, DRAIN_DEADLINE_S, DRAIN_POLL_S)
    drain = {"checked": state is not None, "drained": drained, "note": note,
             **({"source": state.source, "running": state.running, "waiting": state.waiting,
                 "kv_usage": state.kv_usage} if state is not None else {})}
    before_load = poller.before or drain_baseline if poller is not None else None  # after the alone phases
    if state is not None and before_load is not None and None not in (state.aborted, before_load.aborted):
        drain["aborts"] = abort_accounting(requests, state.aborted - before_load.aborted, baseline.expected_tokens,
                                           start, poller.samples, poller.before)
        if lone is not None:
            drain["aborts"]["alone"] = lone
        drained = drained and drain["aborts"]["ok"] and (lone is None or lone["ok"])
    # after the drain is judged (its requests are no part of the load's accounting), and only on a server
    # that came through the load whole: one that failed requests, gave wrong answers or did not drain may
    # never answer again (an engine that corrupts its KV may never end a request)
    healthy = not counts["error"] and not counts["diverged"] and not alone_errors and \
        (drained or not drain["checked"])
    surface = None if replaying or not healthy else \
        {api: probe_surface(endpoint, api, {**body, "stream": False}, dialect)
         for api, body in bodies.items() if api not in dialect.probe_errors}
    load = overlap(requests)
    cache = cache_report(requests, alone_records, not dialect.cache_salt_refused, drain_baseline, before_load, state)
    effects_diverged = effects is not None and (effects["precision"]["diverged"] or effects["batching"]["diverged"])
    if counts["diverged"] or counts["error"] or alone_errors or effects_diverged or (drain["checked"] and not drained) \
            or ignored(surface):
        verdict = "FAIL"
    else:
        verdict = "PASS" if load["proven"] or spread_from == "repro" else "INCONCLUSIVE"  # a repro is as found
    return {
        "validate": 1, "url": url, "baseline": settings.baseline, "baseline_url": settings.baseline_url,
        "source": str(cases.path),
        "golden": str(cases.golden.path) if cases.golden else None,
        "model_fingerprint": cases.golden.fingerprint if cases.golden else None,
        "server": {"model": served["id"], "fingerprint": served.get("fingerprint")},
        "settings": {"concurrency": settings.concurrency, "seed": settings.seed, "cancel_rate": settings.cancel_rate,
                     "tolerance": tolerance, "tolerance_from": tolerance_from(settings, bounds),
                     "margin_tolerance": settings.margin_tolerance, "precision": settings.precision,
                     "batch_invariant": settings.batch_invariant, "api": settings.api, "arrival_spread_s": spread,
                     "arrival_spread_from": spread_from, "alone_latency_s": alone_latency,
                     "repeat": settings.repeat, "timeout": settings.timeout, "variant_rate": settings.variant_rate},
        "dialect": dialect.report(),
        "surface": surface,
        "margins": None if margins is None else {"model": str(margins.model.path), "fingerprint": margins.fingerprint,
                                                 "measured": margins.measured},
        "bounds": bounds.report(),
        "effects": effects,
        "alone": alone_records,
        "requests": requests,
        "overlap": load,
        "drain": drain,
        "cache": cache,
        "variants": variant_report(requests, refused, settings.variant_rate),
        # only against the golden file: a serial "match" says nothing of which steps agree with float64
        "precision": precision(requests, cases.golden, bounds.precision, bounds.precision_tolerance)
        if settings.baseline == "golden" else None,
        "summary": {"requests": len(requests), **counts, "alone_errors": alone_errors,
                    "surface_ignored": len(ignored(surface)), "wall_s": wall_s,
                    "verdict": verdict, "passed": verdict == "PASS"},
    }


def variant_report(requests: list[dict], refused: dict[tuple[str, str], str], rate: float) -> dict:
    """The report's `variants` (FORMATS.md): the rate, the loaded requests sent as each variant and their
    verdicts, and the variants the server refused alone (sent as their case instead)."""
    sent: dict[str, dict[str, int]] = {}
    for r in requests:
        if r.get("variant"):
            counts = sent.setdefault(r["variant"], {})
            counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    return {"rate": rate, "sent": sent,
            "refused": {f"{case}@{api}": why for (case, api), why in sorted(refused.items())}}


def lone_hang_up(endpoint: Endpoint, draft: list[Planned], served_name: str, baseline, dialect: Dialect,
                 path: str) -> dict | None:
    """The plan's longest baseline answer, streamed with nothing else in flight, hung up after its first
    token: validate.aborts's accounting for it (no other request can blur the proof that it was still
    running), with its `id`. None where no answer is long enough to be held to an abort, or the
    server counts no aborts."""
    def length(p: Planned) -> int:
        return baseline.expected_tokens(p.case.id, p.api) or 0

    longest = max(draft, key=length)
    if length(longest) <= ABORT_SLACK + 1:
        return None
    hang_up = Planned(f"{longest.case.id}@{longest.api} hung up alone", longest.case, longest.api, 0.0, True, 1)
    with StatusPoller(endpoint, path, STATUS_POLL_S) as poller:
        start = time.monotonic()
        records = replay(endpoint, [hang_up], served_name, baseline, 1, dialect, start)
    _, state, _ = wait_drained(endpoint, poller.before, DRAIN_DEADLINE_S, DRAIN_POLL_S)
    if state is None or poller.before is None or None in (state.aborted, poller.before.aborted):
        return None
    return {"id": hang_up.id, **abort_accounting(records, state.aborted - poller.before.aborted,
                                                 baseline.expected_tokens, start, poller.samples, poller.before)}


def tolerance_from(settings: Settings, bounds: Tolerances) -> str:
    """What set the tolerance the records' `verdict` applied (FORMATS.md)."""
    if settings.margin_tolerance is not None:
        return "margin_tolerance"
    if settings.baseline == "serial" and bounds.batching_from != "precision":
        return "bit-identical (batch invariant)" if bounds.batching_from == "batch_invariant" else "bit-identical"
    return f"{bounds.precision} bound from the {'golden file' if bounds.bound_from == 'golden' else 'local model'}"
