"""`refengine validate`'s baselines and its overlap rule against real `refengine serve` instances on
127.0.0.1 (in-process OpenAIServer), healthy and with catalogued batching faults:

- the default run (golden baseline, arrival spread from the measured alone latency) fails each of
  the join/leave faults, and the preemption fault on a pool small enough to preempt;
- `--prompts FILE --baseline serial` needs no golden file: the same server's alone answers are the
  baseline, bit-identical by default; it fails the join/leave faults and passes a clean server;
- a run whose requests did not overlap is INCONCLUSIVE (exit 1) and writes a repro.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from refengine.check.golden import GoldenCase, read_golden
from refengine.cli import main
from refengine.data import shipped
from refengine.engine import EngineConfig
from refengine.serve import OpenAIServer
from refengine.validate.baseline import SerialBaseline, judge_serial, prompt_logprobs_difference
from refengine.validate.board import send_alone, served_model
from refengine.validate.client import Endpoint
from refengine.validate.plan import Planned
from refengine.validate.wire import Completion, TokenLogprob

GOLDEN = shipped("golden", "tiny-random.jsonl")
JOIN_LEAVE_FAULTS = ("position-off-by-one-on-join", "logits-rows-misassigned-after-leave")
SMALL_POOL = {"num_blocks": 48, "block_size": 4}  # 192 tokens: the longest case fits, four at once do not


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """The golden file's cases as a plain prompts file (FORMATS.md "Prompts"): no expected answers."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = []
    for case in read_golden(GOLDEN).cases:
        entry = {"id": case.id, "max_tokens": case.max_tokens}
        entry |= {"messages": case.messages} if case.messages else {"prompt": case.prompt}
        lines.append(json.dumps(entry))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def serve(tiny_model):
    servers = []

    def start(fault=None, step_s=0.0, **engine):
        server = OpenAIServer(tiny_model, EngineConfig(max_num_seqs=4, fault=fault, **engine), host="127.0.0.1")
        if step_s:  # a device's pace: each step takes at least step_s (the engine thread is its only caller)
            step = server.engine.step
            server.engine.step = lambda: (time.sleep(step_s), step())[1]
        server.start()
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        server.close()


def validate(tmp_path, *args) -> tuple[int, dict]:
    report = tmp_path / "report.json"
    code = main(["validate", *args, "--report", str(report), "--repro", str(tmp_path / "repro.json")])
    return code, json.loads(report.read_text())


@pytest.mark.parametrize("fault", JOIN_LEAVE_FAULTS)
def test_the_default_run_and_the_serial_baseline_fail_a_join_leave_fault(serve, tmp_path, prompts_file, fault):
    url = serve(fault)
    code, report = validate(tmp_path, "--url", url, "--golden", str(GOLDEN))
    assert code == 1 and report["summary"]["verdict"] == "FAIL" and report["summary"]["diverged"] > 0
    assert report["settings"]["arrival_spread_from"] == "alone latency" and report["overlap"]["proven"]
    code, report = validate(tmp_path, "--url", url, "--prompts", str(prompts_file))
    assert code == 1 and report["baseline"] == "serial" and report["golden"] is None
    assert report["summary"]["diverged"] > 0 and report["settings"]["tolerance"] == 0
    assert (tmp_path / "repro.json").exists()


def test_the_default_run_fails_stale_block_tables_after_preemption(serve, tmp_path):
    code, report = validate(tmp_path, "--url", serve("stale-block-table-after-preemption", **SMALL_POOL),
                            "--golden", str(GOLDEN))
    assert code == 1 and report["summary"]["verdict"] == "FAIL" and report["summary"]["error"] == 0
    # its answers diverge, or it never drains, or (a load that met neither) the n probe kills its engine
    died = [name for verdicts in (report["surface"] or {}).values() for name, v in verdicts.items()
            if v["verdict"] == "failed"]
    assert report["summary"]["diverged"] > 0 or not report["drain"]["drained"] or "n" in died, report["surface"]


