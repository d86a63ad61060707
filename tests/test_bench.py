"""`refengine bench` on the default tiny model: every scenario runs the work it reports, the ratios
are the ones its own figures give, and bad arguments exit 2 before anything runs."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from refengine.bench.kestrel import SHORT_TOKENS
from refengine.bench.prefix import QUESTIONS, SYSTEM_TOKENS
from refengine.bench.reference import (
    SEED_PROMPTS,
    reference_report,
    refresh_cases,
    run_reference,
)
from refengine.bench.interleaved import against_probe
from refengine.bench.roofline import Machine, Roofline, kv_bytes_per_token, streamed_parameters
from refengine.bench.workloads import random_requests, start_engine
from refengine.check.golden import LOCKSTEP_GROUP, load_prompts
from refengine.cli import main
from refengine.data import shipped
from refengine.engine import EngineConfig, LLMEngine
from refengine.model import loader
from refengine.sampling import SamplingParams
from refengine.strategies.models import DEFAULT_MODEL, tiny_model

REQUESTS, PROMPT_LEN, MAX_TOKENS, SERIAL_REQUESTS, EXAMPLES = 4, 8, 5, 2, 2


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One bench of every scenario (as a user runs it), shared by the tests below."""
    plot = tmp_path_factory.mktemp("bench") / "sweep.png"
    args = ["bench", "--requests", REQUESTS, "--prompt-len", PROMPT_LEN, "--max-tokens", MAX_TOKENS,
            "--serial-requests", SERIAL_REQUESTS, "--batch-sizes", "1,2",
            "--scenario", "decode,kestrel,prefix,reference,suite", "--examples", EXAMPLES, "--plot", plot, "--json"]
    done = subprocess.run([sys.executable, "-m", "refengine", *map(str, args)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), plot


def test_every_decode_run_generates_what_it_was_asked_for(report):
    decode = report[0]["decode"]
    runs = {(row["mode"], row["batch"]): row for row in decode["rows"]}
    assert set(runs) == {(mode, batch) for mode in ("fast", "invariant") for batch in (1, 2, REQUESTS)}
    for (mode, batch), row in runs.items():
        requests = SERIAL_REQUESTS if batch == 1 else batch
        assert row["requests"] == requests and row["generated_tokens"] == requests * MAX_TOKENS
        assert row["max_num_seqs"] == batch and row["decode_tokens"] >= row["decode_steps"] > 0
        assert row["vs_serial"] == pytest.approx(row["decode_tok_s"] / runs["fast", 1]["decode_tok_s"])


def test_goals_are_ratios_of_the_reported_figures(report):
    data = report[0]
    decode, machine = data["decode"], data["machine"]
    rows = {(row["mode"], row["batch"]): row for row in decode["rows"]}
    for mode in ("fast", "invariant"):
        interleaved = decode["interleaved"][mode]
        assert interleaved["batch"] == REQUESTS and min(interleaved["decode_steps"].values()) > 0
        rates = interleaved["decode_tok_s"]
        assert interleaved["ratio"] == pytest.approx(rates["batched"] / rates["serial"])
    goals = decode["goals"]
    kv_per_position = kv_bytes_per_token(tiny_model(DEFAULT_MODEL).config)
    probed = decode["against_probe"]  # the roofline goals' swept batch sizes (8 is not swept here)
    assert set(probed) == {"1", str(REQUESTS)}
    for batch, probe in probed.items():
        assert goals[f"fast batch {batch} share of roofline"] == {
            "ratio": pytest.approx(probe["share"]), "goal": 0.8 if batch == "1" else 0.67, "at": int(batch)}
        # a tiny model's step is far from compute-bound: both probes read memory
        assert probe["batch"] == int(batch) and probe["probe"] == "matrix-vector read" and probe["share"] > 0
        requests = SERIAL_REQUESTS if batch == "1" else int(batch)
        assert probe["decode_steps"] == requests * (MAX_TOKENS - 1) // int(batch)  # every token after the first
        low, high = probe["figure_range"]
        assert 0 < low <= probe["figure_median"] <= high
        assert probe["share"] == pytest.approx(np.median([s["roofline_s"] / s["seconds"] for s in probe["steps"]]))
        for step in probe["steps"]:  # the weights and the rows' cache, read at the probe's bandwidth
            assert step["rows"] == int(batch) and PROMPT_LEN <= step["context"] < PROMPT_LEN + MAX_TOKENS
            assert step["roofline_s"] == pytest.approx(
                (data["weight_bytes_f32"] + step["rows"] * step["context"] * kv_per_position) / step["figure"])
    assert "fast batch 8 share of roofline" not in goals
    in_turn = decode["modes_in_turn"]  # both modes stepped alternately at each swept batch size
    assert set(in_turn) == {"1", "2", str(REQUESTS)}
    for batch, turns in in_turn.items():
        requests = SERIAL_REQUESTS if batch == "1" else int(batch)
        assert turns["batch"] == int(batch)
        assert turns["decode_steps"]["invariant"] == turns["decode_steps"]["fast"] >= requests * (MAX_TOKENS - 1) // int(batch)
        rates = turns["decode_tok_s"]
        assert turns["ratio"] == pytest.approx(rates["invariant"] / rates["fast"])
    ratios = {int(batch): turns["ratio"] for batch, turns in in_turn.items()}
    worst = min(ratios, key=ratios.get)
    assert goals["invariant / fast, worst batch"] == {"ratio": pytest.approx(ratios[worst]), "goal": 0.85, "at": worst}
    assert goals["invariant batch 1 / serial"] == {"ratio": pytest.approx(ratios[1]), "goal": 0.8, "at": 1}
    assert machine["bandwidth"] == max(machine["bandwidth_1thread"], machine["bandwidth_all"]) > 0


def test_kestrel_runs_short_and_long_answers_serial_and_batched(report):
    kestrel = report[0]["kestrel"]
    assert all(SHORT_TOKENS[0] <= n <= SHORT_TOKENS[1] for n in kestrel["short"]["max_tokens"])
    assert kestrel["long"]["max_tokens"] == [MAX_TOKENS] * 8
    for workload in kestrel.values():
        runs = workload["runs"]
        assert set(runs) == {"serial", "fast", "invariant"}
        assert runs["serial"]["max_num_seqs"] == 1 and runs["fast"]["max_num_seqs"] == 8
        for mode in ("fast", "invariant"):
            assert runs[mode]["generated_tokens"] == sum(workload["max_tokens"])
            assert 0 < runs[mode]["latency_s_first"] <= runs[mode]["latency_s_mean"]
            assert workload["batched_speedup"][mode] == pytest.approx(runs["serial"]["wall_s"] / runs[mode]["wall_s"])
        assert workload["predicted_s"]["serial"] > workload["predicted_s"]["batched"] > 0


def test_prefix_runs_a_shared_system_prompt_cold_and_hot(report):
    prefix = report[0]["prefix"]
    assert (prefix["system_tokens"], prefix["questions"]) == (SYSTEM_TOKENS, QUESTIONS)
    for mode in ("fast", "invariant"):
        run = prefix[mode]
        assert run["hot_cached_tokens"] == SYSTEM_TOKENS // 16 * 16  # every full block of the system prompt
        assert run["cold_ttft_ms"] > 0 and run["hot_ttft_ms"] > 0 and run["cold_over_hot"] > 0


def _check_refresh_runs(reference: dict, cases) -> None:
    """Each run decoded every case (up to its cut max_tokens), passes are what serial and lockstep
    decoding take, and every rate and ratio is the one the run's own figures give."""
    assert reference["cases"] == len(cases)
    assert reference["case_max_tokens"] == {case.id: case.max_tokens for case in cases}
    groups = [cases[i:i + reference["lockstep_group"]] for i in range(0, len(cases), reference["lockstep_group"])]
    for name in ("serial", "lockstep"):
        run = reference[name]
        assert set(run["case_tokens"]) == {case.id for case in cases}
        assert all(1 <= run["case_tokens"][case.id] <= case.max_tokens for case in cases)
        assert run["tokens"] == sum(run["case_tokens"].values())
        assert run["tok_s"] == pytest.approx(run["tokens"] / run["seconds"])
        assert run["s_per_pass"] == pytest.approx(run["seconds"] / run["passes"])
        assert run["roofline_s"] == pytest.approx(run["passes"] * reference["roofline_s_per_pass"])
        assert run["roofline_fraction"] == pytest.approx(run["roofline_s"] / run["seconds"])
        assert 0 < run["prefill_s"] and run["prefill_s"] + run["decode_s"] <= run["seconds"]
        assert run["decode_roofline_fraction"] == pytest.approx(
            run["decode_passes"] * reference["roofline_s_per_pass"] / run["decode_s"])
        assert reference["goals"][f"{name} share of roofline"] == {"ratio": run["roofline_fraction"], "goal": 0.6}
    assert reference["same_tokens"] and reference["serial"]["case_tokens"] == reference["lockstep"]["case_tokens"]
    serial, lockstep = reference["serial"], reference["lockstep"]
    assert serial["passes"] == serial["tokens"]  # alone, every token is a pass over the weights
    assert serial["decode_passes"] == serial["passes"] - len(cases)  # the first pass of each is its prefill
    assert lockstep["decode_passes"] == lockstep["passes"] - len(groups)
    assert lockstep["passes"] == sum(max(lockstep["case_tokens"][c.id] for c in group) for group in groups)
    assert reference["lockstep_vs_serial"] == pytest.approx(serial["seconds"] / lockstep["seconds"])
    assert reference["bytes_per_pass"] == reference["weight_bytes_f64"] + reference["stored_bytes_per_pass"]
    assert reference["roofline_s_per_pass"] == pytest.approx(reference["bytes_per_pass"] / reference["bandwidth"])


def test_reference_refresh_decodes_the_seed_set_serial_and_in_lockstep(report):
    data = report[0]
    reference = data["reference"]
    cases = refresh_cases(None, MAX_TOKENS)[1]
    assert reference["prompts"] == str(shipped(*SEED_PROMPTS)) and reference["max_tokens_cap"] == MAX_TOKENS
    shipped_cases = load_prompts(shipped(*SEED_PROMPTS))
    assert [c.max_tokens for c in cases] == [min(c.max_tokens, MAX_TOKENS) for c in shipped_cases]
    assert reference["lockstep_group"] == LOCKSTEP_GROUP
    _check_refresh_runs(reference, cases)
    assert not reference["streamed"] and reference["stored_bytes_per_pass"] == 0  # in memory: widened once
    assert reference["weight_bytes_f64"] == 2 * data["weight_bytes_f32"]  # float64: twice the float32 bytes
    assert reference["bandwidth"] == data["machine"]["bandwidth"]


@pytest.mark.parametrize("model_name", ["qwen3-gqa2-tied", "qwen2-gqa2-untied"])
def test_a_streamed_refresh_also_reads_the_stored_weights(model_name, tmp_path, monkeypatch):
    """Streamed (every model streams above 0 bytes with no memory to spare), a pass reads the checkpoint besides the float64
    weights: the tied head's embedding once, an untied model's embedding not at all (a few rows)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "Once upon a time", "max_tokens": 3}\n'
                       '{"id": "b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}\n'
                       '{"id": "c", "prompt": "The sea", "max_tokens": 2}\n')
    monkeypatch.setattr(loader, "STREAM_ABOVE_BYTES", 0)
    monkeypatch.setattr(loader, "available_memory", lambda: 0)
    model = tiny_model(model_name)
    path, cases = refresh_cases(prompts, 4)
    machine = Machine(bandwidth_1thread=1e10, bandwidth_all=2e10, threads=2, sgemm_flops=1e11, load_average=0.0)
    reference = reference_report(run_reference(model.path, path, cases, 4, group=2), machine)
    assert reference["streamed"] and reference["stored_dtypes"] == ["F32"]
    assert reference["stored_bytes_per_pass"] == streamed_parameters(model.config) * 4
    assert reference["case_max_tokens"] == {"a": 3, "b": 4, "c": 2} and reference["bandwidth"] == 2e10
    _check_refresh_runs(reference, cases)


def test_a_compute_bound_step_is_held_against_an_sgemm_right_after_it():
    """Where the roofline says compute-bound (here a machine of 1 kflop/s and memory read in no time),
    the probe is the square sgemm, and each step's roofline is its flops at the sgemm's rate, not at
    the machine's."""
    model = tiny_model(DEFAULT_MODEL)
    slow = Machine(bandwidth_1thread=1e18, bandwidth_all=1e18, threads=2, sgemm_flops=1e3, load_average=0.0)
    roofline = Roofline.of(model.config, slow)
    probe = against_probe(model, random_requests(model, 2, PROMPT_LEN, 3), 2, roofline)
    assert probe["probe"] == "sgemm" and probe["batch"] == 2 and probe["decode_steps"] == 2
    for step in probe["steps"]:
        assert step["rows"] == 2 and step["figure"] > 1e8  # a real BLAS, not the machine handed in
        assert step["roofline_s"] == pytest.approx(2 * streamed_parameters(model.config) * step["rows"] / step["figure"])
    assert probe["share"] == pytest.approx(np.median([s["roofline_s"] / s["seconds"] for s in probe["steps"]]))


def test_suite_counts_every_engine_property_on_the_default_model(report):
    suite = report[0]["suite"]
    rows = {row["property"]: row for row in suite["properties"]}
    assert suite["model"] == "qwen3-gqa2-tied" and suite["max_examples"] == EXAMPLES
    assert {"test_batching.py::test_invariant_mode_is_exact",
            "test_consistency.py::test_any_chunk_size_gives_the_same_outputs",
            "test_reference.py::test_engine_agrees_with_the_float64_reference",
            "test_state_machine.py::SchedulerKVMachine"} <= set(rows)
    assert not any(name.startswith("test_http.py") for name in rows)  # they need a server
    for name, row in rows.items():
        # a @given property runs exactly its examples; a state machine run that stopped early counts too
        assert row["examples"] == EXAMPLES if name.split("::")[1].startswith("test_") else row["examples"] >= EXAMPLES
        assert row["schedules_per_s"] == pytest.approx(row["examples"] / row["seconds"])
    total = suite["total"]
    assert total["examples"] == sum(row["examples"] for row in rows.values())
    assert total["seconds"] == pytest.approx(sum(row["seconds"] for row in rows.values()))
    assert total["schedules_per_s"] == pytest.approx(total["examples"] / total["seconds"])


def test_faults_hunts_each_fault_with_its_property_and_times_the_finds(capsys):
    """seed-leak shows in the first few of the dev profile's examples (a corner holds two seeded requests):
    both runs find it and shrink it to at most 3 requests."""
    from refengine.bench.faults import print_faults

    assert main(["bench", "--scenario", "faults", "--runs", "2", "--faults", "seed-leak", "--json"]) == 0
    faults = json.loads(capsys.readouterr().out)["faults"]
    assert (faults["runs"], faults["examples"], faults["seed"]) == (2, 25, 0)
    [row] = faults["faults"]
    assert (row["fault"], row["property"], row["runs"], row["found"], row["shrunk"]) == \
        ("seed-leak", "invariant-mode-is-exact", 2, 2, 2)
    assert 0 < row["median_first_s"] <= row["worst_first_s"] and 0 < row["median_shrunk_s"]
    assert row["median_first_requests"] >= 2  # a seed leaks only between two requests
    assert faults["not_measured"]["slot-leak"] == "http-server-drains"
    print_faults(faults)
    table = capsys.readouterr().out
    assert "| seed-leak | invariant-mode-is-exact | 2/2 |" in table and "slot-leak (http-server-drains)" in table


def test_a_fault_meets_the_goals_only_when_found_often_and_fast():
    from refengine.bench.faults import Hunt, _row

    def hunts(found: int, first_s: float, worst_s: float) -> list:
        return [Hunt(True, worst_s if n == 0 else first_s, 2, first_s) for n in range(found)] + \
            [Hunt(False, None, None, None)] * (20 - found)

    assert _row("f", "p", hunts(19, 9.9, 59.9))["meets_goals"]
    assert not _row("f", "p", hunts(18, 1.0, 2.0))["meets_goals"]     # found too rarely
    assert not _row("f", "p", hunts(20, 10.1, 12.0))["meets_goals"]   # median too slow
    assert not _row("f", "p", hunts(20, 1.0, 60.1))["meets_goals"]    # worst too slow
    assert not _row("f", "p", hunts(0, 1.0, 1.0))["meets_goals"]
    row = _row("f", "p", hunts(19, 3.0, 7.0))
    assert (row["found"], row["median_first_s"], row["worst_first_s"], row["shrunk"]) == (19, 3.0, 7.0, 19)


def test_plot_is_a_png(report):
    data, plot = report
    assert data["decode"]["plot"] == str(plot)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# greedy; sampled over every id (HF's top_k 0). The sampled run is slow-marked: torch on both cores for
# a while longer beside the parallel run's HTTP tests starves their servers' threads.
@pytest.mark.parametrize("sampler", [[], pytest.param(["--temperature", 1.0], marks=pytest.mark.slow)])
def test_hf_runs_the_same_workload_beside_the_engine(tmp_path, sampler):
    pytest.importorskip("transformers")
    args = ["bench", "--requests", 2, "--prompt-len", PROMPT_LEN, "--max-tokens", MAX_TOKENS, "--serial-requests", 1,
            "--mode", "fast", "--hf", "--json", *sampler]
    done = subprocess.run([sys.executable, "-m", "refengine", *map(str, args)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    decode = json.loads(done.stdout)["decode"]
    hf, rows = decode["hf"], {row["batch"]: row for row in decode["rows"]}
    assert hf["batched"]["decode_tok_s"] > 0 and hf["serial"]["decode_tok_s"] > 0
    assert hf["batched"]["sampling"] == ({"temperature": 1.0, "top_k": 0, "top_p": 1.0} if sampler else "greedy")
    assert hf["engine_vs_hf"]["batched_fast"] == pytest.approx(rows[2]["decode_tok_s"] / hf["batched"]["decode_tok_s"])
    assert hf["engine_vs_hf"]["serial"] == pytest.approx(rows[1]["decode_tok_s"] / hf["serial"]["decode_tok_s"])


def test_a_sampled_workload_samples_each_request_with_its_own_seed():
    """--temperature/--top-k/--top-p: request i samples with seed i, batched exactly as alone (invariant
    mode), and not what greedy decoding gives."""
    model = tiny_model(DEFAULT_MODEL)
    sampler = {"temperature": 1.5, "top_k": 40, "top_p": 0.9}
    requests = random_requests(model, 3, PROMPT_LEN, MAX_TOKENS, sampler=sampler)
    engine = start_engine(model, requests, "invariant", 3)
    batched = engine.run()
    assert max(len(step["scheduled"]) for step in engine.trace) == 3  # they did run together
    greedy = start_engine(model, random_requests(model, 3, PROMPT_LEN, MAX_TOKENS), "invariant", 3).run()
    for i, r in enumerate(requests):
        alone = LLMEngine(model, EngineConfig(mode="invariant", max_num_seqs=1))
        alone.add_request("x", r.prompt_ids, params=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True,
                                                                   seed=i, **sampler))
        assert batched[r.request_id].token_ids == alone.run()["x"].token_ids
    assert any(batched[r.request_id].token_ids != greedy[r.request_id].token_ids for r in requests)


def test_a_sampled_bench_reports_its_sampler():
    args = ["bench", "--requests", 2, "--prompt-len", PROMPT_LEN, "--max-tokens", MAX_TOKENS, "--serial-requests", 1,
            "--mode", "fast", "--temperature", 0.6, "--top-k", 20, "--json"]
    done = subprocess.run([sys.executable, "-m", "refengine", *map(str, args)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["workload"]["sampling"] == {"temperature": 0.6, "top_k": 20, "top_p": 1.0}
    assert all(row["generated_tokens"] == row["requests"] * MAX_TOKENS for row in report["decode"]["rows"])


@pytest.mark.parametrize("args, named", [
    (["--batch-sizes", "0,2"], "--batch-sizes"),
    (["--scenario", "decode,warp"], "--scenario"),
    (["--requests", "0"], "--requests"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--examples", "0"], "--examples"),
    (["--runs", "0"], "--runs"),
    (["--scenario", "faults", "--faults", "slot-leak"], "--faults"),
    (["--scenario", "reference", "--prompts", "/nonexistent/prompts.jsonl"], "--prompts"),
    (["--temperature", "0"], "--temperature"),
    (["--temperature", "0.7", "--top-p", "1.5"], "--top-p"),
    (["--temperature", "0.7", "--top-k", "-1"], "--top-k"),
    (["--top-k", "20"], "--top-k"),
])
def test_bad_arguments_exit_2_with_one_line(args, named, capsys):
    assert main(["bench", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1 and named in captured.err


def test_a_corner_failing_above_the_shrunk_size_is_a_find_left_unshrunk(monkeypatch, tmp_path):
    """The suite stops at a failing @example without shrinking it: a hunt does the same (a find, with no
    time to a small failure), whatever its draws would have found after."""
    from refengine.bench.faults import hunt_once
    from refengine.suite import hunts
    from refengine.suite.corners import CORNERS

    monkeypatch.setenv("REFENGINE_REPRO_DIR", str(tmp_path))
    corner = CORNERS["invariant-mode-is-exact"]["preempted-ahead-of-a-waiting-request"]
    four = {**corner, "requests": corner["requests"] + [{"id": "r3", "prompt_ids": [1], "arrival_step": 9,
                                                         "max_tokens": 1}]}
    monkeypatch.setattr(hunts, "corner_examples", lambda prop: [(DEFAULT_MODEL, four)])
    hunt = hunt_once("preempted-requeued-last", 1, 0)
    assert (hunt.found, hunt.first_requests, hunt.small_s) == (True, 4, None) and hunt.first_s > 0
