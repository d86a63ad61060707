"""`refengine validate`: the margin rule on real golden data (token ids and text alignment), the
random schedule, and end to end over real HTTP against `refengine serve`, healthy and faulty."""
from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from refengine.check.golden import read_golden
from refengine.check.margin_rule import judge_ids, judge_text
from refengine.cli import main
from refengine.data import shipped
from refengine.engine import FAULTS
from refengine.errors import RefengineError
from refengine.validate.plan import Settings, plan

GOLDEN = shipped("golden", "tiny-random.jsonl")
DEADLINE_S = 60
FAULT = "kv-write-block-boundary-off-by-one"  # corrupts every answer past one KV block, batched or not


@pytest.fixture(scope="module")
def golden():
    return read_golden(GOLDEN)


# --- the margin rule by token ids -----------------------------------------------------------------
def test_ids_equal_to_golden_match(golden):
    for case in golden.cases:
        verdict = judge_ids(case, case.token_ids, case.text, golden.tolerance)
        assert verdict.kind == "match" and verdict.compared_by == "token_ids"


def test_ids_flipped_at_a_near_tie_are_explained_only_within_tolerance(golden):
    case, step = min(((c, s) for c in golden.cases for s in range(len(c.token_ids))), key=lambda cs: cs[0].margins[cs[1]])
    runner_up = case.top_logprobs[step][1][0]
    got = case.token_ids[:step] + [runner_up] + [0] * 5  # whatever follows a flip is not compared
    explained = judge_ids(case, got, "", tolerance=case.margins[step])
    assert (explained.kind, explained.index, explained.want, explained.got) == \
        ("explained", step, case.token_ids[step], runner_up)
    assert explained.margin == case.margins[step]
    assert judge_ids(case, got, "", tolerance=case.margins[step] * 0.99).kind == "diverged"


def test_ids_longer_or_shorter_than_golden_diverge(golden):
    case = golden.cases[0]
    longer = judge_ids(case, case.token_ids + [7], case.text, tolerance=1e9)
    assert (longer.kind, longer.index, longer.margin, longer.got) == ("diverged", len(case.token_ids), None, 7)
    shorter = judge_ids(case, case.token_ids[:-1], case.text, tolerance=0.0)
    assert (shorter.kind, shorter.index, shorter.got) == ("diverged", len(case.token_ids) - 1, None)


# --- the margin rule by text alignment ------------------------------------------------------------
def test_text_equal_to_golden_matches(golden):
    for case in golden.cases:
        assert judge_text(case, case.text, golden.tolerance).kind == "match"


def test_text_beyond_the_golden_answer_diverges(golden):
    case = golden.cases[0]
    verdict = judge_text(case, case.text + "more", tolerance=1e9)
    assert (verdict.kind, verdict.index, verdict.margin) == ("diverged", len(case.token_ids), None)


def visible_steps(golden):
    """(case, step) where the step's token settles text of its own, as does the one before it."""
    return [(c, s) for c in golden.cases for s in range(1, len(c.token_ids)) if c.piece(s) and c.piece(s - 1)]


def test_text_changed_at_a_token_diverges_at_that_token(golden):
    case, step = max(visible_steps(golden), key=lambda cs: cs[0].margins[cs[1]])
    settled = case.text_before(step)
    other = "#" if case.text[len(settled)] != "#" else "$"
    verdict = judge_text(case, settled + other + "tail", tolerance=golden.tolerance)
    assert (verdict.kind, verdict.index, verdict.compared_by) == ("diverged", step, "text")
    assert verdict.want_text.startswith(case.piece(step)) and verdict.got_text == other + "tail"
    explained = judge_text(case, settled + other, tolerance=case.margins[step])
    assert (explained.kind, explained.index) == ("explained", step)


