"""The OpenAI-compatible server over real sockets on 127.0.0.1: answers equal the serial engine's,
streaming equals non-streaming, SSE framing, logprobs, 64 clients that come and go, 503 when full,
4xx for bad requests, and the `refengine serve` command."""
from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from refengine.engine import EngineConfig, LLMEngine
from refengine.model import load_model
from refengine.sampling import SamplingParams
from refengine.serve import OpenAIServer
from refengine.serve.handler import peek_empty, peer_closed

DEADLINE_S = 30
MAX_BODY = 64 * 1024
SAMPLING_KEYS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos", "stop", "stop_token_ids")

CAPITAL = {"messages": [{"role": "user", "content": "What is the capital of Japan?"}], "max_tokens": 20}
COLOUR = {"messages": [{"role": "user", "content": "What is your favourite colour?"}], "max_tokens": 24,
          "temperature": 0.9, "top_p": 0.9, "seed": 11}
STORY = {"prompt": "Once upon a time", "max_tokens": 32, "ignore_eos": True}
IDS_SAMPLED = {"prompt": [5, 9, 13, 200, 77], "max_tokens": 28, "temperature": 0.8, "top_k": 50, "seed": 7}
POOL = [("chat", CAPITAL), ("chat", COLOUR), ("completion", STORY), ("completion", IDS_SAMPLED)]
LONG = {"prompt": "Tell me everything.", "max_tokens": 400, "ignore_eos": True}
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


# --- servers and HTTP ---------------------------------------------------------------------
def wait_until(condition, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        threading.Event().wait(0.01)


def start_server(model, max_waiting=64, queue_timeout=30.0, **engine) -> OpenAIServer:
    server = OpenAIServer(model, EngineConfig(mode="invariant", **engine), max_waiting=max_waiting,
                          queue_timeout=queue_timeout, max_body_bytes=MAX_BODY)
    server.start()
    wait_until(lambda: call(server.url, "GET", "/health")[0] == 200, "/health")
    return server


@pytest.fixture(scope="module")
def server(tiny_model):
    server = start_server(tiny_model, max_num_seqs=8, max_num_batched_tokens=32)
    yield server
    server.close()


def connection(url) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    assert parts.hostname == "127.0.0.1"
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=DEADLINE_S)


def call(url, method, path, body=None, raw: bytes | None = None, headers=None):
    conn = connection(url)
    try:
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def status_of(server) -> dict:
    code, data = call(server.url, "GET", "/admin/api/status")
    assert code == 200
    return json.loads(data)


def parse_sse(raw: bytes) -> list[dict]:
    """Every event is exactly `data: <one line>\\n\\n`; the stream ends with one `data: [DONE]`."""
    frames = raw.decode().split("\n\n")
    assert frames[-1] == "", "the stream must end with a blank line"
    frames = frames[:-1]
    assert frames[-1] == "data: [DONE]" and frames.count("data: [DONE]") == 1
    for frame in frames:
        assert frame.startswith("data: ") and "\n" not in frame, repr(frame)
    return [json.loads(frame[len("data: "):]) for frame in frames[:-1]]


def generate(server, kind: str, body: dict, stream: bool) -> dict:
    """token_ids, text, finish_reason, prompt_token_ids, usage, logprobs: from either response shape."""
    code, raw = call(server.url, "POST", PATHS[kind], {**body, "stream": stream,
                                                       "stream_options": {"include_usage": True}})
    assert code == 200, raw
    if not stream:
        response = json.loads(raw)
        choice = response["choices"][0]
        return {"token_ids": choice["token_ids"], "prompt_token_ids": choice["prompt_token_ids"],
                "text": choice["message"]["content"] if kind == "chat" else choice["text"],
                "finish_reason": choice["finish_reason"], "usage": response["usage"],
                "logprobs": choice["logprobs"]}
    chunks = parse_sse(raw)
    assert len({c["id"] for c in chunks}) == 1
    *token_chunks, usage_chunk = chunks
    choices = [c["choices"][0] for c in token_chunks]
    assert all(len(c["token_ids"]) == 1 for c in choices), "one SSE event per token"
    assert all(c["finish_reason"] is None for c in choices[:-1])
    logprobs = [c["logprobs"] for c in choices]
    return {"token_ids": [i for c in choices for i in c["token_ids"]],
            "prompt_token_ids": choices[0]["prompt_token_ids"],
            "text": "".join(c["delta"]["content"] if kind == "chat" else c["text"] for c in choices),
            "finish_reason": choices[-1]["finish_reason"], "usage": usage_chunk["usage"],
            "logprobs": None if logprobs[0] is None else merge_logprobs(logprobs)}


