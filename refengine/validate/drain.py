"""Does a server drain after a run? Its state read from whichever status it exposes, then polled until
nothing is running, nothing is waiting and the KV cache is back to the use it started from.

Sources, tried in this order (the first one the server has is used):
- `/admin/api/status` (refengine, Kestrel-LLM): `running`, `waiting`, `kv_blocks_used`/`kv_blocks_free`;
- `/metrics`, Prometheus text parsed with prometheus_client: vLLM's `vllm:num_requests_running`,
  `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (older vLLM: `vllm:gpu_cache_usage_perc`),
  or llama.cpp's `llamacpp:requests_processing`, `llamacpp:requests_deferred`,
  `llamacpp:kv_cache_usage_ratio` (only `--metrics` builds; newer builds have no KV gauge);
- `/slots` (llama.cpp): a JSON list of slots, busy when `is_processing` (or an older non-idle `state`).
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


# --- the sources ---------------------------------------------------------------------------------
def _from_admin(data) -> State | None:
    if not isinstance(data, dict) or not all(isinstance(data.get(k), int) for k in ("running", "waiting")):
        return None
    used, free = data.get("kv_blocks_used"), data.get("kv_blocks_free")
    kv = used / (used + free) if isinstance(used, int) and isinstance(free, int) and used + free else None
    return State(data["running"], data["waiting"], kv, "/admin/api/status")


METRIC_NAMES = {  # flavour: (running, waiting, KV usage gauges in order of preference)
    "vLLM": ("vllm:num_requests_running", "vllm:num_requests_waiting",
             ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
    "llama.cpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred", ("llamacpp:kv_cache_usage_ratio",)),
}


def _from_metrics(text: str) -> State | None:
    samples: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append(sample.value)
    except ValueError:
        return None  # not Prometheus text
    for flavour, (running, waiting, kv_names) in METRIC_NAMES.items():
        if running in samples:
            kv = next((max(samples[n]) for n in kv_names if n in samples), None)  # per engine: the fullest
            return State(round(sum(samples[running])), round(sum(samples.get(waiting, [0]))), kv,
                         f"/metrics ({flavour})", kv_held_when_idle=flavour == "llama.cpp")
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
