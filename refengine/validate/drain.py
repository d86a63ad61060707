"""Does a server drain after a run? Its state read from whichever status it exposes, then polled until
nothing is running, nothing is waiting, the KV cache is back to the use it started from and, where the
server reports them, the requests in flight and the admission slots taken are back to their start.
Where the server counts its engine steps, an engine that has gone idle (nothing running or waiting, no
step for `idle_s`) and still holds something holds it for good: not drained, without waiting out the
deadline. How fast a server drains is never judged: the deadline only ends the wait for one that never
settles.

Sources, tried in this order (the first one the server has is used):
- `/admin/api/status` (refengine, Kestrel-LLM): `running`, `waiting`, `kv_blocks_used`/`kv_blocks_free`;
- `/metrics`, Prometheus text parsed with prometheus_client: vLLM's `vllm:num_requests_running`,
  `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (older vLLM: `vllm:gpu_cache_usage_perc`),
  or llama.cpp's `llamacpp:requests_processing`, `llamacpp:requests_deferred`,
  `llamacpp:kv_cache_usage_ratio` (only `--metrics` builds; newer builds have no KV gauge);
- `/slots` (llama.cpp): a JSON list of slots, busy when `is_processing` (or an older non-idle `state`).
Besides, where reported: requests in flight and admission slots taken (refengine: `in_flight`,
`slots_used`; `refengine_requests_in_flight`, `refengine_slots_used`), requests aborted (`requests_aborted`;
`refengine_requests_aborted_total`, vLLM's `vllm:request_success_total{finished_reason="abort"}`),
requests ended by any reason (refengine: `requests_finished` + `requests_aborted`; every
`vllm:request_success_total` sample plus `refengine_requests_aborted_total`) and engine steps (`steps`;
`refengine_engine_steps_total`, vLLM's `vllm:iteration_tokens_total_count`: one observation per engine
step). A StatusPoller reads the state throughout a run (validate.aborts: had a hung-up request finished
after its hang-up?).
A source the server does not have answers 4xx or 501 (llama.cpp without `--metrics` / `--slots`), or
lacks the names above. llama.cpp keeps each idle slot's prompt in the KV cache, so there its KV use is
reported but not required to fall back.
"""
from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from .client import Endpoint, ServerError

SOURCES = ("/admin/api/status", "/metrics", "/slots")
NO_STATUS = "server exposes no status (no /admin/api/status, Prometheus /metrics or /slots)"
KV_SLACK = 1e-9  # a float gauge read back as it was written


@dataclass(frozen=True)
class State:
    running: int
    waiting: int | None         # None: the source does not report queued requests (/slots)
    kv_usage: float | None      # 0..1; None: not reported
    source: str                 # e.g. "/metrics (vLLM)"
    kv_held_when_idle: bool = False  # idle slots keep their prompt cache (llama.cpp): KV need not fall back
    in_flight: int | None = None    # requests admitted and not finished; None: not reported
    slots_used: int | None = None   # admission slots taken; None: not reported
    aborted: int | None = None      # requests aborted since start (a counter); None: not reported
    steps: int | None = None        # engine steps since start (a counter); None: not reported
    ended: int | None = None        # requests ended, finished or aborted (a counter); None: not reported
    cache_queries: int | None = None  # prompt tokens looked up in the prefix cache (a counter); None: not reported
    cache_hits: int | None = None     # of those, found cached (a counter); None: not reported

    @property
    def finished(self) -> int | None:
        """Requests ended other than by an abort (a counter); None: not reported."""
        return None if self.ended is None or self.aborted is None else self.ended - self.aborted

    @property
    def path(self) -> str:
        return self.source.split(" ")[0]

    def describe(self) -> str:
        waiting = "waiting not reported" if self.waiting is None else f"{self.waiting} waiting"
        kv = "KV use not reported" if self.kv_usage is None else f"KV use {self.kv_usage:.4%}"
        return f"{self.running} running, {waiting}, {kv} (from {self.source})"


def server_state(endpoint: Endpoint) -> State | None:
    """The server's state from the first status source it exposes; None when it exposes none.
    Unreachable server or a broken status answer: OSError or ServerError."""
    for path in SOURCES:
        state = read_source(endpoint, path)
        if state is not None:
            return state
    return None


def read_source(endpoint: Endpoint, path: str) -> State | None:
    """The state from one source (one of SOURCES); None when the server does not have it."""
    status, body = endpoint.get(path)
    if 400 <= status < 500 or status == 501:
        return None
    if status != 200:
        raise ServerError(f"{path}: HTTP {status}: {body[:120]!r}")
    if path == "/metrics":
        return _from_metrics(body.decode("utf-8", "replace"))
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None  # an HTML page or the like: not a status this module knows
    return _from_admin(data) if path == "/admin/api/status" else _from_slots(data)


