"""The HTTP properties' negative control: against a faulty in-process server the golden property
fails, Hypothesis shrinks the failing schedule to one request sent at once, and the HTTP repro it
writes fails again when `refengine validate --replay` sends it to the faulty server, and passes
against a clean one. The serve layer's faults are found the same way (dev profile's budget,
derandomized) and shrunk to one streamed request that hangs up: hang-up-without-abort by the
hang-up-is-an-abort property, slot-leak by the drain property (admission slots) and, on a server with
the suite's few waiting slots, by the golden property itself (leaked slots become refused requests).
And the shipped HTTP properties pass against a clean server while other processes keep every core
busy: none of them judges how fast the server noticed anything. A vision-language server is held to its
golden image answers the same way (image chats sent to chat with data URLs)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from refengine.check.calibrate import stored_calibration
from refengine.check.golden import load_prompts, read_golden, refresh
from refengine.cli import main
from refengine.data import shipped
from refengine.engine import EngineConfig
from refengine.errors import RefengineError
from refengine.serve import OpenAIServer
from refengine.strategies.http_schedules import HttpRequest
from refengine.suite.harness import PropertyFailure
from refengine.suite.hunts import MAX_SHRUNK_REQUESTS, SmallEnough
from refengine.suite.plugin import HTTP_MAX_WAITING
from refengine.suite.test_http import (
    answers_equal_alone,
    answers_match_golden,
    applies_what_it_accepts,
    cold_warm_evicted,
    connect,
    hang_ups_are_aborts,
    http_property,
    server_drains,
    with_processed,
)

pytestmark = [pytest.mark.invariants, pytest.mark.http,
              pytest.mark.xdist_group("http-server")]  # --dist loadgroup: the drain check needs the server to itself
FAULT = "kv-write-block-boundary-off-by-one"  # corrupts every answer past one KV block
LEAK_WAIT_S = 3.0  # the slot-leak hunt's queue timeout (test_with_few_waiting_slots_a_slot_leak_is_refused_requests)
LONG_ANSWER = 400  # tokens of each long_golden answer


def test_a_faulty_server_fails_the_golden_property_and_shrinks(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("REFENGINE_REPRO_DIR", str(tmp_path))
    shrunk, failure = hunt(tiny_model, FAULT, answers_match_golden, "answers_match_golden_on_faulty_server",
                           "diverged at generated token",
                           small_enough=lambda s: len(s) == 1 and not s[0].stream and s[0].arrival == 0)
    assert len(shrunk) == 1 and not shrunk[0].stream and shrunk[0].arrival == 0, shrunk
    repro = json.loads(failure.repro.read_text())
    assert [(r["case"], r["streamed"], r["verdict"]) for r in repro["requests"]] == \
        [(shrunk[0].case_id, False, "diverged")]
    for fault, code in ((FAULT, 1), (None, 0)):  # replayed: fails again at that request; passes when clean
        server = OpenAIServer(tiny_model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, fault=fault),
                              host="127.0.0.1")
        server.start()
        try:
            report = tmp_path / f"again-{fault}.json"
            assert main(["validate", "--replay", str(failure.repro), "--url", server.url, "--report", str(report),
                         "--repro", str(tmp_path / f"again-{fault}-repro.json")]) == code
            assert [r["verdict"] for r in json.loads(report.read_text())["requests"]] == \
                ["diverged" if fault else "match"]
        finally:
            server.close()


# --- server-side leaks: the serve layer's faults ---------------------------------------------------
@pytest.fixture(scope="module")
def long_golden(tiny_model, tmp_path_factory):
    """A golden file of LONG_ANSWER-token answers of the tiny model (float64 reference, built here): a
    hang-up after a few chunks leaves hundreds of tokens to come, so whether the server had finished
    before it (and so whether a hang-up is an abort to hold it to, validate.aborts) is never a race
    with how fast this machine runs the engine."""
    folder = tmp_path_factory.mktemp("long-golden")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"long-{n}", "prompt": text, "max_tokens": LONG_ANSWER}) + "\n"
                               for n, text in enumerate(("Tell me a long story.", "Once upon a time"))))
    noise = json.loads(shipped("golden", "tiny-random.calibration.json").read_text())
    return refresh(tiny_model, prompts, load_prompts(prompts), folder / "long.jsonl", noise)


def hunt(tiny_model, fault: str, check, name: str, match: str, small_enough=lambda schedule: True,
         golden=None, engine=None, alone_url=None, **server_settings):
    """Hunt `fault` on a faulty in-process server with property `check` (dev profile's example budget,
    derandomized, no database) until a failing schedule of at most MAX_SHRUNK_REQUESTS requests for which
    `small_enough` holds (what the test asserts of the shrunk schedule): (that schedule, its
    PropertyFailure). Stopping there, not at the shrinker's end: refengine.suite.hunts.SmallEnough.
    `golden`: the cases the schedules draw (default: the tiny model's shipped golden file); `engine`: more
    EngineConfig settings; `alone_url`: the server whose alone answers the faulty one is held to."""
    faulty = OpenAIServer(tiny_model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, fault=fault,
                                                   **(engine or {})),
                          host="127.0.0.1", **server_settings)
    faulty.start()
    def on_faulty_server(server, schedule):
        try:
            check(server, schedule)
        except PropertyFailure as failure:
            if len(schedule) <= MAX_SHRUNK_REQUESTS and small_enough(schedule):
                raise SmallEnough(schedule, failure) from None
            raise

    on_faulty_server.__name__ = name
    try:
        found = http_property(on_faulty_server,
                              connect(faulty.url, golden or read_golden(shipped("golden", "tiny-random.jsonl")),
                                      alone_url=alone_url),
                              derandomize=True, database=None, report_multiple_bugs=False)
        with pytest.raises(SmallEnough) as small:
            found()
    finally:
        faulty.close()
    shrunk, failure = small.value.example, small.value.failure
    assert re.search(match, str(failure)), failure
    assert len(json.loads(failure.repro.read_text())["requests"]) == len(shrunk)
    return shrunk, failure


def test_a_speculating_server_wrong_on_its_drafts_fails_the_speculation_property(tiny_model, tmp_path, monkeypatch):
    """draft-compared-one-row-late, served speculating 3 tokens: wrong the same way alone, so only the
    answers of the model served without speculation show it; shrunk to one request."""
    monkeypatch.setenv("REFENGINE_REPRO_DIR", str(tmp_path))
    clean = OpenAIServer(tiny_model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32), host="127.0.0.1")
    clean.start()
    try:
        shrunk, _ = hunt(tiny_model, "draft-compared-one-row-late", answers_equal_alone,
                         "speculating_server_against_unspeculated", "differ from the server's own alone answers",
                         small_enough=lambda s: len(s) == 1, engine={"num_speculative_tokens": 3},
                         alone_url=clean.url)
    finally:
        clean.close()
    assert len(shrunk) == 1


def one_hang_up(schedule) -> bool:
    return len(schedule) == 1 and schedule[0].stream and schedule[0].cancel_after is not None


def test_a_hang_up_that_is_not_aborted_is_found_and_shrinks(tiny_model, long_golden, tmp_path, monkeypatch):
    """hang-up-without-abort: the request runs on to its natural end; no abort is counted."""
    monkeypatch.setenv("REFENGINE_REPRO_DIR", str(tmp_path))
    shrunk, _ = hunt(tiny_model, "hang-up-without-abort", hang_ups_are_aborts,
                           "hang_ups_are_aborts_on_faulty_server", "0 aborts counted for 1 hang-ups",
                           small_enough=one_hang_up, golden=long_golden)
    assert len(shrunk) == 1 and shrunk[0].stream and shrunk[0].cancel_after is not None, shrunk


def test_a_leaked_admission_slot_is_found_and_shrinks(tiny_model, long_golden, tmp_path, monkeypatch):
    """slot-leak: a hung-up request's slot is never returned; the drain property sees slots_used stay up.
    (Slots enough for the whole hunt: every example is judged against its own start.)"""
    monkeypatch.setenv("REFENGINE_REPRO_DIR", str(tmp_path))
    shrunk, _ = hunt(tiny_model, "slot-leak", server_drains, "server_drains_on_faulty_server",
                     "admission slots taken", small_enough=one_hang_up, golden=long_golden, max_waiting=5000)
    assert len(shrunk) == 1 and shrunk[0].stream and shrunk[0].cancel_after is not None, shrunk


@pytest.mark.parametrize("fault", ["evicted-block-still-cached", "cached-prefix-last-block-dropped"])
def test_a_served_prefix_cache_fault_fails_the_cold_warm_evicted_property(fault, tiny_model, tmp_path, monkeypatch):
    """With the in-process suite server's cache (8-token blocks, a 1,024-token pool): a block reused
    while still registered (mostly seen after the eviction pressure), a hit missing its last block
    (mostly seen warm). Which leg fails first depends on which requests of a schedule meet in the
    cache, which is up to timing: any leg may."""
    monkeypatch.setenv("REFENGINE_REPRO_DIR", str(tmp_path))
    hunt(tiny_model, fault, cold_warm_evicted, "cold_warm_evicted_on_faulty_server",
         r"^(cold|warm|after eviction): answers that fail the margin rule|cold vs (warm|after eviction):",
         engine={"block_size": 8, "num_blocks": 128, "enable_prefix_caching": True})


def test_with_few_waiting_slots_a_slot_leak_is_refused_requests(tiny_model, long_golden, tmp_path, monkeypatch):
    """The in-process server of the properties has HTTP_MAX_WAITING waiting slots: leaked slots run
    out within one run, and the golden property itself fails with refused requests (verdict error)."""
    monkeypatch.setenv("REFENGINE_REPRO_DIR", str(tmp_path))
    # A leaked slot never frees, so any wait refuses it; the wait is long enough that a slot a machine
    # with every core busy frees late still counts as freed (else a replay may not refuse: Hypothesis's
    # Flaky): several times the longest golden answer's latency there.
    shrunk, failure = hunt(tiny_model, "slot-leak", answers_match_golden, "answers_match_golden_on_faulty_server",
                           "queue_timeout|no batch slot", golden=long_golden, max_waiting=HTTP_MAX_WAITING,
                           queue_timeout=LEAK_WAIT_S)
    # how many requests a failing schedule needs depends on how many slots earlier examples leaked
    assert len(shrunk) <= MAX_SHRUNK_REQUESTS and ": error (" in str(failure), failure



def test_an_engine_url_is_held_to_the_given_precision_and_model(tiny_model, tmp_path):
    """--precision and --model reach the HTTP properties as validate's bounds: the tolerance of that
    precision from the golden header, or measured on the model where the header lacks it (a golden
    file without it and no model: an error naming the key), and the model's float64 margins."""
    golden_path = shipped("golden", "tiny-random.jsonl")
    lines = golden_path.read_text(encoding="utf-8").split("\n")
    header = json.loads(lines[0])
    del header["noise"]["bf16_vs_f64"]
    old = tmp_path / "old.jsonl"
    old.write_text("\n".join([json.dumps(header)] + lines[1:]), encoding="utf-8")
    server = OpenAIServer(tiny_model, EngineConfig(max_num_seqs=4), host="127.0.0.1")
    server.start()
    try:
        golden = read_golden(golden_path)
        bf16 = connect(server.url, golden, "bf16")
        assert bf16.bounds.precision == "bf16" and bf16.margins is None
        noise = golden.header["noise"]
        assert bf16.tolerance == bf16.batching == noise["bf16_vs_f64"] * noise["safety_factor"]
        with pytest.raises(RefengineError, match="bf16_vs_f64"):
            connect(server.url, read_golden(old), "bf16")
        measured = connect(server.url, read_golden(old), "bf16", tiny_model)
        assert measured.bounds.bound_from == "model" and measured.margins.fingerprint == tiny_model.fingerprint
        run = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "refengine.suite", "-m", "http", "-q",
                              "-p", "no:cacheprovider", "--engine-url", server.url, f"--golden={old}",
                              "--precision=bf16", f"--model={tiny_model.path}"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "HYPOTHESIS_PROFILE": "dev", "REFENGINE_REPRO_DIR": str(tmp_path)})
        assert run.returncode == 0, run.stdout[-3000:]
        refused = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "refengine.suite", "-m", "http", "-q",
                                  "-p", "no:cacheprovider", "--engine-url", server.url, f"--golden={old}",
                                  "--precision=bf16"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert refused.returncode != 0 and "bf16_vs_f64" in refused.stdout
    finally:
        server.close()


