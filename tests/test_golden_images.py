"""Prompt and golden files with images (check/case_images.py): a prompt file showing the tiny Qwen3-VL
model PNG images as data URLs and as paths refreshes to a golden file whose answers are the float64
reference's with those images, each image pinned by its sha256, and `golden check` runs the engine
with them and passes; a replaced image, a web URL, a missing file and an image case on a text-only
model are each refused in one line naming the file, the case and the part."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
from test_serve_images import data_url, encoded, no_network, rgb  # noqa: F401 (no_network: a fixture)

from refengine.check.calibrate import calibrate, stored_calibration, write_calibration
from refengine.check.golden import load_prompts, read_golden
from refengine.cli import main
from refengine.model import load_model
from refengine.model.cache import default_model_dir
from refengine.model.image import image_grid
from refengine.sampling import SamplingParams
from refengine.strategies.models import tiny_model_dir
from refengine.vision_reference import generate_with_images

VL = "qwen3vl-gqa2-tied"


def png(height: int, width: int, seed: int) -> bytes:
    """A PNG of uniform noise (test_serve_images.rgb's pixels)."""
    from PIL import Image
    return encoded(Image.fromarray(rgb(height, width, seed)), "PNG")


def image_part(url: str, sha256: str | None = None) -> dict:
    return {"type": "image_url", "image_url": {"url": url}, **({"sha256": sha256} if sha256 else {})}


def chat(text: str, *images: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, *images]}]


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def vl_model_dir() -> Path:
    return tiny_model_dir(VL)


@pytest.fixture(scope="module")
def vl_calibration(vl_model_dir, tmp_path_factory) -> Path:
    """The tiny Qwen3-VL model's noise calibration for the module's refreshes: the stored one, else
    measured once."""
    path, model = tmp_path_factory.mktemp("calibration") / "vl.calibration.json", load_model(vl_model_dir)
    write_calibration(stored_calibration(model) or calibrate(model), path)
    return path


@pytest.fixture
def image_prompts(tmp_path) -> Path:
    """Two image cases (a path, and a data URL beside a path with its sha256) and a text case."""
    cat = tmp_path / "images" / "cat.png"
    cat.parent.mkdir()
    cat.write_bytes(png(16, 16, 1))
    return write_jsonl(tmp_path / "prompts.jsonl", [
        {"id": "path", "messages": chat("What is this?", image_part("images/cat.png")), "max_tokens": 8},
        {"id": "two", "max_tokens": 8, "messages": chat(
            "Which differs?", image_part(data_url(png(24, 16, 2))),
            image_part("images/cat.png", hashlib.sha256(cat.read_bytes()).hexdigest()))},
        {"id": "text", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}])