def busy(state: State, baseline: State | None) -> list[str]:
    """What keeps `state` from being drained back to `baseline` (empty: drained)."""
    why = [f"{state.running} running"] if state.running else []
    if state.waiting:
        why.append(f"{state.waiting} waiting")
    start = baseline.kv_usage if baseline is not None and baseline.kv_usage is not None else 0.0
    if state.kv_usage is not None and not state.kv_held_when_idle and state.kv_usage > start + KV_SLACK:
        why.append(f"KV use {state.kv_usage:.4%} (started at {start:.4%})")
    for name, what in (("in_flight", "in flight"), ("slots_used", "admission slots taken")):
        now, then = getattr(state, name), getattr(baseline, name, None) if baseline is not None else None
        if now is not None and now > (then or 0):
            why.append(f"{now} {what} (started at {then or 0})")
    return why


def wait_drained(endpoint: Endpoint, baseline_state: State | None, deadline_s: float = 30.0,
                 poll_s: float = 0.05, idle_s: float | None = None) -> tuple[bool, State | None, str]:
    """Poll until nothing is running or waiting and KV use (and in-flight requests and admission
    slots, where reported) are back to `baseline_state`'s (read with the same source; None: KV back to
    0). (ok, last state read, note). With `idle_s`, on a server that counts engine steps: an engine idle
    that long (nothing running or waiting, no step) that still holds something is not drained, at once.
    A server with no status at all: (False, None, NO_STATUS note) — not drained, but not shown to leak
    either: the caller decides."""
    deadline = time.monotonic() + deadline_s
    path = baseline_state.path if baseline_state is not None else None
    last, error, idle = None, None, Idle(idle_s)
    while True:
        try:
            state = read_source(endpoint, path) if path else server_state(endpoint)
            error = None
        except (OSError, ServerError) as e:  # keep polling: a server busy draining may answer late
            state, error = None, f"{type(e).__name__}: {e}"
        if state is None and error is None:
            if last is None and path is None:
                return False, None, NO_STATUS
            path = None  # the baseline's source has gone: look again
        if state is not None:
            last, path = state, state.path
            why = busy(state, baseline_state)
            if not why:
                return True, state, f"drained: {state.describe()}"
            if idle.for_good(state):
                return False, state, (f"the engine is idle (no step for {idle_s:g} s, nothing running or waiting) "
                                      f"and the server still has {', '.join(why)} ({state.describe()})")
        if time.monotonic() >= deadline:
            if last is None:
                return False, None, f"no status within {deadline_s:g} s: {error or NO_STATUS}"
            note = f"{deadline_s:g} s after the run the server still has {', '.join(busy(last, baseline_state))}"
            return False, last, note + f" ({last.describe()})" + (f"; last poll failed: {error}" if error else "")
        time.sleep(poll_s)


class Idle:
    """Has the engine been idle (nothing running or waiting, the step counter unchanged) for `idle_s`
    of the polls it was shown? Never, for idle_s None or a source that counts no steps."""

    def __init__(self, idle_s: float | None):
        self.idle_s, self.since, self.steps = idle_s, None, None

    def for_good(self, state: State) -> bool:
        if self.idle_s is None or state.steps is None:
            return False
        now = time.monotonic()
        if state.running or state.waiting or state.steps != self.steps:
            self.since, self.steps = now, state.steps
            return False
        return now - self.since >= self.idle_s


class StatusPoller:
    """(monotonic time the read began, State) from one source every `poll_s` while a run goes on: what
    the server had counted at each moment (validate.aborts). A context manager: `before` is read on
    entering, before anything of the run is sent (None if that read failed), and a last sample on
    leaving, at time math.inf: begun after everything of the run (its records' times are rounded, this
    read may begin within the rounding of the last one); failed reads are skipped."""

    def __init__(self, endpoint: Endpoint, path: str, poll_s: float = 0.01):
        self.endpoint, self.path, self.poll_s = endpoint, path, poll_s
        self.samples: list[tuple[float, State]] = []
        self.before: State | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-poller", daemon=True)

    def __enter__(self) -> StatusPoller:
        self.before = self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        state = self._read()
        if state is not None:
            self.samples.append((math.inf, state))

    def _read(self) -> State | None:
        try:
            return read_source(self.endpoint, self.path)
        except (OSError, ServerError):
            return None

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            state = self._read()
            if state is not None:
                self.samples.append((began, state))
            self._stop.wait(self.poll_s)


