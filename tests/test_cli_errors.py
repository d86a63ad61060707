"""Bad command lines exit with status 2 and exactly one stderr line naming the problem."""
from __future__ import annotations

import subprocess
import sys

import pytest

from refengine.model.tiny import TinySpec, make_tiny

SPEC = TinySpec(layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=48, vocab=260)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("cli-model"), SPEC)


def refengine(*args, cwd):
    return subprocess.run([sys.executable, "-m", "refengine", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def assert_one_line_error(result, *named):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    for text in named:
        assert text in lines[0]
    assert result.stdout == ""


@pytest.mark.parametrize("command", [["info"], ["generate", "--ids", "1,2"], ["logits", "--ids", "1", "--out", "x.npy"]])
def test_non_existent_model_folder(tmp_path, command):
    missing = tmp_path / "no-such-model"
    result = refengine(command[0], "--model", missing, *command[1:], cwd=tmp_path)
    assert_one_line_error(result, str(missing), "does not exist")


def test_logits_with_an_id_outside_the_vocabulary(model_dir, tmp_path):
    result = refengine("logits", "--model", model_dir, "--ids", f"1,{SPEC.vocab}", "--out", "x.npy", cwd=tmp_path)
    assert_one_line_error(result, "--ids", f"token id {SPEC.vocab} at position 1", "outside the vocabulary")
    assert not (tmp_path / "x.npy").exists()


def test_generate_with_an_id_outside_the_vocabulary(model_dir, tmp_path):
    result = refengine("generate", "--model", model_dir, "--ids", f"{SPEC.vocab + 5}", cwd=tmp_path)
    assert_one_line_error(result, "--ids", f"token id {SPEC.vocab + 5} at position 0")


@pytest.mark.parametrize("command", [["logits", "--out", "x.npy"], ["generate"]])
@pytest.mark.parametrize("ids", ["", ","])
def test_empty_ids(model_dir, tmp_path, command, ids):
    result = refengine(command[0], "--model", model_dir, "--ids", ids, *command[1:], cwd=tmp_path)
    assert_one_line_error(result, "--ids", "empty prompt")


def test_ids_that_are_not_integers(model_dir, tmp_path):
    result = refengine("generate", "--model", model_dir, "--ids", "1,x", cwd=tmp_path)
    assert_one_line_error(result, "--ids", "'1,x'")


def test_a_valid_command_line_succeeds(model_dir, tmp_path):
    result = refengine("logits", "--model", model_dir, "--ids", f"0,{SPEC.vocab - 1}", "--out", "x.npy", cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == ""
    assert (tmp_path / "x.npy").exists()


@pytest.mark.parametrize("command, flag", [
    (["validate", "--url", "http://127.0.0.1:9", "--golden", "g.jsonl", "--concurrency", "0"], "--concurrency"),
    (["make-tiny", "out", "--heads", "3", "--kv-heads", "2"], "--heads"),
    (["bench", "--requests", "0"], "--requests"),
    (["replay", "--fault", "drop-token"], "--fault"),
    (["run-schedule", "--mode", "fast", "--model", "no-such-folder"], "no-such-folder"),
])
def test_library_errors_name_the_flag_that_set_the_field(tmp_path, command, flag):
    """The library names fields (`concurrency: ...`); the one line the user reads names the flag."""
    (tmp_path / "g.jsonl").write_text("")
    result = refengine(*command, cwd=tmp_path)
    assert_one_line_error(result, flag)
    assert result.stderr.split("error: ", 1)[1].startswith(flag)
