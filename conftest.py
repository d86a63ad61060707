"""Markers, Hypothesis profiles and shared fixtures.

HYPOTHESIS_PROFILE selects the profile: dev (default, fast), ci (derandomized, more examples),
thorough (pre-release).
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "dev", max_examples=25, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile(
    "ci", max_examples=80, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile(
    "thorough", max_examples=1000, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

MARKERS = {
    "invariants": "continuous-batching properties (pytest -m invariants)",
    "golden": "golden-file checks against the float64 reference",
    "parity": "agreement with HF transformers (needs the parity extra)",
    "slow": "long-running; excluded from the default run",
}


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true",
                     help="regenerate the committed golden files with the float64 reference")


def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The default tiny Qwen3 model (what `refengine make-tiny DIR` writes), built once per session."""
    from refengine.tiny import make_tiny
    return make_tiny(tmp_path_factory.mktemp("tiny-default"))


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from refengine.model import load_model
    return load_model(tiny_model_dir)