# --- the sources ---------------------------------------------------------------------------------
def _from_admin(data) -> State | None:
    if not isinstance(data, dict) or not all(isinstance(data.get(k), int) for k in ("running", "waiting")):
        return None
    used, free = data.get("kv_blocks_used"), data.get("kv_blocks_free")
    kv = used / (used + free) if isinstance(used, int) and isinstance(free, int) and used + free else None
    counts = {name: data.get(key) if isinstance(data.get(key), int) else None
              for name, key in (("in_flight", "in_flight"), ("slots_used", "slots_used"),
                                ("aborted", "requests_aborted"), ("steps", "steps"),
                                ("cache_queries", "prefix_cache_queries"), ("cache_hits", "prefix_cache_hits"))}
    finished = data.get("requests_finished")
    ended = finished + counts["aborted"] if isinstance(finished, int) and counts["aborted"] is not None else None
    return State(data["running"], data["waiting"], kv, "/admin/api/status", ended=ended, **counts)


METRIC_NAMES = {  # flavour: (running, waiting, KV usage gauges in order of preference)
    "vLLM": ("vllm:num_requests_running", "vllm:num_requests_waiting",
             ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
    "llama.cpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred", ("llamacpp:kv_cache_usage_ratio",)),
}


COUNT_NAMES = {  # State field: (metric sample name, labels it must carry), in order of preference
    "in_flight": (("refengine_requests_in_flight", {}),),
    "slots_used": (("refengine_slots_used", {}),),
    "aborted": (("refengine_requests_aborted_total", {}),
                ("vllm:request_success_total", {"finished_reason": "abort"})),
    "steps": (("refengine_engine_steps_total", {}), ("vllm:iteration_tokens_total_count", {})),
    "cache_queries": (("vllm:prefix_cache_queries_total", {}),),
    "cache_hits": (("vllm:prefix_cache_hits_total", {}),),
}


ENDED_NAME, ENDED_APART_NAME = "vllm:request_success_total", "refengine_requests_aborted_total"


def _from_metrics(text: str) -> State | None:
    samples: dict[str, list[float]] = {}
    labelled: dict[str, list[tuple[dict, float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append(sample.value)
                labelled.setdefault(sample.name, []).append((sample.labels, sample.value))
    except ValueError:
        return None  # not Prometheus text

    def count(field: str) -> int | None:
        for name, labels in COUNT_NAMES[field]:
            values = [v for ls, v in labelled.get(name, []) if labels.items() <= ls.items()]
            if values:
                return round(sum(values))
        return None

    ended = None  # vLLM counts aborts among its finished_reasons, refengine apart from them
    if ENDED_NAME in samples:
        ended = round(sum(samples[ENDED_NAME]) + sum(samples.get(ENDED_APART_NAME, [])))
    for flavour, (running, waiting, kv_names) in METRIC_NAMES.items():
        if running in samples:
            kv = next((max(samples[n]) for n in kv_names if n in samples), None)  # per engine: the fullest
            return State(round(sum(samples[running])), round(sum(samples.get(waiting, [0]))), kv,
                         f"/metrics ({flavour})", kv_held_when_idle=flavour == "llama.cpp", ended=ended,
                         **{field: count(field) for field in COUNT_NAMES})
    return None


def pool_tokens(endpoint: Endpoint) -> int | None:
    """How many tokens the server's KV pool holds: refengine's status (kv_blocks_used + kv_blocks_free,
    x kv_block_size) or vLLM's `vllm:cache_config_info` labels (num_gpu_blocks x block_size); None
    where neither says."""
    try:
        status, body = endpoint.get("/admin/api/status")
        data = json.loads(body) if status == 200 else None
        if isinstance(data, dict) and all(isinstance(data.get(k), int) for k in
                                          ("kv_blocks_used", "kv_blocks_free", "kv_block_size")):
            return (data["kv_blocks_used"] + data["kv_blocks_free"]) * data["kv_block_size"]
        status, body = endpoint.get("/metrics")
        if status != 200:
            return None
        for family in text_string_to_metric_families(body.decode("utf-8", "replace")):
            for sample in family.samples:
                if sample.name.startswith("vllm:cache_config_info"):
                    return int(sample.labels["num_gpu_blocks"]) * int(sample.labels["block_size"])
    except (OSError, ServerError, ValueError, KeyError):
        return None
    return None


def _slot_busy(slot: dict) -> bool:
    if "is_processing" in slot:
        return bool(slot["is_processing"])
    state = slot.get("state", 0)  # older llama.cpp: 0 idle, 1 processing; some forks spell it out
    return state.upper() != "IDLE" if isinstance(state, str) else bool(state)


def _from_slots(data) -> State | None:
    if not isinstance(data, list) or not all(isinstance(s, dict) for s in data):
        return None
    return State(sum(map(_slot_busy, data)), None, None, "/slots (llama.cpp)", kv_held_when_idle=True)