def test_images_refresh_to_golden_answers_the_engine_gives_with_them(image_prompts, vl_model_dir, vl_calibration,
                                                                     tmp_path, capsys):
    out = tmp_path / "golden" / "vl.jsonl"  # another folder: its paths are rewritten relative to it
    assert main(["golden", "refresh", "--model", str(vl_model_dir), "--prompts", str(image_prompts), "--out", str(out),
                 "--calibration", str(vl_calibration)]) == 0
    golden, model = read_golden(out), load_model(vl_model_dir)
    cat = (tmp_path / "images" / "cat.png").read_bytes()
    lines = {line["id"]: line for line in map(json.loads, out.read_text(encoding="utf-8").splitlines()[1:])}
    sha256 = hashlib.sha256(cat).hexdigest()
    assert lines["path"]["messages"][0]["content"][1] == image_part("../images/cat.png", sha256)
    data = lines["two"]["messages"][0]["content"][1]
    assert data["image_url"]["url"].startswith("data:image/png;base64,") and data["sha256"] == \
        hashlib.sha256(png(24, 16, 2)).hexdigest()
    assert lines["text"]["messages"] == [{"role": "user", "content": "Hello"}]
    v = model.vision_config
    for case in golden.cases:  # each answer is the float64 reference's with its images
        pixels = [image.pixels() for image in case.images]
        tokens = [v.image_tokens(image_grid(p, model.image_processor)) for p in pixels]
        assert case.prompt_ids.count(v.image_token_id) == sum(tokens) == {"path": 4, "two": 6 + 4, "text": 0}[case.id]
        if pixels:
            want = generate_with_images(model, case.prompt_ids, pixels, SamplingParams(max_tokens=case.max_tokens))
            assert (case.token_ids, case.margins) == (want.token_ids, want.margins)
    assert golden.cases[0].token_ids != golden.cases[1].token_ids  # the images make the answers

    capsys.readouterr()
    assert main(["golden", "check", str(out), "--model", str(vl_model_dir), "--max-num-batched-tokens", "8"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("PASS")

    # the same golden file with another picture at cat.png (its sha256 updated): the engine sees it and fails
    other = png(16, 16, 7)
    (tmp_path / "images" / "cat.png").write_bytes(other)
    out.write_text(out.read_text(encoding="utf-8").replace(hashlib.sha256(cat).hexdigest(),
                                                           hashlib.sha256(other).hexdigest()), encoding="utf-8")
    assert main(["golden", "check", str(out), "--model", str(vl_model_dir)]) == 1
    assert "diverged" in capsys.readouterr().out


def test_a_refresh_is_the_same_bytes_again(image_prompts, vl_model_dir, vl_calibration, tmp_path):
    args = ["golden", "refresh", "--model", str(vl_model_dir), "--prompts", str(image_prompts),
            "--calibration", str(vl_calibration), "--lockstep-group", "2"]
    assert main([*args, "--out", str(tmp_path / "a.jsonl")]) == main([*args, "--out", str(tmp_path / "b.jsonl")]) == 0
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


def refused(argv: list[str], capsys) -> str:
    """The one stderr line of a command that exits 2."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("edit, message", [
    (lambda part: part.update(sha256="0" * 64), "sha256 mismatch: the part says 0000"),
    (lambda part: part.update(sha256="cafe"), ".sha256: expected the 64 hex digits of a sha256"),
    (lambda part: part["image_url"].update(url="https://example.com/cat.png"),
     ".image_url.url: https: URLs are never fetched"),
    (lambda part: part["image_url"].update(url="http://127.0.0.1:1/cat.png"), ".image_url.url: http: URLs are never"),
    (lambda part: part["image_url"].update(url="images/dog.png"), ".image_url.url: cannot read"),
    (lambda part: part["image_url"].update(url="prompts.jsonl"), ".image_url.url: .*: not a PNG or JPEG file"),
    (lambda part: part["image_url"].update(url="data:image/png;base64,iVBOR*"), ".image_url.url: malformed base64"),
    (lambda part: part.update(detail="high"), ": unknown key\\(s\\) detail"),
], ids=["sha256-mismatch", "sha256-malformed", "https", "http", "missing-file", "not-an-image", "bad-base64",
        "unknown-key"])
def test_a_bad_image_in_a_prompt_file_is_refused_naming_file_case_and_part(image_prompts, edit, message, capsys,
                                                                          no_network):  # noqa: F811
    lines = [json.loads(line) for line in image_prompts.read_text(encoding="utf-8").splitlines()]
    edit(lines[1]["messages"][0]["content"][2])
    write_jsonl(image_prompts, lines)
    out = image_prompts.parent / "g.jsonl"
    err = refused(["golden", "refresh", "--prompts", str(image_prompts), "--out", str(out)], capsys)
    assert f"{image_prompts}:2: case 'two': messages[0].content[2]" in err
    assert re.search(message, err), err
    assert not out.exists()


def test_a_golden_file_whose_image_changed_or_lost_its_sha256_is_refused(image_prompts, vl_model_dir, vl_calibration,
                                                                        tmp_path, capsys):
    out = tmp_path / "vl.jsonl"
    assert main(["golden", "refresh", "--model", str(vl_model_dir), "--prompts", str(image_prompts), "--out", str(out),
                 "--calibration", str(vl_calibration)]) == 0
    (tmp_path / "images" / "cat.png").write_bytes(png(16, 16, 3))  # replaced after the refresh
    err = refused(["golden", "check", str(out), "--model", str(vl_model_dir)], capsys)
    assert f"{out}:2: case 'path': messages[0].content[1]: sha256 mismatch" in err
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    del lines[2]["messages"][0]["content"][1]["sha256"]
    write_jsonl(out, lines)
    err = refused(["validate", "--url", "http://127.0.0.1:1", "--golden", str(out)], capsys)
    assert f"{out}:2: case 'path': messages[0].content[1]: sha256 mismatch" in err  # the first bad line
    del lines[1]
    write_jsonl(out, lines)
    err = refused(["golden", "check", str(out), "--model", str(vl_model_dir)], capsys)
    assert f"{out}:2: case 'two': messages[0].content[1]: missing sha256" in err


def test_an_image_case_on_a_text_only_model_is_refused_naming_file_and_case(image_prompts, capsys):
    model_dir = default_model_dir()  # tiny-chat, a Qwen3 text model with a stored calibration
    err = refused(["golden", "refresh", "--model", str(model_dir), "--prompts", str(image_prompts),
                   "--out", str(image_prompts.parent / "g.jsonl")], capsys)
    assert f"{image_prompts}:1: case 'path': 1 image(s), but {model_dir} is a text-only model (qwen3)" in err


def test_a_prompt_file_takes_text_parts_and_keeps_text_cases_as_they_were(tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"id": "parts", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hel"},
                                                                  {"type": "text", "text": "lo"}]}], "max_tokens": 2},
        {"id": "plain", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}])
    model = load_model(default_model_dir())
    parts, plain = load_prompts(prompts)
    assert parts.images == plain.images == () and parts.encode(model) == plain.encode(model)
    image = {"type": "image", "image": "x.png"}  # transformers' form: not a file's
    write_jsonl(prompts, [{"id": "bad", "messages": [{"role": "user", "content": [image]}], "max_tokens": 2}])
    with pytest.raises(Exception, match=r"p\.jsonl:1: messages\[0\]\.content\[0\]: expected a text part .* or an "
                                        r"image part \(\{\"type\": \"image_url\""):
        load_prompts(prompts)


def test_pixels_are_the_servers_decoding_of_the_same_bytes(image_prompts):
    from refengine.serve.images import decode_image_part
    two = load_prompts(image_prompts)[1]
    for image in two.images:
        np.testing.assert_array_equal(image.pixels(), decode_image_part(image_part(image.data_url()), "x"))


def test_the_reference_cost_bench_refuses_image_cases(image_prompts):
    from refengine.bench.reference import refresh_cases
    from refengine.errors import RefengineError
    where = re.escape(f"{image_prompts}:1: case 'path'")
    with pytest.raises(RefengineError, match=rf"^prompts: {where}: shows images"):
        refresh_cases(image_prompts, None)
