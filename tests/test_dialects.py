"""`refengine validate` against servers that speak other dialects than refengine's own: a real HTTP
server (stdlib http.server on 127.0.0.1, in a thread) answers from the shipped golden file the way
vLLM, llama.cpp and HF `transformers serve` do — ids in other places or none at all, no [DONE], a
trailing incomplete character held back — and validate must judge every answer, not the dialect. A
server that answers from a golden file cannot apply logits processors, prompt logprobs, echo or n: these
refuse them by name (HF's refuses every field it does not know), which the surface probe records as
refused. Like the real one, the HF dialect writes the special tokens an answer generates into its text."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from refengine.check.golden import read_golden
from refengine.check.margin_rule import judge_text
from refengine.cli import main
from refengine.data import shipped
from refengine.sampling import PROCESSOR_KEYS
from refengine.validate.board import Cases, validate
from refengine.validate.client import ServerError
from refengine.validate.dialect import names
from refengine.validate.plan import Settings
from refengine.validate.surface import server_failed, surface_notes

GOLDEN = shipped("golden", "tiny-random.jsonl")
HF_KEYS = {"model", "messages", "prompt", "max_tokens", "temperature", "stream"}  # what HF serve accepts here
TOKEN_S = 0.002  # the fake server's decode step: answers take time, so requests overlap as on a real server
EXTRA = {"system_fingerprint": "fp-1", "service_tier": None, "kv_transfer_params": {"x": [1]}}  # unknown fields


@pytest.fixture(scope="module")
def golden():
    return read_golden(GOLDEN)


def unsettled_from(case) -> int:
    """The first of the golden tokens at the end whose text is only the flush of an incomplete character."""
    tail = len(case.token_ids)
    if case.text.endswith("\ufffd"):
        tail -= 1
        while tail and not case.piece(tail - 1):
            tail -= 1
    return tail


class Answer:
    """A golden case cut to the request's max_tokens: ids, the text piece each token shows, finish reason."""

    def __init__(self, case, max_tokens: int, hold_back: bool, specials: dict[int, str]):
        n = min(max_tokens, len(case.token_ids))
        self.ids = case.token_ids[:n]
        self.finish = case.finish_reason if n == len(case.token_ids) else "length"
        stopped = n if self.finish == "length" else n - 1  # the eos it stopped on is not written
        self.pieces = [specials[t] if t in specials and i < stopped else case.piece(i) for i, t in enumerate(self.ids)]
        if hold_back and n == len(case.token_ids) and unsettled_from(case) < n:
            self.pieces[-1] = ""  # the incomplete character at the end is never sent
        self.prompt_ids = case.prompt_ids


