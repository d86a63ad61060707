"""HTTP invariants: Hypothesis join/leave schedules of golden cases (strategies.http_schedules) sent
over real HTTP to an OpenAI-compatible server — `--engine-url URL` (judged against `--golden FILE`),
else an in-process refengine server on 127.0.0.1 serving the default tiny model (suite.plugin's
`http_engine` fixture).

- every completed answer matches its golden case under the margin rule;
- streamed and whole answers of the same case in one schedule are identical;
- afterwards the server drains: nothing running or waiting, KV use back to where it started (read
  from /admin/api/status, Prometheus /metrics or llama.cpp's /slots: validate.drain; skipped on a
  server with none of them).
A failing property raises PropertyFailure whose message names the schedule (Hypothesis reports the
shrunk one last). tests/test_invariants_http.py shows each can fail against a faulty server.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings

from ..check.golden import Golden, GoldenCase
from ..strategies.http_schedules import http_schedules, planned_requests
from ..validate.board import describe_record, replay, served_model
from ..validate.client import Endpoint
from ..validate.drain import server_state, wait_drained
from .harness import PropertyFailure

pytestmark = [pytest.mark.invariants, pytest.mark.http,
              pytest.mark.xdist_group("http-server")]  # --dist loadgroup: the drain check needs the server to itself

TIMEOUT_S = 60
DRAIN_DEADLINE_S = 30
COMPLETED = ("match", "explained", "diverged")


@dataclass(frozen=True)
class Server:
    endpoint: Endpoint
    served_name: str
    golden: Golden


def connect(url: str, golden: Golden) -> Server:
    endpoint = Endpoint(url, TIMEOUT_S)
    return Server(endpoint, served_model(endpoint)["id"], golden)


def http_property(check, server: Server, twins: bool = False, **overrides):
    """`check(server, schedule)` as a Hypothesis property over HTTP schedules of the golden cases."""
    def run(schedule):
        check(server, schedule)
    run.__name__ = run.__qualname__ = check.__name__  # names the falsifying example and its database entry
    overrides.setdefault("deadline", None)  # how fast the server answers is not the property
    return settings(**overrides)(given(schedule=http_schedules(server.golden, twins=twins))(run))


def send(server: Server, schedule) -> list[dict]:
    """Every request of the schedule at its arrival time, all in flight together; validate's records."""
    planned = planned_requests(schedule, server.golden)
    return replay(server.endpoint, planned, server.served_name, server.golden.tolerance, len(planned))


def outcomes(records: list[dict]) -> str:
    """The schedule as sent, one request a line, with what came back."""
    lines = []
    for r in records:
        line = f"  {r['id']} {r['case']!r} {r['api']} {'streamed' if r['streamed'] else 'whole'}: {r['verdict']}"
        lines.append(line + (f" ({r['error']})" if r["verdict"] == "error" else ""))
    return "\n".join(lines)


# --- the properties ------------------------------------------------------------------------------
def answers_match_golden(server: Server, schedule) -> None:
    check_records(server, send(server, schedule))


def check_records(server: Server, records: list[dict]) -> None:
    failed = [r for r in records if r["verdict"] in ("diverged", "error")]
    diffs = [describe_record(r, server.golden.tolerance) for r in failed if r["verdict"] == "diverged"]
    if failed:
        raise PropertyFailure("answers that fail the margin rule; http schedule:\n" + outcomes(records) + "\n"
                              + "\n".join(diffs))


def parting(case: GoldenCase, a: dict, b: dict, tolerance: float) -> str | None:
    """Why answers `a` and `b` of one case differ, or None. They may part only at a golden near-tie
    (margin <= tolerance): there batch-dependent rounding may pick either token."""
    ids_a, ids_b = a["token_ids"], b["token_ids"]
    if ids_a is None or ids_b is None:
        near_tie = "explained" in (a["verdict"], b["verdict"])
        return None if a["text"] == b["text"] or near_tie else f"texts differ: {a['text']!r} vs {b['text']!r}"
    if ids_a == ids_b:
        return None if a["text"] == b["text"] else f"same token ids, texts differ: {a['text']!r} vs {b['text']!r}"
    step = next((s for s, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
    if step < len(case.margins) and case.margins[step] <= tolerance:
        return None
    return (f"token ids part at step {step}: {ids_a[step:step + 1] or '(end)'} vs {ids_b[step:step + 1] or '(end)'}"
            f" (golden margin there {case.margins[step] if step < len(case.margins) else '(golden ended)'})")


def streamed_equals_whole(server: Server, schedule) -> None:
    records = send(server, schedule)
    completed = [r for r in records if r["verdict"] in COMPLETED]
    cases = {c.id: c for c in server.golden.cases}
    pairs = [(s, w) for s in completed if s["streamed"] for w in completed
             if not w["streamed"] and w["case"] == s["case"]]
    for s, w in pairs:
        why = parting(cases[s["case"]], s, w, server.golden.tolerance)
        if why is not None:
            raise PropertyFailure(f"{s['id']} (streamed) and {w['id']} (whole) of {s['case']!r}: {why}; "
                                  f"http schedule:\n" + outcomes(records))


def server_drains(server: Server, schedule) -> None:
    baseline = server_state(server.endpoint)  # idle: the server is this test's alone (xdist_group)
    records = send(server, schedule)
    ok, _, note = wait_drained(server.endpoint, baseline, DRAIN_DEADLINE_S, poll_s=0.02)
    if not ok:
        raise PropertyFailure(f"{note}; http schedule:\n" + outcomes(records))


# --- the tests ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(http_engine) -> Server:
    return connect(*http_engine)


def overlapped(records: list[dict]) -> bool:
    """Whether two requests were in flight together (sent, then answered or hung up, as the client saw it)."""
    spans = sorted((r["sent_s"], r["sent_s"] + r["latency_s"]) for r in records if "latency_s" in r)
    return any(later_sent < earlier_done for (_, earlier_done), (later_sent, _) in zip(spans, spans[1:]))


def test_completed_answers_match_golden(server):
    """...and the schedules really had requests in flight together, so the server batched them."""
    concurrent = []

    def answers_match_golden_while_counting_overlaps(server, schedule):
        records = send(server, schedule)
        concurrent.append(overlapped(records))
        check_records(server, records)

    http_property(answers_match_golden_while_counting_overlaps, server)()
    assert sum(concurrent) >= len(concurrent) // 4, f"only {sum(concurrent)} of {len(concurrent)} schedules overlapped"


def test_streamed_and_whole_answers_are_identical(server):
    http_property(streamed_equals_whole, server, twins=True)()


def test_server_drains_after_every_schedule(server):
    if server_state(server.endpoint) is None:
        pytest.skip(f"{server.endpoint.url}: server exposes no status (/admin/api/status, /metrics, /slots)")
    http_property(server_drains, server)()
