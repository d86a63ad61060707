"""Drain and health after a run, over real HTTP on 127.0.0.1: refengine's /metrics parses with
prometheus_client and agrees with /admin/api/status during and after load; validate.drain reads the
state of a vLLM-style (/metrics), llama.cpp-style (/slots, or llama.cpp /metrics) and status-less
server and waits for each to drain."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client.parser import text_string_to_metric_families

from refengine.engine import EngineConfig
from refengine.serve import OpenAIServer
from refengine.validate.client import Endpoint
from refengine.validate.drain import (
    NO_STATUS,
    read_source,
    server_state,
    wait_drained,
)

DEADLINE_S = 30
LOAD = {"prompt": "Tell me a long story.", "max_tokens": 3000, "ignore_eos": True, "stream": True}
LOAD_ENGINE = EngineConfig(mode="invariant", max_num_seqs=2, num_blocks=1024)  # 2 x 3000 tokens: seconds of load


def wait_until(condition, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# --- refengine serve: /metrics against /admin/api/status -----------------------------------------
def scrape(endpoint: Endpoint) -> dict[tuple[str, frozenset], float]:
    status, body = endpoint.get("/metrics")
    assert status == 200
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    [v] = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    return v


def expected(status: dict) -> dict[str, float]:
    kv_total = status["kv_blocks_used"] + status["kv_blocks_free"]
    return {"vllm:num_requests_running": status["running"], "vllm:num_requests_waiting": status["waiting"],
            "vllm:kv_cache_usage_perc": status["kv_blocks_used"] / kv_total,
            "refengine_requests_aborted_total": status["requests_aborted"],
            "vllm:num_preemptions_total": status["preemptions"]}


def agreeing_scrape(endpoint: Endpoint, watch=("running", "waiting", "kv_blocks_used", "requests_aborted")):
    """(status, metrics) read while the watched facts stood still: status before and after the scrape agree."""
    while True:
        before = endpoint.get_json("/admin/api/status")
        samples = scrape(endpoint)
        after = endpoint.get_json("/admin/api/status")
        if all(before[k] == after[k] for k in watch):
            return after, samples


def stream_for_a_while(url: str, hold: threading.Event):
    """A long streamed completion; hang up once `hold` is set (the server aborts it)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=DEADLINE_S)
    conn.request("POST", "/v1/completions", json.dumps(LOAD), {"Content-Type": "application/json"})
    sock = conn.sock  # getresponse() drops conn.sock when the server will close the connection
    resp = conn.getresponse()
    assert resp.status == 200
    resp.readline()
    hold.wait(DEADLINE_S)
    sock.shutdown(socket.SHUT_RDWR)  # the server sees the hang-up at once
    conn.close()