def merge_logprobs(parts: list[dict]) -> dict:
    return {key: [x for part in parts for x in part[key]] for key in parts[0]}


# --- the oracle: the same request alone in a serial engine ----------------------------------
def prompt_ids_of(model, kind: str, body: dict) -> list[int]:
    if kind == "chat":
        return model.tokenizer.encode_chat(body["messages"])
    prompt = body["prompt"]
    return list(prompt) if isinstance(prompt, list) else model.tokenizer.encode(prompt)


def serial(model, kind: str, body: dict, logprobs: int = 0):
    sampling = {k: body[k] for k in SAMPLING_KEYS if k in body}
    if isinstance(sampling.get("stop"), (str, list)):
        sampling["stop"] = tuple([sampling["stop"]] if isinstance(sampling["stop"], str) else sampling["stop"])
    sampling["stop_token_ids"] = tuple(sampling.get("stop_token_ids", ()))
    sampling.update({k: body[k] for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")
                     if k in body})
    if "logit_bias" in body:
        sampling["logit_bias"] = tuple(sorted((int(k), float(v)) for k, v in body["logit_bias"].items()))
    engine = LLMEngine(model, EngineConfig(mode="invariant", max_num_seqs=1))
    engine.add_request("serial", prompt_ids_of(model, kind, body), params=SamplingParams(**sampling, logprobs=logprobs))
    return engine.run()["serial"]


def assert_matches_serial(got: dict, expected, prompt_ids: list[int]):
    assert got["token_ids"] == expected.token_ids
    assert got["text"] == expected.text
    assert got["finish_reason"] == expected.finish_reason
    assert got["prompt_token_ids"] == prompt_ids
    assert got["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(expected.token_ids),
                            "total_tokens": len(prompt_ids) + len(expected.token_ids)}


# --- answers --------------------------------------------------------------------------------
PROCESSED = [("chat", {**CAPITAL, "frequency_penalty": 2.0, "presence_penalty": -1.0, "repetition_penalty": 1.5}),
             ("completion", {**IDS_SAMPLED, "logit_bias": {"7": 5.0, "13": -100}, "repetition_penalty": 0.5}),
             ("completion", {"prompt": [5, 9, 13], "max_tokens": 8, "min_tokens": 3, "stop_token_ids": [42],
                             "logit_bias": {"42": 100}})]


@pytest.mark.parametrize("kind,body", POOL + PROCESSED, ids=["chat-greedy", "chat-sampled", "text-prompt",
                                                             "id-prompt-sampled", "chat-penalties", "sampled-bias",
                                                             "min-tokens-forced-stop"])
def test_streaming_and_whole_answers_equal_the_serial_engine(server, tiny_model, kind, body):
    expected = serial(tiny_model, kind, body)
    prompt_ids = prompt_ids_of(tiny_model, kind, body)
    whole = generate(server, kind, body, stream=False)
    streamed = generate(server, kind, body, stream=True)
    assert_matches_serial(whole, expected, prompt_ids)
    assert_matches_serial(streamed, expected, prompt_ids)


