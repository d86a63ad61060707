"""The calibration behind every tolerance: stored for the default tiny model, current, and checked."""
import json

import pytest

from refengine.check.calibrate import (
    cached_calibration_path,
    calibration_for,
    load_calibration,
    numerics_digest,
    write_calibration,
)
from refengine.cli import main
from refengine.data import shipped
from refengine.errors import RefengineError
from refengine.strategies import tiny_model

pytestmark = pytest.mark.invariants
GOLDEN_DIR = shipped("golden")
STORED = GOLDEN_DIR / "tiny-default.calibration.json"


def test_stored_calibration_is_the_default_models_and_matches_the_golden_header():
    stored, model = load_calibration(STORED), tiny_model()
    assert stored["model_fingerprint"] == model.fingerprint
    assert calibration_for(model) == stored
    header = json.loads((GOLDEN_DIR / "tiny-default.jsonl").read_text().splitlines()[0])
    assert header["noise"] == stored


def test_stored_bounds_still_cover_a_fresh_measurement(tmp_path):
    """A kernel change that makes float32 noisier must show here before the suite trusts old bounds."""
    stored = load_calibration(STORED)
    assert main(["calibrate", "--model", str(tiny_model().path), "--out", str(tmp_path / "fresh.json")]) == 0
    fresh = load_calibration(tmp_path / "fresh.json")
    assert fresh["measured"]["batched_vs_serial_tokens"] > 100 and fresh["measured"]["f32_vs_f64_tokens"] > 100
    for bound in ("f32_batched_vs_serial", "f32_vs_f64"):
        assert 0 < fresh[bound] <= 2 * stored[bound], (bound, fresh[bound], stored[bound])


def test_a_cached_calibration_is_used_only_with_the_kernels_it_was_measured_on(tmp_path, monkeypatch):
    model = tiny_model("llama-mha-untied")  # not a golden model: its calibration lives in the cache
    monkeypatch.setenv("REFENGINE_CACHE", str(tmp_path))
    current = cached_calibration_path(model)
    planted = {"model_fingerprint": model.fingerprint, "f32_batched_vs_serial": 1.0, "f32_vs_f64": 1.0,
               "safety_factor": 8}
    write_calibration(planted, current.with_name(current.name.replace(numerics_digest(), "0" * 12)))
    measured = calibration_for(model)
    assert measured["f32_vs_f64"] < 1.0 and load_calibration(current) == measured
    write_calibration(planted, current)
    assert calibration_for(model) == planted


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

