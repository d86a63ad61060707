"""Images in schedules: the format's generated images (check.images), how the suite places drawn images
in a prompt (suite.harness.resolve_images), and a schedule with images run, replayed and refused."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from refengine.check import calibrate
from refengine.check.images import GeneratedImage, generated_image, image_run
from refengine.check.replay import replay
from refengine.check.schedule import parse_schedule
from refengine.errors import RefengineError
from refengine.model import load_model
from refengine.strategies.models import (
    DEFAULT_MODEL,
    VISION_MODEL,
    make_tiny_command,
    tiny_model,
    tiny_model_dir,
)
from refengine.suite.harness import REPRO_DIR_VAR, PropertyFailure, check, prepared, resolve_images

START, END, PAD = 3, 4, 5  # the tiny Qwen3-VL tokenizer's <|vision_start|>, <|vision_end|>, <|image_pad|>
ENGINE = {"mode": "invariant", "max_num_seqs": 4, "max_num_batched_tokens": 6, "block_size": 2,
          "max_model_len": 128, "num_blocks": 4}


def drawn(*images, prompt=(7, 8, 9)) -> dict:
    return {"engine": dict(ENGINE), "requests": [
        {"id": "r0", "prompt_ids": list(prompt), "max_tokens": 3, "arrival_step": 0,
         "images": [{"at": at, "height": h, "width": w, "seed": s} for at, h, w, s in images]}]}


def test_the_tiny_vision_models_placeholder_ids_are_what_these_tests_assume():
    v = tiny_model(VISION_MODEL).vision_config
    assert (v.vision_start_token_id, v.vision_end_token_id, v.image_token_id) == (START, END, PAD)


def test_a_generated_image_is_the_same_pixels_every_time_and_another_seed_others():
    a = generated_image(9, 17, 3)
    assert a.shape == (9, 17, 3) and a.dtype == np.uint8
    assert np.array_equal(a, generated_image(9, 17, 3))
    assert not np.array_equal(a, generated_image(9, 17, 4))


@pytest.mark.parametrize("height, width, tokens", [(8, 8, 1), (16, 16, 4), (24, 16, 6), (7, 9, 1), (17, 15, 4),
                                                   (40, 40, 16)])
def test_an_images_run_is_one_token_per_merged_patch_between_start_and_end(height, width, tokens):
    # 4-pixel patches merged 2x2: sides resized to multiples of 8, at most 32x32 (1024 pixels)
    run = image_run(tiny_model(VISION_MODEL), generated_image(height, width, 0))
    assert run == [START] + [PAD] * tokens + [END]


def test_drawn_images_go_before_their_token_in_prompt_order_and_the_pool_holds_the_request():
    schedule = drawn((9, 8, 8, 1), (1, 16, 16, 2), prompt=(7, PAD, 9))  # the second before the prompt's token 1
    resolved = resolve_images(VISION_MODEL, schedule)
    request = resolved["requests"][0]
    # the prompt's own image token made 0; the image at 9 (past the end) after the prompt, the one at 1 first
    assert request["prompt_ids"] == [7, START, PAD, PAD, PAD, PAD, END, 0, 9, START, PAD, END]
    assert request["images"] == [{"height": 16, "width": 16, "seed": 2}, {"height": 8, "width": 8, "seed": 1}]
    assert resolved["engine"]["num_blocks"] == (12 + 3) // 2 + 1  # 15 tokens in blocks of 2
    assert schedule["requests"][0]["prompt_ids"] == [7, PAD, 9]  # the drawn schedule is left as it was


def test_two_images_at_one_token_are_two_runs_and_a_text_model_drops_them():
    schedule = drawn((0, 8, 8, 1), (0, 8, 8, 2))
    assert resolve_images(VISION_MODEL, schedule)["requests"][0]["prompt_ids"] == \
        [START, PAD, END, START, PAD, END, 7, 8, 9]
    text = resolve_images(DEFAULT_MODEL, schedule)["requests"][0]
    assert text["prompt_ids"] == [7, 8, 9] and "images" not in text


def test_a_conversation_takes_no_images():
    schedule = drawn((0, 8, 8, 1))
    schedule["requests"].append({**schedule["requests"][0], "id": "r1", "continues": "r0"})
    resolved = prepared(VISION_MODEL, schedule)
    assert all("images" not in r for r in resolved["requests"])


def test_a_resolved_schedule_with_images_replays_bit_identical_batched_and_alone():
    schedule = prepared(VISION_MODEL, drawn((1, 24, 16, 1), (2, 16, 16, 2)))
    schedule["requests"].insert(0, {"id": "r1", "prompt_ids": [1, 2], "max_tokens": 3, "arrival_step": 0})
    result = replay(tiny_model(VISION_MODEL), parse_schedule(schedule, "test"))
    assert result.passed, result.report()
    # behind the text request in its first step, its prefill cut inside the first image (17 tokens, budget 6)
    assert [(c["id"], c["num_tokens"]) for c in result.trace[0]["scheduled"]] == [("r1", 2), ("r0", 4)]
    mine = schedule["requests"][1]
    other = dict(schedule, requests=[dict(mine, images=[{"height": 24, "width": 16, "seed": 9}, mine["images"][1]])])
    theirs = replay(tiny_model(VISION_MODEL), parse_schedule(other, "test")).outputs["r0"]
    assert theirs.steps[0].logits_sha256 != result.outputs["r0"].steps[0].logits_sha256  # the pixels count


@pytest.mark.parametrize("images, named", [
    ("one", "'r0'.images"),
    ([{"height": 8, "width": 8}], "images[0]"),
    ([{"height": 0, "width": 8, "seed": 1}], "images[0].height"),
    ([{"height": 8, "width": 8, "seed": -1}], "images[0].seed"),
    ([{"height": 8, "width": True, "seed": 1}], "images[0].width"),
])
def test_a_bad_image_is_refused_naming_it(images, named):
    schedule = {"engine": ENGINE, "requests": [{"id": "r0", "prompt_ids": [1], "images": images}]}
    with pytest.raises(RefengineError, match=named.replace("[", r"\[").replace("]", r"\]")):
        parse_schedule(schedule, "s.json")


def test_images_need_prompt_ids_or_messages():
    schedule = {"engine": ENGINE, "requests": [{"id": "r0", "prompt": "hi",
                                                 "images": [{"height": 8, "width": 8, "seed": 1}]}]}
    with pytest.raises(RefengineError, match="r0.*images"):
        parse_schedule(schedule, "s.json")


def run_schedule(path, model_dir):
    return subprocess.run([sys.executable, "-m", "refengine", "run-schedule", str(path), "--model", str(model_dir),
                           "--json"], capture_output=True, text=True, timeout=300)


def test_run_schedule_runs_images_on_a_vision_model_and_refuses_them_on_a_text_model(tmp_path):
    path = tmp_path / "images.json"
    path.write_text(json.dumps(prepared(VISION_MODEL, drawn((1, 16, 16, 1)))))
    done = run_schedule(path, tiny_model_dir(VISION_MODEL))
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["requests"]["r0"]["token_ids"]) == 3
    refused = run_schedule(path, tiny_model_dir(DEFAULT_MODEL))
    assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert "r0" in refused.stderr and "images.json" in refused.stderr


def test_a_repros_make_tiny_command_rebuilds_the_suites_vision_model(tmp_path):
    flags = make_tiny_command(VISION_MODEL).split()[3:]  # refengine make-tiny DIR <flags>
    subprocess.run([sys.executable, "-m", "refengine", "make-tiny", str(tmp_path / "vl"), *flags], check=True,
                   capture_output=True, timeout=300)
    assert load_model(tmp_path / "vl").fingerprint == tiny_model(VISION_MODEL).fingerprint


def test_a_vision_models_calibration_measures_prompts_with_images():
    """The tower's float32 noise is in the bounds the image properties apply: the reference's image prompts are
    among the rows compared, and the engine's image requests among the runs (an image fault breaks them)."""
    model, text = tiny_model(VISION_MODEL), tiny_model(DEFAULT_MODEL)
    rows = calibrate.reference_noise(model)["rows"]
    assert rows == calibrate.reference_noise(text)["rows"] + len(calibrate.CALIBRATION_IMAGES) * calibrate.MAX_TOKENS
    with pytest.raises(RefengineError, match="the engine itself is broken|exceeds the float32 ceiling"):
        calibrate.calibrate(model, VISION_MODEL, fault="image-positions-from-step-rows")


