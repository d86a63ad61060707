"""The tiny Qwen3-MoE model served: `refengine serve` on 127.0.0.1 and `refengine validate` passes it
against a golden file refreshed for it; and a chat message carrying an image is refused over HTTP
with a 4xx JSON error naming the message (the model is text-only)."""
from __future__ import annotations

import http.client
import json

import pytest
from test_validate import serving

from refengine.cli import main
from refengine.strategies.models import tiny_model_dir

MOE = "qwen3moe-e4k2"
PROMPTS = [  # chat and raw text, short answers: a refresh of a few seconds
    {"id": "capital", "messages": [{"role": "user", "content": "What is the capital of Japan?"}], "max_tokens": 6},
    {"id": "drink", "messages": [{"role": "user", "content": "Tea or coffee?"}], "max_tokens": 8},
    {"id": "story", "prompt": "Once upon a time", "max_tokens": 12},
    {"id": "green", "prompt": "Name something green:", "max_tokens": 10},
]


@pytest.fixture
def serve_moe():
    yield from serving(tiny_model_dir(MOE))


@pytest.mark.parametrize("mode", ["invariant", "fast"])
def test_validate_passes_the_served_moe_model_against_its_golden_file(serve_moe, tmp_path, mode, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    golden = tmp_path / "tiny-qwen3moe-e4k2.jsonl"
    assert main(["golden", "refresh", "--model", str(tiny_model_dir(MOE)), "--prompts", str(prompts),
                 "--out", str(golden)]) == 0
    header = json.loads(golden.read_text().splitlines()[0])
    assert header["architecture"] == "qwen3_moe" and header["tiny_model"]["experts"] == 4
    url = serve_moe("--mode", mode, "--max-num-seqs", "4")
    code = main(["validate", "--url", url, "--golden", str(golden), "--concurrency", "4", "--seed", "1",
                 "--repeat", "2", "--report", str(tmp_path / "report.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = json.loads((tmp_path / "report.json").read_text())["summary"]
    assert summary["passed"] and summary["diverged"] == summary["error"] == 0 and summary["match"] > 0


def post_json(url: str, path: str, body: dict):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type"), json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                                  {"type": "image", "image": "cat.png"}])
def test_an_image_in_a_chat_message_is_refused_naming_the_message(serve_moe, part):
    url = serve_moe()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, part]}]
    status, content_type, body = post_json(url, "/v1/chat/completions", {"messages": messages})
    assert 400 <= status < 500 and content_type.startswith("application/json")
    assert "messages[1].content[1]" in body["error"]["message"] and part["type"] in body["error"]["message"]
    assert "text-only model" in body["error"]["message"]
    text_only = [messages[0], {"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    status, _, body = post_json(url, "/v1/chat/completions", {"messages": text_only, "max_tokens": 2})
    assert status == 200 and body["choices"][0]["message"]["content"] is not None
