"""Batched decode throughput over serial's with both engines stepping in turn.

The machines this runs on are VMs whose memory bandwidth moves with their host's load (35-72 GB/s
for the same read within an hour), so a serial run and a batched run minutes apart can differ by 20%
from that alone. Stepping a serial engine and a batched engine alternately gives both the same
machine; the ratio of their decode rates is then the batching gain.
"""
from __future__ import annotations

import time

from tqdm import tqdm

from .bench import BenchRequest, start_engine
from .model import Model


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
