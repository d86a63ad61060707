"""The precision report: how far the server's logprobs are from the float64 golden ones, and what
margin tolerance that error calls for.

Token agreement alone says little about a server's numerics: a float16 server agrees with the
golden tokens almost everywhere and still flips every near-tie the float32 bound does not cover.
Every validate request asks for logprobs (validate.dialect), so on each AGREEING step (before a
record's first divergence, where its token is the golden token and the golden top-1) the server's
logprob of that token can be set against the golden float64 logprob of the same token after the
same prefix: |Δlogprob| there is the server's own numeric error, measured on the run itself.

Why that error calls for a margin tolerance of max |Δlogprob| x safety factor (margin_rule.tolerance,
the one formula): the margin rule forgives a first divergence where the golden top-2 margin (the
difference of the two best logprobs) is within the tolerance. If every logprob the server computes
is off by at most e, its top-2 margin is off by at most 2e, so it may swap the two best tokens
wherever the true margin is <= 2e. The golden file's own tolerance is its measured f32_vs_f64 bound
(a max |logit difference|; a logprob is a logit minus the logsumexp, which moves by at most as much,
so |Δlogprob| <= 2 x that bound for a float32 server) times the safety factor (8), which covers
that factor 2 and the gap between a sampled maximum and the true one. The same rule applied to the
error seen here gives the tolerance this server calls for: when it exceeds the golden tolerance, the
server is less precise than float32 (f16, bf16, a quantized model) and its explained/diverged
verdicts should be read with this tolerance instead. Each divergence is listed with whether its
margin falls inside the tolerance called for.

Records compared by text carry no token ids, so their logprobs cannot be aligned with golden
steps: they are skipped and counted, as are records without logprobs. Cancelled and error records
are not compared. The raw deltas are kept in the report (key "deltas", for the plot) only when
fewer than MAX_KEPT_DELTAS, to keep the JSON report small; agreeing_deltas() recomputes them.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..check.margin_rule import tolerance
from ..errors import RefengineError
from ..plotting import pyplot, save
from .load import COMPARED

MAX_KEPT_DELTAS = 10_000

__all__ = ["MAX_KEPT_DELTAS", "agreeing_deltas", "format_precision", "plot_precision", "precision"]


def agreeing(record: dict, case) -> list[float]:
    """|server logprob - golden logprob| on each agreeing step of one compared record with ids."""
    ids, logprobs = record["token_ids"], record["logprobs"]
    end = record.get("step") if record["verdict"] in ("explained", "diverged") else None
    end = min(len(ids), len(logprobs), len(case.token_ids), len(case.top_logprobs),
              len(case.token_ids) if end is None else end)
    deltas = []
    for i in range(end):
        top = case.top_logprobs[i]
        if ids[i] != case.token_ids[i] or not top or top[0][0] != ids[i] or logprobs[i] is None:
            continue
        deltas.append(abs(float(logprobs[i]) - float(top[0][1])))
    return deltas


def agreeing_deltas(records: list[dict], golden) -> tuple[np.ndarray, dict]:
    """All |Δlogprob| of the agreeing steps, and the counts: records used, by text, without logprobs."""
    cases = {c.id: c for c in golden.cases}
    deltas, counts = [], {"records": 0, "by_text": 0, "without_logprobs": 0}
    for r in records:
        if r.get("verdict") not in COMPARED or r.get("case") not in cases:
            continue
        if r.get("token_ids") is None:
            counts["by_text"] += 1
        elif r.get("logprobs") is None:
            counts["without_logprobs"] += 1
        else:
            counts["records"] += 1
            deltas += agreeing(r, cases[r["case"]])
    return np.asarray(deltas, dtype=np.float64), counts


def precision(records: list[dict], golden, run_precision: str = "f32",
              run_tolerance: float | None = None) -> dict | None:
    """The precision report of validate's request records against a golden file (check.golden.Golden);
    None when no record carries logprobs (the server reports none, or refused the fields).
    `run_precision`, `run_tolerance`: what the run held the server to (validate.bounds), set against
    the tolerance its logprobs call for where that is not float32."""
    if not any(r.get("logprobs") is not None for r in records):
        return None
    deltas, counts = agreeing_deltas(records, golden)
    noise = golden.header["noise"]
    bound, safety = noise["f32_vs_f64"], noise["safety_factor"]
    out = {"steps": int(deltas.size), **counts, "max": None, "p50": None, "p99": None,
           "float32_bound": bound, "safety_factor": safety,
           "golden_tolerance": tolerance(noise, "f32_vs_f64"), "tolerance_called_for": None,
           "run_precision": run_precision, "run_tolerance": run_tolerance}
    if deltas.size:
        worst = float(deltas.max())
        out |= {"max": worst, "p50": float(np.percentile(deltas, 50)), "p99": float(np.percentile(deltas, 99)),
                "tolerance_called_for": tolerance({"f32_vs_f64": worst, "safety_factor": safety}, "f32_vs_f64")}
    called_for = out["tolerance_called_for"]
    out["divergences"] = [
        {"id": r["id"], "step": r.get("step"), "margin": r.get("margin"),
         "inside": None if called_for is None else r.get("margin") is not None and r["margin"] <= called_for}
        for r in records if r.get("verdict") in ("explained", "diverged") and not r.get("variant")]
    if deltas.size < MAX_KEPT_DELTAS:
        out["deltas"] = deltas.tolist()
    return out


def _g(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def format_precision(p: dict) -> list[str]:
    """The precision report as aligned lines for the text report."""
    skipped = [f"{p[k]} {what}" for k, what in (("by_text", "compared by text"),
                                                 ("without_logprobs", "without logprobs")) if p.get(k)]
    rows = [("|Δlogprob| max", _g(p["max"])), ("|Δlogprob| p50", _g(p["p50"])), ("|Δlogprob| p99", _g(p["p99"])),
            ("steps counted", f"{p['steps']} agreeing steps of {p['records']} records"
             + (f" (skipped {', '.join(skipped)})" if skipped else "")),
            ("float32 bound", (f"{_g(p['float32_bound'])} (golden tolerance {_g(p.get('golden_tolerance'))} = "
                               f"bound x safety factor {p['safety_factor']})")),
            ("tolerance called for", "-" if p["tolerance_called_for"] is None else
             f"{_g(p['tolerance_called_for'])} = max x safety factor {p['safety_factor']}")]
    if p["tolerance_called_for"] is not None and p.get("golden_tolerance") is not None:
        rows.append(("vs golden tolerance", "within it: float32-grade logprobs"
                     if p["tolerance_called_for"] <= p["golden_tolerance"] else
                     f"{p['tolerance_called_for'] / p['golden_tolerance']:.3g}x wider: the logprobs are less precise "
                     f"than float32 (or wrong); the verdicts above used the run's own tolerance"))
    run, run_tolerance = p.get("run_precision", "f32"), p.get("run_tolerance")
    if run != "f32" and None not in (p["tolerance_called_for"], run_tolerance):
        rows.append((f"vs {run} tolerance", f"within it ({_g(run_tolerance)}): {run}-grade logprobs"
                     if p["tolerance_called_for"] <= run_tolerance else
                     f"{p['tolerance_called_for'] / run_tolerance:.3g}x wider than {_g(run_tolerance)}: the logprobs "
                     f"are less precise than {run} (or wrong)"))
    for d in p["divergences"]:
        where = "step ?" if d["step"] is None else f"step {d['step']}"
        margin = "no margin (strict)" if d["margin"] is None else f"margin {_g(d['margin'])}"
        inside = {True: "inside", False: "outside", None: "unknown"}[d["inside"]]
        rows.append((f"divergence {d['id']}", f"{where}, {margin}: {inside} the tolerance called for"))
    width = max(len(label) for label, _ in rows)
    return ["precision (server logprobs vs golden float64):"] + [f"  {label:<{width}}  {value}" for label, value in rows]


def plot_precision(p: dict, deltas, path: str | Path) -> Path:
    """A log-x histogram of |Δlogprob| with the float32 bound marked, written to `path` (PNG).
    `deltas`: the raw values (None: p["deltas"]; a report with >= MAX_KEPT_DELTAS steps keeps none,
    so pass agreeing_deltas(records, golden)[0]). Exact zeros (bit-equal logprobs) are drawn in the
    leftmost bin and counted in the legend."""
    plt = pyplot()
    if deltas is None:
        if "deltas" not in p:
            raise RefengineError(f"plot: the precision report keeps no deltas ({p['steps']} steps >= "
                                 f"{MAX_KEPT_DELTAS}); pass agreeing_deltas(records, golden)[0]")
        deltas = p["deltas"]
    deltas = np.asarray(deltas, dtype=np.float64)
    if not deltas.size:
        raise RefengineError("plot: no agreeing steps to plot")
    bound = p["float32_bound"]
    positive = deltas[deltas > 0]
    zeros = int(deltas.size - positive.size)
    low = min(positive.min() if positive.size else bound, bound) / 2
    high = max(deltas.max(), bound, p.get("tolerance_called_for") or 0) * 2
    bins = np.geomspace(low, high, 50)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(np.where(deltas > 0, deltas, bins[0]), bins=bins, color="tab:blue",
            label=f"{deltas.size} agreeing steps" + (f" ({zeros} exact zeros, leftmost bin)" if zeros else ""))
    ax.axvline(bound, color="tab:red", ls="--", label=f"float32 bound {bound:.3g} (golden f32_vs_f64)")
    if p.get("tolerance_called_for") is not None:
        ax.axvline(p["tolerance_called_for"], color="black", ls=":",
                   label=f"tolerance called for {p['tolerance_called_for']:.3g} (max x {p['safety_factor']})")
    ax.set_xscale("log")
    ax.set_xlabel("|server logprob - golden float64 logprob|")
    ax.set_ylabel("steps")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"precision: max {_g(p['max'])}, p50 {_g(p['p50'])}, p99 {_g(p['p99'])}", fontsize=10)
    fig.tight_layout()
    return save(fig, path, dpi=90)
