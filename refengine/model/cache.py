"""Where models come from without `--model`: the embedded default, tiny-chat, ships inside the package
(trained once, refengine.model.train); generated model folders (the suite's random tiny models, bench
presets) are built once into `REFENGINE_CACHE` (default ~/.cache/refengine) and reused.

Every cached model goes through `cached_model`, which builds into a staging folder and renames it
into place, so parallel test workers and processes racing for the same model never see half a folder.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from ..data import shipped
from .tiny import TinySpec, make_tiny

DEFAULT_MODEL_NAME = "tiny-chat"
RANDOM_MODEL_NAME = "tiny-random"


def cache_dir() -> Path:
    return Path(os.environ.get("REFENGINE_CACHE") or Path.home() / ".cache" / "refengine")


def cached_model(name: str, build: Callable[[Path], object]) -> Path:
    """`cache_dir()/models/NAME`, written by `build(folder)` the first time it is asked for."""
    target = cache_dir() / "models" / name
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{name}-"))
        try:
            build(staging)
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():  # not a lost race: a real failure
                shutil.rmtree(staging, ignore_errors=True)
                raise
        finally:
            if staging.exists():  # another process finished first; its folder is byte-identical
                shutil.rmtree(staging, ignore_errors=True)
    return target


def cached_tiny_model(name: str, spec: TinySpec) -> Path:
    return cached_model(name, lambda folder: make_tiny(folder, spec))


def default_model_dir() -> Path:
    """The embedded default: tiny-chat, trained to answer the seed experiment's questions (package data)."""
    return shipped("models", DEFAULT_MODEL_NAME)


def random_model_dir() -> Path:
    """The suite's base random-weight model: what `refengine make-tiny DIR` writes."""
    return cached_tiny_model(RANDOM_MODEL_NAME, TinySpec())