@pytest.mark.parametrize("engine", [{}, SMALL_POOL], ids=["default-pool", "small-pool"])
def test_a_clean_server_passes_the_serial_baseline_bit_identical(serve, tmp_path, prompts_file, engine):
    code, report = validate(tmp_path, "--url", serve(**engine), "--prompts", str(prompts_file),
                            "--cancel-rate", "0.3", "--repeat", "2")
    assert code == 0, report["summary"]
    compared = [r for r in report["requests"] if r["verdict"] != "cancelled"]
    assert compared and {r["verdict"] for r in compared} == {"match"}
    assert {r["compared_by"] for r in compared} == {"token_ids"}
    loaded = {(r["case"], r["api"]) for r in report["requests"]}  # cases and variants, each once alone before
    assert sorted((r["case"], r["api"]) for r in report["alone"]) == sorted(loaded)
    variants = [r for r in report["requests"] if r.get("variant")]  # a quarter go as a variant of their case
    assert variants and all(r["case"].endswith(f"+{r['variant']}") for r in variants)
    assert not report["variants"]["refused"]
    assert sum(report["variants"]["sent"][v].get("match", 0) for v in report["variants"]["sent"]) == \
        sum(r["verdict"] == "match" for r in variants)
    assert all(r["logprobs"] for r in report["alone"])  # the server's own margins are at hand
    assert report["overlap"]["fraction"] >= 0.5 and report["overlap"]["max_in_flight"] > 1
    assert not (tmp_path / "repro.json").exists()


def test_a_run_without_overlap_is_inconclusive_and_says_how_to_fix_it(serve, tmp_path, capsys):
    code, report = validate(tmp_path, "--url", serve(), "--golden", str(GOLDEN), "--concurrency", "1",
                            "--cancel-rate", "0")
    out = capsys.readouterr().out
    assert code == 1 and report["summary"]["verdict"] == "INCONCLUSIVE"
    assert report["summary"]["diverged"] == report["summary"]["error"] == 0
    assert report["overlap"] == {**report["overlap"], "max_in_flight": 1, "overlapped": 0, "proven": False}
    assert "INCONCLUSIVE: only 0 of" in out
    repro = json.loads((tmp_path / "repro.json").read_text())
    assert [r["id"] for r in repro["requests"]] == [r["id"] for r in report["requests"]]


def alone_answer(url: str) -> Completion:
    """The longest golden case answered alone by the server (whole, with logprobs)."""
    golden = read_golden(GOLDEN)
    case = max(golden.cases, key=lambda c: len(c.token_ids))
    endpoint = Endpoint(url, 30)
    kept, _ = send_alone(endpoint, [Planned(case.id, case, "completions", 0.0, False, None)],
                         served_model(endpoint)["id"], None)
    return kept.answers[case.id, "completions"]


def test_a_serial_divergence_is_explained_only_at_the_servers_own_margin(serve):
    alone = alone_answer(serve())
    margins = [t.margin for t in alone.logprobs]  # None where two alternatives share a text (completions' dict)
    known = [i for i, m in enumerate(margins) if m is not None]
    assert len(known) > len(margins) // 2 and all(margins[i] >= 0 for i in known)
    step = min(known, key=margins.__getitem__)  # the server's own nearest tie
    flipped = Completion(alone.text, alone.token_ids[:step] + [alone.token_ids[step] + 1], None, "length", False)
    assert judge_serial("c", alone, alone, 0.0).kind == "match"
    strict = judge_serial("c", alone, flipped, 0.0)
    assert (strict.kind, strict.index, strict.margin) == ("diverged", step, margins[step])
    assert judge_serial("c", alone, flipped, margins[step]).kind == "explained"
    without_logprobs = Completion(alone.text, alone.token_ids, None, alone.finish_reason, False)
    assert judge_serial("c", without_logprobs, flipped, 1e9).kind == "diverged"  # no margin known: strict


