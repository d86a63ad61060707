"""Does a server drain after a run? Its state read from whichever status it exposes, then polled until
nothing is running, nothing is waiting, the KV cache is back to the use it started from and, where the
server reports them, the requests in flight and the admission slots taken are back to their start.
Where the server counts its engine steps the wait can be bounded in steps (wait_drained_within_steps):
freeing is then judged by the engine's own progress, not by a wall clock.

Sources, tried in this order (the first one the server has is used):
- `/admin/api/status` (refengine, Kestrel-LLM): `running`, `waiting`, `kv_blocks_used`/`kv_blocks_free`;
- `/metrics`, Prometheus text parsed with prometheus_client: vLLM's `vllm:num_requests_running`,
  `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (older vLLM: `vllm:gpu_cache_usage_perc`),
  or llama.cpp's `llamacpp:requests_processing`, `llamacpp:requests_deferred`,
  `llamacpp:kv_cache_usage_ratio` (only `--metrics` builds; newer builds have no KV gauge);
- `/slots` (llama.cpp): a JSON list of slots, busy when `is_processing` (or an older non-idle `state`).
Besides, where reported: requests in flight and admission slots taken (refengine: `in_flight`,
`slots_used`; `refengine_requests_in_flight`, `refengine_slots_used`), requests aborted (`requests_aborted`;
`refengine_requests_aborted_total`, vLLM's `vllm:request_success_total{finished_reason="abort"}`) and
engine steps (`steps`; `refengine_engine_steps_total`, vLLM's `vllm:iteration_tokens_total_count`: one
observation per engine step).
A source the server does not have answers 4xx or 501 (llama.cpp without `--metrics` / `--slots`), or
lacks the names above. llama.cpp keeps each idle slot's prompt in the KV cache, so there its KV use is
reported but not required to fall back.
"""
from __future__ import annotations

import json
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
                 poll_s: float = 0.05) -> tuple[bool, State | None, str]:
    """Poll until nothing is running or waiting and KV use is back to `baseline_state`'s (read with the
    same source; None: KV back to 0). (ok, last state read, note). A server with no status at all:
    (False, None, NO_STATUS note) — not drained, but not shown to leak either: the caller decides."""
    deadline = time.monotonic() + deadline_s
    path = baseline_state.path if baseline_state is not None else None
    last, error = None, None
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
        if time.monotonic() >= deadline:
            if last is None:
                return False, None, f"no status within {deadline_s:g} s: {error or NO_STATUS}"
            note = f"{deadline_s:g} s after the run the server still has {', '.join(busy(last, baseline_state))}"
            return False, last, note + f" ({last.describe()})" + (f"; last poll failed: {error}" if error else "")
        time.sleep(poll_s)


def wait_drained_within_steps(endpoint: Endpoint, baseline_state: State | None, max_steps: int,
                              idle_s: float = 1.0, deadline_s: float = 30.0,
                              poll_s: float = 0.01) -> tuple[bool, State | None, str]:
    """wait_drained, bounded in engine steps: drained before the server has run `max_steps` steps more
    than at the first poll. A server whose engine stays idle (nothing running or waiting, no step) for
    `idle_s` without having drained holds what it holds for good: not drained. Where the source reports
    no step counter, the wall-clock wait_drained (`deadline_s`). (ok, last state read, note)."""
    first = read_source(endpoint, baseline_state.path) if baseline_state is not None else server_state(endpoint)
    if first is None or first.steps is None:
        return wait_drained(endpoint, baseline_state, deadline_s, poll_s)
    deadline = time.monotonic() + deadline_s
    state, idle_since, idle_steps = first, None, None
    while True:
        why = busy(state, baseline_state)
        if not why:
            return True, state, f"drained: {state.describe()}"
        now = time.monotonic()
        if state.steps - first.steps > max_steps:
            return False, state, (f"{state.steps - first.steps} engine steps after the run the server still has "
                                  f"{', '.join(why)} ({state.describe()})")
        if state.running or state.waiting or state.steps != idle_steps:
            idle_since, idle_steps = now, state.steps
        elif now - idle_since >= idle_s:
            return False, state, (f"the engine is idle ({state.steps - first.steps} steps after the run) and the "
                                  f"server still has {', '.join(why)} ({state.describe()})")
        if now >= deadline:
            return False, state, f"{deadline_s:g} s after the run the server still has {', '.join(why)}"
        time.sleep(poll_s)
        state = read_source(endpoint, first.path) or state


# --- the sources ---------------------------------------------------------------------------------
def _from_admin(data) -> State | None:
    if not isinstance(data, dict) or not all(isinstance(data.get(k), int) for k in ("running", "waiting")):
        return None
    used, free = data.get("kv_blocks_used"), data.get("kv_blocks_free")
    kv = used / (used + free) if isinstance(used, int) and isinstance(free, int) and used + free else None
    counts = {name: data.get(key) if isinstance(data.get(key), int) else None
              for name, key in (("in_flight", "in_flight"), ("slots_used", "slots_used"),
                                ("aborted", "requests_aborted"), ("steps", "steps"))}
    return State(data["running"], data["waiting"], kv, "/admin/api/status", **counts)


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
}


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

    for flavour, (running, waiting, kv_names) in METRIC_NAMES.items():
        if running in samples:
            kv = next((max(samples[n]) for n in kv_names if n in samples), None)  # per engine: the fullest
            return State(round(sum(samples[running])), round(sum(samples.get(waiting, [0]))), kv,
                         f"/metrics ({flavour})", kv_held_when_idle=flavour == "llama.cpp",
                         **{field: count(field) for field in COUNT_NAMES})
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