def dialect_server(golden, dialect: str):
    """A ThreadingHTTPServer answering /v1/models and both completion APIs in `dialect`."""
    cases, broken = golden.cases, []

    def find(api, body):
        for case in cases:
            if api == "chat" and case.messages == body.get("messages"):
                return case
            if api == "completions" and body.get("prompt") in (case.prompt, case.prompt_ids):
                return case
        raise LookupError(body)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, status: int, obj: dict):
            raw = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            self.reply(200, {"object": "list", "data": [{"id": f"{dialect}-model", "object": "model", **EXTRA}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            api = "chat" if self.path.endswith("/chat/completions") else "completions"
            if dialect == "hf":  # transformers serve refuses what it does not know, by name
                unexpected = set(body) - HF_KEYS - {"logprobs", "top_logprobs", "stream_options"}
                unused = set(body) & {"logprobs", "top_logprobs", "stream_options"}
                if unexpected or unused:
                    what = "Unexpected keys" if unexpected else "Unsupported fields"
                    return self.reply(422, {"detail": f"{what} in the request: {unexpected or unused}"})
            if dialect == "breaks-on-n" and (broken or body.get("n", 1) > 1):  # an engine that dies on a fork
                broken.append(True)
                return self.reply(500, {"error": {"message": "engine failed: AssertionError()"}})
            if dialect == "500-on-n" and body.get("n", 1) > 1:  # llama.cpp's refusal of n != 1
                return self.reply(500, {"error": {"code": 500, "message": "Only one completion choice is allowed",
                                                  "type": "server_error"}})
            processors = sorted(set(body) & {*PROCESSOR_KEYS, "prompt_logprobs", "echo", "n"})
            if processors and dialect != "hf":  # it answers from a golden file: it cannot apply them, so it says so
                return self.reply(400, {"error": {"message": f"{processors[0]}: not supported by this test server"}})
            answer = Answer(find(api, body), body.get("max_tokens", 16), hold_back=dialect in ("held-back", "hf"),
                            specials=golden.special_tokens if dialect == "hf" else {})  # HF writes them
            logprobs = body.get("logprobs") and (api == "completions" or body.get("top_logprobs"))
            if body.get("stream"):
                return self.stream(api, body, answer, bool(logprobs))
            time.sleep(TOKEN_S * len(answer.ids))
            choice = {"index": 0, "finish_reason": answer.finish, "logprobs": None, **EXTRA}
            text = "".join(answer.pieces)
            choice |= {"message": {"role": "assistant", "content": text}} if api == "chat" else {"text": text}
            top = {"id": "x", "object": "chat.completion", "model": "m", "choices": [choice],
                   "usage": {"completion_tokens": len(answer.ids)}}
            self.add_ids(api, body, choice, top, answer.ids, bool(logprobs), answer, first=True)
            self.reply(200, top)

        def add_ids(self, api, body, choice, top, ids, logprobs, answer, first):
            if dialect == "vllm" and body.get("return_token_ids"):
                choice["token_ids"] = ids
                if first:
                    (top if api == "chat" else choice)["prompt_token_ids"] = answer.prompt_ids
            if dialect == "llamacpp" and logprobs and ids:
                choice["logprobs"] = {"content": [{"id": i, "token": "?", "logprob": -0.1, "bytes": [],
                                                   "top_logprobs": []} for i in ids]}

        def stream(self, api, body, answer, logprobs):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()  # HTTP/1.0: the body ends when the connection closes
            try:
                for i, (token, piece) in enumerate(zip(answer.ids, answer.pieces)):
                    time.sleep(TOKEN_S)
                    if dialect == "broken" and i == 2:
                        return  # closes mid-answer: no finish_reason, no [DONE]
                    last = i == len(answer.ids) - 1
                    choice = {"index": 0, "finish_reason": answer.finish if last and dialect != "llamacpp" else None}
                    choice |= {"delta": {"content": piece}} if api == "chat" else {"text": piece}
                    chunk = {"id": "x", "object": "chunk", "choices": [choice], **EXTRA}
                    self.add_ids(api, body, choice, chunk, [token], logprobs, answer, first=i == 0)
                    self.send_event(chunk)
                if dialect == "llamacpp":  # the finish_reason comes alone, in an empty delta
                    self.send_event({"choices": [{"index": 0, "finish_reason": answer.finish, "delta": {}}]})
                    if body.get("stream_options", {}).get("include_usage"):
                        self.send_event({"choices": [], "usage": {"completion_tokens": len(answer.ids)}})
                if dialect != "hf":  # HF serve ends the stream after the finish_reason chunk
                    self.wfile.write(b"data: [DONE]\n\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client hung up mid-stream

        def send_event(self, obj):
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@pytest.fixture
def serve(golden):
    servers = []

    def start(dialect: str) -> str:
        server = dialect_server(golden, dialect)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def run(url, golden, cancel_rate=0.0, seed=2):
    return validate(url, Cases.of_golden(golden), Settings(concurrency=4, seed=seed, cancel_rate=cancel_rate, timeout=30))


def compared(report):
    return [r for r in report["requests"] if r["verdict"] not in ("cancelled",)]


@pytest.mark.parametrize("dialect, compared_by", [("vllm", "token_ids"), ("llamacpp", "token_ids"),
                                                  ("hf", "text"), ("held-back", "text")])
def test_every_answer_matches_whatever_the_dialect(serve, golden, dialect, compared_by):
    report = run(serve(dialect), golden, cancel_rate=0.2)
    records = compared(report)
    assert report["summary"]["passed"], [r for r in records if r["verdict"] != "match"]
    assert {r["verdict"] for r in records} == {"match"}
    assert {r["compared_by"] for r in records} == {compared_by}
    assert {r["streamed"] for r in records} == {True, False}
    assert report["summary"]["cancelled"] > 0
    if dialect != "hf":  # these refuse every variant by name (a 400): each went as its case, sent alone too
        refused = report["variants"]["refused"]
        assert refused and not report["variants"]["sent"] and not report["summary"]["alone_errors"]
        assert {key.split("+")[0] for key in refused} <= {r["case"] for r in report["alone"] if r["verdict"] == "match"}


def test_vllm_ids_come_with_return_token_ids_and_prompt_ids_are_checked(serve, golden):
    report = run(serve("vllm"), golden)
    d = report["dialect"]
    assert d["return_token_ids"] == "sent" and d["probe_requests"] == 2 and not d["no_done_marker"]
    assert d["apis"] == {api: {"token_ids_from": "token_ids", "logprobs_requested": True, "logprobs": False,
                               "prompt_token_ids": True} for api in ("chat", "completions")}
    assert all(r["token_ids"] == next(c for c in golden.cases if c.id == r["case"]).token_ids
               for r in report["requests"])


def test_llamacpp_ids_are_read_from_the_logprobs_asked_for_only_there(serve, golden):
    report = run(serve("llamacpp"), golden)
    d = report["dialect"]
    assert d["probe_requests"] == 2  # one per API: every request asks for logprobs
    assert d["apis"] == {api: {"token_ids_from": "logprobs", "logprobs_requested": True, "logprobs": True,
                               "prompt_token_ids": False} for api in ("chat", "completions")}


def test_hf_serve_refuses_the_extension_fields_and_ends_streams_without_done(serve, golden, capsys, tmp_path):
    url = serve("hf")
    code = main(["validate", "--url", url, "--golden", str(GOLDEN), "--cancel-rate", "0", "--seed", "2",
                 "--repro", str(tmp_path / "repro.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "the server refuses return_token_ids" in out and "without data: [DONE] (accepted as complete)" in out
    assert "chat: the server reports no token ids; answers compared by text" in out
    assert "came with special tokens written in their text (<|im_start|>: a server that does not skip them)" in out
    # every variant drawn is refused by name (422): a note each, no alone error, the case sent instead
    assert "refused alone, sent as its case: /v1/" in out and "\nalone " not in out and "alone_errors" not in out
    report = run(url, golden)
    assert report["dialect"]["return_token_ids"] == "refused" and report["dialect"]["no_done_marker"]
    assert report["dialect"]["apis"]["chat"] == {"token_ids_from": None, "logprobs_requested": False,  # refused
                                                 "logprobs": False, "prompt_token_ids": False}


@pytest.mark.parametrize("dialect", ["breaks-on-n", "500-on-n"])
def test_a_server_broken_by_a_parameter_fails_the_run_and_one_refusing_it_with_a_500_does_not(serve, golden, dialect):
    """An HTTP 500 on `n` after which the server fails every request (its engine died) is the surface probe's
    `failed`, a FINDING; a 500 the server serves on after (llama.cpp's refusal of n != 1) is an `error`, a
    note."""
    report = validate(serve(dialect), Cases.of_golden(golden), Settings(concurrency=4, seed=2, cancel_rate=0.0,
                                                                        timeout=30, variant_rate=0.0))
    surface, notes = report["surface"], "\n".join(surface_notes(report["surface"]))
    assert report["summary"]["diverged"] == report["summary"]["error"] == 0
    if dialect == "breaks-on-n":
        assert surface["chat"]["n"]["verdict"] == "failed" and "then the plain request failed too" in notes
        assert report["summary"]["verdict"] == "FAIL" and "FINDING: chat: the server fails on n (" in notes
    else:
        assert {surface[api]["n"]["verdict"] for api in ("chat", "completions")} == {"error"}
        assert {surface[api]["logit_bias"]["verdict"] for api in surface} == {"refused"}  # a 400 naming it
        assert report["summary"]["verdict"] == "PASS" and "the server answers the plain request after it" in notes


@pytest.mark.parametrize("error, failed", [(ServerError("HTTP 500: engine failed", 500), True),
                                           (ServerError("broken HTTP response", None), True),
                                           (TimeoutError("timed out"), True),
                                           (ServerError("HTTP 400: bad request", 400), False),
                                           (ServerError("HTTP 401: no key", 401), False)])
def test_a_5xx_a_broken_answer_or_none_is_the_servers_failure(error, failed):
    assert server_failed(error) is failed


def test_a_trailing_incomplete_character_held_back_is_unsettled_not_a_divergence(serve, golden):
    held = [c for c in golden.cases if unsettled_from(c) < len(c.token_ids)]
    assert held, "the golden file has no answer ending in an incomplete character"
    report = run(serve("held-back"), golden)
    by_case = {r["case"]: r for r in report["requests"]}
    for case in held:
        record = by_case[case.id]
        assert record["verdict"] == "match" and "settled no text of their own at the end" in record["note"]
        assert not record["text"].endswith("\ufffd")
        replaced = case.text_before(unsettled_from(case)) + "\ufffd"  # a server replacing it: also unsettled
        assert judge_text(case, replaced, golden.tolerance).kind == "match"
    case = held[0]  # other text where the incomplete character was is still a divergence
    wrong = judge_text(case, case.text_before(unsettled_from(case)) + "x", tolerance=0.0)
    assert (wrong.kind, wrong.index) == ("diverged", len(case.token_ids) - 1)


def test_a_stream_closed_before_its_finish_reason_is_an_error(serve, golden):
    report = run(serve("broken"), golden)
    streamed = [r for r in report["requests"] if r["streamed"]]
    long = [r for r in streamed if len(next(c for c in golden.cases if c.id == r["case"]).token_ids) > 2]
    assert long and all(r["verdict"] == "error" and "without a finish_reason" in r["error"] for r in long)
    assert all(r["verdict"] == "match" for r in report["requests"] if not r["streamed"])
    assert not report["summary"]["passed"]


def test_logprob_ids_a_stream_left_out_are_set_aside_not_judged():
    """llama.cpp streams no logprobs for a token that completed no character: the usage count shows it."""
    from refengine.validate.wire import Stream
    stream = Stream()
    for piece, ids in (("a", [5]), ("b", [6])):
        stream.add({"choices": [{"index": 0, "delta": {"content": piece}, "logprobs": {"content": [{"id": i} for i in ids]},
                                 "finish_reason": None, "unknown": {"nested": [None]}}]})
    stream.add({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    stream.add({"choices": [], "usage": {"completion_tokens": 3}})
    completion = stream.completion(cancelled=False, done_marker=True)
    assert completion.text == "ab" and completion.token_ids is None and "usage.completion_tokens 3" in completion.note


@pytest.mark.parametrize("case_id, reported, accepted", [
    ("capital-japan", "length", True),      # stopped on its max_tokens-th token: both reasons hold
    ("capital-japan", "stop", True),
    ("capital-japan", "eos", False),
    ("favourite-colour", "length", False),  # stopped one token short of max_tokens: length is wrong
    ("green-thing", "stop", False),         # ran to max_tokens without a stop: stop is wrong
    ("capital-japan", None, False)])
def test_a_stop_on_the_last_allowed_token_may_be_reported_as_length(case_id, reported, accepted):
    from refengine.validate.baseline import GoldenBaseline
    from refengine.validate.client import Completion
    from refengine.validate.plan import Planned

    golden = read_golden(shipped("golden", "tiny-chat.jsonl"))
    case = next(c for c in golden.cases if c.id == case_id)
    answer = Completion(case.text, list(case.token_ids), None, reported, False)
    fields = GoldenBaseline(golden, golden.tolerance).judge(Planned("r0", case, "chat", 0.0, False, None), answer)
    assert (fields["verdict"] == "match") is accepted, fields
    other_name = accepted and reported != case.finish_reason
    assert fields.get("finish_reason_at_max_tokens") == (reported if other_name else None)


@pytest.mark.parametrize("message, field, named", [
    ("prompt_logprobs: not supported", "logprobs", False),
    ("logprobs: not supported", "logprobs", True),
    ("Unexpected keys in the request: {'logprobs'}", "logprobs", True),
    ("top_logprobs must be <= 20", "logprobs", False),
    ("bad return_token_ids_v2", "return_token_ids", False),
    ("cache_salt", "cache_salt", True),
])
def test_a_refusal_names_a_field_only_as_a_word_of_its_own(message, field, named):
    assert names(message, field) is named
