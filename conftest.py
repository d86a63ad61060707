"""What only this repository's own tests need (the markers, profiles, options and the suite's
fixtures come from refengine's pytest plugin, refengine/suite/plugin.py, which the installed
package registers)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The base random-weight Qwen3 model (what `refengine make-tiny DIR` writes), built once per session."""
    from refengine.model.tiny import make_tiny
    return make_tiny(tmp_path_factory.mktemp("tiny-random"))


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from refengine.model import load_model
    return load_model(tiny_model_dir)


@pytest.fixture(scope="session")
def default_model():
    """The embedded default model, tiny-chat (package data): what every command and the shipped suite's
    HTTP properties use without --model."""
    from refengine.model import load_model
    from refengine.model.cache import default_model_dir
    return load_model(default_model_dir())
