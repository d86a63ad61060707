"""Precision and batching apart: against a golden file, each case's answer sent alone is judged against
the float64 golden answer (what the device's precision does) and each loaded answer against the
same server's alone answer (what batching does), each divergence with its margin and tolerance.
A plot draws every divergence's margin against both tolerances, the two effects in two colours."""
from __future__ import annotations

from pathlib import Path

from ..errors import RefengineError
from ..plotting import pyplot, save

KINDS = ("match", "explained", "diverged")


def effect_counts(requests: list[dict], alone: list[dict]) -> dict:
    """The report's `effects`: verdict counts of the precision effect (alone records) and of the
    batching effect (the loaded records' `batching`)."""
    batching = [r["batching"]["verdict"] for r in requests if "batching" in r]
    return {"precision": {k: sum(r["verdict"] == k for r in alone) for k in KINDS},
            "batching": {k: batching.count(k) for k in KINDS}}


def divergences(report: dict) -> dict[str, list[tuple[str, float | None]]]:
    """(record id, margin) of every divergence, per effect; a margin of None: none known (strict)."""
    precision = [(r["id"], r["margin"]) for r in report["alone"] if r["verdict"] in KINDS[1:]]
    batching = [(r["id"], r["batching"]["margin"]) for r in report["requests"]
                if r.get("batching", {}).get("verdict") in KINDS[1:]]
    return {"precision": precision, "batching": batching}


def plot_effects(report: dict, path: str | Path) -> Path:
    """Every divergence's margin (log y; a strict one, with no margin, drawn at the bottom edge),
    precision effects and batching effects in two colours, with the two tolerances as lines."""
    if not report.get("effects"):
        raise RefengineError("plot: no effects to draw (the baseline is not golden)")
    plt, found, bounds = pyplot(), divergences(report), report["bounds"]
    margins = [m for pairs in found.values() for _, m in pairs if m]
    lines = [t for t in (bounds["precision_tolerance"], bounds["batching"]) if t]
    low = min(margins + lines + [1.0]) / 4
    fig, ax = plt.subplots(figsize=(7, 4))
    x = 0
    for effect, colour in (("precision", "tab:blue"), ("batching", "tab:orange")):
        pairs = found[effect]
        xs = list(range(x, x + len(pairs)))
        ax.scatter(xs, [m if m else low for _, m in pairs], color=colour, zorder=3,
                   label=f"{effect}: {len(pairs)} divergences" + (" (none)" if not pairs else ""))
        x += len(pairs) + 1
    if bounds["precision_tolerance"]:
        ax.axhline(bounds["precision_tolerance"], color="tab:blue", ls="--",
                   label=f"precision tolerance {bounds['precision_tolerance']:.3g} ({bounds['precision']})")
    if bounds["batching"]:
        ax.axhline(bounds["batching"], color="tab:orange", ls=":", label=f"batching tolerance {bounds['batching']:.3g}")
    ax.set_yscale("log")
    ax.set_ylim(low / 2, max(margins + lines + [1.0]) * 4)
    ax.set_xticks([])
    ax.set_xlabel("divergences (precision: alone vs golden; batching: loaded vs alone)")
    ax.set_ylabel("top-2 margin at the divergence")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    e = report["effects"]
    ax.set_title(f"precision: {e['precision']['diverged']} diverged, {e['precision']['explained']} explained; "
                 f"batching: {e['batching']['diverged']} diverged, {e['batching']['explained']} explained",
                 fontsize=9)
    fig.tight_layout()
    return save(fig, path, dpi=90)