@pytest.mark.slow  # it loads every core: in the default run that would starve the other xdist worker's tests
def test_the_http_properties_pass_on_a_clean_server_with_every_core_busy(tmp_path):
    """Twice as many busy processes as cores, and the shipped HTTP properties (dev profile, run as a
    user runs them) against the in-process clean server: a starved worker thread or client must not
    turn into a verdict."""
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "refengine.suite", "-m", "http", "-q",
                              "-p", "no:cacheprovider"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "HYPOTHESIS_PROFILE": "dev", "REFENGINE_REPRO_DIR": str(tmp_path)})
    finally:
        for p in spin:
            p.kill()
            p.wait()
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert re.search(r"\bpassed\b", run.stdout) and not re.search(r"\bskipped\b", run.stdout), run.stdout[-2000:]


# --- logits processors over HTTP -----------------------------------------------------------------
def hold_until_added(server: OpenAIServer, count: int, deadline_s: float = 60.0) -> None:
    """From now on, the server steps nothing until `count` more requests are in its engine: they share
    their first step however slowly this machine starts the clients."""
    engine, step, add = server.engine, server.engine.step, server.engine.add_request
    added: list[float] = []

    def counted_add(*args, **kwargs):
        added.append(time.monotonic())
        return add(*args, **kwargs)

    def held_step():
        if 0 < len(added) < count and time.monotonic() - added[0] < deadline_s:
            time.sleep(0.001)  # the engine thread admits the next arrival between steps
            return []
        return step()

    engine.add_request, engine.step = counted_add, held_step


