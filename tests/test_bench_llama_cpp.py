"""The llama-cpp bench scenario: its ratios and agreement counts from the runs, a server that will not
start reported by name, and (where `benchmarks/llama_cpp.py --out $REFENGINE_LLAMA_CPP` has built
llama-server) the whole scenario against the real server on the default model."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from refengine.bench.llama_cpp import _agreement, _ratios, llama_server
from refengine.cli import main
from refengine.errors import RefengineError
from refengine.model.cache import default_model_dir

ROOT = Path(__file__).resolve().parent.parent


def _run(batch: int, round_: int, rates: dict[str, float], ids: dict[str, dict]) -> dict:
    return {"round": round_, "batch": batch,
            **{name: {"decode_tok_s": rate, "token_ids": ids.get(name, {})} for name, rate in rates.items()}}


def test_each_ratio_is_taken_within_a_round_then_the_median_over_rounds():
    # round 1's llama.cpp run was slow (the machine drifted): a ratio of medians would read 1.5, the
    # median of per-round ratios reads 2.0
    runs = [_run(8, 0, {"fast": 100.0, "invariant": 90.0, "llama.cpp": 50.0}, {}),
            _run(8, 1, {"fast": 60.0, "invariant": 48.0, "llama.cpp": 20.0}, {}),
            _run(8, 2, {"fast": 80.0, "invariant": 80.0, "llama.cpp": 40.0}, {})]
    ratios = _ratios(runs, ["fast", "invariant"])["8"]
    assert ratios["fast / llama.cpp"] == {"median": 2.0, "rounds": [2.0, 3.0, 2.0]}
    assert ratios["invariant / llama.cpp"] == {"median": 2.0, "rounds": [1.8, 2.4, 2.0]}
    assert ratios["invariant / fast"] == {"median": 0.9, "rounds": [0.9, 0.8, 1.0]}
    assert list(_ratios(runs, ["fast"])["8"]) == ["fast / llama.cpp"]


def test_same_answers_count_requests_whose_ids_match_llama_cpp_in_the_first_round():
    llama = {"a": [1, 2, 3], "b": [4, 5, 6]}
    runs = [_run(2, 0, {"fast": 1.0, "invariant": 1.0, "llama.cpp": 1.0},
                 {"fast": {"a": [1, 2, 3], "b": [4, 5, 7]}, "invariant": {"a": [1, 2, 3], "b": [4, 5, 6]},
                  "llama.cpp": llama}),
            _run(2, 1, {"fast": 1.0, "invariant": 1.0, "llama.cpp": 1.0},
                 {"fast": {"a": [9], "b": [9]}, "invariant": {"a": [9], "b": [9]}, "llama.cpp": llama})]
    assert _agreement(runs, ["fast", "invariant"]) == {"2": {"fast": 1, "invariant": 2, "requests": 2}}


def test_a_server_that_exits_at_start_is_named_with_its_log(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not a gguf")
    with pytest.raises(RefengineError, match=r"^llama_server: .*exit 1"):
        with llama_server("/bin/false", gguf, slots=1, slot_len=16, threads=1):
            pass


@pytest.mark.parametrize("args, named", [
    (["--scenario", "llama-cpp"], "--llama-server"),
    (["--scenario", "llama-cpp", "--llama-server", "/bin/false"], "--gguf"),
    (["--scenario", "llama-cpp", "--llama-server", "/nonexistent/llama-server", "--gguf", "/bin/false"],
     "--llama-server"),
    (["--scenario", "llama-cpp", "--llama-server", "/bin/false", "--gguf", "/bin/false", "--temperature", "0.7"],
     "--temperature"),
    (["--rounds", "0"], "--rounds"),
])
def test_bad_arguments_exit_2_with_one_line(args, named, capsys):
    assert main(["bench", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1 and named in captured.err


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("REFENGINE_LLAMA_CPP"),
                    reason="set REFENGINE_LLAMA_CPP to the folder benchmarks/llama_cpp.py --out built llama-server in")
def test_the_scenario_runs_both_engines_on_the_same_requests(tmp_path):
    built = subprocess.run([sys.executable, ROOT / "benchmarks" / "llama_cpp.py", "--model", default_model_dir(),
                            "--out", os.environ["REFENGINE_LLAMA_CPP"]],
                           capture_output=True, text=True, timeout=1800)
    assert built.returncode == 0, built.stderr
    paths = json.loads(built.stdout)
    args = ["bench", "--scenario", "llama-cpp", "--requests", 3, "--prompt-len", 8, "--max-tokens", 6,
            "--rounds", 2, "--llama-server", paths["llama_server"], "--gguf", paths["gguf"], "--json"]
    done = subprocess.run([sys.executable, "-m", "refengine", *map(str, args)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    llama = json.loads(done.stdout)["llama_cpp"]
    assert [(r["round"], r["batch"]) for r in llama["runs"]] == [(0, 1), (0, 3), (1, 1), (1, 3)]
    for run in llama["runs"]:
        assert run["llama.cpp"]["decode_tokens"] == run["batch"] * 5  # the first of 6 tokens comes with the prompt
        assert all(run[mode]["generated_tokens"] == run["batch"] * 6 for mode in ("fast", "invariant"))
    # two float32 implementations of one trained model: the same greedy answers
    assert llama["same_answers"] == {"1": {"fast": 1, "invariant": 1, "requests": 1},
                                     "3": {"fast": 3, "invariant": 3, "requests": 3}}
