"""A hang-up is an abort: judged from what the server did, never from how fast a thread noticed.

Once the server is idle, its aborts counter must count every hang-up the server had to abort, and no
more requests than hung up or failed. The server had to abort a hang-up, which must then not have
run to its end, when both:
- more than ABORT_SLACK tokens of the baseline answer had not been sent when the client hung up
  (validate.load.tokens_to_come: a hang-up that close to the end may finish before it is seen), and
- where the server counts finished requests (ended other than by an abort) and its status was read
  during the run (validate.drain.StatusPoller), the request had provably not finished after the
  hang-up: a status read begun after the hang-up counted no more finished requests than the answers
  the client had seen end before that read began. Those had all finished, so the hung-up request had
  not. (A server counts an end no later than it sends it: a status page behind the answers it has
  sent is stale.) Without such a read the hang-up is not held to an abort: a server writing behind
  its engine may have finished the request before the client hung up, with its end not yet sent.
Where the server counts no finished requests, the first rule alone decides. tests/test_aborts.py
holds each rule to a fault; tests/test_invariants_http.py's loaded run shows a clean server passing
with every core busy.
"""
from __future__ import annotations

from .drain import State
from .load import COMPARED, tokens_to_come

ABORT_SLACK = 32  # a hang-up this close to its answer's end may finish before the server notices
CLOCK_SLACK_S = 0.001  # the records' times are rounded to the millisecond


def unfinished_after_hang_up(record: dict, records: list[dict], start: float,
                             samples: list[tuple[float, State]], finished_before: int) -> bool:
    """Did a status read begun after `record`'s hang-up count no more finished requests (beyond
    `finished_before`, the count before the run) than the answers seen to end before that read began?
    `start`: the monotonic time the records' `done_s` count from."""
    hung_up = start + record["done_s"] + CLOCK_SLACK_S
    ends = [start + r["done_s"] + CLOCK_SLACK_S for r in records if r["verdict"] in COMPARED]  # not `record`: a hang-up
    return any(began >= hung_up and state.finished is not None
               and state.finished - finished_before <= sum(1 for t in ends if t <= began)
               for began, state in samples)


def abort_accounting(records: list[dict], counted: int, expected_tokens, start: float | None = None,
                     samples: list[tuple[float, State]] | None = None, before: State | None = None) -> dict:
    """The report's `drain.aborts` (FORMATS.md). `counted`: the aborts the server counted for the run;
    `expected_tokens(case id, api)`: the baseline answer's length; `samples` (with the `start` of the
    records' clock and the state `before` the run): the server's status read during the run."""
    def to_come(r):
        return tokens_to_come(r, expected_tokens(r["case"], r["api"]))

    far = [r for r in records if r["verdict"] == "cancelled" and (to_come(r) or 0) > ABORT_SLACK]
    proving = samples is not None and before is not None and before.finished is not None
    must = [r["id"] for r in far
            if not proving or unfinished_after_hang_up(r, records, start, samples, before.finished)]
    unproven = [r["id"] for r in far if r["id"] not in must]
    may = sum(r["verdict"] in ("cancelled", "error") for r in records)
    ok = len(must) <= counted <= may
    note = (f"{counted} aborts counted for {len(must)} hang-ups with more than {ABORT_SLACK} tokens unsent"
            + (" and not finished after the hang-up" if proving else "")
            + f" ({may} requests hung up or failed"
            + (f"; {len(unproven)} more not shown unfinished after their hang-up" if unproven else "") + ")")
    return {"counted": counted, "must": must, "unproven": unproven, "may": may, "ok": ok, "note": note}
