"""The calibration behind every tolerance: committed for every suite model, current, under its ceiling."""
import json

import pytest

from refengine.check.calibrate import (
    BOUNDS,
    SAFETY_FACTOR,
    cached_calibration_path,
    calibrate,
    calibration_for,
    ceiling,
    load_calibration,
    numerics_digest,
    stored_calibration,
    write_calibration,
)
from refengine.cli import main
from refengine.data import shipped
from refengine.errors import RefengineError
from refengine.model import load_model
from refengine.model.cache import default_model_dir
from refengine.strategies import TINY_CONFIGS, tiny_model

pytestmark = pytest.mark.invariants
GOLDEN_DIR = shipped("golden")
STORED = GOLDEN_DIR / "tiny-random.calibration.json"
DEFAULT = "tiny-chat"  # the embedded default model: not a suite model, but calibrated and golden the same way
MODELS = [*TINY_CONFIGS, DEFAULT]


def model_named(name: str):
    return load_model(default_model_dir()) if name == DEFAULT else tiny_model(name)


@pytest.mark.parametrize("name, model_name", [("tiny-random", MODELS[0]), ("tiny-chat", DEFAULT)])
def test_a_golden_files_calibration_is_its_models_and_in_its_header(name, model_name):
    model = model_named(model_name)
    stored = load_calibration(GOLDEN_DIR / f"{name}.calibration.json")
    assert stored["model_fingerprint"] == model.fingerprint
    assert calibration_for(model) == stored
    header = json.loads((GOLDEN_DIR / f"{name}.jsonl").read_text().splitlines()[0])
    assert header["noise"] == stored


def test_a_committed_calibration_is_handed_out_as_a_copy():
    """The committed files are read once per process (the suite asks per example): what one caller does
    to its calibration never reaches the next caller."""
    model = tiny_model()
    first = stored_calibration(model)
    assert first == load_calibration(STORED)
    first["f32_vs_f64"] = 1e9
    first["measured"].clear()
    assert stored_calibration(model) == load_calibration(STORED)


@pytest.mark.parametrize("name", MODELS)
def test_every_suite_model_has_a_committed_calibration_under_its_ceiling(name):
    """No suite model (nor the default model) is ever calibrated on first use with the engine under test."""
    model = model_named(name)
    stored = stored_calibration(model)
    assert stored is not None, f"{name}: no refengine/data/golden/*.calibration.json for {model.fingerprint}"
    limit = ceiling(model)["value"]
    for bound in BOUNDS:
        assert 0 < stored[bound] <= limit / 10, (name, bound, stored[bound], limit)


@pytest.mark.parametrize("name", MODELS)
def test_committed_bounds_still_cover_a_fresh_measurement(name, tmp_path):
    """A kernel change that makes float32 noisier must show here before the suite trusts old bounds; and
    the engine's own error against float64 must stay within the reference-derived tolerance, or the
    reference-agreement property would raise false alarms on a correct engine."""
    model = model_named(name)
    stored = stored_calibration(model)
    if name == MODELS[0]:  # the command line once
        assert main(["calibrate", "--model", str(model.path), "--out", str(tmp_path / "fresh.json")]) == 0
        fresh = load_calibration(tmp_path / "fresh.json")
    else:
        fresh = calibrate(model, name)
    measured = fresh["measured"]
    assert measured["batched_vs_serial_tokens"] > 100 and measured["f32_vs_f64_rows"] > 300
    for bound in BOUNDS:
        assert 0 < fresh[bound] <= 2 * stored[bound], (name, bound, fresh[bound], stored[bound])
    assert measured["engine_vs_f64"] <= stored["f32_vs_f64"] * SAFETY_FACTOR / 2, (name, measured["engine_vs_f64"])
    assert fresh["ceiling"] == ceiling(model)["value"]


def test_a_cached_calibration_is_used_only_with_the_kernels_it_was_measured_on(tmp_path, monkeypatch):
    model = tiny_model("llama-mha-untied")
    monkeypatch.setattr("refengine.check.calibrate.stored_calibration", lambda model: None)  # as a model outside the suite
    monkeypatch.setenv("REFENGINE_CACHE", str(tmp_path))
    current = cached_calibration_path(model)
    planted = {"model_fingerprint": model.fingerprint, "f32_batched_vs_serial": 5e-4, "f32_vs_f64": 5e-4,
               "safety_factor": 8}
    write_calibration(planted, current.with_name(current.name.replace(numerics_digest(), "0" * 12)))
    measured = calibration_for(model)
    assert measured["f32_vs_f64"] < 5e-4 and load_calibration(current) == measured
    write_calibration(planted, current)
    assert calibration_for(model) == planted


def test_a_cached_calibration_above_the_ceiling_is_refused_naming_the_model_and_bound(tmp_path, monkeypatch):
    model = tiny_model("llama-mha-untied")
    monkeypatch.setattr("refengine.check.calibrate.stored_calibration", lambda model: None)
    monkeypatch.setenv("REFENGINE_CACHE", str(tmp_path))
    write_calibration({"model_fingerprint": model.fingerprint, "f32_batched_vs_serial": 1e-5, "f32_vs_f64": 2.5,
                       "safety_factor": 8}, cached_calibration_path(model))
    with pytest.raises(RefengineError, match=r"model llama-mha-untied .*f32_vs_f64 2\.5 exceeds the float32 ceiling"):
        calibration_for(model, "llama-mha-untied")


@pytest.mark.parametrize("content, message", [
    ("{", "not valid JSON"),
    ('{"f32_vs_f64": 1e-5, "safety_factor": 8}', "f32_batched_vs_serial"),
    ('{"f32_batched_vs_serial": -1, "f32_vs_f64": 1e-5, "safety_factor": 8}', "f32_batched_vs_serial"),
])
def test_a_bad_calibration_file_is_refused_by_name(tmp_path, content, message):
    path = tmp_path / "noise.json"
    path.write_text(content)
    with pytest.raises(RefengineError, match=message) as error:
        load_calibration(path)
    assert str(path) in str(error.value)
