"""Ratios measured with the two things compared taking turns.

The machines this runs on are VMs whose memory bandwidth moves with their host's load (35-72 GB/s
for the same read within an hour), so a serial run and a batched run minutes apart can differ by 20%
from that alone. Stepping a serial engine and a batched engine alternately gives both the same
machine; the ratio of their decode rates is then the batching gain. The same holds for invariant
mode against fast mode at one batch size (modes_ratio). Likewise a batch-1 step is held against a
read of memory right after it, not against the best the machine showed at another time.
"""
from __future__ import annotations

import time

import numpy as np
from tqdm import tqdm

from ..model import Model
from .roofline import MatvecRead, streamed_parameters
from .workloads import BenchRequest, start_engine


def _decode_step(engine) -> tuple[float, int] | None:
    """(seconds, tokens) of one step, or None when it was not decode-only."""
    started = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - started
    scheduled = engine.trace[-1]["scheduled"]
    engine.trace.clear()  # only this step's entry is read; a long run would otherwise keep every step
    return (seconds, len(scheduled)) if scheduled and all(s["phase"] == "decode" for s in scheduled) else None


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
    rates = {name: sum(t for _, t in s) / sum(sec for sec, _ in s) for name, s in steps.items() if s}
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


def batch1_vs_bandwidth(model: Model, requests: list[BenchRequest]) -> dict:
    """Run `requests` one after another at batch 1 (fast), each decode step followed by a matrix-vector
    product over 512 MB; per step, its time over the weight-read time at that product's bandwidth."""
    engine = start_engine(model, requests, "fast", 1)
    weight_bytes = streamed_parameters(model.config) * 4
    ratios, bandwidths = [], []
    read = MatvecRead()
    with tqdm(total=sum(r.max_tokens for r in requests), desc="fast B=1 with bandwidth reads", unit="tok",
              leave=False) as bar:
        while engine.has_unfinished():
            if (step := _decode_step(engine)) is not None:
                bandwidths.append(read.bandwidth(repeats=1))
                ratios.append(step[0] / (weight_bytes / bandwidths[-1]))
            bar.n = sum(len(o.token_ids) for o in engine.outputs().values())
            bar.refresh()
    return {"decode_steps": len(ratios), "ratio": float(np.median(ratios)) if ratios else None,
            "bandwidth_median": float(np.median(bandwidths)) if bandwidths else None,
            "bandwidth_range": [float(min(bandwidths)), float(max(bandwidths))] if bandwidths else None}
