"""`refengine bench --plot`: decode step time and tokens/s vs batch size, against the roofline; drawn
from the report's decode section, so a committed `bench --json` run draws again (docs/pictures.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import RefengineError
from ..plotting import pyplot, save
from .roofline import Roofline

MODE_STYLES = {"fast": ("tab:blue", "o"), "invariant": ("tab:orange", "s")}


def plot_decode(decode: dict, path: str | Path) -> Path:
    """The decode section of a `bench --json` report (from a run that recorded its roofline) as a PNG."""
    if "roofline" not in decode:
        raise RefengineError("plot: the report's decode section records no roofline (a run from before "
                             "bench kept what its plot draws)")
    return plot_sweep(path, decode["sweep"], Roofline(**decode["roofline"]), decode["plot_context"],
                      decode["plot_title"])


def plot_sweep(path: str | Path, sweep: dict[str, dict[int, dict]], roofline: Roofline, context: float,
               title: str) -> Path:
    """`sweep`: {mode: {batch: RunStats.to_json()}} (batch as int or str, as in the JSON report);
    `context`: mean KV prefix of a decode token."""
    plt = pyplot()
    sweep = {mode: {int(b): run for b, run in runs.items()} for mode, runs in sweep.items()}
    batches = sorted({b for runs in sweep.values() for b in runs})
    grid = np.unique(np.geomspace(1, max(batches) * 1.5, 64).round().astype(int))
    compute = np.array([roofline.compute_seconds(b) for b in grid]) * 1e3
    memory = np.array([roofline.memory_seconds(b, context) for b in grid]) * 1e3
    bound = np.maximum(compute, memory)

    fig, (ax_time, ax_rate) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_time.plot(grid, memory, ":", color="gray", label="memory: (4N + KV(B)) / BW")
    ax_time.plot(grid, compute, "--", color="gray", label="compute: 2NB / FLOPS")
    ax_time.plot(grid, bound, "-", color="black", lw=1, label="roofline T(B)")
    ax_rate.plot(grid, grid / bound * 1e3, "-", color="black", lw=1, label="roofline B / T(B)")
    for mode, runs in sweep.items():
        color, marker = MODE_STYLES.get(mode, ("tab:green", "^"))
        xs = sorted(runs)
        ax_time.plot(xs, [runs[b]["decode_step_ms"]["p50"] for b in xs], marker=marker, color=color,
                     label=f"{mode} (median decode step)")
        ax_rate.plot(xs, [runs[b]["decode_tok_s"] for b in xs], marker=marker, color=color, label=mode)
    for ax, ylabel in ((ax_time, "decode step time (ms)"), (ax_rate, "decode tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size (concurrent decodes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save(fig, path, dpi=90)