def test_text_divergence_can_be_blamed_on_a_token_that_showed_no_text(golden):
    """A token holding half a UTF-8 character shows nothing; if the text parts at the next visible
    token, the flip may have happened at either, so a near-tie at the silent one explains it."""
    candidates = [(c, s) for c in golden.cases for s in range(1, len(c.token_ids) - 1)
                  if not c.piece(s) and c.piece(s - 1) and c.token_ids[s] not in golden.header["generation"]["eos_token_ids"]]
    assert candidates, "the tiny model's golden data has no token that settled no text"
    case, silent = candidates[0]
    visible = next(s for s in range(silent + 1, len(case.token_ids)) if case.piece(s))
    got = case.text_before(silent) + "#"
    assert not case.text.startswith(got)
    blamed = judge_text(case, got, tolerance=case.margins[silent])
    assert (blamed.kind, blamed.index) == ("explained", silent)
    strict = min(case.margins[silent:visible + 1]) * 0.99
    assert (judge_text(case, got, strict).kind, judge_text(case, got, strict).index) == ("diverged", visible)


# --- the schedule --------------------------------------------------------------------------------
def test_schedule_is_seeded_and_mixes_streaming_cancels_and_apis(golden):
    settings = Settings(seed=5, cancel_rate=0.3, repeat=4)
    planned = plan(golden.cases, settings, 1.0)
    assert planned == plan(golden.cases, settings, 1.0)
    assert planned != plan(golden.cases, Settings(seed=6, cancel_rate=0.3, repeat=4), 1.0)
    assert len(planned) == 4 * len(golden.cases) and len({p.id for p in planned}) == len(planned)
    cancelled = [p for p in planned if p.cancel_after is not None]
    assert cancelled and all(p.stream and 1 <= p.cancel_after < len(p.case.token_ids) for p in cancelled)
    whole = [p for p in planned if p.cancel_after is None]
    assert {p.stream for p in whole} == {True, False}
    assert {p.api for p in planned} == {"chat", "completions"}
    assert all((p.api == "chat") == bool(p.case.messages) for p in planned)
    assert [p.arrival_s for p in planned] == sorted(p.arrival_s for p in planned)


def test_chat_only_api_refuses_a_raw_prompt_case(golden):
    with pytest.raises(RefengineError, match="raw text prompt"):
        plan(golden.cases, Settings(api="chat"), 1.0)


