"""The HTTP properties' negative control: against a faulty in-process server the golden property
fails, Hypothesis shrinks the failing schedule to one request sent at once, and the HTTP repro it
writes fails again when `refengine validate --replay` sends it to the faulty server, and passes
against a clean one. The serve layer's faults are found the same way (dev profile's budget,
derandomized) and shrunk to one streamed request that hangs up: hang-up-without-abort by the
hang-up-is-an-abort property, slot-leak by the drain property (admission slots) and, on a server with
the suite's few waiting slots, by the golden property itself (leaked slots become refused requests)."""
from __future__ import annotations

import json
import re

import pytest
from test_invariants_faults import MAX_SHRUNK_REQUESTS, SmallEnough

from refengine.check.golden import read_golden
from refengine.cli import main
from refengine.data import shipped
from refengine.engine import EngineConfig
from refengine.serve import OpenAIServer
from refengine.suite.harness import PropertyFailure
from refengine.suite.plugin import HTTP_MAX_WAITING
from refengine.suite.test_http import (
    answers_match_golden,
    connect,
    hang_ups_are_aborts,
    http_property,
    server_drains,
)

pytestmark = [pytest.mark.invariants, pytest.mark.http,
              pytest.mark.xdist_group("http-server")]  # --dist loadgroup: the drain check needs the server to itself
FAULT = "kv-write-block-boundary-off-by-one"  # corrupts every answer past one KV block


def test_a_faulty_server_fails_the_golden_property_and_shrinks(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("REFENGINE_REPRO_DIR", str(tmp_path))
    shrunk, failure = hunt(tiny_model, FAULT, answers_match_golden, "answers_match_golden_on_faulty_server",
                           "diverged at generated token",
                           small_enough=lambda s: len(s) == 1 and not s[0].stream and s[0].arrival == 0)
    assert len(shrunk) == 1 and not shrunk[0].stream and shrunk[0].arrival == 0, shrunk
    repro = json.loads(failure.repro.read_text())
    assert [(r["case"], r["streamed"], r["verdict"]) for r in repro["requests"]] == \
        [(shrunk[0].case_id, False, "diverged")]
    for fault, code in ((FAULT, 1), (None, 0)):  # replayed: fails again at that request; passes when clean
        server = OpenAIServer(tiny_model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, fault=fault),
                              host="127.0.0.1")
        server.start()
        try:
            report = tmp_path / f"again-{fault}.json"
            assert main(["validate", "--replay", str(failure.repro), "--url", server.url, "--report", str(report),
                         "--repro", str(tmp_path / f"again-{fault}-repro.json")]) == code
            assert [r["verdict"] for r in json.loads(report.read_text())["requests"]] == \
                ["diverged" if fault else "match"]
        finally:
            server.close()


# --- server-side leaks: the serve layer's faults ---------------------------------------------------
def hunt(tiny_model, fault: str, check, name: str, match: str, small_enough=lambda schedule: True,
         **server_settings):
    """Hunt `fault` on a faulty in-process server with property `check` (dev profile's example budget,
    derandomized, no database) until a failing schedule of at most MAX_SHRUNK_REQUESTS requests for which
    `small_enough` holds (what the test asserts of the shrunk schedule): (that schedule, its
    PropertyFailure). Stopping there, not at the shrinker's end: tests/test_invariants_faults.SmallEnough."""
    faulty = OpenAIServer(tiny_model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, fault=fault),
                          host="127.0.0.1", **server_settings)
    faulty.start()
    def on_faulty_server(server, schedule):
        try:
            check(server, schedule)
        except PropertyFailure as failure:
            if len(schedule) <= MAX_SHRUNK_REQUESTS and small_enough(schedule):
                raise SmallEnough(schedule, failure) from None
            raise

    on_faulty_server.__name__ = name
    try:
        found = http_property(on_faulty_server,
                              connect(faulty.url, read_golden(shipped("golden", "tiny-random.jsonl"))),
                              derandomize=True, database=None, report_multiple_bugs=False)
        with pytest.raises(SmallEnough) as small:
            found()
    finally:
        faulty.close()
    shrunk, failure = small.value.example, small.value.failure
    assert re.search(match, str(failure)), failure
    assert len(json.loads(failure.repro.read_text())["requests"]) == len(shrunk)
    return shrunk, failure


def one_hang_up(schedule) -> bool:
    return len(schedule) == 1 and schedule[0].stream and schedule[0].cancel_after is not None


def test_a_hang_up_that_is_not_aborted_is_found_and_shrinks(tiny_model, tmp_path, monkeypatch):
    """hang-up-without-abort: the request runs on to its natural end; no abort is counted."""
    monkeypatch.setenv("REFENGINE_REPRO_DIR", str(tmp_path))
    shrunk, failure = hunt(tiny_model, "hang-up-without-abort", hang_ups_are_aborts,
                           "hang_ups_are_aborts_on_faulty_server", "hung up after", small_enough=one_hang_up)
    assert len(shrunk) == 1 and shrunk[0].stream and shrunk[0].cancel_after is not None, shrunk
    assert "counted 0 aborts" in str(failure), failure


def test_a_leaked_admission_slot_is_found_and_shrinks(tiny_model, tmp_path, monkeypatch):
    """slot-leak: a hung-up request's slot is never returned; the drain property sees slots_used stay up.
    (Slots enough for the whole hunt: every example is judged against its own start.)"""
    monkeypatch.setenv("REFENGINE_REPRO_DIR", str(tmp_path))
    shrunk, _ = hunt(tiny_model, "slot-leak", server_drains, "server_drains_on_faulty_server",
                     "admission slots taken", small_enough=one_hang_up, max_waiting=5000)
    assert len(shrunk) == 1 and shrunk[0].stream and shrunk[0].cancel_after is not None, shrunk


def test_with_few_waiting_slots_a_slot_leak_is_refused_requests(tiny_model, tmp_path, monkeypatch):
    """The in-process server of the properties has HTTP_MAX_WAITING waiting slots: leaked slots run
    out within one run, and the golden property itself fails with refused requests (verdict error)."""
    monkeypatch.setenv("REFENGINE_REPRO_DIR", str(tmp_path))
    # A leaked slot never frees, so any wait refuses it; the wait is long enough that a slot a busy
    # machine frees late still counts as freed (else a replay may not refuse: Hypothesis's Flaky).
    shrunk, failure = hunt(tiny_model, "slot-leak", answers_match_golden, "answers_match_golden_on_faulty_server",
                           "queue_timeout|no batch slot", max_waiting=HTTP_MAX_WAITING, queue_timeout=0.5)
    # how many requests a failing schedule needs depends on how many slots earlier examples leaked
    assert len(shrunk) <= MAX_SHRUNK_REQUESTS and ": error (" in str(failure), failure