@pytest.mark.parametrize("fault", [None, "deepstack-one-layer-late", "text-after-image-one-position"])
def test_the_engine_with_images_agrees_with_the_float64_reference_unless_an_image_fault_is_on(fault, tmp_path,
                                                                                              monkeypatch):
    monkeypatch.setenv(REPRO_DIR_VAR, str(tmp_path))
    schedule = drawn((1, 24, 16, 1), (3, 16, 8, 2))
    if fault is None:
        assert check("reference-agreement", VISION_MODEL, schedule, against="reference").passed
    else:
        with pytest.raises(PropertyFailure, match="r0"):
            check("reference-agreement", VISION_MODEL, schedule, against="reference", fault=fault)


def test_an_images_keys_must_be_exactly_the_formats():
    schedule = {"engine": ENGINE, "requests": [{"id": "r0", "prompt_ids": [1],
                                                 "images": [{"at": 0, "height": 8, "width": 8, "seed": 1}]}]}
    with pytest.raises(RefengineError, match=r"images\[0\]"):  # a drawn image not placed is no schedule's
        parse_schedule(schedule, "s.json")
    schedule["requests"][0]["images"][0].pop("at")
    assert parse_schedule(schedule, "s.json").requests[0].images == (GeneratedImage(8, 8, 1),)
