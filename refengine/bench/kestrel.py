"""The Kestrel scenario: 8 concurrent chat requests, serial vs batched, short answers vs long decodes.

Kestrel-LLM measured 8 short chat answers (2-6 tokens) taking 62% longer batched than serial, while
long chats gained 1.7x. Here both workloads run serial (fast, max_num_seqs=1) and batched
(max_num_seqs=8) in each mode, next to what the throughput model predicts for the same schedule:
serial pays one prefill and n-1 batch-1 decode steps per request; batched pays one prefill of all
prompts together and then decode steps whose batch shrinks as answers finish.
"""
from __future__ import annotations

import numpy as np

from ..model import Model
from .roofline import Roofline
from .workloads import BenchRequest, RunStats, run_requests

QUESTIONS = [
    "What colour is the sky on a clear day? One word.", "What is the capital of Japan? One word.",
    "Name a hot drink made from leaves. One word.", "What colour is grass? One word.",
    "What is the capital of France? One word.", "Name a drink made from roasted beans. One word.",
    "Mix red and blue: which colour? One word.", "What is the capital of Germany? One word.",
]
SHORT_TOKENS = (2, 6)


def kestrel_requests(model: Model, long_tokens: int, seed: int = 0) -> dict[str, list[BenchRequest]]:
    rng = np.random.default_rng(seed)
    prompts = [model.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    short = [int(n) for n in rng.integers(SHORT_TOKENS[0], SHORT_TOKENS[1] + 1, len(prompts))]
    return {
        "short": [BenchRequest(f"short{i}", p, n) for i, (p, n) in enumerate(zip(prompts, short))],
        "long": [BenchRequest(f"long{i}", p, long_tokens) for i, p in enumerate(prompts)],
    }


def predicted_seconds(roofline: Roofline, requests: list[BenchRequest], batched: bool) -> float:
    if not batched:
        return sum(roofline.forward_seconds(len(r.prompt_ids), 1, len(r.prompt_ids))
                   + sum(roofline.step_seconds(1, len(r.prompt_ids) + j) for j in range(1, r.max_tokens))
                   for r in requests)
    prompt_tokens = sum(len(r.prompt_ids) for r in requests)
    seconds = roofline.forward_seconds(prompt_tokens, len(requests), prompt_tokens)
    for j in range(1, max(r.max_tokens for r in requests)):
        active = [r for r in requests if r.max_tokens > j]
        context = sum(len(r.prompt_ids) + j for r in active)
        seconds += roofline.forward_seconds(len(active), len(active), context)
    return seconds


def run_kestrel(model: Model, modes: list[str], long_tokens: int) -> dict[str, tuple[list[BenchRequest], dict]]:
    """{workload: (requests, {"serial": stats, mode: stats})} for the short and long workloads."""
    results = {}
    for workload, requests in kestrel_requests(model, long_tokens).items():
        runs: dict[str, RunStats] = {"serial": run_requests(model, requests, "fast", 1, label=f"{workload} serial")}
        for mode in modes:
            runs[mode] = run_requests(model, requests, mode, len(requests), label=f"{workload} {mode} batched")
        results[workload] = (requests, runs)
    return results


def kestrel_report(results: dict[str, tuple[list[BenchRequest], dict]], roofline: Roofline) -> dict:
    """The runs of run_kestrel beside what the throughput model predicts for the same schedules."""
    report = {}
    for workload, (requests, runs) in results.items():
        report[workload] = {
            "max_tokens": [r.max_tokens for r in requests],
            "prompt_tokens": [len(r.prompt_ids) for r in requests],
            "runs": {name: stats.to_json() for name, stats in runs.items()},
            "batched_speedup": {mode: runs["serial"].wall_s / stats.wall_s for mode, stats in runs.items()
                                if mode != "serial"},
            "predicted_s": {"serial": predicted_seconds(roofline, requests, batched=False),
                            "batched": predicted_seconds(roofline, requests, batched=True)},
        }
    return report
