"""refengine's pytest plugin (registered as the `pytest11` entry point `refengine`, so installing
refengine is enough): the markers, the Hypothesis profiles, the options and the fixtures the shipped
property suite needs. `pytest --pyargs refengine.suite` runs the suite from any directory.

Profiles follow Hypothesis's conventions: HYPOTHESIS_PROFILE (or `--hypothesis-profile`) selects
one; without it, the `ci` profile when the environment variable CI is set, else `dev`.
  dev       25 examples per property (the default on a workstation)
  ci        80 examples, derandomized: the same examples on every run of the same code
  thorough  1000 examples, for a release
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

PROFILES = {"dev": {"max_examples": 25}, "ci": {"max_examples": 80, "derandomize": True},
            "thorough": {"max_examples": 1000}}
MARKERS = {
    "invariants": "continuous-batching properties (pytest -m invariants)",
    "http": "properties judged over HTTP: with --engine-url, the only invariants that run",
    "golden": "golden-file checks against the float64 reference",
    "parity": "agreement with HF transformers (needs the parity extra)",
    "slow": "long-running; excluded from the default run",
}

for _name, _values in PROFILES.items():
    settings.register_profile(_name, deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
                              **_values)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


def default_golden() -> str:
    from ..data import shipped
    return str(shipped("golden", "tiny-default.jsonl"))


def pytest_addoption(parser):
    group = parser.getgroup("refengine")
    group.addoption("--engine-url", metavar="URL",
                    help="run the HTTP invariants against this OpenAI-compatible server (default: an "
                         "in-process refengine server on 127.0.0.1 serving the default tiny model); the "
                         "in-process engine properties are skipped")
    group.addoption("--golden", metavar="FILE", default=None,
                    help="golden file the --engine-url server's model must match (default: the shipped "
                         "golden file of the embedded default model)")
    group.addoption("--update-golden", action="store_true",
                    help="regenerate the committed golden files with the float64 reference")


def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def pytest_collection_modifyitems(config, items):
    url = config.getoption("--engine-url")
    if not url:
        return
    skip = pytest.mark.skip(reason=f"--engine-url {url}: this property runs the in-process engine; only the "
                                   f"HTTP properties judge a server")
    for item in items:
        if item.get_closest_marker("invariants") and not item.get_closest_marker("http"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def http_engine(request):
    """(url, golden) for the HTTP invariants: the --engine-url server and the --golden file, or an
    in-process OpenAIServer on 127.0.0.1 serving the default tiny model (4 seats, 32-token steps so
    prefill chunks mix with decodes and requests queue)."""
    from ..check.golden import read_golden
    from ..engine import EngineConfig
    from ..errors import RefengineError
    from ..serve import OpenAIServer
    from ..strategies import tiny_model
    from ..validate.board import served_model
    from ..validate.client import Endpoint

    url = request.config.getoption("--engine-url")
    model = None if url else tiny_model()
    try:
        golden = read_golden(request.config.getoption("--golden") or default_golden())
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