def test_refengine_metrics_agree_with_status_during_and_after_load(tiny_model):
    server = OpenAIServer(tiny_model, LOAD_ENGINE, host="127.0.0.1")
    server.start()
    endpoint = Endpoint(server.url, DEADLINE_S)
    hold = threading.Event()
    clients = [threading.Thread(target=stream_for_a_while, args=(server.url, hold)) for _ in range(5)]
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=DEADLINE_S)
        conn.request("GET", "/metrics")
        assert conn.getresponse().getheader("Content-Type").startswith("text/plain; version=0.0.4")
        conn.close()
        baseline = server_state(endpoint)
        assert baseline.source == "/admin/api/status" and baseline.running == 0 and baseline.kv_usage == 0
        for c in clients:
            c.start()
        wait_until(lambda: endpoint.get_json("/admin/api/status")["waiting"] == 3, "2 running, 3 waiting")
        for _ in range(3):  # during the load
            status, samples = agreeing_scrape(endpoint)
            assert status["running"] == 2 and status["waiting"] == 3 and status["kv_blocks_used"] > 0
            for name, want in expected(status).items():
                assert value(samples, name, model_name=status["model"]) == pytest.approx(want), name
        busy = read_source(endpoint, "/metrics")
        assert busy.source == "/metrics (vLLM)" and busy.running == 2 and busy.waiting == 3 and busy.kv_usage > 0
        ok, last, note = wait_drained(endpoint, baseline, deadline_s=0.3, poll_s=0.05)
        assert not ok and last.running == 2 and "still has 2 running, 3 waiting, KV use" in note, note

        hold.set()  # every client hangs up: the server aborts all five
        ok, last, note = wait_drained(endpoint, baseline, DEADLINE_S, poll_s=0.02)
        assert ok and last.running == last.waiting == 0 and last.kv_usage == 0, note
        ok, last, note = wait_drained(endpoint, read_source(endpoint, "/metrics"), DEADLINE_S)
        assert ok and last.source == "/metrics (vLLM)", note
        wait_until(lambda: endpoint.get_json("/admin/api/status")["requests_aborted"] == 5, "five aborts")
        status, samples = agreeing_scrape(endpoint)  # after the load
        for name, want in expected(status).items():
            assert value(samples, name) == pytest.approx(want), name
        assert value(samples, "vllm:num_requests_running") == value(samples, "vllm:kv_cache_usage_perc") == 0
        assert value(samples, "refengine_requests_aborted_total") == 5
        assert value(samples, "vllm:request_success_total", finished_reason="length") == 0
    finally:
        hold.set()
        for c in clients:
            c.join(DEADLINE_S)
        server.close()


@pytest.mark.parametrize("fault", [None, "abort-leaks-blocks"])
def test_refengine_counts_finishes_by_reason_and_a_leak_is_caught(tiny_model, fault):
    server = OpenAIServer(tiny_model, EngineConfig(mode="invariant", max_num_seqs=2, fault=fault), host="127.0.0.1")
    server.start()
    endpoint = Endpoint(server.url, DEADLINE_S)
    try:
        baseline = server_state(endpoint)
        for _ in range(2):
            endpoint.complete("/v1/completions", {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        hung_up = threading.Event()
        hung_up.set()
        stream_for_a_while(server.url, hung_up)  # one token, then the client leaves: an abort
        ok, last, note = wait_drained(endpoint, baseline, deadline_s=DEADLINE_S, poll_s=0.02, idle_s=0.5)
        assert ok == (fault is None), note
        if fault:  # the aborted request's blocks never come back: an idle engine holds them, found long before the deadline
            assert last.running == last.waiting == 0 and last.kv_usage > baseline.kv_usage == 0, note
        status, samples = agreeing_scrape(endpoint)
        assert status["requests_finished"] == status["requests_finished_length"] == 2
        assert value(samples, "vllm:request_success_total", finished_reason="length") == 2
        assert value(samples, "vllm:request_success_total", finished_reason="stop") == 0
        assert value(samples, "refengine_requests_total") == 3
    finally:
        server.close()


# --- other servers: tiny stdlib ones exposing one kind of status each ----------------------------
class FakeServer(ThreadingHTTPServer):
    """Answers GET `path` with routes[path](): (status, content type, body); anything else is a 404."""
    daemon_threads = True

    def __init__(self, routes: dict):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                status, kind, body = routes[self.path]() if self.path in routes else (404, "text/plain", "no")
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(f"http://127.0.0.1:{self.server_address[1]}", 5)


def vllm_metrics(load: dict):
    return 200, "text/plain; version=0.0.4", (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="m"}} {float(load["running"])}\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {float(load["waiting"])}\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {load["kv"]}\n'
        "# TYPE vllm:request_success_total counter\n"
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 7.0\n'
        f'vllm:request_success_total{{engine="0",finished_reason="abort",model_name="m"}} {load.get("aborted", 0)}.0\n'
        "# TYPE vllm:iteration_tokens_total histogram\n"
        f'vllm:iteration_tokens_total_bucket{{engine="0",le="+Inf",model_name="m"}} {load.get("steps", 0)}.0\n'
        f'vllm:iteration_tokens_total_count{{engine="0",model_name="m"}} {load.get("steps", 0)}.0\n'
        f'vllm:iteration_tokens_total_sum{{engine="0",model_name="m"}} 0.0\n'
        "# TYPE vllm:prefix_cache_queries counter\n"
        f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {load.get("cache_queries", 0)}.0\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {load.get("cache_hits", 0)}.0\n'
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
        'num_gpu_blocks="2048"} 1.0\n')


