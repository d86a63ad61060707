"""The embedded default model: the default tiny model, generated once into a cache folder."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .tiny import make_tiny


def cache_dir() -> Path:
    root = os.environ.get("REFENGINE_CACHE") or Path.home() / ".cache" / "refengine"
    return Path(root)


def default_model_dir() -> Path:
    """Generate (atomically, so parallel callers never see half a folder) and return its path."""
    target = cache_dir() / "models" / "tiny-default"
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tiny-"))
        make_tiny(staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first; its folder is identical
            for f in staging.iterdir():
                f.unlink()
            staging.rmdir()
    return target