# --- end to end over HTTP -------------------------------------------------------------------------
def wait_until(condition, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def get_json(url: str, path: str):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    except OSError:
        return None, None
    finally:
        conn.close()


@pytest.fixture
def serve(tiny_model_dir):
    """Start `refengine serve` on a free 127.0.0.1 port; yields its URL once /health answers."""
    yield from serving(tiny_model_dir)


def serving(model_dir):
    """The body of a `serve` fixture for the model in `model_dir`: start(*args, fault=None) -> URL."""
    processes = []

    def start(*args, fault=None):
        env = {**os.environ, "REFENGINE_FAULT": fault} if fault else None
        process = subprocess.Popen(
            [sys.executable, "-m", "refengine", "serve", "--model", str(model_dir), "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        processes.append(process)
        line = process.stdout.readline()
        assert line.startswith("serving http://127.0.0.1:"), line + process.stderr.read()
        url = line.split()[1]
        wait_until(lambda: get_json(url, "/health")[0] == 200, "/health")
        return url

    yield start
    for process in processes:
        process.terminate()
        process.wait(DEADLINE_S)
        process.stdout.close()
        process.stderr.close()


@pytest.mark.parametrize("mode", ["fast", "invariant"])
@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_validate_passes_against_refengine_serve(serve, tmp_path, mode, max_num_seqs, capsys):
    url = serve("--mode", mode, "--max-num-seqs", str(max_num_seqs))
    report_path = tmp_path / "report.json"
    code = main(["validate", "--url", url, "--golden", str(GOLDEN), "--concurrency", "8", "--seed", "3",
                 "--cancel-rate", "0.3", "--repeat", "2", "--arrival-spread", "0.5", "--report", str(report_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(report_path.read_text())
    summary, requests = report["summary"], report["requests"]
    assert summary["passed"] and summary["diverged"] == summary["error"] == 0
    assert summary["cancelled"] > 0 and summary["match"] > 0
    compared = [r for r in requests if r["verdict"] in ("match", "explained")]
    assert {r["streamed"] for r in compared} == {True, False}
    assert {r["compared_by"] for r in compared} == {"token_ids"}
    assert len(requests) == 2 * len(read_golden(GOLDEN).cases)
    assert report["settings"]["tolerance"] == read_golden(GOLDEN).tolerance  # the calibrated bound by default
    assert report["dialect"] == {  # refengine's own dialect: ids in the answer's fields, logprobs when asked
        "return_token_ids": "sent", "cache_salt": "sent", "no_done_marker": False, "streams_without_done": 0,
        "probe_requests": 2, "surface_requests": 17,  # a plain answer and each logits processor per API, prompt
        # logprobs and n on both, echo on completions
        "resent": 0, "apis": {api: {"token_ids_from": "token_ids", "logprobs_requested": True, "logprobs": True,
                                    "prompt_token_ids": True} for api in ("chat", "completions")}}
    assert "-> PASS" in out

    wait_until(lambda: get_json(url, "/admin/api/status")[1]["in_flight"] == 0, "every request to leave")
    status = get_json(url, "/admin/api/status")[1]
    assert status["running"] == status["waiting"] == status["kv_blocks_used"] == 0
    lone = report["drain"]["aborts"]["alone"]  # the longest answer, hung up alone before the load
    assert lone["ok"] and lone["must"] == [lone["id"]] and lone["counted"] == 1
    assert status["requests_aborted"] == report["drain"]["aborts"]["counted"] + 1  # the load's aborts are its own
    assert status["requests_finished"] + status["requests_aborted"] == status["requests_total"] == \
        len(requests) + report["dialect"]["probe_requests"] + report["dialect"]["surface_requests"] + \
        len(report["alone"]) + 1  # + probes, the surface probe, alone, lone
    assert status["requests_aborted"] <= summary["cancelled"] + 1  # a hang-up can come after the last token
    assert (status["max_batch_active"] > 1) == (max_num_seqs > 1)


def test_validate_fails_against_a_server_with_a_fault(serve, tmp_path, capsys):
    assert FAULT in FAULTS
    url = serve("--max-num-seqs", "8", fault=FAULT)
    report_path = tmp_path / "report.json"
    code = main(["validate", "--url", url, "--golden", str(GOLDEN), "--concurrency", "8", "--cancel-rate", "0",
                 "--report", str(report_path), "--repro", str(tmp_path / "repro.json")])
    out = capsys.readouterr().out
    assert code == 1, out
    report = json.loads(report_path.read_text())
    assert not report["summary"]["passed"] and report["summary"]["diverged"] > 0
    diverged = [r for r in report["requests"] if r["verdict"] == "diverged"]
    assert all(r["margin"] is None or r["margin"] > report["settings"]["tolerance"] for r in diverged)
    assert all(r["expected"] != r["got"] for r in diverged)
    first = diverged[0]
    assert f"{first['id']}: diverged at generated token {first['step']}\n  got token {first['got']}, golden token " \
           f"{first['expected']}" in out
    assert "-> FAIL" in out


def test_a_speculating_server_is_held_to_the_same_model_served_without_speculation(serve, tmp_path, capsys):
    """--baseline-url: the alone answers from the model served without speculation; the speculating server
    passes, counting drafts, and one that verifies each draft against the next row fails, though its own
    alone answers agree with its loaded ones (it is wrong the same way alone)."""
    plain = serve("--mode", "invariant")
    args = ["validate", "--golden", str(GOLDEN), "--baseline", "serial", "--baseline-url", plain, "--batch-invariant",
            "--concurrency", "8", "--cancel-rate", "0", "--seed", "1"]
    speculating = serve("--mode", "invariant", "--speculative", "ngram:3")
    report_path = tmp_path / "report.json"
    assert main([*args, "--url", speculating, "--report", str(report_path)]) == 0, capsys.readouterr().out
    report = json.loads(report_path.read_text())
    assert report["baseline_url"] == plain and report["summary"]["passed"] and report["summary"]["match"] > 0
    assert get_json(speculating, "/admin/api/status")[1]["spec_decode_accepted_tokens"] > 0
    faulty = serve("--mode", "invariant", "--speculative", "ngram:3", fault="draft-compared-one-row-late")
    assert main([*args, "--url", faulty, "--report", str(report_path)]) == 1
    assert json.loads(report_path.read_text())["summary"]["diverged"] > 0
    assert main([*args[:5], *args[7:], "--url", faulty]) == 0  # its own alone answers are wrong the same way


def test_requests_the_server_refuses_are_errors_and_fail_validation(serve, tmp_path, capsys):
    url = serve("--max-model-len", "64")  # the long cases' prompt + max_tokens do not fit
    report_path = tmp_path / "report.json"
    code = main(["validate", "--url", url, "--golden", str(GOLDEN), "--cancel-rate", "0", "--report", str(report_path),
                 "--repro", str(tmp_path / "repro.json"), "--variant-rate", "0"])  # a variant asks for fewer tokens
    assert code == 1
    errors = {r["case"]: r["error"] for r in json.loads(report_path.read_text())["requests"] if r["verdict"] == "error"}
    too_long = {c.id for c in read_golden(GOLDEN).cases if len(c.prompt_ids) + c.max_tokens > 64}
    assert set(errors) == too_long and all("HTTP 400" in e for e in errors.values())
    assert "-> FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("flag, value", [("--concurrency", "0"), ("--cancel-rate", "1"), ("--margin-tolerance", "-1"),
                                         ("--url", "ftp://127.0.0.1:1"), ("--golden", "no-such-file.jsonl"),
                                         ("--baseline-url", "http://127.0.0.1:2")])  # the golden baseline is its own
def test_bad_arguments_are_usage_errors(flag, value, capsys):
    args = {"--url": "http://127.0.0.1:1", "--golden": str(GOLDEN), flag: value}
    assert main(["validate", *[x for kv in args.items() for x in kv]]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and (flag in err or value in err)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_server_is_a_usage_error(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["validate", "--url", url, "--golden", str(GOLDEN)]) == 2
    captured = capsys.readouterr()
    assert len(captured.err.splitlines()) == 1 and url in captured.err and captured.out == ""


# --- a hang-up after the server had sent the rest ---------------------------------------------------
def test_a_hang_up_counts_what_the_server_had_already_sent():
    """A server writes ahead of a slow reader. A client that hangs up after reading one token chunk
    counts the chunks that had already arrived and whether the answer's end was among them, and abort
    accounting holds the server only to the tokens it had not yet sent. Here a real HTTP server on
    127.0.0.1 writes its whole stream in one write, then holds the connection until the test ends."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from refengine.validate.client import Endpoint
    from refengine.validate.load import tokens_to_come

    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            chunk = {"choices": [{"index": 0, "text": "a", "token_ids": [7], "finish_reason": None}]}
            events = [chunk] * body["sent"]
            if body["ends"]:
                events.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + ("data: [DONE]\n\n" if body["ends"] else "")
            self.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + stream.encode())
            self.wfile.flush()
            release.wait(DEADLINE_S)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = Endpoint(f"http://127.0.0.1:{server.server_address[1]}", DEADLINE_S)
    try:
        whole = endpoint.complete("/v1/completions", {"prompt": "x", "stream": True, "sent": 50, "ends": True}, 1)
        part = endpoint.complete("/v1/completions", {"prompt": "x", "stream": True, "sent": 10, "ends": False}, 1)
    finally:
        release.set()
        server.shutdown()
        server.server_close()
    assert whole.cancelled and whole.token_ids == [7] and whole.unread == (49, True)
    assert part.cancelled and part.token_ids == [7] and part.unread == (9, False)
    records = [{"tokens": 1, "unread_tokens": c.unread[0], "unread_end": c.unread[1]} for c in (whole, part)]
    assert [tokens_to_come(r, 60) for r in records] == [0, 50]
    assert tokens_to_come({"tokens": None}, 60) is None and tokens_to_come({"tokens": 3}, None) is None


@pytest.mark.parametrize("source", ["golden", "prompts"])
def test_a_quarter_of_the_load_goes_as_variants_drawn_apart_and_a_refused_one_as_its_case(source):
    """Against a golden file and a prompt set (no answer known: a hang-up is drawn from max_tokens, which a
    variant cuts to 32)."""
    from refengine.check.golden import load_prompts, read_golden
    from refengine.data import shipped
    from refengine.validate.plan import Settings, plan
    cases = read_golden(shipped("golden/tiny-random.jsonl")).cases if source == "golden" else \
        load_prompts(shipped("golden/prompts/seed-experiment.jsonl"))
    assert max(c.max_tokens for c in cases) > 32
    plain = plan(cases, Settings(variant_rate=0.0, repeat=8, cancel_rate=0.9), 2.0)
    mixed = plan(cases, Settings(repeat=8, cancel_rate=0.9), 2.0)
    strip = [(p.arrival_s, p.stream, p.cache, p.api) for p in plain]
    assert strip == [(p.arrival_s, p.stream, p.cache, p.api) for p in mixed]  # no other draw moved
    for p, q in zip(plain, mixed):  # the hang-up point too, cut to a variant's shorter answer
        cut = None if p.cancel_after is None else min(p.cancel_after, max(1, q.case.max_tokens - 1))
        assert q.cancel_after == cut
    assert any(q.cancel_after and q.cancel_after < p.cancel_after for p, q in zip(plain, mixed))  # one was cut
    drawn = [p for p in mixed if "+" in p.case.id]
    kinds = {"penalties", "prompt-logprobs", "n"} | ({"bias"} if source == "golden" else set())  # bias: on the answer
    assert 0.15 < len(drawn) / len(mixed) < 0.35 and {p.case.variant for p in drawn} == kinds
    assert all(p.id.split("#")[0] == p.case.id and p.case.base in cases for p in drawn)
    refused = frozenset((p.case.id, p.api) for p in drawn if p.case.variant == "n")
    again = plan(cases, Settings(repeat=8, cancel_rate=0.9), 2.0, refused=refused)
    assert [p.case.id for p in again] == [p.case.base.id if (p.case.id, p.api) in refused else p.case.id for p in mixed]


def test_only_a_variants_4xx_alone_is_a_refusal():
    from refengine.validate.board import refused_variants
    records = [{"case": "a+n", "api": "chat", "variant": "n", "verdict": "error", "error": "n", "status": 422},
               {"case": "a+bias", "api": "chat", "variant": "bias", "verdict": "error", "error": "boom", "status": 500},
               {"case": "a+penalties", "api": "chat", "variant": "penalties", "verdict": "error", "error": "reset"},
               {"case": "a", "api": "chat", "verdict": "error", "error": "bad", "status": 400},
               {"case": "a+n", "api": "completions", "variant": "n", "verdict": "answered"}]
    assert refused_variants(records) == {("a+n", "chat"): "n"}


def test_the_report_counts_each_variants_verdicts_and_names_the_refused_ones():
    from refengine.validate.board import variant_report
    from refengine.validate.report import format_variants
    requests = [{"variant": "n", "verdict": "match"}, {"variant": "n", "verdict": "diverged"}, {"verdict": "match"},
                {"variant": "n", "verdict": "match"}, {"variant": "bias", "verdict": "cancelled"}]
    report = variant_report(requests, {("a+prompt-logprobs", "chat"): "HTTP 422: no"}, 0.25)
    assert report == {"rate": 0.25, "sent": {"n": {"match": 2, "diverged": 1}, "bias": {"cancelled": 1}},
                      "refused": {"a+prompt-logprobs@chat": "HTTP 422: no"}}
    assert format_variants(report) == [
        "variants (rate 0.25, each judged against its own alone answer): bias 1 (1 cancelled); "
        "n 3 (1 diverged, 2 match)",
        "note: variant a+prompt-logprobs@chat refused alone, sent as its case: HTTP 422: no"]
