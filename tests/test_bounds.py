"""Tolerances the code under test cannot widen (issue #14, item 1).

The f32-vs-f64 bound comes from the float32 reference (no engine code runs), the batched-vs-serial bound
of every suite model is committed, and nothing is adopted above the ceiling of float32 precision. The
fault `attention-bound-inflating` is the negative control: an attention bug that, when the bounds were
measured with the engine on first use, became 3-6 logits of "noise" (tolerance x 8: every divergence
explained). It is identical batched and alone, so the batched-vs-serial properties cannot see it (shown
below); what must hold is that no tolerance inflates under it and that the properties judged against
float64 (reference agreement, the sampling support) fail on every suite model.
"""
import math

import numpy as np
import pytest
from hypothesis import Phase, find, settings

from refengine import reference
from refengine.check import calibrate as calibration
from refengine.check.margin_rule import tolerance
from refengine.engine import FAULTS, kernels, model_runner
from refengine.engine.faults import Fault
from refengine.errors import RefengineError
from refengine.strategies import TINY_CONFIGS, tiny_model
from refengine.suite.harness import (
    REPRO_DIR_VAR,
    PropertyFailure,
    check,
    greedy_schedules,
)
from refengine.suite.test_sampling import check_sampled_support

pytestmark = pytest.mark.invariants
FAULT = "attention-bound-inflating"
MODELS = list(TINY_CONFIGS)


def schedule(mode: str, sampling: dict | None = None) -> dict:
    """Two requests that overlap, a chunked prefill, decodes: prompts of >= 2 tokens (over one key the
    softmax is 1 whatever its scale)."""
    extra = {"sampling": sampling} if sampling else {}
    return {"engine": {"mode": mode, "max_num_seqs": 4, "max_num_batched_tokens": 8, "block_size": 4},
            "requests": [{"id": "a", "prompt_ids": [5, 9, 13, 21, 34, 55], "max_tokens": 4, **extra},
                         {"id": "b", "prompt_ids": [17, 250, 3], "max_tokens": 4, "arrival_step": 1, **extra}]}


def test_the_float32_reference_is_float32_throughout_and_the_float64_one_unchanged():
    model, ids = tiny_model(), [5, 9, 13, 21, 34]
    f32, f64 = reference.prompt_logits(model, ids, np.float32), reference.prompt_logits(model, ids)
    assert f32.dtype == np.float32 and f64.dtype == np.float64  # one float64 step would make the rest float64
    assert 0 < np.abs(f32 - f64).max() < 1e-4


def test_the_f32_vs_f64_bound_runs_no_engine_code(monkeypatch):
    def no_engine(*args, **kwargs):
        raise AssertionError("the engine ran while measuring f32_vs_f64")
    monkeypatch.setattr(model_runner.ModelRunner, "execute", no_engine)
    monkeypatch.setattr(model_runner.ModelRunner, "__init__", no_engine)
    model = tiny_model("llama-mha-untied")
    noise = calibration.reference_noise(model)
    assert 0 < noise["max"] < calibration.ceiling(model)["value"] and noise["rows"] == 2 * (
        len(calibration.PROMPT_LENGTHS) * calibration.MAX_TOKENS)


def test_the_ceiling_is_the_documented_formula():
    model = tiny_model()
    cfg, got = model.config, calibration.ceiling(model)
    w = model.weights(np.float64)
    scale = max(float((np.abs(reference.final_hidden(w, cfg, p, reference.KVCache())) @ np.abs(w.lm_head).T).max())
                for p in calibration.calibration_prompts(cfg.vocab_size))
    n = max(cfg.hidden_size, cfg.intermediate_size, cfg.q_size)
    expected = 6 * (4 * cfg.num_layers + 1) * 2.0 ** -23 * math.sqrt(n) * scale
    assert got["value"] == pytest.approx(expected, rel=1e-12) and got["S"] == pytest.approx(scale, rel=1e-12)
    max_logit = float(np.abs(reference.prompt_logits(model, calibration.calibration_prompts(cfg.vocab_size)[-1])).max())
    assert max_logit <= scale  # S bounds |logit| by construction


def test_the_fault_is_catalogued():
    assert Fault(FAULT) is Fault.ATTENTION_BOUND_INFLATING and "log2(e)" in FAULTS[FAULT]


@pytest.mark.parametrize("name", MODELS)
def test_attention_bound_inflating_inflates_no_tolerance_and_fails_the_float64_properties(
        name, tmp_path, monkeypatch):
    monkeypatch.setenv(REPRO_DIR_VAR, str(tmp_path / "repros"))
    model = tiny_model(name)
    clean = {bound: tolerance(calibration.calibration_for(model, name), bound) for bound in calibration.BOUNDS}

    # The bug in the code under test (not switched on by name): every engine built now has it, the
    # calibration's own runs included -- the situation in which the bounds once became 2-10 logits.
    monkeypatch.setattr(model_runner, "attention",
                        lambda invariant, fault=None: kernels.attention(invariant, Fault.ATTENTION_BOUND_INFLATING))
    assert {b: tolerance(calibration.calibration_for(model, name), b) for b in calibration.BOUNDS} == clean
    # A model without a committed calibration, calibrated on first use: refused, naming model and bound.
    monkeypatch.setattr(calibration, "stored_calibration", lambda model: None)
    monkeypatch.setenv("REFENGINE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RefengineError, match=rf"model {name} .*engine_vs_f64 .* exceeds the float32 ceiling"):
        calibration.calibration_for(model, name)
    assert not calibration.cached_calibration_path(model).exists()  # nothing adopted
    monkeypatch.undo()
    monkeypatch.setenv(REPRO_DIR_VAR, str(tmp_path / "repros"))

    # Switched on by name: invisible batched vs alone, caught against float64 with the clean tolerance.
    check("invariant-mode-is-exact", name, schedule("invariant"), fault=FAULT)
    for mode in ("fast", "invariant"):
        with pytest.raises(PropertyFailure) as failure:
            check("reference-agreement", name, schedule(mode), against="reference", fault=FAULT)
        assert f"tolerance {clean['f32_vs_f64']:.3g}" in str(failure.value), str(failure.value)
    with pytest.raises(PropertyFailure, match="logit deviation from float64"):
        check_sampled_support(name, schedule("fast", {"temperature": 0.8, "top_k": 0, "top_p": 0.9, "seed": 7}),
                              fault=FAULT)


@pytest.mark.parametrize("name", MODELS)
def test_the_dev_profile_finds_the_fault_on_every_model(name, tmp_path, monkeypatch):
    """Hypothesis's own draws (the reference-agreement property's strategy), without shrinking: the
    first failing example within the dev budget."""
    monkeypatch.setenv(REPRO_DIR_VAR, str(tmp_path))

    def fails(example):
        try:
            check("reference-agreement", name, example, against="reference", fault=FAULT)
        except PropertyFailure:
            return True
        return False

    found = find(greedy_schedules, fails, settings=settings(settings.default, database=None, derandomize=True,
                                                           phases=[Phase.generate]))
    assert found["requests"]
    check("reference-agreement", name, found, against="reference")  # the same schedule passes without the fault
