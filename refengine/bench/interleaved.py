"""Ratios measured with the two things compared taking turns.

The machines this runs on are VMs whose memory bandwidth moves with their host's load (35-72 GB/s
for the same read within an hour), so a serial run and a batched run minutes apart can differ by 20%
from that alone. Stepping a serial engine and a batched engine alternately gives both the same
machine; the ratio of their decode rates is then the batching gain. Likewise a batch-1 step is held
against a read of memory right after it, not against the best the machine showed at another time.
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


def interleaved_ratio(model: Model, mode: str, requests: list[BenchRequest], serial_requests: list[BenchRequest]) -> dict:
    """Step a `mode` engine batching `requests` and a serial fast engine running `serial_requests`
    one after another, alternately, until the batched one is done."""
    batched = start_engine(model, requests, mode, len(requests))
    serial = start_engine(model, serial_requests, "fast", 1)
    steps = {"batched": [], "serial": []}
    with tqdm(total=sum(r.max_tokens for r in requests), desc=f"{mode} B={len(requests)} interleaved with serial",
              unit="tok", leave=False) as bar:
        while batched.has_unfinished():
            for name, engine in (("batched", batched), ("serial", serial)):
                if engine.has_unfinished() and (step := _decode_step(engine)) is not None:
                    steps[name].append(step)
            bar.n = sum(len(o.token_ids) for o in batched.outputs().values())
            bar.refresh()
    rates = {name: sum(t for _, t in s) / sum(sec for sec, _ in s) for name, s in steps.items() if s}
    return {"mode": mode, "batch": len(requests), "decode_steps": {name: len(s) for name, s in steps.items()},
            "decode_tok_s": rates, "ratio": rates["batched"] / rates["serial"] if len(rates) == 2 else None}


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
