"""Sending a plan: every request at its arrival time (measured from the start), at most
`concurrency` in flight, each judged by a baseline as it comes back; and the overlap the client saw.

A request's span is from sending it until its answer ended or it hung up, on the client's clock.
It overlapped another request when their spans intersect: both were in flight together, so (on a
server that batches) they shared engine steps. A run proves join/leave load only when at least
MIN_OVERLAP_FRACTION of its compared requests overlapped another.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from .client import Endpoint, ServerError
from .dialect import Dialect, send
from .plan import Planned, request_body

VERDICTS = ("match", "explained", "diverged", "cancelled", "error")
COMPARED = VERDICTS[:3]
MIN_OVERLAP_FRACTION = 0.5


def send_one(endpoint: Endpoint, p: Planned, served_model: str, baseline, start: float, dialect: Dialect) -> dict:
    time.sleep(max(0.0, start + p.arrival_s - time.monotonic()))  # wait for this request's arrival time
    sent = time.monotonic()
    entry = {"id": p.id, "case": p.case.id, "api": p.api, "streamed": p.stream, "arrival_s": p.arrival_s,
             "cancel_after": p.cancel_after, "cache": p.cache, "sent_s": round(sent - start, 3)}
    variant = getattr(p.case, "variant", None)  # validate.variants.ProcessedCase
    if variant:
        entry["variant"] = variant
    try:
        completion = send(endpoint, p.api, request_body(p, served_model), p.cancel_after, dialect,
                          salt=dialect.cache_salt(p.cache, p.id))
    except (ServerError, OSError) as e:
        status = {"status": e.status} if getattr(e, "status", None) is not None else {}
        return {**entry, **ended(sent, start), "cancelled": False, "verdict": "error",
                "error": str(e) or type(e).__name__, **status}
    entry |= {**ended(sent, start), "cancelled": completion.cancelled,
              "tokens": len(completion.token_ids) if completion.token_ids is not None else None,
              "finish_reason": completion.finish_reason, "token_ids": completion.token_ids, "text": completion.text}
    if completion.cached_tokens is not None:
        entry["cached_tokens"] = completion.cached_tokens
    if completion.logprobs is not None:
        entry["logprobs"] = [t.logprob for t in completion.logprobs]
    if completion.note:
        entry["note"] = completion.note
    if completion.unread is not None:
        entry["unread_tokens"], entry["unread_end"] = completion.unread
    if completion.cancelled:
        return {**entry, "verdict": "cancelled"}
    return {**entry, **baseline.judge(p, completion)}


def tokens_to_come(record: dict, expected: int | None) -> int | None:
    """How many of a hung-up request's `expected` tokens the server had not yet sent when the client
    hung up: expected minus those received and those sent but unread (client._unread); 0 when the
    answer's end had been sent; None when either count is unknown."""
    if record.get("unread_end"):
        return 0
    if expected is None or record.get("tokens") is None:
        return None
    return expected - record["tokens"] - record.get("unread_tokens", 0)


def ended(sent: float, start: float) -> dict:
    done = time.monotonic()
    return {"latency_s": round(done - sent, 3), "done_s": round(done - start, 3)}


def replay(endpoint: Endpoint, planned: list[Planned], served_name: str, baseline, concurrency: int,
           dialect: Dialect | None = None, start: float | None = None) -> list[dict]:
    """Send every planned request at its arrival time (measured from `start`, a time.monotonic();
    default now), at most `concurrency` in flight; their report records, in plan order, each with how
    many others it overlapped. `baseline.judge(planned, completion)` gives a completed answer's verdict
    fields; `dialect`: what a probe learned (default: ids from the answer's own fields)."""
    dialect = dialect or Dialect()
    start = time.monotonic() if start is None else start
    with ThreadPoolExecutor(concurrency, thread_name_prefix="validate") as pool:
        records = list(pool.map(lambda p: send_one(endpoint, p, served_name, baseline, start, dialect), planned))
    for r, n in zip(records, overlapped_with(records)):
        r["overlapped_with"] = n
    return records


def overlapped_with(records: list[dict]) -> list[int]:
    """Per record, how many other records' spans intersect its own."""
    spans = [(r["sent_s"], r["done_s"]) for r in records]
    return [sum(1 for j, (s2, e2) in enumerate(spans) if j != i and s2 < e1 and s1 < e2)
            for i, (s1, e1) in enumerate(spans)]


def max_in_flight(records: list[dict]) -> int:
    events = sorted([(r["sent_s"], 1) for r in records] + [(r["done_s"], -1) for r in records],
                    key=lambda e: (e[0], e[1]))  # an end before a start at the same instant: not together
    most = now = 0
    for _, delta in events:
        now += delta
        most = max(most, now)
    return most


def overlap(records: list[dict]) -> dict:
    """The report's `overlap` object: was the run under join/leave load?"""
    compared = [r for r in records if r["verdict"] in COMPARED]
    together = sum(1 for r in compared if r["overlapped_with"] > 0)
    fraction = together / len(compared) if compared else 0.0
    return {"max_in_flight": max_in_flight(records), "compared": len(compared), "overlapped": together,
            "fraction": round(fraction, 3), "required": MIN_OVERLAP_FRACTION,
            "proven": bool(compared) and fraction >= MIN_OVERLAP_FRACTION}
