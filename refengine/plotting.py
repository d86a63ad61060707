"""The one way refengine draws: matplotlib's non-interactive backend, imported when a plot is asked
for (matplotlib is the `plot` extra, never a core dependency)."""
from __future__ import annotations

from pathlib import Path

from .errors import RefengineError


def pyplot():
    """matplotlib.pyplot on the Agg backend (files, no screen), or a RefengineError naming the extra."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RefengineError("plot: needs matplotlib (pip install 'refengine[plot]')") from None
    return plt


def save(fig, path: str | Path, dpi: int) -> Path:
    """Write `fig` as a PNG at `path` and free it; a path that cannot be written is a RefengineError
    naming it (the `plot` field: the CLI names its --plot flag)."""
    plt = pyplot()
    path = Path(path)
    try:
        fig.savefig(path, dpi=dpi)
    except OSError as e:
        raise RefengineError(f"plot: cannot write {path} ({e.strerror or e})") from None
    finally:
        plt.close(fig)
    return path