def llamacpp_metrics(load: dict):
    return 200, "text/plain; version=0.0.4", (
        "# TYPE llamacpp:kv_cache_usage_ratio gauge\n"
        f"llamacpp:kv_cache_usage_ratio {load['kv']}\n"
        "# TYPE llamacpp:requests_processing gauge\n"
        f"llamacpp:requests_processing {load['running']}\n"
        "# TYPE llamacpp:requests_deferred gauge\n"
        f"llamacpp:requests_deferred {load['waiting']}\n")


def llamacpp_slots(load: dict):
    slots = [{"id": i, "n_ctx": 4096, "is_processing": i < load["running"]} for i in range(4)]
    return 200, "application/json", json.dumps(slots)


def not_supported():  # llama.cpp without --metrics
    return 501, "application/json", json.dumps({"error": {"code": 501, "type": "not_supported_error"}})


@pytest.mark.parametrize("kind", ["vllm", "llamacpp-metrics", "llamacpp-slots"])
def test_drain_is_read_from_whatever_status_the_server_has(kind):
    load = {"running": 0, "waiting": 0, "kv": 0.0}
    routes = {"vllm": {"/metrics": lambda: vllm_metrics(load)},
              "llamacpp-metrics": {"/metrics": lambda: llamacpp_metrics(load), "/slots": not_supported},
              "llamacpp-slots": {"/metrics": not_supported, "/slots": lambda: llamacpp_slots(load)}}[kind]
    server = FakeServer(routes)
    try:
        baseline = server_state(server.endpoint)
        source = {"vllm": "/metrics (vLLM)", "llamacpp-metrics": "/metrics (llama.cpp)",
                  "llamacpp-slots": "/slots (llama.cpp)"}[kind]
        assert baseline.source == source and baseline.running == 0
        load.update(running=2, waiting=1, kv=0.25)
        state = server_state(server.endpoint)
        assert state.running == 2 and state.waiting == (None if kind == "llamacpp-slots" else 1)
        assert state.kv_usage == {"vllm": 0.25, "llamacpp-metrics": 0.25, "llamacpp-slots": None}[kind]
        ok, last, note = wait_drained(server.endpoint, baseline, deadline_s=0.3, poll_s=0.05)
        assert not ok and last.running == 2 and "still has 2 running" in note and source in note, note

        load.update(running=0, waiting=0)  # requests gone; llama.cpp's idle slots keep their prompt cache
        ok, last, note = wait_drained(server.endpoint, baseline, deadline_s=0.3, poll_s=0.05)
        assert ok == (kind != "vllm"), note  # vLLM's KV must fall back to where it started
        if kind == "vllm":
            assert "KV use 25.0000% (started at 0.0000%)" in note, note
        threading.Timer(0.2, lambda: load.update(kv=0.0)).start()
        ok, last, note = wait_drained(server.endpoint, baseline, deadline_s=DEADLINE_S, poll_s=0.02)
        assert ok and last.running == 0 and note.startswith("drained:"), note
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_without_status_says_so():
    server = FakeServer({"/slots": not_supported, "/metrics": lambda: (200, "text/plain", "# nothing here\n")})
    try:
        assert server_state(server.endpoint) is None
        ok, last, note = wait_drained(server.endpoint, None, deadline_s=1, poll_s=0.05)
        assert (ok, last, note) == (False, None, NO_STATUS)
        assert "server exposes no status" in note
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("fault", [None, "abort-leaks-blocks"])
def test_validate_fails_a_server_that_does_not_drain_after_hang_ups(tiny_model, fault):
    """Board validation checks the drain after its run: hang-ups that leak KV fail the run. Seed 0 hangs
    up two long answers ~70 tokens before their end, so the server is still running them when the
    client leaves (a hang-up a few tokens from the end may come after the server finished: no abort).
    No variants: a variant asks for at most 32 tokens, and one of those two answers, sent as one, left a
    single far hang-up, too few to rely on under load."""
    from refengine.check.golden import read_golden
    from refengine.data import shipped
    from refengine.validate.board import Cases, validate
    from refengine.validate.plan import Settings

    server = OpenAIServer(tiny_model, EngineConfig(max_num_seqs=4, fault=fault), host="127.0.0.1")
    server.start()
    try:
        report = validate(server.url, Cases.of_golden(read_golden(shipped("golden", "tiny-random.jsonl"))),
                          Settings(concurrency=4, cancel_rate=0.5, seed=0, variant_rate=0))
    finally:
        server.close()
    aborts = report["drain"]["aborts"]
    assert report["summary"]["cancelled"] > 0 and report["drain"]["checked"] and aborts["must"] + aborts["unproven"]
    assert report["drain"]["drained"] is (fault is None)
    assert report["summary"]["passed"] is (fault is None), report["drain"]