def test_stop_string_cuts_the_text_as_the_serial_engine_does(server, tiny_model):
    full = serial(tiny_model, "completion", STORY).text
    start = next(i for i in range(len(full) // 3, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    stop = full[start:start + 2]
    body = {**STORY, "stop": [stop, "never-generated"]}
    expected = serial(tiny_model, "completion", body)
    assert expected.finish_reason == "stop" and expected.text == full[:full.index(stop)]
    prompt_ids = prompt_ids_of(tiny_model, "completion", body)
    for stream in (False, True):
        assert_matches_serial(generate(server, "completion", body, stream), expected, prompt_ids)


def test_chat_logprobs_are_the_engine_top_logprobs(server, tiny_model):
    expected = serial(tiny_model, "chat", CAPITAL, logprobs=3)
    for stream in (False, True):
        body = {**CAPITAL, "logprobs": True, "top_logprobs": 3}
        entries = generate(server, "chat", body, stream)["logprobs"]["content"]
        assert [e["token_id"] for e in entries] == expected.token_ids
        for entry, step in zip(entries, expected.steps):
            assert [(t["token_id"], t["logprob"]) for t in entry["top_logprobs"]] == step.top_logprobs
            assert entry["logprob"] == step.top_logprobs[0][1]  # greedy: the chosen token is the top one
            assert bytes(entry["bytes"]).decode() == entry["token"]


def test_completion_logprobs_report_each_token(server, tiny_model):
    expected = serial(tiny_model, "completion", STORY, logprobs=2)
    for stream in (False, True):
        logprobs = generate(server, "completion", {**STORY, "logprobs": 2}, stream)["logprobs"]
        assert logprobs["token_logprobs"] == [s.top_logprobs[0][1] for s in expected.steps]
        assert logprobs["tokens"] == [tiny_model.tokenizer.decode([i], skip_special_tokens=False)
                                      for i in expected.token_ids]
        assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"])
        assert logprobs["text_offset"] == sorted(logprobs["text_offset"])


def test_sampled_tokens_report_their_own_logprob(server, tiny_model):
    """A drawn token is often not among the top alternatives; its logprob is still the log-softmax
    of its own logit in the row it was drawn from."""
    body = {**STORY, "temperature": 1.5, "seed": 3}
    engine = LLMEngine(tiny_model, EngineConfig(mode="invariant", max_num_seqs=1), keep_logits=True)
    engine.add_request("alone", prompt_ids_of(tiny_model, "completion", body),
                       params=SamplingParams(**{k: body[k] for k in SAMPLING_KEYS if k in body}))
    steps = engine.run()["alone"].steps
    rows = [s.logits.astype(np.float64) for s in steps]
    expected = [float(row[s.token_id] - row.max() - np.log(np.exp(row - row.max()).sum())) for row, s in zip(rows, steps)]
    assert any(s.token_id != int(row.argmax()) for row, s in zip(rows, steps))  # some draws are not the top token
    for stream in (False, True):
        logprobs = generate(server, "completion", {**body, "logprobs": 1}, stream)["logprobs"]
        assert logprobs["token_logprobs"] == pytest.approx(expected, rel=1e-12, abs=1e-12)


def prompt_logprobs_of(server, kind: str, body: dict, stream: bool) -> list:
    """The response's vLLM-shaped prompt_logprobs (the first chunk's, streamed)."""
    code, raw = call(server.url, "POST", PATHS[kind], {**body, "stream": stream})
    assert code == 200, raw
    first = json.loads(raw) if not stream else parse_sse(raw)[0]
    return first["prompt_logprobs"] if kind == "chat" else first["choices"][0]["prompt_logprobs"]


@pytest.mark.parametrize("kind,body", [("chat", CAPITAL), ("completion", STORY)], ids=["chat", "completion"])
def test_prompt_logprobs_are_the_float64_ones_in_vllms_shape(server, tiny_model, kind, body):
    """An entry per prompt token, null first; each names the prompt token (with its rank) and the k most likely
    ids (ranks 1..k); the values are the serial engine's bit for bit and the float64 log-softmax of the
    reference's rows within float32 noise (computed here from reference.prompt_logits, not the engine's helpers)."""
    from refengine.reference import prompt_logits
    prompt_ids = prompt_ids_of(tiny_model, kind, body)
    engine = LLMEngine(tiny_model, EngineConfig(mode="invariant", max_num_seqs=1))
    engine.add_request("alone", prompt_ids, params=SamplingParams(max_tokens=1, prompt_logprobs=3))
    expected = engine.run()["alone"].prompt_logprobs
    rows = prompt_logits(tiny_model, prompt_ids)
    f64 = rows - rows.max(axis=1, keepdims=True)
    f64 -= np.log(np.exp(f64).sum(axis=1, keepdims=True))
    for stream in (False, True):
        entries = prompt_logprobs_of(server, kind, {**body, "prompt_logprobs": 3}, stream)
        assert len(entries) == len(prompt_ids) and entries[0] is None
        for position, (entry, want) in enumerate(zip(entries[1:], expected), start=1):
            token = prompt_ids[position]
            own = entry[str(token)]
            assert own["logprob"] == want.logprob and own["rank"] == want.rank
            assert abs(own["logprob"] - f64[position - 1, token]) < 1e-4
            row = f64[position - 1]
            assert 1 + np.sum(row > row[token] + 1e-4) <= own["rank"] <= 1 + np.sum(row > row[token] - 1e-4)
            assert set(entry) == {str(token)} | {str(i) for i, _ in want.top_logprobs} and len(want.top_logprobs) == 3
            assert all(entry[str(i)]["logprob"] == lp for i, lp in want.top_logprobs)
            assert all(v["decoded_token"] == tiny_model.tokenizer.decode([int(k)], skip_special_tokens=False)
                       for k, v in entry.items())
    code, raw = call(server.url, "POST", PATHS[kind], body)
    assert code == 200 and "prompt_logprobs" not in json.loads(raw) and \
        "prompt_logprobs" not in json.loads(raw)["choices"][0]


def test_echo_repeats_the_prompt_and_scores_it_first(server, tiny_model):
    prompt_ids = prompt_ids_of(tiny_model, "completion", STORY)
    expected = serial(tiny_model, "completion", STORY, logprobs=2)
    engine = LLMEngine(tiny_model, EngineConfig(mode="invariant", max_num_seqs=1))
    engine.add_request("alone", prompt_ids, params=SamplingParams(max_tokens=1, prompt_logprobs=2))
    scored = engine.run()["alone"].prompt_logprobs
    for stream in (False, True):
        got = generate(server, "completion", {**STORY, "echo": True, "logprobs": 2}, stream)
        assert got["text"] == STORY["prompt"] + expected.text and got["token_ids"] == expected.token_ids
        logprobs = got["logprobs"]
        pieces = [tiny_model.tokenizer.decode([i], skip_special_tokens=False) for i in prompt_ids + expected.token_ids]
        assert logprobs["tokens"] == pieces
        assert logprobs["token_logprobs"] == [None] + [p.logprob for p in scored] + \
            [s.top_logprobs[0][1] for s in expected.steps]
        assert logprobs["top_logprobs"][0] is None and len(logprobs["top_logprobs"][1]) == 2
        assert logprobs["text_offset"] == sorted(logprobs["text_offset"]) and logprobs["text_offset"][0] == 0
    plain = generate(server, "completion", {**STORY, "echo": True}, stream=False)
    assert plain["text"] == STORY["prompt"] + expected.text and plain["logprobs"] is None


@pytest.mark.parametrize("kind,body", [("chat", COLOUR), ("completion", {**IDS_SAMPLED, "echo": True, "logprobs": 1})],
                         ids=["chat", "completion-echo"])
def test_n_choices_are_the_answers_with_seed_plus_k(server, tiny_model, kind, body):
    """Choice k, whole or streamed, is the serial engine's answer with n 1 and seed + k; usage counts
    every choice's tokens."""
    prompt_ids = prompt_ids_of(tiny_model, kind, body)
    expected = [serial(tiny_model, kind, {**body, "seed": body["seed"] + k}) for k in range(3)]
    assert len({tuple(e.token_ids) for e in expected}) == 3  # three different draws: a shared seed would show
    for stream in (False, True):
        code, raw = call(server.url, "POST", PATHS[kind], {**body, "n": 3, "stream": stream,
                                                           "stream_options": {"include_usage": True}})
        assert code == 200, raw
        if stream:
            chunks = parse_sse(raw)
            choices = {k: [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == k]
                       for k in range(3)}
            assert sum(map(len, choices.values())) == len(chunks) - 1  # and the usage chunk
            usage = chunks[-1]["usage"]
            got = [([i for c in cs for i in c["token_ids"]],
                    "".join(c["delta"]["content"] if kind == "chat" else c["text"] for c in cs),
                    cs[-1]["finish_reason"]) for cs in choices.values()]
        else:
            response = json.loads(raw)
            assert [c["index"] for c in response["choices"]] == [0, 1, 2]
            usage = response["usage"]
            got = [(c["token_ids"], c["message"]["content"] if kind == "chat" else c["text"], c["finish_reason"])
                   for c in response["choices"]]
        echo = body["prompt"] if kind == "completion" and isinstance(body["prompt"], str) else \
            tiny_model.tokenizer.decode(prompt_ids, skip_special_tokens=False) if body.get("echo") else ""
        assert got == [(e.token_ids, echo + e.text, e.finish_reason) for e in expected]
        assert usage["completion_tokens"] == sum(len(e.token_ids) for e in expected)
    # every answer's slot came back: the request's one, once its last answer ended (the snapshot follows the step)
    wait_until(lambda: status_of(server)["in_flight"] == 0 and status_of(server)["slots_used"] == 0, "slots back")


THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n"
                     "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template_as_in_vllm(tmp_path, tiny_model_dir):
    folder = tmp_path / "thinking"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING_TEMPLATE}))
    model = load_model(folder)
    server = start_server(model, max_num_seqs=2)
    try:
        messages = CAPITAL["messages"]
        default = generate(server, "chat", {**CAPITAL, "max_tokens": 2}, stream=False)["prompt_token_ids"]
        for stream in (False, True):
            body = {**CAPITAL, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
            got = generate(server, "chat", body, stream=stream)["prompt_token_ids"]
            assert got == model.tokenizer.encode_chat(messages, enable_thinking=False) != default
        assert default == model.tokenizer.encode_chat(messages)
    finally:
        server.close()


def test_models_and_health(server, tiny_model):
    code, raw = call(server.url, "GET", "/v1/models")
    model = json.loads(raw)["data"][0]
    assert code == 200 and model["id"] == tiny_model.path.name and model["fingerprint"] == tiny_model.fingerprint
    assert json.loads(call(server.url, "GET", "/health")[1]) == {"status": "ok"}


# --- bad requests ---------------------------------------------------------------------------
BAD_REQUESTS = {
    "invalid-json": ("/v1/completions", b'{"prompt": "hi", ', 400, None),
    "not-an-object": ("/v1/completions", b'["hi"]', 400, None),
    "unknown-model": ("/v1/completions", {"model": "gpt-17", "prompt": "hi"}, 404, "model"),
    "max-tokens-0": ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    "max-tokens-text": ("/v1/completions", {"prompt": "hi", "max_tokens": "8"}, 400, "max_tokens"),
    "temperature-negative": ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    "sampling-without-seed": ("/v1/completions", {"prompt": "hi", "temperature": 0.7}, 400, "seed"),
    "top-p-zero": ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    "token-id-outside-vocab": ("/v1/completions", {"prompt": [1, 2, 10**6]}, 400, "prompt"),
    "empty-prompt": ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    "missing-prompt": ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    "missing-messages": ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    "message-without-role": ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages"),
    "template-kwargs-not-object": ("/v1/chat/completions", {**CAPITAL, "chat_template_kwargs": ["enable_thinking"]},
                                   400, "chat_template_kwargs"),
    "template-kwargs-messages": ("/v1/chat/completions", {**CAPITAL, "chat_template_kwargs": {"messages": []}},
                                 400, "chat_template_kwargs"),
    "stop-not-strings": ("/v1/completions", {"prompt": "hi", "stop": [1]}, 400, "stop"),
    "n-0": ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    "n-17": ("/v1/chat/completions", {**CAPITAL, "n": 17}, 400, "n"),
    "n-text": ("/v1/completions", {"prompt": "hi", "n": "2"}, 400, "n"),
    "presence-penalty-3": ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    "frequency-penalty-text": ("/v1/completions", {"prompt": "hi", "frequency_penalty": "1"}, 400,
                               "frequency_penalty"),
    "repetition-penalty-0": ("/v1/chat/completions", {**CAPITAL, "repetition_penalty": 0}, 400, "repetition_penalty"),
    "logit-bias-outside-vocab": ("/v1/completions", {"prompt": "hi", "logit_bias": {"1000000": 5}}, 400, "logit_bias"),
    "logit-bias-not-an-id": ("/v1/completions", {"prompt": "hi", "logit_bias": {"hello": 5}}, 400, "logit_bias"),
    "logit-bias-200": ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 200}}, 400, "logit_bias"),
    "min-tokens-above-max": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400,
                             "min_tokens"),
    "min-tokens-negative": ("/v1/completions", {"prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    "logprobs-too-many": ("/v1/completions", {"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    "top-logprobs-without-logprobs": ("/v1/chat/completions", {**CAPITAL, "top_logprobs": 2}, 400, "top_logprobs"),
    "prompt-logprobs-negative": ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    "prompt-logprobs-too-many": ("/v1/chat/completions", {**CAPITAL, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    "prompt-logprobs-text": ("/v1/completions", {"prompt": "hi", "prompt_logprobs": "2"}, 400, "prompt_logprobs"),
    "echo-on-chat": ("/v1/chat/completions", {**CAPITAL, "echo": True}, 400, "echo"),
    "echo-not-boolean": ("/v1/completions", {"prompt": "hi", "echo": "yes"}, 400, "echo"),
    "beyond-context": ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    "oversize-body": ("/v1/completions", {"prompt": "x" * MAX_BODY}, 413, None),
    "unknown-path": ("/v2/everything", {"prompt": "hi"}, 404, None),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_request_gets_a_json_4xx_and_the_server_keeps_serving(server, name):
    path, body, expected_status, param = BAD_REQUESTS[name]
    raw = body if isinstance(body, bytes) else None
    code, data = call(server.url, "POST", path, body=None if raw else body, raw=raw)
    error = json.loads(data)["error"]
    assert code == expected_status, error
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert param is None or error["code"], error  # a field's error says what kind it is (invalid_value, ...)
    assert generate(server, "completion", {"prompt": "hi", "max_tokens": 2}, stream=False)["token_ids"]


def test_wrong_method_and_missing_length_get_4xx(server):
    assert call(server.url, "GET", "/v1/completions")[0] == 405
    with socket.create_connection(("127.0.0.1", urlsplit(server.url).port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        reply = b"".join(iter(lambda: s.recv(4096), b""))
    assert reply.startswith(b"HTTP/1.1 411") and b'"code": "length_required"' in reply
    assert status_of(server)["running"] == 0


# --- load: 64 clients that come and go ------------------------------------------------------
def stream_then_hang_up(url, kind, body, events: int):
    conn = connection(url)
    conn.request("POST", PATHS[kind], body=json.dumps({**body, "stream": True}))
    response = conn.getresponse()
    assert response.status == 200
    for _ in range(2 * events):  # each event is a data line plus a blank line
        response.readline()
    response.close()
    conn.close()


def send_then_hang_up(url, kind, body):
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", urlsplit(url).port)) as s:
        s.sendall(f"POST {PATHS[kind]} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n".encode() + data)


def test_64_clients_joining_and_leaving_get_serial_answers_and_free_every_block(server, tiny_model):
    expected = {n: serial(tiny_model, kind, body) for n, (kind, body) in enumerate(POOL)}
    before = status_of(server)
    start, done = threading.Barrier(64), threading.Event()
    results, errors, live_batches = [], [], []

    def client(i):
        rng = random.Random(1000 + i)
        n = rng.randrange(len(POOL))
        kind, body = POOL[n]
        stream, hang_up = rng.random() < 0.5, rng.random() < 0.25
        start.wait()
        threading.Event().wait(rng.random() * 0.2)  # arrival jitter
        try:
            if hang_up and stream:
                stream_then_hang_up(server.url, "completion", LONG, events=rng.randint(1, 4))
            elif hang_up:
                send_then_hang_up(server.url, "completion", LONG)
            else:
                results.append((n, generate(server, kind, body, stream)))
        except Exception as e:  # collected and asserted in the main thread
            errors.append(f"client {i}: {e!r}")

    def monitor():
        while not done.is_set():
            live_batches.append(status_of(server)["batch_active"])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    watcher = threading.Thread(target=monitor)
    watcher.start()
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    done.set()
    watcher.join(DEADLINE_S)
    elapsed = time.perf_counter() - started
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    assert len(results) >= 32
    for n, got in results:
        assert got["token_ids"] == expected[n].token_ids and got["text"] == expected[n].text

    def all_arrived_and_left():  # a client that hung up right after sending may still be in the server's hands
        status = status_of(server)
        return status["requests_total"] - before["requests_total"] == 64 and status["in_flight"] == 0

    wait_until(all_arrived_and_left, "all 64 requests to arrive and leave")
    after = status_of(server)
    assert after["running"] == after["waiting"] == after["kv_blocks_used"] == 0
    assert after["kv_blocks_free"] == server.engine.config.num_blocks
    assert after["requests_aborted"] > before["requests_aborted"], "hang-ups must abort their requests"
    assert after["requests_finished"] + after["requests_aborted"] == after["requests_total"]
    assert max(live_batches) > 1 and after["max_batch_active"] > 1, "steps must batch requests"
    print(f"\n64 clients: {elapsed:.2f}s, {len(results)} completed, "
          f"{after['requests_aborted'] - before['requests_aborted']} aborted, max live batch_active "
          f"{max(live_batches)}, max_batch_active {after['max_batch_active']}")


# --- a full batch -----------------------------------------------------------------------------
def test_full_batch_gets_503_after_the_queue_timeout_and_a_hang_up_frees_the_slot(tiny_model):
    server = start_server(tiny_model, max_waiting=0, queue_timeout=0.3, max_num_seqs=1, num_blocks=260)
    try:
        occupant = connection(server.url)
        occupant.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "stream": True}))
        response = occupant.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")

        code, data = call(server.url, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert code == 503 and json.loads(data)["error"]["code"] == "queue_timeout"
        assert status_of(server)["requests_rejected_busy"] == 1

        response.close()  # the socket stays open while the response holds it
        occupant.close()
        wait_until(lambda: status_of(server)["in_flight"] == 0, "the hung-up request to be aborted")
        status = status_of(server)
        assert status["requests_aborted"] == 1 and status["kv_blocks_used"] == 0
        assert generate(server, "completion", {"prompt": "hi", "max_tokens": 2}, stream=False)["token_ids"]
    finally:
        server.close()


# --- the command --------------------------------------------------------------------------------
def test_refengine_serve_prints_its_url_and_serves(tiny_model_dir):
    process = subprocess.Popen(
        [sys.executable, "-m", "refengine", "serve", "--model", str(tiny_model_dir), "--port", "0",
         "--mode", "invariant", "--max-num-seqs", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("serving http://127.0.0.1:"), line + process.stderr.read()
        url = line.split()[1]
        wait_until(lambda: call(url, "GET", "/health")[0] == 200, "/health")
        code, raw = call(url, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert code == 200 and len(json.loads(raw)["choices"][0]["token_ids"]) == 3
    finally:
        process.terminate()
        process.wait(DEADLINE_S)
        process.stdout.close()
        process.stderr.close()


def test_refengine_serve_refuses_an_unknown_fault(tiny_model_dir):
    result = subprocess.run([sys.executable, "-m", "refengine", "serve", "--model", str(tiny_model_dir),
                             "--port", "0"], env={**os.environ, "REFENGINE_FAULT": "no-such-fault"},
                            capture_output=True, text=True, timeout=DEADLINE_S)
    assert result.returncode == 2 and "no-such-fault" in result.stderr and len(result.stderr.splitlines()) == 1


# --- the serve layer's faults: a hang-up that is not aborted, an admission slot that leaks ----------
def hang_up_after_one_chunk(server, max_tokens=500):
    """A streamed completion; the client leaves after its first chunk (as validate's client does)."""
    conn = connection(server.url)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}))
    sock = conn.sock  # getresponse() drops conn.sock when the server will close the connection
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def test_a_peek_at_a_socket_whose_data_was_read_never_waits():
    """The engine thread peeks at a client's socket that poll found readable; the worker may have read
    what made it so in between. The connection's own recv would then wait for data up to its timeout
    (2 s here, the handler's 60 s in a server: every request stalled that long) and call the client gone;
    the peek says at once that it is not."""
    ours, client = socket.socketpair()
    ours.settimeout(2.0)  # as the handler's connection has one
    try:
        client.sendall(b"GET")
        assert not peer_closed(ours)  # data to read: not gone
        ours.recv(3)  # the worker reads it
        assert peek_empty(ours) is False and ours.gettimeout() == 2.0
        client.close()
        assert peer_closed(ours)  # now the peer has closed
    finally:
        ours.close()
        client.close()


@pytest.mark.parametrize("fault", [None, "slot-leak", "hang-up-without-abort"])
def test_a_hang_up_is_aborted_and_returns_its_admission_slot(tiny_model, fault):
    server = start_server(tiny_model, max_waiting=1, queue_timeout=0.3, max_num_seqs=1, fault=fault)
    try:
        status = status_of(server)
        assert (status["slots_used"], status["slots_total"]) == (0, 2)
        hang_up_after_one_chunk(server)
        wait_until(lambda: status_of(server)["in_flight"] == 0, "the hung-up request to end")
        status = status_of(server)
        assert status["kv_blocks_used"] == 0
        if fault == "hang-up-without-abort":  # ran on to its natural end: finished, never aborted
            assert (status["requests_aborted"], status["requests_finished_length"]) == (0, 1), status
            assert status["steps"] >= 500
        else:
            # aborted, not run to its end: how many steps the abort took is the machine's load, not the server
            assert (status["requests_aborted"], status["requests_finished"]) == (1, 0), status
        assert status["slots_used"] == (1 if fault == "slot-leak" else 0), status
        if fault == "slot-leak":  # a second leak uses up both slots: the next request is refused
            hang_up_after_one_chunk(server)
            wait_until(lambda: status_of(server)["slots_used"] == 2 and status_of(server)["in_flight"] == 0,
                       "the second hang-up to leak its slot")
            code, data = call(server.url, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert code == 503 and json.loads(data)["error"]["code"] == "queue_timeout"
        else:
            assert generate(server, "completion", {"prompt": "hi", "max_tokens": 2}, stream=False)["token_ids"]
    finally:
        server.close()


@pytest.mark.parametrize("stream", [False, True])
def test_prefix_caching_reports_cached_tokens_and_counts_hits(tiny_model, stream):
    """With prefix caching a repeated prompt reports its cached full blocks in
    usage.prompt_tokens_details.cached_tokens (vLLM's field), gets the same answer as the first time
    (invariant mode: bit-identical), and /metrics counts queries and hits under vLLM's names; without
    caching the field is absent."""
    prompt = list(range(3, 43))  # 40 tokens: two full 16-token blocks can be shared
    server = start_server(tiny_model, block_size=16, enable_prefix_caching=True)
    try:
        first = generate(server, "completion", {"prompt": prompt, "max_tokens": 5, "logprobs": 1}, stream=stream)
        again = generate(server, "completion", {"prompt": prompt, "max_tokens": 5, "logprobs": 1}, stream=stream)
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
        assert again["token_ids"] == first["token_ids"] and again["logprobs"] == first["logprobs"]
        status = status_of(server)
        assert (status["prefix_cache_queries"], status["prefix_cache_hits"]) == (80, 32)
        code, data = call(server.url, "GET", "/metrics")
        metrics = {s.name: s.value for f in text_string_to_metric_families(data.decode()) for s in f.samples}
        assert (metrics["vllm:prefix_cache_queries_total"], metrics["vllm:prefix_cache_hits_total"]) == (80, 32)
        salted = {"prompt": prompt, "max_tokens": 5, "logprobs": 1, "cache_salt": "tenant-a"}
        other = generate(server, "completion", salted, stream=stream)  # vLLM's cache_salt: shares with no other salt
        assert other["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert other["token_ids"] == first["token_ids"]
        assert generate(server, "completion", salted, stream=stream)["usage"]["prompt_tokens_details"] == \
            {"cached_tokens": 32}
        for bad in ("", 7):
            code, data = call(server.url, "POST", "/v1/completions", {**salted, "cache_salt": bad})
            assert code == 400 and json.loads(data)["error"]["param"] == "cache_salt"
        assert status_of(server)["in_flight"] == 0  # refused before admission: nothing lost
    finally:
        server.close()
    server = start_server(tiny_model, block_size=16)
    try:
        generate(server, "completion", {"prompt": prompt, "max_tokens": 2}, stream=stream)
        assert "prompt_tokens_details" not in generate(server, "completion", {"prompt": prompt, "max_tokens": 2},
                                                       stream=stream)["usage"]
    finally:
        server.close()
