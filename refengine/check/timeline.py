"""A schedule as it ran, drawn: requests as rows, engine steps as columns (`refengine replay --plot`,
`refengine run-schedule --plot`).

A join/leave schedule is hard to read as JSON and harder as a trace: which request waited, which one
was chunked, who was preempted when the pool ran dry, and where the first divergence sits against
all of that. `timeline` turns the engine's trace and outputs into one row per request (pure data,
tested against the schedule file: tests/test_timeline.py); `plot_timeline` draws the rows.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

from ..engine import RequestOutput
from ..plotting import pyplot, save
from .margin_rule import Verdict


@dataclass(frozen=True)
class Divergence:
    step: int               # the engine step of the first differing token
    kind: str               # "explained" (within the margin rule) | "diverged"
    margin: float | None    # the baseline's top-2 margin there


@dataclass(frozen=True)
class Row:
    id: str
    arrival: int
    work: tuple[tuple[int, str, int], ...]  # (step, "prefill" | "decode", tokens) for every scheduled step
    preempted: tuple[int, ...]              # steps at which the scheduler took its blocks
    aborted: int | None                     # the step whose trace records the abort
    finish: tuple[int, str] | None          # (step of its last token, finish reason), abort excluded
    divergence: Divergence | None


def timeline(trace: list[dict], outputs: dict[str, RequestOutput],
             verdicts: dict[str, Verdict] | None = None) -> list[Row]:
    """One row per request, in the order the outputs list them (their arrival order)."""
    rows = []
    for rid, out in outputs.items():
        work = tuple((t["step"], s["phase"], s["num_tokens"]) for t in trace for s in t["scheduled"] if s["id"] == rid)
        aborted = next((t["step"] for t in trace if rid in t["aborted"]), None)
        finished = out.finish_reason not in (None, "abort") and out.steps
        v = (verdicts or {}).get(rid)
        divergence = Divergence(v.engine_step, v.kind, v.margin) \
            if v is not None and v.kind in ("explained", "diverged") and v.engine_step is not None else None
        rows.append(Row(rid, out.arrival_step, work,
                        tuple(t["step"] for t in trace if rid in t["preempted"]), aborted,
                        (out.steps[-1].step, out.finish_reason) if finished else None, divergence))
    return rows


PHASE_COLOURS = {"prefill": "#4c72b0", "decode": "#55a868"}
WAITING_COLOUR = "#e6e6e6"
DIVERGENCE_COLOURS = {"explained": "#dd8452", "diverged": "#c44e52"}


def plot_timeline(rows: list[Row], num_steps: int, path: str | Path, title: str) -> Path:
    """The rows as a PNG at `path`: a grey bar from arrival to the end (waiting where nothing is drawn
    over it), a blue cell per prefill chunk with its token count, a green cell per decode; a red cross
    where the request was preempted, a black square where it was aborted, its finish reason after its
    last token, and a star at the first divergence with the baseline's margin there."""
    plt = pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    width = min(max(7.0, 0.32 * num_steps + 2.5), 24.0)
    fig, ax = plt.subplots(figsize=(width, 0.55 * len(rows) + 1.8))
    for y, row in enumerate(rows):
        last = row.finish[0] if row.finish else row.aborted if row.aborted is not None \
            else max([s for s, _, _ in row.work], default=row.arrival)
        end = last + 1
        ax.barh(y, end - row.arrival, left=row.arrival, height=0.7, color=WAITING_COLOUR, edgecolor="none")
        for step, phase, tokens in row.work:
            ax.barh(y, 0.9, left=step + 0.05, height=0.56, color=PHASE_COLOURS[phase], edgecolor="none")
            if phase == "prefill":
                ax.text(step + 0.5, y, str(tokens), ha="center", va="center", fontsize=7, color="white")
        for step in row.preempted:
            ax.plot(step + 0.5, y, marker="X", markersize=10, color="#c44e52", markeredgecolor="white")
        if row.aborted is not None:
            ax.plot(row.aborted + 0.5, y, marker="s", markersize=8, color="black")
            ax.text(row.aborted + 1.0, y, "abort", va="center", fontsize=7)
        if row.finish:
            ax.text(row.finish[0] + 1.1, y, row.finish[1], va="center", fontsize=7)
        if d := row.divergence:
            ax.plot(d.step + 0.5, y + 0.3, marker="*", markersize=13, color=DIVERGENCE_COLOURS[d.kind],
                    markeredgecolor="black", markeredgewidth=0.5)
            margin = "no margin known" if d.margin is None else f"margin {d.margin:.3g}"
            ax.text(d.step + 0.9, y + 0.32, f"{d.kind}, {margin}", va="center", fontsize=7,
                    color=DIVERGENCE_COLOURS[d.kind])
    ax.set_yticks(range(len(rows)), [row.id for row in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, num_steps + 3)
    ax.set_xlabel("engine step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(True, axis="x", alpha=0.25)
    ax.set_axisbelow(True)
    legend = [Patch(color=PHASE_COLOURS["prefill"], label="prefill chunk (tokens)"),
              Patch(color=PHASE_COLOURS["decode"], label="decode"),
              Patch(color=WAITING_COLOUR, label="waiting"),
              Line2D([], [], ls="", marker="X", color="#c44e52", label="preempted"),
              Line2D([], [], ls="", marker="s", color="black", label="aborted")]
    if any(row.divergence for row in rows):
        legend.append(Line2D([], [], ls="", marker="*", markersize=11, color=DIVERGENCE_COLOURS["diverged"],
                             label="first divergence"))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.55 / max(1, len(rows)) - 0.12),
              ncol=len(legend), fontsize=7, frameon=False)
    ax.set_title("\n".join(textwrap.fill(line, int(11 * width)) for line in title.split("\n")), fontsize=9)
    fig.tight_layout()
    return save(fig, path, dpi=110)