def test_refengine_reports_slots_aborts_and_steps_and_drain_reads_them(tiny_model):
    """validate.drain reads in_flight, slots_used, requests_aborted, ended requests and steps from
    /admin/api/status and /metrics alike; a busy engine is not idle, so the drain waits it out, and
    after the hang-up it drains with the abort counted."""
    server = OpenAIServer(tiny_model, LOAD_ENGINE, host="127.0.0.1", max_waiting=3)
    server.start()
    endpoint = Endpoint(server.url, DEADLINE_S)
    hold = threading.Event()
    client = threading.Thread(target=stream_for_a_while, args=(server.url, hold))
    try:
        baseline = server_state(endpoint)
        assert (baseline.in_flight, baseline.slots_used, baseline.aborted, baseline.ended) == (0, 0, 0, 0)
        assert baseline.steps == 0
        client.start()
        wait_until(lambda: server_state(endpoint).steps > 0, "the load to run")
        for path in ("/admin/api/status", "/metrics"):
            state = read_source(endpoint, path)
            assert (state.in_flight, state.slots_used, state.aborted, state.ended) == (1, 1, 0, 0), state
            assert state.steps > 0
        ok, last, note = wait_drained(endpoint, baseline, deadline_s=0.3, poll_s=0.01, idle_s=0.05)
        assert not ok and (last.in_flight, last.slots_used, last.running) == (1, 1, 1), note
        hold.set()  # the client hangs up
        ok, last, note = wait_drained(endpoint, baseline, deadline_s=DEADLINE_S, poll_s=0.01, idle_s=1.0)
        assert ok and (last.in_flight, last.slots_used, last.aborted, last.ended) == (0, 0, 1, 1), note
        assert read_source(endpoint, "/metrics").ended == 1
    finally:
        hold.set()
        client.join(DEADLINE_S)
        server.close()


def test_drain_reads_vllm_aborts_and_engine_steps():
    load = {"running": 1, "waiting": 0, "kv": 0.5, "aborted": 3, "steps": 40}
    server = FakeServer({"/metrics": lambda: vllm_metrics(load)})
    try:
        state = server_state(server.endpoint)
        assert (state.aborted, state.steps, state.in_flight, state.slots_used) == (3, 40, None, None)
        assert state.ended == 7 + 3  # every finished_reason, the aborts among them
    finally:
        server.shutdown()
        server.server_close()
