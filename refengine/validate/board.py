"""Board validation: replay a golden file's cases against any OpenAI-compatible server the way users
send them (concurrently, arriving at random, some hanging up mid-stream, streamed and whole answers
mixed) and judge every completed answer by the margin rule against the float64 golden tokens.
"""
from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..check.golden import Golden, GoldenCase
from ..check.margin_rule import Verdict, describe, judge_ids, judge_text
from ..errors import RefengineError
from .client import Completion, Endpoint, ServerError
from .dialect import PATHS, Dialect, dialect_notes, probe, send
from .drain import server_state, wait_drained

APIS = ("auto", "completions", "chat")
__all__ = ["PATHS", "Planned", "Settings", "plan", "replay", "validate"]
VERDICTS = ("match", "explained", "diverged", "cancelled", "error")
DRAIN_DEADLINE_S, DRAIN_POLL_S = 10.0, 0.05  # after the run: how long a server may take to drain


@dataclass(frozen=True)
class Settings:
    concurrency: int = 4
    seed: int = 0
    cancel_rate: float = 0.2
    margin_tolerance: float | None = None  # None: the golden file's calibrated noise bound
    api: str = "auto"
    arrival_spread: float = 1.0            # seconds over which request arrivals are spread
    repeat: int = 1
    timeout: float = 600.0

    def __post_init__(self):
        if self.concurrency < 1:
            raise RefengineError(f"concurrency: must be >= 1, got {self.concurrency}")
        if not 0 <= self.cancel_rate < 1:
            raise RefengineError(f"cancel_rate: must be in [0, 1), got {self.cancel_rate}")
        if self.margin_tolerance is not None and self.margin_tolerance < 0:
            raise RefengineError(f"margin_tolerance: must be >= 0, got {self.margin_tolerance}")
        if self.api not in APIS:
            raise RefengineError(f"api: expected one of {', '.join(APIS)}, got {self.api!r}")
        if self.arrival_spread < 0:
            raise RefengineError(f"arrival_spread: must be >= 0 seconds, got {self.arrival_spread}")
        if self.repeat < 1:
            raise RefengineError(f"repeat: must be >= 1, got {self.repeat}")
        if not self.timeout > 0:
            raise RefengineError(f"timeout: must be > 0 seconds, got {self.timeout}")


@dataclass(frozen=True)
class Planned:
    id: str
    case: GoldenCase
    api: str                 # "completions" | "chat"
    arrival_s: float
    stream: bool
    cancel_after: int | None  # hang up after this many token-carrying chunks


def plan(golden: Golden, settings: Settings) -> list[Planned]:
    """The random join/leave schedule, fixed by the seed."""
    rng = random.Random(settings.seed)
    planned = []
    for copy in range(settings.repeat):
        for case in golden.cases:
            api = "chat" if case.messages and settings.api != "completions" else "completions"
            if settings.api == "chat" and not case.messages:
                raise RefengineError(f"{golden.path}: case {case.id!r} is a raw text prompt; api chat needs "
                                     f"chat messages (use api auto or completions)")
            cancel = len(case.token_ids) > 1 and rng.random() < settings.cancel_rate
            planned.append(Planned(
                case.id if settings.repeat == 1 else f"{case.id}#{copy}", case, api,
                round(rng.uniform(0, settings.arrival_spread), 3), stream=cancel or rng.random() < 0.5,
                cancel_after=rng.randint(1, len(case.token_ids) - 1) if cancel else None))
    return sorted(planned, key=lambda p: p.arrival_s)


def request_body(p: Planned, served_model: str) -> dict:
    body = {"model": served_model, "max_tokens": p.case.max_tokens, "temperature": 0, "stream": p.stream}
    if p.api == "chat":
        body["messages"] = p.case.messages
        if p.case.chat_template_kwargs is not None:  # the template arguments the golden prompt was rendered with
            body["chat_template_kwargs"] = p.case.chat_template_kwargs
    else:  # chat cases sent as completions carry the golden prompt ids: exactly the tokens the reference saw
        body["prompt"] = p.case.prompt if p.case.prompt is not None else p.case.prompt_ids
    return body


def judge(case: GoldenCase, completion: Completion, tolerance: float) -> Verdict:
    if completion.token_ids is not None:
        return judge_ids(case, completion.token_ids, completion.text, tolerance)
    return judge_text(case, completion.text, tolerance)


