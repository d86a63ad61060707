"""Benchmarks (pytest-benchmark): `pytest benchmarks/ --benchmark-only`. Not part of the default run
(testpaths is tests/)."""
from __future__ import annotations

import numpy as np
import pytest
from bench_models import MID_SPEC

from refengine.model import load_model
from refengine.model.cache import cached_tiny_model


@pytest.fixture(scope="session")
def mid_model():
    return load_model(cached_tiny_model("bench-mid", MID_SPEC))


@pytest.fixture(scope="session")
def mid_weights(mid_model):
    return mid_model.weights(np.float32)