def test_a_penalty_row_bug_fails_the_answers_equal_alone_property(tiny_model, tmp_path, monkeypatch):
    """penalty-counts-by-batch-row served: a short answer with penalties, then a long one, in one batch;
    when the short one leaves, the long one's row moves into its place without its counts, and its
    answer differs from its answer alone. The same two requests pass on a clean server."""
    monkeypatch.setenv("REFENGINE_REPRO_DIR", str(tmp_path))
    golden = read_golden(shipped("golden", "tiny-random.jsonl"))
    for fault in ("penalty-counts-by-batch-row", None):
        server = OpenAIServer(tiny_model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, fault=fault),
                              host="127.0.0.1")
        server.start()
        try:
            # the long one a tenth of a second after the short one, however slow this machine: it joins second
            connected = replace(with_processed(connect(server.url, golden), bases=("green-thing", "story")),
                                arrival_step_s=0.02)
            index = {case.id: n for n, case in enumerate(connected.processed.cases)}
            schedule = [HttpRequest(index["green-thing+penalties"], "green-thing+penalties", "chat", False, 0, None),
                        HttpRequest(index["story+penalties"], "story+penalties", "completions", False, 5, None)]
            hold_until_added(server, len(schedule))
            if fault:
                with pytest.raises(PropertyFailure, match="answers that differ from the server's own alone"):
                    answers_equal_alone(connected, schedule)
            else:
                answers_equal_alone(connected, schedule)
        finally:
            server.close()