def prompt_mismatch(case: GoldenCase, completion: Completion) -> str | None:
    got = completion.prompt_token_ids
    if got is None or got == case.prompt_ids:
        return None
    at = next((i for i, (a, b) in enumerate(zip(got, case.prompt_ids)) if a != b), min(len(got), len(case.prompt_ids)))
    return (f"the server's prompt ids differ from the golden prompt at position {at} "
            f"({len(got)} vs {len(case.prompt_ids)} ids): different tokenizer or chat template")


def replay_one(endpoint: Endpoint, p: Planned, served_model: str, tolerance: float, start: float,
               dialect: Dialect) -> dict:
    time.sleep(max(0.0, start + p.arrival_s - time.monotonic()))  # wait for this request's arrival time
    sent = time.monotonic()
    entry = {"id": p.id, "case": p.case.id, "api": p.api, "streamed": p.stream, "arrival_s": p.arrival_s,
             "sent_s": round(sent - start, 3)}
    try:
        completion = send(endpoint, p.api, request_body(p, served_model), p.cancel_after, dialect)
    except (ServerError, OSError) as e:
        return {**entry, "latency_s": round(time.monotonic() - sent, 3), "cancelled": False, "verdict": "error",
                "error": str(e) or type(e).__name__}
    entry |= {"latency_s": round(time.monotonic() - sent, 3), "cancelled": completion.cancelled,
              "tokens": len(completion.token_ids) if completion.token_ids is not None else None,
              "finish_reason": completion.finish_reason, "token_ids": completion.token_ids, "text": completion.text}
    if completion.note:
        entry["note"] = completion.note
    if completion.cancelled:
        return {**entry, "verdict": "cancelled"}
    mismatch = prompt_mismatch(p.case, completion)
    if mismatch:
        return {**entry, "verdict": "error", "error": mismatch}
    if completion.token_ids is None and p.case.text_offsets is None:
        return {**entry, "verdict": "error", "error": "the server reports no token ids and the golden file has "
                                                      "no text_offsets to align its text with; refresh it"}
    verdict = judge(p.case, completion, tolerance)
    if verdict.kind == "match" and completion.finish_reason != p.case.finish_reason:
        return {**entry, "verdict": "error", "error": f"the answer matches but finish_reason is "
                                                      f"{completion.finish_reason!r}, golden {p.case.finish_reason!r}"}
    return {**entry, **record_fields(verdict)}


def record_fields(v: Verdict) -> dict:
    """A verdict as the validation report's request fields (FORMATS.md): `step` is the generated-token index."""
    if v.kind == "match":  # a text match may note golden tokens left unsettled at the end (judge_text)
        return {"verdict": "match", "compared_by": v.compared_by, **({"note": v.reason} if v.reason else {})}
    return {"verdict": v.kind, "compared_by": v.compared_by, "step": v.index, "margin": v.margin,
            "expected": v.want, "got": v.got, "expected_text": v.want_text, "got_text": v.got_text}


def served_model(endpoint: Endpoint) -> dict:
    """The first entry of the server's /v1/models. Unreachable server or no model: RefengineError."""
    try:
        return endpoint.get_json("/v1/models")["data"][0]
    except (OSError, ServerError, KeyError, IndexError, TypeError) as e:
        raise RefengineError(f"{endpoint.url}: cannot list models at /v1/models ({type(e).__name__}: {e})") from None


def replay(endpoint: Endpoint, planned: list[Planned], served_name: str, tolerance: float,
           concurrency: int, dialect: Dialect | None = None) -> list[dict]:
    """Send every planned request at its arrival time (measured from now), at most `concurrency` in
    flight; their report records, in plan order. `dialect`: what a probe learned (default: ids from
    the answer's own fields, no logprobs)."""
    dialect = dialect or Dialect()
    start = time.monotonic()
    with ThreadPoolExecutor(concurrency, thread_name_prefix="validate") as pool:
        return list(pool.map(lambda p: replay_one(endpoint, p, served_name, tolerance, start, dialect), planned))


def probe_bodies(planned: list[Planned], served_name: str) -> dict[str, dict]:
    """Per API in the plan, the request body of its case with the shortest prompt (the dialect probe)."""
    shortest = {}
    for p in planned:
        if p.api not in shortest or len(p.case.prompt_ids) < len(shortest[p.api].case.prompt_ids):
            shortest[p.api] = p
    return {api: request_body(p, served_name) for api, p in sorted(shortest.items())}


