"""Sharded golden refresh: `golden refresh --shard I/N` on each of N machines, then `golden merge`,
gives the bytes of one unsharded refresh; shards that are not the N of one refresh are refused with
an error naming what differs. Shards are made of whole lockstep groups (cases decoded together share
products, so a case's last bits depend on its group)."""
from __future__ import annotations

import json

import pytest

from refengine.cli import main
from refengine.data import shipped
from refengine.model.tiny import make_tiny

PROMPTS = [
    {"id": "story", "prompt": "Once upon a time", "max_tokens": 6},
    {"id": "fox", "prompt": "The quick brown fox", "max_tokens": 4},
    {"id": "japan", "messages": [{"role": "user", "content": "What is the capital of Japan?"}], "max_tokens": 5},
    {"id": "count", "prompt": "1, 2, 3,", "max_tokens": 3},
    {"id": "sea", "messages": [{"role": "user", "content": "Write about the sea."}], "max_tokens": 7},
]


GROUP = ["--lockstep-group", "2"]  # 5 prompts: groups story+fox, japan+count, sea


@pytest.fixture(scope="module")
def refreshed(tiny_model_dir, tmp_path_factory):
    """The prompt set refreshed whole and as 3 shards (and 2 shards), same model, same machine."""
    d = tmp_path_factory.mktemp("shards")
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS), encoding="utf-8")
    model = ["--model", str(tiny_model_dir), "--prompts", str(prompts), *GROUP]
    assert main(["golden", "refresh", *model, "--out", str(d / "whole.jsonl")]) == 0
    for n in (2, 3):
        for i in range(1, n + 1):
            assert main(["golden", "refresh", *model, "--shard", f"{i}/{n}", "--out", str(d / f"s{i}of{n}.jsonl")]) == 0
    return d


def shards(d, n):
    return [str(d / f"s{i}of{n}.jsonl") for i in range(1, n + 1)]


def case_ids(path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()[1:]]


@pytest.mark.parametrize("n", [2, 3])
def test_merged_shards_are_byte_identical_to_the_unsharded_refresh(refreshed, n):
    first = {2: ["story", "fox", "sea"], 3: ["story", "fox"]}[n]  # every n-th group of two from the first
    assert case_ids(refreshed / f"s1of{n}.jsonl") == first
    out = refreshed / f"merged{n}.jsonl"
    assert main(["golden", "merge", *reversed(shards(refreshed, n)), "--out", str(out)]) == 0  # any order
    assert out.read_bytes() == (refreshed / "whole.jsonl").read_bytes()


def refused(args, capsys) -> str:
    assert main(["golden", "merge", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    return err


def test_a_missing_or_repeated_shard_is_refused(refreshed, capsys):
    s = shards(refreshed, 3)
    out = ["--out", str(refreshed / "x.jsonl")]
    assert "missing [3]" in refused([s[0], s[1], *out], capsys)
    assert "given twice [2]" in refused([s[0], s[1], s[1], *out], capsys)
    assert "shard.count differs" in refused([s[0], shards(refreshed, 2)[1], s[2], *out], capsys)
    assert "not a shard" in refused([*s, str(refreshed / "whole.jsonl"), *out], capsys)
    assert not (refreshed / "x.jsonl").exists()


def test_shards_of_another_model_or_prompt_set_are_refused(refreshed, tiny_model_dir, tmp_path, capsys):
    calibration = ["--calibration", str(shipped("golden", "tiny-random.calibration.json"))]
    (tmp_path / "set").mkdir()
    edited = tmp_path / "set" / "prompts.jsonl"  # same file name, one prompt changed
    edited.write_text((refreshed / "prompts.jsonl").read_text().replace("Once upon", "Once, upon"), encoding="utf-8")
    for model, prompts, name in ((make_tiny(tmp_path / "other", seed=1), refreshed / "prompts.jsonl", "model.jsonl"),
                                 (tiny_model_dir, edited, "set.jsonl")):
        assert main(["golden", "refresh", "--model", str(model), "--prompts", str(prompts), *calibration,
                     *GROUP, "--shard", "3/3", "--out", str(tmp_path / name)]) == 0
    capsys.readouterr()
    s, out = shards(refreshed, 3), ["--out", str(tmp_path / "x.jsonl")]
    assert "'model_fingerprint' differs" in refused([s[0], s[1], str(tmp_path / "model.jsonl"), *out], capsys)
    assert "shard.prompts_sha256 differs" in refused([s[0], s[1], str(tmp_path / "set.jsonl"), *out], capsys)


@pytest.mark.parametrize("shard", ["0/2", "3/2", "x/2", "2"])
def test_a_bad_shard_is_a_usage_error(refreshed, tiny_model_dir, shard, capsys):
    assert main(["golden", "refresh", "--model", str(tiny_model_dir), "--prompts", str(refreshed / "prompts.jsonl"),
                 "--shard", shard, "--out", str(refreshed / "bad.jsonl")]) == 2
    assert "--shard" in capsys.readouterr().err and not (refreshed / "bad.jsonl").exists()


def test_shards_of_another_lockstep_group_are_refused(refreshed, tiny_model_dir, tmp_path, capsys):
    """Groups of 1 decode every case alone: its bits differ from the same case decoded beside another."""
    assert main(["golden", "refresh", "--model", str(tiny_model_dir), "--prompts", str(refreshed / "prompts.jsonl"),
                 "--lockstep-group", "1", "--shard", "3/3", "--out", str(tmp_path / "alone.jsonl")]) == 0
    capsys.readouterr()
    s = shards(refreshed, 3)
    assert "'lockstep_group' differs" in refused([s[0], s[1], str(tmp_path / "alone.jsonl"),
                                                  "--out", str(tmp_path / "x.jsonl")], capsys)


@pytest.mark.parametrize("args, flag", [(["--shard", "4/4"], "--shard"), (["--lockstep-group", "0"], "--lockstep-group")])
def test_more_shards_than_lockstep_groups_or_an_empty_group_is_a_usage_error(refreshed, tiny_model_dir, args, flag,
                                                                              capsys):
    assert main(["golden", "refresh", "--model", str(tiny_model_dir), "--prompts", str(refreshed / "prompts.jsonl"),
                 *GROUP, *args, "--out", str(refreshed / "bad.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and not (refreshed / "bad.jsonl").exists()
