"""HTTP invariants: Hypothesis join/leave schedules of golden cases (strategies.http_schedules) sent
over real HTTP to an OpenAI-compatible server — `--engine-url URL` (judged against `--golden FILE`,
at `--precision`, with `--model DIR`'s float64 margins where its answers carry none: validate's rules,
so the suite and `refengine validate` agree on a server), else an in-process refengine server on
127.0.0.1 serving the default tiny model (suite.plugin's `http_engine` fixture).

The tolerance is validate.bounds': the bound of the server's precision (float32 unless --precision
says otherwise) from the golden header, or measured on --model, x 8; against its own alone answers the
same (the batching tolerance).
- every completed answer matches its golden case under the margin rule, and the schedules were
  really under load: of the compared requests in schedules of two or more, at least
  validate.load.MIN_OVERLAP_FRACTION overlapped another (validate's rule; arrival steps are scaled to
  the server's measured alone latency, so this holds on fast and slow servers);
- every completed answer equals the same server's answer to that case and API sent alone (fetched
  once: validate's serial baseline), except at the server's own top-2 margin (or, where it reports
  none, --model's float64 margin) within the batching tolerance; these schedules mix the golden cases
  with the variants of the first VARIANT_BASES (validate.variants: penalties; a bias against the golden
  first token with min_tokens; prompt logprobs, compared too; n, every answer compared), which no
  golden answer has;
- a speculating server answers as the same model served without speculation: the property above, the
  alone answers from --baseline-url's server (in process: a second refengine server speculating by
  prompt lookup, held to the first); skipped with --engine-url and no --baseline-url;
- streamed and whole answers of the same case in one schedule are identical;
- a hang-up is an abort (validate.aborts, judged once the server is idle): every streamed request that
  hung up with more than validate.aborts.ABORT_SLACK tokens of its golden answer unsent, and that a
  status read after the hang-up shows unfinished, must not run to its end: the server's
  `requests_aborted` counts it; and the schedule's aborts are at most its hang-ups and errors (skipped
  on a server that counts no aborts);
- an answer is the same cold, warm and after eviction: a schedule sent under a fresh cache_salt
  (validate.dialect: every schedule is; so its requests compute their prompts in the running batch),
  then again under that salt (its prompts' KV now in the prefix cache), then, once prompts that share
  nothing have filled more than the server's KV pool (its size from its status: skipped where unknown),
  once more: every completed answer meets the golden file, and each request's three answers agree up
  to a golden near-tie (a failure's repro holds the leg that failed, as one schedule);
- the server applies the logits processors it accepts: validate.surface's probe finds none ignored
  (one probe per API; a server that refuses one by name passes);
- afterwards the server drains: once it is idle, nothing running or waiting, KV use and, where
  reported, requests in flight and admission slots taken back to where they started (read from
  /admin/api/status, Prometheus /metrics or llama.cpp's /slots: validate.drain; skipped on a server
  with none of them). An engine idle for IDLE_S that still holds something has leaked it; how long the
  server takes to get idle is not judged (DRAIN_DEADLINE_S only ends the wait for one that never does).
No property judges how fast the server noticed anything: each holds on a clean server with every core
busy (tests/test_invariants_http.py's loaded run).
A failing property raises PropertyFailure whose message names the schedule (Hypothesis reports the
shrunk one last). tests/test_invariants_http.py shows each can fail against a faulty server.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings

from ..check.golden import Golden, GoldenCase
from ..errors import RefengineError
from ..strategies.http_schedules import arrival_step_s, http_schedules, planned_requests
from ..validate.aborts import abort_accounting
from ..validate.baseline import GoldenBaseline, SerialBaseline
from ..validate.board import send_alone, served_model
from ..validate.bounds import Tolerances, tolerances
from ..validate.client import Endpoint
from ..validate.dialect import Dialect, accepts_id_prompts
from ..validate.dialect import send as send_request
from ..validate.drain import (
    State,
    StatusPoller,
    pool_tokens,
    read_source,
    server_state,
    wait_drained,
)
from ..validate.load import MIN_OVERLAP_FRACTION, replay
from ..validate.margins import LocalMargins
from ..validate.plan import Planned, request_body
from ..validate.precision import agreeing
from ..validate.report import describe_record
from ..validate.repro import repro, write_repro
from ..validate.surface import FINDINGS, probe_surface
from ..validate.variants import variants
from .harness import PropertyFailure, repro_dir

pytestmark = [pytest.mark.invariants, pytest.mark.http,
              pytest.mark.xdist_group("http-server")]  # --dist loadgroup: the drain check needs the server to itself

TIMEOUT_S = 60
DRAIN_DEADLINE_S = 30
COMPLETED = ("match", "explained", "diverged")
STATUS_POLL_S = 0.01
IDLE_S = 0.5  # an engine idle this long (nothing running or waiting, no step) that still holds something: a leak
FILLER_TOKENS = 512  # the longest prompt evict_everything sends
MAX_FILLERS = 64     # more than this many to fill the pool (a GPU server's): the eviction leg is left out
# The cases whose variants join the schedules: each variant is sent alone once first, and what a variant
# shows (a row of per-request state mixed up beside other rows) does not depend on which case it is of.
VARIANT_BASES = 3


@dataclass(frozen=True)
class Server:
    endpoint: Endpoint
    served_name: str
    golden: Golden
    arrival_step_s: float  # strategies.http_schedules: from the shortest alone answer's latency
    id_prompts: bool = True  # /v1/completions takes token-id prompts (chat cases may go as completions)
    alone: dict = field(default_factory=dict)  # (case id, api) -> the server's answer with nothing else in flight
    bounds: Tolerances | None = None  # validate.bounds: against golden (precision) and against alone (batching)
    margins: LocalMargins | None = None  # the --model folder's float64 margins, for answers that carry none
    processed: Golden | None = None  # the golden cases and the variants it answered alone (with_processed)

    @property
    def pool(self) -> Golden:
        """The cases its schedules draw: the golden cases, and their variants once with_processed fetched them."""
        return self.golden if self.processed is None else self.processed

    @property
    def tolerance(self) -> float:
        return self.bounds.precision_tolerance

    @property
    def batching(self) -> float:
        return self.bounds.batching


def connect(url: str, golden: Golden, precision: str = "f32", model=None, alone_url: str | None = None) -> Server:
    """The server, with its pace, the tolerances it is held to (validate.bounds: `precision`'s bound
    from the golden header, or measured on `model`) and its own alone answers: every golden case sent
    once alone, whole, to each API a schedule may send it to (`alone_url`: to that server instead, the
    same model served another way; the pace is still the server's)."""
    bounds = tolerances(precision, None, False, golden, model)
    endpoint = Endpoint(url, TIMEOUT_S)
    name = served_model(endpoint)["id"]
    chat_cases = sorted((c for c in golden.cases if c.messages), key=lambda c: len(c.prompt_ids))
    id_prompts = not chat_cases or accepts_id_prompts(endpoint, name, chat_cases[0].prompt_ids)
    kept, records = send_alone(endpoint, alone_requests(golden.cases, id_prompts), name, dialect=None)
    if alone_url is not None:
        other = Endpoint(alone_url, TIMEOUT_S)
        kept, _ = send_alone(other, alone_requests(golden.cases, id_prompts), served_model(other)["id"], dialect=None)
    pace = min(r["latency_s"] for r in records if r["api"] == "completions" or not id_prompts)
    return Server(endpoint, name, golden, arrival_step_s(pace), id_prompts, kept.answers, bounds,
                  None if model is None else LocalMargins(model))


def alone_requests(cases, id_prompts: bool) -> list[Planned]:
    """Each case, whole, to each API a schedule may send it to (a case with images: chat only)."""
    return [Planned(case.id, case, api, 0.0, False, None) for case in cases for api in ("completions", "chat")
            if (api == "chat" and case.messages) or (api == "completions" and not case.images
                                                     and (id_prompts or not case.messages))]


def with_processed(server: Server, bases: tuple[str, ...] | None = None) -> Server:
    """The server with the processed variants (validate.variants) of the golden cases `bases` (ids;
    default the golden file's first VARIANT_BASES) and their answers alone (fetched here, not by connect:
    the other properties' servers see exactly the requests they did), its `processed` pool the golden
    cases and then the variants. A variant the server refuses (HF transformers serve: 422 on
    repetition_penalty) is left out."""
    chosen = server.golden.cases[:VARIANT_BASES] if bases is None else \
        [case for case in server.golden.cases if case.id in bases]
    planned = alone_requests([v for case in chosen for v in variants(case)], server.id_prompts)
    kept, _ = send_alone(server.endpoint, planned, server.served_name, dialect=None)
    refused = {p.case.id for p in planned if (p.case.id, p.api) not in kept.answers}
    answered = list({p.case.id: p.case for p in planned if p.case.id not in refused}.values())
    return replace(server, alone={**server.alone, **kept.answers},
                   processed=replace(server.golden, cases=server.golden.cases + answered))


def http_property(check, server: Server, twins: bool = False, **overrides):
    """`check(server, schedule)` as a Hypothesis property over HTTP schedules of the server's cases (pool)."""
    def run(schedule):
        check(server, schedule)
    run.__name__ = run.__qualname__ = check.__name__  # names the falsifying example and its database entry
    overrides.setdefault("deadline", None)  # how fast the server answers is not the property
    schedules = http_schedules(server.pool, twins=twins,
                               id_prompts=server.id_prompts)
    return settings(**overrides)(given(schedule=schedules)(run))


def send(server: Server, schedule, baseline=None, start: float | None = None,
         dialect: Dialect | None = None) -> list[dict]:
    """Every request of the schedule at its arrival time (from `start`, default now), all in flight
    together; validate's records, judged by `baseline` (default: the golden file). `dialect` (default a
    fresh one) holds the cache_salt: a fresh one is a cold cache."""
    planned = planned_requests(schedule, server.pool, server.arrival_step_s)
    baseline = baseline or GoldenBaseline(server.golden, server.tolerance)
    return replay(server.endpoint, planned, server.served_name, baseline, len(planned), dialect, start)


def answers_equal_alone(server: Server, schedule) -> None:
    """Validate's serial baseline as a property: every completed answer is the server's own alone
    answer to that case and API, except at the server's own top-2 margin (or --model's) within the batching tolerance
    (a fast-mode server's batched rounding may flip a near-tie; a batch-invariant one never differs). With
    with_processed, the schedules mix in the variants: a server that keeps a request's penalty counts,
    bias, min_tokens, prompt positions or forked answers in batch state it mixes up answers them
    differently beside other requests."""
    records = send(server, schedule, SerialBaseline(server.alone, server.batching, margins=server.margins))
    failed = [r for r in records if r["verdict"] in ("diverged", "error")]
    if failed:
        fail(server, "http-answers-equal-alone", "answers that differ from the server's own alone answers; "
             "http schedule:\n"
             + outcomes(records) + "\n"
             + "\n".join(describe_record(r, server.batching, "serial", server.margins is not None) for r in failed
                          if r["verdict"] == "diverged"), records)


def applies_what_it_accepts(server: Server) -> None:
    """validate.surface's probe, on the first golden case of each API: no logits processor the server
    accepts may be ignored, no prompt logprobs, echo or n it answers may be ignored or wrong, and the server
    may fail on none of them (HTTP 5xx, no answer)."""
    ignored = {}
    for api in ("completions", "chat"):
        case = next((c for c in server.golden.cases if api == "completions" and not c.images
                     and (server.id_prompts or not c.messages) or api == "chat" and c.messages), None)
        if case is not None:
            body = request_body(Planned(case.id, case, api, 0.0, False, None), server.served_name)
            ignored |= {f"{api}: {name}": v["why"] for name, v in probe_surface(server.endpoint, api, body,
                                                                               Dialect()).items()
                        if v["verdict"] in FINDINGS}
    if ignored:
        raise PropertyFailure("http-applies-what-it-accepts: the server accepts parameters it ignores, answers "
                              "wrongly or fails on: " + "; ".join(f"{k} ({why})" for k, why in ignored.items()))


def outcomes(records: list[dict]) -> str:
    """The schedule as sent, one request a line, with what came back."""
    lines = []
    for r in records:
        line = f"  {r['id']} {r['case']!r} {r['api']} {'streamed' if r['streamed'] else 'whole'}: {r['verdict']}"
        lines.append(line + (f" ({r['error']})" if r["verdict"] == "error" else ""))
    return "\n".join(lines)


def fail(server: Server, name: str, message: str, records: list[dict]):
    """Write the schedule as sent as an HTTP repro (validate.repro; Hypothesis replays the shrunk
    example last, so the file ends up holding it), then raise."""
    data = repro(records, found_by=name, url=server.endpoint.url, server={"model": server.served_name},
                 baseline="golden", source=server.golden.path, fingerprint=server.golden.fingerprint,
                 settings={"concurrency": len(records), "margin_tolerance": None,
                           "tolerance": server.tolerance, "precision": server.bounds.precision, "api": "auto",
                           "timeout": TIMEOUT_S})
    path = write_repro(repro_dir() / f"{name}.json", data)
    raise PropertyFailure(f"{message}\nwritten to {path}; send it again with "
                          f"`refengine validate --replay {path} --url {server.endpoint.url}`", path)


# --- the properties ------------------------------------------------------------------------------
def answers_match_golden(server: Server, schedule) -> None:
    check_records(server, send(server, schedule))


def check_records(server: Server, records: list[dict]) -> None:
    failed = [r for r in records if r["verdict"] in ("diverged", "error")]
    diffs = [describe_record(r, server.tolerance) for r in failed if r["verdict"] == "diverged"]
    if failed:
        fail(server, "http-answers-match-golden", "answers that fail the margin rule; http schedule:\n"
             + outcomes(records) + "\n" + "\n".join(diffs), records)
    check_logprobs(server, records)


def check_logprobs(server: Server, records: list[dict]) -> None:
    """The OpenAI logprobs a completed answer reports (validate asks every request for them): on
    every step that agrees with the golden tokens, within twice the golden tolerance of the float64
    logprob (a logprob is a logit minus the row's logsumexp: each moves by at most the logit bound)."""
    bound = 2 * server.tolerance
    cases = {c.id: c for c in server.golden.cases}
    for r in records:
        if r["verdict"] not in COMPLETED or r.get("token_ids") is None or not r.get("logprobs"):
            continue
        deltas = agreeing(r, cases[r["case"]])
        if deltas and max(deltas) > bound:
            fail(server, "http-answers-match-golden", f"{r['id']} ({r['case']!r}): a logprob of an agreeing token is "
                 f"{max(deltas):.3g} from the golden float64 one (bound {bound:.3g}, at step "
                 f"{deltas.index(max(deltas))} of the agreeing steps); http schedule:\n" + outcomes(records), records)


def parting(case: GoldenCase, a: dict, b: dict, tolerance: float) -> str | None:
    """Why answers `a` and `b` of one case differ, or None. They may part only at a golden near-tie
    (margin <= tolerance): there batch-dependent rounding may pick either token."""
    ids_a, ids_b = a["token_ids"], b["token_ids"]
    if ids_a is None or ids_b is None:
        near_tie = "explained" in (a["verdict"], b["verdict"])
        same = a["text"].rstrip("\ufffd") == b["text"].rstrip("\ufffd")  # an incomplete last character held back
        return None if same or near_tie else f"texts differ: {a['text']!r} vs {b['text']!r}"
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
        why = parting(cases[s["case"]], s, w, server.tolerance)
        if why is not None:
            fail(server, "http-streamed-equals-whole", f"{s['id']} (streamed) and {w['id']} (whole) of "
                 f"{s['case']!r}: {why}; http schedule:\n" + outcomes(records), records)


def evict_everything(server: Server) -> bool:
    """Send, one at a time, prompts that share nothing (each its own cache_salt and its own order of the
    golden prompts' ids) whose tokens add up to more than the server's KV pool: a prefix cache that
    evicts least recently used blocks has then evicted everything it held before. False (nothing sent)
    where the pool's size is unknown, the server takes no token-id prompts, or it would take more than
    MAX_FILLERS prompts."""
    pool = pool_tokens(server.endpoint)
    ids = [i for case in server.golden.cases for i in case.prompt_ids]
    if pool is None or not server.id_prompts or not ids:
        return False
    length = min(FILLER_TOKENS, pool // 2)
    count = pool // length + 2  # what fits, plus one to spare, plus one for the blocks a partial tail keeps
    if count > MAX_FILLERS:
        return False
    dialect = Dialect()
    for n in range(count):
        prompt = random.Random(n).choices(ids, k=length)
        body = {"model": server.served_name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        send_request(server.endpoint, "completions", body, None, dialect, salt=dialect.cache_salt("cold", str(n)))
    return True


def cold_warm_evicted(server: Server, schedule) -> None:
    dialect = Dialect()  # one salt for the three sends, fresh: nothing before them shares their cache
    legs = {"cold": send(server, schedule, dialect=dialect), "warm": send(server, schedule, dialect=dialect)}
    if evict_everything(server):
        legs["after eviction"] = send(server, schedule, dialect=dialect)
    sent = "\n".join(f"{leg}:\n{outcomes(records)}" for leg, records in legs.items())
    for leg, records in legs.items():
        failed = [r for r in records if r["verdict"] in ("diverged", "error")]
        if failed:
            fail(server, "http-cold-warm-evicted", f"{leg}: answers that fail the margin rule; http schedule sent "
                 f"cold, warm and after eviction:\n{sent}\n" + "\n".join(describe_record(r, server.tolerance)
                                                                        for r in failed if r["verdict"] == "diverged"),
                 records)
    cases = {c.id: c for c in server.golden.cases}
    for leg, records in legs.items():
        for cold, other in zip(legs["cold"], records):
            if leg == "cold" or cold["verdict"] not in COMPLETED or other["verdict"] not in COMPLETED:
                continue
            why = parting(cases[cold["case"]], cold, other, server.tolerance)
            if why is not None:
                fail(server, "http-cold-warm-evicted", f"{cold['id']} ({cold['case']!r}) cold vs {leg}: {why}; http "
                     f"schedule sent cold, warm and after eviction:\n{sent}", records)


def settled(server: Server) -> State | None:
    """The server's state once nothing runs or waits (what an earlier schedule left may still be
    finishing: the baseline of a schedule is taken after it). Not a check: a server that never settles
    is judged by the properties, against the state it had."""
    state = server_state(server.endpoint)
    deadline = time.monotonic() + DRAIN_DEADLINE_S
    while state is not None and (state.running or state.waiting) and time.monotonic() < deadline:
        time.sleep(STATUS_POLL_S)
        state = read_source(server.endpoint, state.path) or state
    return state


def drained(server: Server, baseline: State | None) -> tuple[bool, State | None, str]:
    return wait_drained(server.endpoint, baseline, DRAIN_DEADLINE_S, STATUS_POLL_S, idle_s=IDLE_S)


def server_drains(server: Server, schedule) -> None:
    baseline = settled(server)  # the server is this test's alone (xdist_group)
    records = send(server, schedule)
    ok, _, note = drained(server, baseline)
    if not ok:
        fail(server, "http-server-drains", f"{note}; http schedule:\n" + outcomes(records), records)


def hang_ups_are_aborts(server: Server, schedule) -> None:
    baseline = settled(server)
    with StatusPoller(server.endpoint, baseline.path, STATUS_POLL_S) as poller:
        start = time.monotonic()
        records = send(server, schedule, start=start)
    ok, last, drain_note = drained(server, baseline)
    if last is None:
        fail(server, "http-hang-ups-are-aborts", f"{drain_note}; http schedule:\n" + outcomes(records), records)
    expected = GoldenBaseline(server.golden, server.tolerance).expected_tokens
    aborts = abort_accounting(records, last.aborted - baseline.aborted, expected, start,
                              poller.samples, poller.before)
    if not aborts["ok"]:
        fail(server, "http-hang-ups-are-aborts", f"{aborts['note']}: must abort {aborts['must']} (requests_aborted "
             f"from {baseline.source}); http schedule:\n" + outcomes(records), records)
    if not ok:
        fail(server, "http-hang-ups-are-aborts", f"{drain_note}; http schedule:\n" + outcomes(records), records)


# --- the tests ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(http_engine) -> Server:
    try:
        return connect(*http_engine)
    except RefengineError as e:  # a golden file without the precision's bound, and no --model
        pytest.fail(f"HTTP invariants: {e}", pytrace=False)


def test_completed_answers_match_golden(server):
    """...and the schedules were under load: validate's overlap rule over their compared requests."""
    overlaps = []  # per compared request of a schedule of two or more: did it overlap another?

    def answers_match_golden_while_counting_overlaps(server, schedule):
        records = send(server, schedule)
        if len(records) > 1:
            overlaps.extend(r["overlapped_with"] > 0 for r in records if r["verdict"] in COMPLETED)
        check_records(server, records)

    http_property(answers_match_golden_while_counting_overlaps, server)()
    assert overlaps and sum(overlaps) >= MIN_OVERLAP_FRACTION * len(overlaps), \
        f"inconclusive: only {sum(overlaps)} of {len(overlaps)} compared requests overlapped another"


def test_answers_equal_the_servers_own_alone_answers(server):
    """...the golden cases and their variants, mixed in one schedule."""
    http_property(answers_equal_alone, with_processed(server))()


def test_the_server_applies_the_logits_processors_it_accepts(server):
    applies_what_it_accepts(server)


def test_streamed_and_whole_answers_are_identical(server):
    http_property(streamed_equals_whole, server, twins=True)()


def test_an_answer_is_the_same_cold_warm_and_after_eviction(server):
    """A quarter of the profile's examples: each sends its schedule three times and fills the pool."""
    http_property(cold_warm_evicted, server, max_examples=-(-settings.default.max_examples // 4))()


def test_server_drains_after_every_schedule(server):
    """...admission slots included: in_flight and slots_used back to their start."""
    if server_state(server.endpoint) is None:
        pytest.skip(f"{server.endpoint.url}: server exposes no status (/admin/api/status, /metrics, /slots)")
    http_property(server_drains, server)()


@pytest.fixture(scope="module")
def speculating(http_speculation) -> Server:
    if http_speculation is None:
        pytest.skip("--engine-url without --baseline-url: no server of the same model without speculation")
    target, baseline = http_speculation
    try:
        return connect(*target, alone_url=baseline)
    except RefengineError as e:
        pytest.fail(f"HTTP invariants: {e}", pytrace=False)


def test_a_speculating_server_answers_as_the_same_model_without_speculation(speculating):
    """answers_equal_alone, the alone answers from the server that does not speculate (greedy golden
    cases: a seeded sampler draws otherwise under speculation)."""
    http_property(answers_equal_alone, speculating)()


def test_a_hang_up_is_an_abort(server):
    state = server_state(server.endpoint)
    if state is None or state.aborted is None:
        pytest.skip(f"{server.endpoint.url}: server counts no aborts (requests_aborted on /admin/api/status, "
                    f"or /metrics)")
    http_property(hang_ups_are_aborts, server)()
