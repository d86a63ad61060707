"""`refengine bench` on the default tiny model: every scenario runs the work it reports, the ratios
are the ones its own figures give, and bad arguments exit 2 before anything runs."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from refengine.bench.kestrel import SHORT_TOKENS
from refengine.cli import main

REQUESTS, PROMPT_LEN, MAX_TOKENS, SERIAL_REQUESTS = 4, 8, 5, 2


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One bench of every scenario (as a user runs it), shared by the tests below."""
    plot = tmp_path_factory.mktemp("bench") / "sweep.png"
    args = ["bench", "--requests", REQUESTS, "--prompt-len", PROMPT_LEN, "--max-tokens", MAX_TOKENS,
            "--serial-requests", SERIAL_REQUESTS, "--batch-sizes", "1,2", "--scenario", "decode,kestrel,reference",
            "--plot", plot, "--json"]
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
        goal, interleaved = decode["goals"][mode], decode["interleaved"][mode]
        assert goal["separate_runs_ratio"] == pytest.approx(rows[mode, REQUESTS]["vs_serial"])
        assert interleaved["batch"] == REQUESTS and min(interleaved["decode_steps"].values()) > 0
        rates = interleaved["decode_tok_s"]
        assert goal["ratio"] == interleaved["ratio"] == pytest.approx(rates["batched"] / rates["serial"])
    weight_read_s = data["weight_bytes_f32"] / machine["bandwidth"]
    batch1, reads = decode["goals"]["batch1_step_vs_weight_read"], decode["batch1_with_bandwidth_reads"]
    p50_step_s = rows["fast", 1]["decode_step_ms"]["p50"] / 1e3
    assert batch1["best_bandwidth_ratio"] == pytest.approx(p50_step_s / weight_read_s)
    assert batch1["ratio"] == reads["ratio"] > 0
    assert reads["decode_steps"] == SERIAL_REQUESTS * (MAX_TOKENS - 1)  # every token after the first is a decode
    low, high = reads["bandwidth_range"]
    assert 0 < low <= reads["bandwidth_median"] <= high
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


def test_reference_figure_is_its_time_against_float64_bytes(report):
    data = report[0]
    reference = data["reference"]
    assert reference["weight_bytes"] == 2 * data["weight_bytes_f32"]  # float64: twice the float32 bytes
    assert reference["roofline_fraction"] == pytest.approx(reference["roofline_s_per_token"]
                                                           / reference["decode_s_per_token"])


def test_plot_is_a_png(report):
    data, plot = report
    assert data["decode"]["plot"] == str(plot)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hf_runs_the_same_workload_beside_the_engine(tmp_path):
    pytest.importorskip("transformers")
    args = ["bench", "--requests", 2, "--prompt-len", PROMPT_LEN, "--max-tokens", MAX_TOKENS, "--serial-requests", 1,
            "--mode", "fast", "--hf", "--json"]
    done = subprocess.run([sys.executable, "-m", "refengine", *map(str, args)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    decode = json.loads(done.stdout)["decode"]
    hf, rows = decode["hf"], {row["batch"]: row for row in decode["rows"]}
    assert hf["batched"]["decode_tok_s"] > 0 and hf["serial"]["decode_tok_s"] > 0
    assert hf["engine_vs_hf"]["batched_fast"] == pytest.approx(rows[2]["decode_tok_s"] / hf["batched"]["decode_tok_s"])
    assert hf["engine_vs_hf"]["serial"] == pytest.approx(rows[1]["decode_tok_s"] / hf["serial"]["decode_tok_s"])


@pytest.mark.parametrize("args, named", [
    (["--batch-sizes", "0,2"], "--batch-sizes"),
    (["--scenario", "decode,warp"], "--scenario"),
    (["--requests", "0"], "--requests"),
    (["--max-tokens", "0"], "--max-tokens"),
])
def test_bad_arguments_exit_2_with_one_line(args, named, capsys):
    assert main(["bench", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1 and named in captured.err