def test_a_server_that_ignores_processors_it_accepts_fails_the_probe_and_validate(tiny_model, tmp_path):
    """logits-processors-ignored and echo-ignored: the property names what is ignored; validate FAILs with a
    FINDING line, and passes that part against a clean server."""
    golden_path = shipped("golden", "tiny-random.jsonl")
    for fault in ("logits-processors-ignored", "echo-ignored", None):
        server = OpenAIServer(tiny_model, EngineConfig(max_num_seqs=4, fault=fault), host="127.0.0.1")
        server.start()
        try:
            connected = connect(server.url, read_golden(golden_path))
            report = tmp_path / f"report-{fault}.json"
            code = main(["validate", "--url", server.url, "--golden", str(golden_path), "--report", str(report),
                         "--repro", str(tmp_path / f"repro-{fault}.json")])
            surface = json.loads(report.read_text())["surface"]
            if fault == "echo-ignored":
                with pytest.raises(PropertyFailure, match="completions: echo"):
                    applies_what_it_accepts(connected)
                assert code == 1
                assert surface["completions"]["echo"]["verdict"] == "ignored"
                assert {surface[api]["logit_bias"]["verdict"] for api in surface} == {"applied"}
            elif fault:
                with pytest.raises(PropertyFailure, match="logit_bias"):
                    applies_what_it_accepts(connected)
                assert code == 1
                assert {surface[api]["logit_bias"]["verdict"] for api in surface} == {"ignored"}
            else:
                applies_what_it_accepts(connected)
                assert {v["verdict"] for verdicts in surface.values() for v in verdicts.values()} <= \
                    {"applied", "accepted"}
                assert {surface[api]["logit_bias"]["verdict"] for api in surface} == {"applied"}
                assert {surface[api]["prompt_logprobs"]["verdict"] for api in surface} == {"applied"}
                assert surface["completions"]["echo"]["verdict"] == "applied" and "echo" not in surface["chat"]
        finally:
            server.close()


