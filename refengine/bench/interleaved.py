"""Ratios measured with the two things compared taking turns.

The machines this runs on are VMs whose memory bandwidth moves with their host's load within minutes
(docs/performance/history.md has figures), so a serial run and a batched run minutes apart can differ
by that alone. Stepping a serial engine and a batched engine alternately gives both the same
machine; the ratio of their decode rates is then the batching gain. The same holds for invariant
mode against fast mode at one batch size (modes_ratio). Likewise a step is held against its
roofline at the machine figure measured right after it (against_probe: a read of memory for a
memory-bound step, a square sgemm for a compute-bound one), not against the best the machine showed
at another time.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace

import numpy as np
from tqdm import tqdm

from ..model import Model
from .roofline import GemmRate, MatvecRead, Roofline
from .workloads import BenchRequest, start_engine


def _decode_step(engine) -> tuple[float, list[str]] | None:
    """(seconds, the ids of the rows it decoded) of one step, or None when it was not decode-only."""
    started = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - started
    scheduled = engine.trace[-1]["scheduled"]
    engine.trace.clear()  # only this step's entry is read; a long run would otherwise keep every step
    decoded = scheduled and all(s["phase"] == "decode" for s in scheduled)
    return (seconds, [s["id"] for s in scheduled]) if decoded else None


def _in_turns(model: Model, engines: dict[str, tuple[str, list[BenchRequest], int]], label: str) -> dict[str, float]:
    """Step the engines (name: (mode, requests, max_num_seqs)) alternately, which one goes first swapping
    every round, until the first one named is done; each one's decode tokens/s over its decode-only
    steps, and how many there were."""
    started = {name: start_engine(model, requests, mode, seats) for name, (mode, requests, seats) in engines.items()}
    first = started[next(iter(engines))]
    steps = {name: [] for name in engines}
    order = list(started.items())
    with tqdm(total=sum(r.max_tokens for r in engines[next(iter(engines))][1]), desc=label, unit="tok",
              leave=False) as bar:
        while first.has_unfinished():
            for name, engine in order:
                if engine.has_unfinished() and (step := _decode_step(engine)) is not None:
                    steps[name].append(step)
            order.reverse()
            bar.n = sum(len(o.token_ids) for o in first.outputs().values())
            bar.refresh()
    rates = {name: sum(len(ids) for _, ids in s) / sum(sec for sec, _ in s) for name, s in steps.items() if s}
    return {"decode_steps": {name: len(s) for name, s in steps.items()}, "decode_tok_s": rates}


def interleaved_ratio(model: Model, mode: str, requests: list[BenchRequest], serial_requests: list[BenchRequest]) -> dict:
    """Step a `mode` engine batching `requests` and a serial fast engine running `serial_requests`
    one after another, alternately, until the batched one is done."""
    turns = _in_turns(model, {"batched": (mode, requests, len(requests)), "serial": ("fast", serial_requests, 1)},
                      f"{mode} B={len(requests)} interleaved with serial")
    rates = turns["decode_tok_s"]
    return {"mode": mode, "batch": len(requests), **turns,
            "ratio": rates["batched"] / rates["serial"] if len(rates) == 2 else None}


def modes_ratio(model: Model, requests: list[BenchRequest], max_num_seqs: int) -> dict:
    """An invariant and a fast engine on the same `requests` at `max_num_seqs`, stepped alternately:
    invariant over fast decode tokens/s. The two modes run the same decode code (a decode step
    differs only where fast mode attends a prefill chunk whole), so this is the goal's ratio with the
    machine's drift between separate runs taken out."""
    turns = _in_turns(model, {"invariant": ("invariant", requests, max_num_seqs),
                              "fast": ("fast", requests, max_num_seqs)},
                      f"invariant and fast B={max_num_seqs} in turn")
    rates = turns["decode_tok_s"]
    return {"batch": max_num_seqs, **turns, "ratio": rates["invariant"] / rates["fast"] if len(rates) == 2 else None}


def _until_idle(window: float = 0.02, limit: float = 2.0) -> None:
    """Wait until this process uses under a quarter of a core over one `window`: OpenBLAS's threads
    spin for a while after each call, on the cores the engine's next step needs."""
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline:
        before = os.times()
        time.sleep(window)
        after = os.times()
        if (after.user + after.system) - (before.user + before.system) < window / 4:
            return


def _context(engine, ids: list[str]) -> float:
    """Mean positions the rows of the decode step just taken attended over: each one's input token
    and everything before it."""
    return float(np.mean([len(engine.output(i).prompt_ids) + len(engine.output(i).token_ids) - 1 for i in ids]))


def against_probe(model: Model, requests: list[BenchRequest], max_num_seqs: int, roofline: Roofline) -> dict:
    """Run `requests` in one fast engine at `max_num_seqs`; after each decode step, measure the
    machine figure that bounds such a step in `roofline` (the sgemm rate where the step is
    compute-bound, else a 512 MB matrix-vector read), with the process idle before the step and before
    the probe. Per step its roofline at that figure; the median of roofline over step time is the share
    the goals take."""
    batch = min(max_num_seqs, len(requests))
    mean_context = float(np.mean([len(r.prompt_ids) + r.max_tokens / 2 for r in requests]))
    compute = roofline.compute_seconds(batch) >= roofline.memory_seconds(batch, mean_context)
    probe = GemmRate() if compute else MatvecRead()
    engine = start_engine(model, requests, "fast", max_num_seqs)
    steps = []
    with tqdm(total=sum(r.max_tokens for r in requests), desc=f"fast B={batch} with {probe.name} probes",
              unit="tok", leave=False) as bar:
        while engine.has_unfinished():
            _until_idle()
            if (step := _decode_step(engine)) is not None:
                seconds, ids = step
                _until_idle()
                figure, attended = probe.measure(), _context(engine, ids)
                at = replace(roofline, flops=figure) if compute else replace(roofline, bandwidth=figure)
                steps.append({"seconds": seconds, "rows": len(ids), "context": attended, "figure": figure,
                              "roofline_s": at.step_seconds(len(ids), attended)})
            bar.n = sum(len(o.token_ids) for o in engine.outputs().values())
            bar.refresh()
    figures = [s["figure"] for s in steps]
    return {"batch": batch, "probe": probe.name, "decode_steps": len(steps), "steps": steps,
            "share": float(np.median([s["roofline_s"] / s["seconds"] for s in steps])) if steps else None,
            "figure_median": float(np.median(figures)) if steps else None,
            "figure_range": [min(figures), max(figures)] if steps else None}
