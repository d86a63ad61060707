"""HTTP join/leave schedules over a golden file's cases: what the properties of
refengine/suite/test_http.py send to a server (in-process `refengine serve`, or any
OpenAI-compatible server given by `--engine-url`).

A schedule is 1-MAX_HTTP_REQUESTS requests, all in flight together (one client each). A request is
exactly five draws and the schedule nothing else, so the shrinker can delete any whole request (its
deletion pass removes up to five consecutive draws: a list's own "one more?" draw per element would
make a request six, and only trailing requests could go):
- case: an index into the golden cases (the same case may be drawn more than once), drawn from
  MORE_REQUESTS_FACTOR x as many values: the draw mod the number of cases is the case, and a draw below
  the number of cases also makes this request the schedule's last (so the simplest draw, 0, is the
  first golden case and the end of the schedule);
- api: `completions`, or `chat` when drawn and the case has chat messages (a chat case sent as a
  completion carries its golden prompt ids; to a server that takes no token-id prompts, `id_prompts`
  False, a chat case always goes as chat, and so does a case with images);
- stream: a whole JSON answer, or SSE chunks;
- arrival: 0-MAX_ARRIVAL_STEPS arrival steps after the schedule starts. The step's length is the
  server's: its shortest alone answer's latency / (MAX_ARRIVAL_STEPS + 1) (test_http measures it), so
  every request arrives before any earlier one that runs to completion has finished — requests join
  a running batch on a fast server and a slow one alike;
- leave: run to completion, or (streamed only; drawn and ignored for a whole answer) hang up after
  1-MAX_CANCEL_CHUNKS chunks that carry tokens; an answer with no more chunks than that completes.
Every request is greedy (`temperature: 0`) with the golden `max_tokens`. With `twins`, each drawn
request is followed by its twin: the same case, api and arrival, streamed if it is whole and whole if
it streams, run to completion.
Simplest first, and what a failure shrinks to: one whole completion of the first golden case, sent
at once, run to completion (with twins: that and its streamed twin).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import strategies as st

from ..check.golden import Golden
from ..validate.plan import Planned

MAX_HTTP_REQUESTS = 6
MAX_ARRIVAL_STEPS = 5
MAX_CANCEL_CHUNKS = 8
MORE_REQUESTS_FACTOR = 3  # a request is the last with probability about 1/3: schedules of ~3 requests


@dataclass(frozen=True)
class HttpRequest:
    case: int
    case_id: str
    api: str                  # "completions" | "chat"
    stream: bool
    arrival: int              # arrival steps after the schedule starts
    cancel_after: int | None  # hang up after this many token-carrying chunks; None: run to completion

    def __repr__(self) -> str:  # one line per request in Hypothesis's falsifying example
        leave = "to completion" if self.cancel_after is None else f"hang up after {self.cancel_after} chunks"
        return (f"<case {self.case} {self.case_id!r} {self.api} {'streamed' if self.stream else 'whole'} "
                f"at step {self.arrival}, {leave}>")

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(repr(self))


@st.composite
def http_requests(draw, golden: Golden, id_prompts: bool = True) -> tuple[HttpRequest, bool]:
    """(the request, whether it is the schedule's last). `id_prompts` False: the server takes no
    token-id prompts, so a chat case always goes as chat (the api is still drawn: a request stays five
    draws); so does a case with images (completions has no place for them)."""
    num_cases = len(golden.cases)
    drawn = draw(st.integers(0, MORE_REQUESTS_FACTOR * num_cases - 1))
    index, last = drawn % num_cases, drawn < num_cases
    case = golden.cases[index]
    chat = (draw(st.booleans()) or not id_prompts or bool(case.images)) and bool(case.messages)
    stream = draw(st.booleans())
    arrival = draw(st.integers(0, MAX_ARRIVAL_STEPS))
    leave = draw(st.integers(0, MAX_CANCEL_CHUNKS))  # 0: run to completion
    return HttpRequest(index, case.id, "chat" if chat else "completions", stream, arrival,
                       leave if stream and leave else None), last


@st.composite
def request_lists(draw, golden: Golden, max_requests: int, id_prompts: bool = True) -> list[HttpRequest]:
    """1-max_requests requests, five draws each and nothing between them (see http_requests: the
    case draw says whether more follow)."""
    requests = []
    while len(requests) < max_requests:
        request, last = draw(http_requests(golden, id_prompts))
        requests.append(request)
        if last:
            break
    return requests


def twinned(request: HttpRequest) -> list[HttpRequest]:
    """The request and its twin: same case, api and arrival; whole if it streams and streamed if not,
    run to completion."""
    return [request, replace(request, stream=not request.stream, cancel_after=None)]


@st.composite
def http_schedules(draw, golden: Golden, max_requests: int = MAX_HTTP_REQUESTS,
                   twins: bool = False, id_prompts: bool = True) -> list[HttpRequest]:
    """With `twins`, every drawn request is followed by its twin (see twinned), so every schedule has
    streamed and whole answers of one case to compare; max_requests still bounds the whole list."""
    if not twins:
        return draw(request_lists(golden, max_requests, id_prompts))
    drawn = draw(request_lists(golden, max(1, max_requests // 2), id_prompts))
    return [request for each in drawn for request in twinned(each)]


def arrival_step_s(shortest_alone_latency_s: float) -> float:
    return shortest_alone_latency_s / (MAX_ARRIVAL_STEPS + 1)


def planned_requests(schedule: list[HttpRequest], golden: Golden, step_s: float) -> list[Planned]:
    """The schedule as refengine.validate requests, ids r0, r1, ... in schedule order; arrival steps
    of `step_s` seconds."""
    return [Planned(f"r{n}", golden.cases[r.case], r.api, round(r.arrival * step_s, 4), r.stream, r.cancel_after)
            for n, r in enumerate(schedule)]