def validate(url: str, golden: Golden, settings: Settings) -> dict:
    """Run the schedule; the report (FORMATS.md). Unreachable server: RefengineError."""
    endpoint = Endpoint(url, settings.timeout)
    served = served_model(endpoint)
    tolerance = golden.tolerance if settings.margin_tolerance is None else settings.margin_tolerance
    planned, dialect = plan(golden, settings), Dialect()
    probe(endpoint, probe_bodies(planned, served["id"]), dialect)
    try:
        baseline = server_state(endpoint)  # None: the server exposes no status
    except (OSError, ServerError):
        baseline = None
    start = time.monotonic()
    requests = replay(endpoint, planned, served["id"], tolerance, settings.concurrency, dialect)
    counts = {kind: sum(r["verdict"] == kind for r in requests) for kind in VERDICTS}
    wall_s = round(time.monotonic() - start, 3)
    drained, state, note = wait_drained(endpoint, baseline, DRAIN_DEADLINE_S, DRAIN_POLL_S)
    drain = {"checked": state is not None, "drained": drained, "note": note,
             **({"source": state.source, "running": state.running, "waiting": state.waiting,
                 "kv_usage": state.kv_usage} if state is not None else {})}
    return {
        "validate": 1, "url": url, "golden": str(golden.path), "model_fingerprint": golden.fingerprint,
        "server": {"model": served["id"], "fingerprint": served.get("fingerprint")},
        "settings": {"concurrency": settings.concurrency, "seed": settings.seed, "cancel_rate": settings.cancel_rate,
                     "tolerance": tolerance,
                     "tolerance_from": "golden noise" if settings.margin_tolerance is None else "margin_tolerance",
                     "api": settings.api, "arrival_spread_s": settings.arrival_spread, "repeat": settings.repeat},
        "dialect": dialect.report(),
        "requests": requests,
        "drain": drain,
        "summary": {"requests": len(requests), **counts, "wall_s": wall_s,
                    "passed": counts["diverged"] == counts["error"] == 0 and (drained or not drain["checked"])},
    }


def describe_record(r: dict, tolerance: float) -> str:
    """The margin rule's diff for an `explained` or `diverged` record."""
    verdict = Verdict(r["id"], r["verdict"], r["compared_by"], index=r["step"], got=r["got"], want=r["expected"],
                      margin=r["margin"], tolerance=tolerance, want_text=r["expected_text"], got_text=r["got_text"])
    return describe(verdict, "got", "golden")


def _detail(r: dict) -> str:
    if r["verdict"] == "match":
        return f"{r['tokens'] if r['tokens'] is not None else '?'} tokens, by {r['compared_by']}"
    if r["verdict"] in ("explained", "diverged"):
        margin = "golden answer ended" if r["margin"] is None else f"margin {r['margin']:.4g}"
        return f"step {r['step']}, {margin}, by {r['compared_by']}"
    if r["verdict"] == "cancelled":
        return "client hung up mid-stream"
    return r["error"]


def format_report(report: dict) -> str:
    s, summary = report["settings"], report["summary"]
    width = max(len(r["id"]) for r in report["requests"])
    lines = [f"{'request':<{width}}  {'api':<11}  {'stream':<6}  {'sent':>6}  {'latency':>7}  {'verdict':<9}  detail"]
    for r in sorted(report["requests"], key=lambda r: r["sent_s"]):
        lines.append(f"{r['id']:<{width}}  {r['api']:<11}  {'yes' if r['streamed'] else 'no':<6}  "
                     f"{r['sent_s']:>5.2f}s  {r['latency_s']:>6.2f}s  {r['verdict']:<9}  {_detail(r)}")
    for r in report["requests"]:
        if r["verdict"] in ("explained", "diverged"):
            lines.append(describe_record(r, s["tolerance"]))
    lines.append(
        f"validate {report['url']} (served model {report['server']['model']!r}) against {report['golden']}: "
        f"{summary['requests']} requests, concurrency {s['concurrency']}, seed {s['seed']}, cancel rate "
        f"{s['cancel_rate']}, tolerance {s['tolerance']:.6g} ({s['tolerance_from']}), {summary['wall_s']:.2f}s")
    server_fingerprint = report["server"]["fingerprint"]
    if server_fingerprint and server_fingerprint != report["model_fingerprint"]:
        lines.append(f"note: the server reports model {server_fingerprint}, the golden file was made from "
                     f"{report['model_fingerprint']} (expected for a converted or quantized model)")
    lines += dialect_notes(report.get("dialect"))
    if "drain" in report:
        lines.append(f"drain: {report['drain']['note']}")
    lines.append(", ".join(f"{kind} {summary[kind]}" for kind in VERDICTS)
                 + (" -> PASS" if summary["passed"] else " -> FAIL"))
    return "\n".join(lines)

