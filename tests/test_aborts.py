"""validate.aborts, the hang-up rule of board validation and of the HTTP properties, on hand-made
records and status reads: which hang-ups a server had to abort, and when its count is right. Each
boundary is pinned from both sides (the judge's own mutants: a `<` for a `<=`, a dropped condition)."""
from __future__ import annotations

import math

import pytest

from refengine.validate.aborts import (
    ABORT_SLACK,
    CLOCK_SLACK_S,
    abort_accounting,
    unfinished_after_hang_up,
)
from refengine.validate.drain import State

START = 100.0  # the records' clock starts here (time.monotonic())
ANSWER = 200   # every baseline answer is this long


def status(finished: int | None, aborted: int | None = 0) -> State:
    ended = None if finished is None or aborted is None else finished + aborted
    return State(1, 0, None, "/admin/api/status", aborted=aborted, ended=ended)


def hang_up(rid: str, done_s: float, tokens: int = 3, unread: int = 0) -> dict:
    return {"id": rid, "case": "c", "api": "completions", "verdict": "cancelled", "done_s": done_s,
            "tokens": tokens, "unread_tokens": unread, "unread_end": False}


def answer(rid: str, done_s: float, verdict: str = "match") -> dict:
    return {"id": rid, "case": "c", "api": "completions", "verdict": verdict, "done_s": done_s, "tokens": ANSWER}


def expected(case_id, api):
    return ANSWER


def at(done_s: float) -> float:
    """A status read begun just after the record that ended at `done_s` (its rounding allowed for)."""
    return START + done_s + 2 * CLOCK_SLACK_S


def test_the_slack_decides_without_a_finished_count():
    near = hang_up("near", 0.1, tokens=ANSWER - ABORT_SLACK)  # exactly ABORT_SLACK to come
    far = hang_up("far", 0.1, tokens=ANSWER - ABORT_SLACK - 1)
    read_unread = hang_up("unread", 0.1, tokens=3, unread=ANSWER - ABORT_SLACK - 3)  # sent, not yet read
    ended = dict(hang_up("ended", 0.1), unread_end=True)
    records = [near, far, read_unread, ended]
    for before in (None, status(None), status(0, aborted=None)):  # no finished count: the slack alone
        report = abort_accounting(records, 1, expected, START, [(math.inf, status(4))], before)
        assert (report["must"], report["unproven"], report["may"], report["ok"]) == (["far"], [], 4, True)
    assert not abort_accounting(records, 0, expected)["ok"]


@pytest.mark.parametrize("counted, ok", [(0, False), (1, True), (3, True), (4, False)])
def test_the_count_must_lie_between_the_hang_ups_held_and_those_that_hung_up_or_failed(counted, ok):
    records = [hang_up("far", 0.1), hang_up("near", 0.2, tokens=ANSWER), answer("a", 0.3, "error"),
               answer("b", 0.4)]
    report = abort_accounting(records, counted, expected)
    assert (report["must"], report["may"], report["ok"]) == (["far"], 3, ok)


def test_a_hang_up_is_held_only_where_a_read_after_it_shows_it_unfinished():
    r = hang_up("r", 0.5)
    others = [answer("a", 0.2), answer("b", 0.7)]
    records = [r, *others]
    before = status(10)
    # before the hang-up nothing proves anything, however few requests had finished
    assert not unfinished_after_hang_up(r, records, START, [(START + 0.4, status(10))], 10)
    # after it: finished no more than the answers seen to end by then (a, at 0.2)
    assert unfinished_after_hang_up(r, records, START, [(at(0.5), status(11))], 10)
    assert not unfinished_after_hang_up(r, records, START, [(at(0.5), status(12))], 10)
    # b's end (0.7) counts only for a read begun after it
    assert not unfinished_after_hang_up(r, records, START, [(at(0.6), status(12))], 10)
    assert unfinished_after_hang_up(r, records, START, [(at(0.7), status(12))], 10)
    # the last read, after the whole run, sees every end
    assert unfinished_after_hang_up(r, records, START, [(math.inf, status(12))], 10)
    # one read that proves it is enough, whatever the others say; a read without a finished count proves nothing
    assert unfinished_after_hang_up(r, records, START, [(at(0.5), status(13)), (at(0.7), status(12))], 10)
    assert not unfinished_after_hang_up(r, records, START, [(at(0.5), status(None))], 10)
    report = abort_accounting(records, 1, expected, START, [(at(0.5), status(11))], before)
    assert (report["must"], report["unproven"], report["ok"]) == (["r"], [], True)
    report = abort_accounting(records, 0, expected, START, [(at(0.5), status(12))], before)
    assert (report["must"], report["unproven"], report["ok"]) == ([], ["r"], True)
    assert not abort_accounting(records, 0, expected, START, [(at(0.5), status(11))], before)["ok"]


def test_the_hang_up_time_allows_for_the_records_rounding():
    r = hang_up("r", 0.5)
    assert not unfinished_after_hang_up(r, [r], START, [(START + 0.5 + CLOCK_SLACK_S / 2, status(0))], 0)
    assert unfinished_after_hang_up(r, [r], START, [(START + 0.5 + CLOCK_SLACK_S, status(0))], 0)


def test_only_answers_seen_to_end_count_as_finished_and_not_the_hang_up_itself():
    r = hang_up("r", 0.5)
    for other in (hang_up("q", 0.1), answer("e", 0.1, "error")):  # their end is not known to be a finish
        assert not unfinished_after_hang_up(r, [r, other], START, [(at(0.5), status(1))], 0)
    for verdict in ("match", "explained", "diverged"):
        assert unfinished_after_hang_up(r, [r, answer("a", 0.1, verdict)], START, [(at(0.5), status(1))], 0)
    # the finished count is the requests ended by any reason but an abort: an abort is no finish
    assert unfinished_after_hang_up(r, [r], START, [(at(0.5), status(0, aborted=1))], 0)
    assert status(2, aborted=1).finished == 2 and status(None).finished is None


def test_requests_finished_before_the_run_are_not_the_runs():
    r = hang_up("r", 0.5)
    report = abort_accounting([r], 1, expected, START, [(at(0.5), status(5, aborted=3))], status(5, aborted=2))
    assert (report["must"], report["ok"]) == (["r"], True)
    report = abort_accounting([r], 1, expected, START, [(at(0.5), status(6, aborted=3))], status(5, aborted=2))
    assert (report["must"], report["unproven"]) == ([], ["r"])
