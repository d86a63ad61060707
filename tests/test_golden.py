"""Golden files: the committed ones pass `golden check` in both modes, refresh reproduces them, and
a wrong model, a tampered token or a killed refresh are caught."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from refengine.check.calibrate import calibrate, stored_calibration
from refengine.check.golden import load_prompts, read_golden, refresh
from refengine.check.golden_check import check
from refengine.cli import main
from refengine.cli.common import FAULT_ENV
from refengine.data import shipped
from refengine.errors import RefengineError
from refengine.model import load_model
from refengine.model.cache import default_model_dir
from refengine.model.tiny import TinySpec, make_tiny

GOLDEN_DIR = shipped("golden")
PROMPTS = GOLDEN_DIR / "prompts" / "seed-experiment.jsonl"
# Each committed golden file and the model it was made from: the shipped embedded default (None), or
# a generated tiny model (`refengine make-tiny DIR [flags]`).
GOLDEN_MODELS = {
    "tiny-chat": None,                                       # refengine/data/models/tiny-chat
    "tiny-random": TinySpec(),                               # refengine make-tiny DIR
    "tiny-qwen2-untied": TinySpec(arch="qwen2", tie=False),  # refengine make-tiny DIR --arch qwen2 --no-tie
}


@pytest.fixture(scope="module", params=list(GOLDEN_MODELS))
def golden_model(request, tmp_path_factory):
    """(golden path, model folder); with --update-golden the committed file is refreshed first."""
    name, spec = request.param, GOLDEN_MODELS[request.param]
    model_dir = default_model_dir() if spec is None else make_tiny(tmp_path_factory.mktemp(name), spec)
    path = GOLDEN_DIR / f"{name}.jsonl"
    if request.config.getoption("--update-golden"):
        model = load_model(model_dir)
        refresh(model, PROMPTS, load_prompts(PROMPTS), path, stored_calibration(model) or calibrate(model))
    return path, model_dir


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("other"), TinySpec(), seed=1)


@pytest.mark.golden
@pytest.mark.parametrize("mode", ["fast", "invariant"])
def test_committed_golden_file_passes_check(golden_model, mode, capsys):
    path, model_dir = golden_model
    assert main(["golden", "check", str(path), "--model", str(model_dir), "--mode", mode]) == 0
    assert capsys.readouterr().out.rstrip().endswith("PASS")
    golden, model = read_golden(path), load_model(model_dir)
    for seed in (1, 2, 3):
        result = check(golden, model, mode, seed, max_num_seqs=8)
        assert result.passed, result.report()
        assert set(result.verdicts) == {c.id for c in golden.cases}
        # the cases really shared steps, and some joined while others were decoding
        assert max(result.batch_sizes) > 1
        assert any({s["phase"] for s in step["scheduled"]} == {"prefill", "decode"} for step in result.trace)


@pytest.mark.golden
@pytest.mark.parametrize("fault", ["position-off-by-one-on-join", "logits-rows-misassigned-after-leave"])
def test_check_catches_a_batching_only_fault_because_its_schedule_batches(golden_model, fault, monkeypatch, capsys):
    """These bugs need a request joining or leaving a running batch: one at a time they are invisible."""
    path, model_dir = golden_model
    monkeypatch.setenv(FAULT_ENV, fault)
    check_args = ["golden", "check", str(path), "--model", str(model_dir)]
    assert main(check_args + ["--max-num-seqs", "1"]) == 0
    assert main(check_args) == 1
    assert capsys.readouterr().out.rstrip().endswith("FAIL")


def test_prompt_set_mirrors_the_seed_experiment():
    cases = load_prompts(PROMPTS)
    short = [c for c in cases if c.max_tokens <= 6]
    long = [c for c in cases if c.max_tokens >= 64]
    assert len(short) == 8 and all(c.messages and c.max_tokens >= 2 for c in short)
    assert len(long) >= 3 and len(short) + len(long) == len(cases)


def _numbers_apart(value):
    """(the value with every float replaced by 0.0, its floats in order)."""
    if isinstance(value, float):
        return 0.0, [value]
    if isinstance(value, (list, dict)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        parts = {k: _numbers_apart(v) for k, v in items}
        shape = {k: p[0] for k, p in parts.items()}
        return (shape if isinstance(value, dict) else list(shape.values())), [f for p in parts.values() for f in p[1]]
    return value, []


def test_refresh_is_byte_identical_and_reproduces_the_committed_file(golden_model, tmp_path):
    """Byte for byte on one machine. Against the committed file (made on another CPU, whose BLAS and
    exp/log round float64 differently in the last bits): every token, text and header field (but the
    `numerics` the refresh ran on) exactly,
    every margin and logprob to 1e-9 relative."""
    path, model_dir = golden_model
    outs = [tmp_path / "first" / path.name, tmp_path / "second" / path.name]
    for out in outs:
        assert main(["golden", "refresh", "--model", str(model_dir), "--prompts", str(PROMPTS), "--out", str(out)]) == 0
    assert outs[0].read_bytes() == outs[1].read_bytes()

    fresh, committed = (outs[0].read_text().splitlines(), path.read_text().splitlines())
    machine_free = [{k: v for k, v in json.loads(x).items() if k != "numerics"} for x in (fresh[0], committed[0])]
    assert machine_free[0] == machine_free[1] and len(fresh) == len(committed)  # numerics: the BLAS it ran on
    for got, want in zip(fresh[1:], committed[1:]):
        (got_shape, got_floats), (want_shape, want_floats) = (_numbers_apart(json.loads(x)) for x in (got, want))
        assert got_shape == want_shape
        assert got_floats == pytest.approx(want_floats, rel=1e-9, abs=1e-12)


def test_golden_header_records_how_the_model_was_made(golden_model):
    path, model_dir = golden_model
    header = read_golden(path).header
    assert header["model_fingerprint"] == load_model(model_dir).fingerprint
    if GOLDEN_MODELS[path.stem] is None:  # trained: the recipe of the shipped folder, which make-tiny did not write
        assert "tiny_model" not in header
        assert header["trained_model"] == json.loads((model_dir / "refengine_trained.json").read_text())
    else:
        spec = {k: v for k, v in header["tiny_model"].items() if k not in ("seed", "dtype", "shards")}
        assert TinySpec(**spec) == GOLDEN_MODELS[path.stem] and "trained_model" not in header
    assert header["precision"] == "f64" and set(header["noise"]) >= {"f32_vs_f64", "safety_factor"}


def test_a_golden_file_from_another_model_is_refused(golden_model, other_model_dir, capsys):
    path, _ = golden_model
    assert main(["golden", "check", str(path), "--model", str(other_model_dir)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1
    assert "fingerprint mismatch" in captured.err and str(path) in captured.err


def test_a_tampered_high_margin_token_fails_with_a_readable_diff(golden_model, tmp_path, capsys):
    path, model_dir = golden_model
    lines = path.read_text(encoding="utf-8").splitlines()
    cases = [json.loads(line) for line in lines[1:]]
    case, step = max(((c, s) for c in cases for s in range(len(c["margins"]))), key=lambda cs: cs[0]["margins"][cs[1]])
    original = case["token_ids"][step]
    runner_up = case["top_logprobs"][step][1][0]
    case["token_ids"][step] = runner_up
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("\n".join([lines[0]] + [json.dumps(c) for c in cases]) + "\n", encoding="utf-8")

    assert main(["golden", "check", str(tampered), "--model", str(model_dir)]) == 1
    out = capsys.readouterr().out
    assert f"{case['id']}: diverged at generated token {step}\n" in out
    assert f"got token {original} " in out and f"golden token {runner_up} " in out
    assert f"golden top-2 margin there {case['margins'][step]:.6g} > tolerance" in out
    assert "diverged 1" in out and out.rstrip().endswith("FAIL")


def test_a_killed_refresh_leaves_the_old_file_intact(tiny_model_dir, tmp_path):
    prompts = tmp_path / "many.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"story {i}", "max_tokens": 128}) + "\n"
                               for i in range(200)))
    calibration = tmp_path / "noise.json"
    calibration.write_text(json.dumps(read_golden(GOLDEN_DIR / "tiny-random.jsonl").header["noise"]))
    out = tmp_path / "golden" / "old.jsonl"
    out.parent.mkdir()
    out.write_text("the old golden file\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "refengine", "golden", "refresh", "--model", str(tiny_model_dir),
         "--prompts", str(prompts), "--out", str(out), "--calibration", str(calibration)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        progress = b""
        while not re.search(rb"\| *[1-9]\d*/25600 ", progress):  # tqdm, in tokens: some made, the file not written
            chunk = os.read(process.stderr.fileno(), 4096)
            assert chunk, "refresh exited before reporting progress"
            progress += chunk
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait(60)
        process.stderr.close()
    assert process.returncode == -signal.SIGKILL
    assert out.read_text() == "the old golden file\n"
    assert [p.name for p in out.parent.iterdir()] == ["old.jsonl"]


@pytest.mark.parametrize("line, error", [
    ('{"id": "a", "prompt": "x"}', "'max_tokens' must be a positive integer"),
    ('{"id": "a", "prompt": "x", "messages": [], "max_tokens": 2}', "exactly one of 'prompt'"),
    ('{"id": "a", "prompt": "x", "max_tokens": 2, "temprature": 0}', "unknown key(s) temprature"),
    ('{"id": "a", "prompt": "x", "max_tokens": 2}\n{"id": "a", "prompt": "y", "max_tokens": 2}', "duplicate id 'a'"),
    ('{"id": "a", "prompt": "x", "max_tokens": 2', "invalid JSON"),
])
def test_bad_prompt_files_name_the_line(tmp_path, line, error):
    path = tmp_path / "prompts.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(RefengineError) as excinfo:
        load_prompts(path)
    assert str(path) + ":" in str(excinfo.value) and error in str(excinfo.value)


def test_a_file_that_is_not_golden_is_refused(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(PROMPTS.read_text())
    with pytest.raises(RefengineError, match="not a golden file header"):
        read_golden(path)