@pytest.mark.parametrize("fault", [None, "hang-up-without-abort"])
def test_a_hang_up_the_server_does_not_abort_fails_the_run(serve, tmp_path, fault):
    """Long answers that the client leaves early must be counted as aborts by the server's status: the
    longest one hung up alone is always held to it (validate.board.lone_hang_up); under load, those a
    status read shows unfinished after their hang-up. At the tiny model's CPU pace the longest answer
    (64 tokens) could end within one status poll, its hang-up then unproven (seen under pytest -n 2):
    at 4 ms a step it runs ten polls past it."""
    code, report = validate(tmp_path, "--url", serve(fault, step_s=0.004), "--golden", str(GOLDEN),
                            "--cancel-rate", "0.5", "--variant-rate", "0")
    aborts = report["drain"]["aborts"]
    longest = max(read_golden(GOLDEN).cases, key=lambda c: len(c.token_ids))
    assert aborts["alone"]["id"].startswith(f"{longest.id}@") and aborts["alone"]["must"] == [aborts["alone"]["id"]]
    assert aborts["alone"]["counted"] == (0 if fault else 1) and aborts["alone"]["ok"] is (fault is None)
    assert aborts["must"] + aborts["unproven"], "the schedule has no hang-up of a long answer"  # seed 0: two
    assert (code == 0) is (fault is None) and report["summary"]["passed"] is (fault is None)


