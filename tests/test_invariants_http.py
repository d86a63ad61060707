"""The HTTP properties' negative control: against a faulty in-process server the golden property
fails, Hypothesis shrinks the failing schedule to one request sent at once, and the HTTP repro it
writes fails again when `refengine validate --replay` sends it to the faulty server, and passes
against a clean one."""
from __future__ import annotations

import json

import pytest

from refengine.check.golden import read_golden
from refengine.cli import main
from refengine.data import shipped
from refengine.engine import EngineConfig
from refengine.serve import OpenAIServer
from refengine.suite.harness import PropertyFailure
from refengine.suite.test_http import answers_match_golden, connect, http_property

pytestmark = [pytest.mark.invariants, pytest.mark.http,
              pytest.mark.xdist_group("http-server")]  # --dist loadgroup: the drain check needs the server to itself
FAULT = "kv-write-block-boundary-off-by-one"  # corrupts every answer past one KV block


def test_a_faulty_server_fails_the_golden_property_and_shrinks(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("REFENGINE_REPRO_DIR", str(tmp_path))
    faulty = OpenAIServer(tiny_model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, fault=FAULT),
                          host="127.0.0.1")
    faulty.start()
    failing = []

    def answers_match_golden_on_faulty_server(server, schedule):
        try:
            answers_match_golden(server, schedule)
        except PropertyFailure:
            failing.append(schedule)  # Hypothesis replays the shrunk example last
            raise

    try:
        found = http_property(answers_match_golden_on_faulty_server,
                              connect(faulty.url, read_golden(shipped("golden", "tiny-default.jsonl"))),
                              derandomize=True, database=None, report_multiple_bugs=False)
        with pytest.raises(PropertyFailure, match="diverged at generated token") as failure:
            found()
        shrunk = failing[-1]
        assert len(shrunk) == 1 and not shrunk[0].stream and shrunk[0].arrival == 0, shrunk
        repro = json.loads(failure.value.repro.read_text())
        assert [(r["case"], r["streamed"], r["verdict"]) for r in repro["requests"]] == \
            [(shrunk[0].case_id, False, "diverged")]
        again = tmp_path / "again.json"
        assert main(["validate", "--replay", str(failure.value.repro), "--url", faulty.url, "--report", str(again),
                     "--repro", str(tmp_path / "again-repro.json")]) == 1
        assert [r["verdict"] for r in json.loads(again.read_text())["requests"]] == ["diverged"]
    finally:
        faulty.close()
    clean = OpenAIServer(tiny_model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32), host="127.0.0.1")
    clean.start()
    try:
        assert main(["validate", "--replay", str(failure.value.repro), "--url", clean.url,
                     "--repro", str(tmp_path / "clean-repro.json")]) == 0
    finally:
        clean.close()
