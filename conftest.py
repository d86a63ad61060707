"""What only this repository's own tests need (the markers, profiles, options and the suite's
fixtures come from refengine's pytest plugin, refengine/suite/plugin.py, which the installed
package registers)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The default tiny Qwen3 model (what `refengine make-tiny DIR` writes), built once per session."""
    from refengine.model.tiny import make_tiny
    return make_tiny(tmp_path_factory.mktemp("tiny-default"))


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from refengine.model import load_model
    return load_model(tiny_model_dir)