def test_with_prefix_caching_a_join_fault_shows_in_the_cold_requests(serve, tmp_path):
    """`refengine serve`'s default: the alone answers leave their prompts' KV in the cache, so a warm
    request's prefill is mostly a hit; the cold ones (a cache_salt of their own) compute theirs in the
    running batch, where the join fault lives."""
    url = serve("position-off-by-one-on-join", enable_prefix_caching=True, block_size=4)
    code, report = validate(tmp_path, "--url", url, "--golden", str(GOLDEN), "--repeat", "2")
    cache = report["cache"]
    assert code == 1 and cache["cache_salt"] == "sent" and cache["cold"]["diverged"] > 0
    requests = 2 * len(read_golden(GOLDEN).cases)
    assert [cache[g]["requests"] for g in ("cold", "shared", "warm")] == [requests // 3] * 3
    assert cache["cold"]["cached_tokens"] == 0 and cache["warm"]["cached_tokens"] > 0
    assert cache["cold_with_cached_tokens"] == []
    # the counters also count the hits of requests that hung up before their usage was sent
    assert cache["counters"]["load"]["hits"] >= (cache["shared"]["cached_tokens"] or 0) + cache["warm"]["cached_tokens"]
    repro = json.loads((tmp_path / "repro.json").read_text())
    assert sum(r.get("cache") == "cold" for r in repro["requests"]) == cache["cold"]["requests"]
    code, again = validate(tmp_path, "--url", url, "--replay", str(tmp_path / "repro.json"))
    assert code == 1 and again["cache"]["cold"]["diverged"] > 0  # replayed cold, under the replay's own salt


def test_a_server_that_ignores_cache_salt_is_noted(serve, tmp_path, capsys):
    url = serve("cache-salt-ignored", enable_prefix_caching=True, block_size=4)
    code, report = validate(tmp_path, "--url", url, "--golden", str(GOLDEN))
    assert code == 0 and report["cache"]["cold_with_cached_tokens"]  # right answers; the isolation is gone
    assert "ignores cache_salt" in capsys.readouterr().out


def scored(entries, cancelled=False) -> Completion:
    return Completion("x", [5], [1, 2], "length", cancelled, "token_ids", prompt_logprobs=entries)


@pytest.mark.parametrize("alone, loaded, tolerance, problem", [
    (None, None, 0.0, None),
    ([None, {2: -1.0}], [None, {2: -1.0}], 0.0, None),
    ([None, {2: -1.0}], None, 0.0, "alone only"),
    (None, [None, {2: -1.0}], 0.0, "under load only"),
    ([None, {2: -1.0}], [None, {2: -1.0}, {3: -1.0}], 0.0, "3 prompt logprob entries, alone 2"),
    ([None, {2: -1.0}], [None, {2: -1.0 + 1e-9}], 0.0, "prompt position 1, token 2"),   # bit-exact at tolerance 0
    ([None, {2: -1.0}], [None, {2: -1.0 + 1e-9}], 1e-9, None),
    ([None, {2: -1.0}], [None, {2: -1.0 + 3e-9}], 1e-9, "> bound 2e-09"),                 # 2 x the logit bound
    ([None, {2: -1.0, 7: -2.0}], [None, {2: -1.0, 8: -2.0}], 0.0, "prompt position 1: ids [2, 8], alone [2, 7]"),
    ([None, {2: -1.0, 7: -2.0}], [None, {2: -1.0, 8: -2.0}], 1e-9, None),  # a near-tie may swap alternatives
    ([None, {2: -1.0}], [{2: -1.0}, {2: -1.0}], 1e-9, "prompt position 0"),
])
def test_prompt_logprobs_under_load_are_the_alone_ones_within_twice_the_bound(alone, loaded, tolerance, problem):
    got = prompt_logprobs_difference(scored(alone), scored(loaded), tolerance)
    assert (got is None) if problem is None else (got is not None and problem in got), got


# case "c" (a prompt asking for two tokens) sent as a completion: what the serial baseline's tests judge
# answers to (its golden answer is not what they judge)
PLANNED = Planned("r0", GoldenCase(id="c", prompt="hi", messages=None, prompt_ids=[1, 2], max_tokens=2,
                                   token_ids=[7, 8], text="xy", finish_reason="length", margins=[1.0, 1.0],
                                   top_logprobs=[], text_offsets=None), "completions", 0.0, False, None)


def test_the_serial_baseline_fails_prompt_logprobs_that_moved_under_load():
    alone = Completion("xy", [7, 8], [1, 2], "length", False, "token_ids", prompt_logprobs=[None, {2: -1.0}])
    baseline = SerialBaseline({("c", "completions"): alone}, 0.0)
    assert baseline.judge(PLANNED, alone)["verdict"] == "match"
    record = baseline.judge(PLANNED, replace(alone, prompt_logprobs=[None, {2: -1.5}]))
    assert (record["verdict"], record["compared_by"]) == ("diverged", "prompt_logprobs") and "token 2" in record["note"]


def answer(ids, margins=(5.0, 5.0), finish="length") -> Completion:
    return Completion("".join(chr(97 + i) for i in ids), ids, [1, 2], finish, False, "token_ids",
                      logprobs=[TokenLogprob(-0.1, (-0.1, -0.1 - m)) for m in margins])



@pytest.mark.parametrize("others, verdict, choice", [
    ((answer([7, 9]),), "match", None),
    ((answer([7, 9]),), "diverged", None),                         # the first answer moved: no `choice`
    ((answer([7, 8]),), "diverged", 1),                            # the second answer moved
    ((answer([7, 9]), answer([3, 4])), "error", None),             # a choice more than alone
    ((), "error", None),                                           # a choice fewer
    ((answer([7, 9], finish="stop"),), "error", 1),                # its finish reason moved
])
def test_every_choice_of_n_is_judged_against_the_alone_answers_choice_at_its_index(others, verdict, choice):
    alone = replace(answer([7, 8]), others=(answer([7, 9]),))
    first = answer([7, 3]) if (verdict, choice) == ("diverged", None) else answer([7, 8])
    record = SerialBaseline({("c", "completions"): alone}, 0.01).judge(PLANNED, replace(first, others=others))
    assert (record["verdict"], record.get("choice")) == (verdict, choice), record


def test_an_explained_choice_after_the_first_is_the_verdict_and_a_diverged_one_wins_over_it():
    near = answer([7, 9], margins=(5.0, 0.001))  # a near-tie at step 1: a flip there is explained
    alone = replace(answer([7, 8]), others=(near, near))
    baseline = SerialBaseline({("c", "completions"): alone}, 0.01)
    explained = baseline.judge(PLANNED, replace(answer([7, 8]), others=(near, answer([7, 3]))))
    assert (explained["verdict"], explained["choice"], explained["step"]) == ("explained", 2, 1)
    diverged = baseline.judge(PLANNED, replace(answer([7, 8]), others=(answer([7, 3]), answer([2, 9]))))
    assert (diverged["verdict"], diverged["choice"], diverged["step"]) == ("diverged", 2, 0)
