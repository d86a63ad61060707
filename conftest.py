"""Markers, Hypothesis profiles and shared fixtures.

HYPOTHESIS_PROFILE selects the profile: dev (default, fast), ci (derandomized, more examples),
thorough (pre-release).
"""
from __future__ import annotations

import os
from pathlib import Path

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


DEFAULT_GOLDEN = Path(__file__).resolve().parent / "golden" / "tiny-default.jsonl"


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true",
                     help="regenerate the committed golden files with the float64 reference")
    parser.addoption("--engine-url", metavar="URL",
                     help="run the HTTP invariants against this OpenAI-compatible server (default: an "
                          "in-process refengine server on 127.0.0.1 serving the default tiny model)")
    parser.addoption("--golden", metavar="FILE", default=str(DEFAULT_GOLDEN),
                     help="golden file the --engine-url server's model must match (default: %(default)s)")


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


@pytest.fixture(scope="session")
def http_engine(request):
    """(url, golden) for the HTTP invariants: the --engine-url server and the --golden file, or an
    in-process OpenAIServer on 127.0.0.1 serving the default tiny model (4 seats, 32-token steps so
    prefill chunks mix with decodes and requests queue)."""
    from refengine.engine_config import EngineConfig
    from refengine.errors import RefengineError
    from refengine.golden import read_golden
    from refengine.openai_client import Endpoint
    from refengine.server import OpenAIServer
    from refengine.validate import served_model

    url = request.config.getoption("--engine-url")
    model = None if url else request.getfixturevalue("tiny_model")
    try:
        golden = read_golden(request.config.getoption("--golden"))
        if url:
            served_model(Endpoint(url, timeout=10))
        else:
            golden.require_model(model)
        problem = None
    except RefengineError as e:
        problem = f"HTTP invariants: {e}"
    if problem:
        pytest.fail(problem, pytrace=False)
    if url:
        yield url, golden
        return
    server = OpenAIServer(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32), host="127.0.0.1")
    server.start()
    yield server.url, golden
    server.close()
