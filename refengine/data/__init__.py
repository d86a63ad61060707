"""Data that ships inside the package: the tokenizer corpus of the tiny models, the golden files
with their calibrations and prompt sets (golden/), and the example schedule (examples/). Found
through the package, so an installed refengine (not only a checkout) uses the committed files."""
from __future__ import annotations

from importlib import resources
from pathlib import Path


def shipped(*parts: str) -> Path:
    """The path of a shipped data file or folder, e.g. shipped("golden", "tiny-chat.jsonl")."""
    return Path(str(resources.files(__name__).joinpath(*parts)))