# --- images: a vision-language server held to its golden image answers ----------------------------
@pytest.fixture(scope="module")
def image_golden(tmp_path_factory):
    """A golden file of the tiny Qwen3-VL model (float64 reference with images, built here): a chat with an
    image before its text, one with two images after it, and a text chat."""
    from test_golden_images import image_part, png, write_jsonl
    folder = tmp_path_factory.mktemp("image-golden")
    (folder / "a.png").write_bytes(png(24, 16, 1))
    (folder / "b.png").write_bytes(png(16, 16, 2))
    lines = [{"id": "before", "max_tokens": 12, "messages": [{"role": "user", "content": [
                 image_part("a.png"), {"type": "text", "text": "What is it?"}]}]},
             {"id": "after", "max_tokens": 12, "messages": [{"role": "user", "content": [
                 {"type": "text", "text": "Compare:"}, image_part("b.png"), image_part("a.png")]}]},
             {"id": "text", "max_tokens": 12, "messages": [{"role": "user", "content": "Hello"}]}]
    prompts = write_jsonl(folder / "prompts.jsonl", lines)
    model = tiny_vision_model()
    return refresh(model, prompts, load_prompts(prompts), folder / "images.jsonl", stored_calibration(model))


def tiny_vision_model():
    from refengine.strategies.models import VISION_MODEL, tiny_model
    return tiny_model(VISION_MODEL)


def test_the_golden_property_holds_a_vision_server_to_its_image_answers(image_golden, tmp_path, monkeypatch):
    """Clean, the image chats' answers are the golden ones under every drawn schedule (sent to chat only:
    completions has no place for images); served with deepstack a layer late (wrong alone too), the property
    fails and shrinks to one request."""
    monkeypatch.setenv("REFENGINE_REPRO_DIR", str(tmp_path))
    golden, model = image_golden, tiny_vision_model()
    clean = OpenAIServer(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16), host="127.0.0.1")
    clean.start()
    try:
        server = connect(clean.url, golden)
        assert {api for (case, api) in server.alone if case != "text"} == {"chat"}
        http_property(answers_match_golden, server, derandomize=True, database=None)()
    finally:
        clean.close()
    shrunk, _ = hunt(model, "deepstack-one-layer-late", answers_match_golden, "image_answers_on_faulty_server",
                     "diverged at generated token", small_enough=lambda s: len(s) == 1, golden=golden)
    assert len(shrunk) == 1 and golden.cases[shrunk[0].case].images
