"""The layering is one-way (docs/contributing.md, "The package"): model -> reference / engine -> check ->
serve / validate / bench -> cli. Importing a layer must not load a layer above it, and board
validation must not load the engine at all: what it judges is somebody else's server."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

LAYERS = ("model", "reference", "engine", "check", "serve", "validate", "bench", "cli", "suite")


def loaded_after(module: str) -> set[str]:
    """The refengine layers a fresh interpreter has loaded after importing `module`."""
    code = (f"import sys, json, {module}; "
            "print(json.dumps(sorted({m.split('.')[1] for m in sys.modules if m.startswith('refengine.')})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return set(json.loads(out.stdout)) & set(LAYERS)


@pytest.mark.parametrize("module, allowed", [
    ("refengine.model", {"model"}),
    ("refengine.reference", {"model", "reference"}),
    ("refengine.vision_reference", {"model", "reference"}),
    ("refengine.engine", {"model", "engine"}),
    ("refengine.check.replay", {"model", "reference", "engine", "check"}),
    ("refengine.validate.board", {"model", "reference", "check", "validate"}),
    ("refengine.serve", {"model", "engine", "serve"}),
])
def test_a_layer_loads_nothing_above_it(module, allowed):
    assert loaded_after(module) <= allowed
