"""`refengine bench --scenario reference`: what a golden refresh costs, serial against lockstep.

A refresh is the float64 reference decoding a prompt set, and its cost is passes over the weights:
every pass reads the float64 weights (for a streamed model, also the checkpoint it widens them
from) whether it serves one case or sixteen. So the same cases run twice in one process: serial,
each case alone (one pass per token per case), and lockstep as `golden refresh` runs them
(check.golden.lockstep_groups, each group one pass per token). The passes are counted from the
reference's own progress callback, and each run is held against its roofline: passes x bytes a pass
must read / the machine's measured bandwidth.
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

from tqdm import tqdm

from ..check.golden import (
    LOCKSTEP_GROUP,
    TOP_K_LOGPROBS,
    PromptCase,
    load_prompts,
    lockstep_groups,
)
from ..data import shipped
from ..errors import RefengineError
from ..model import Model
from ..model.weights import StreamedWeights
from ..reference import generate_lockstep
from ..sampling import SamplingParams
from .roofline import Machine, streamed_parameters

SEED_PROMPTS = ("golden", "prompts", "seed-experiment.jsonl")  # the prompt set the shipped golden files refresh
ROOFLINE_GOAL = 0.6  # the performance issue's: a run's share of its roofline, serial and lockstep alike
F64_BYTES = 8
# Bytes per value of the checkpoint dtypes a weight can be stored in (safetensors' names).
STORED_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def refresh_cases(path: str | Path | None, max_tokens: int | None) -> tuple[Path, list[PromptCase]]:
    """The prompt file (default: the shipped seed set) and its cases, each case's max_tokens cut to
    `max_tokens` when given."""
    path = Path(path) if path else shipped(*SEED_PROMPTS)
    try:
        cases = load_prompts(path)
    except RefengineError as e:
        raise RefengineError(f"prompts: {e}") from None
    for case in cases:  # the lockstep decode it times has no images: it would answer another prompt
        if case.images:
            raise RefengineError(f"prompts: {case.where}: shows images; the reference cost is timed on text cases "
                                 f"only (remove its image parts)")
    if max_tokens is not None:
        cases = [dataclasses.replace(c, max_tokens=min(c.max_tokens, max_tokens)) for c in cases]
    return path, cases


def stored_bytes_per_pass(model: Model) -> int:
    """Checkpoint bytes a streamed pass reads: every tensor a token multiplies by, as stored (the
    embedding only when it is also the tied output head; otherwise a pass reads a few of its rows)."""
    checkpoint, ignored = model.checkpoint, model.config.ignored_prefix  # a VL checkpoint's vision tower: never read
    skip = set() if model.config.tie_word_embeddings else {checkpoint.embed_name}
    tensors = [source.tensors[name] for name, source in checkpoint.sources.items()
               if name not in skip and not (ignored and name.startswith(ignored))]
    return sum(math.prod(shape) * STORED_ITEMSIZE[dtype] for dtype, shape in tensors)


def _timed(label: str, total: int, groups: list[list[int]], prompt_ids, params, model: Model) -> tuple[dict, list]:
    """Decode every group of case indices with one generate_lockstep call each: seconds, passes and
    results, the seconds split at each group's first pass (its prefill, compute-bound: every prompt
    token multiplies every weight) from the decode passes after it, which only the weight read bounds."""
    stamps, results = [], {}  # per group: when it started, then the end of each of its passes

    def progress(tokens: int) -> None:
        stamps[-1].append(time.perf_counter())
        bar.update(tokens)

    with tqdm(total=total, desc=f"reference {label}", unit="tok", leave=False) as bar:
        started = time.perf_counter()
        for group in groups:
            stamps.append([time.perf_counter()])
            done = generate_lockstep(model, [prompt_ids[i] for i in group], [params[i] for i in group],
                                     top_k_logprobs=TOP_K_LOGPROBS, progress=progress)
            results.update(zip(group, done))
        seconds = time.perf_counter() - started
    ordered = [results[i] for i in range(len(prompt_ids))]
    return {"seconds": seconds, "tokens": sum(len(r.token_ids) for r in ordered),
            "passes": sum(len(s) - 1 for s in stamps), "prefill_s": sum(s[1] - s[0] for s in stamps),
            "decode_passes": sum(len(s) - 2 for s in stamps), "decode_s": sum(s[-1] - s[1] for s in stamps)}, ordered


def run_reference(model_dir: Path, path: Path, cases: list[PromptCase], max_tokens: int | None = None,
                  group: int = LOCKSTEP_GROUP) -> dict:
    """`cases` (refresh_cases: of the prompt file `path`, cut to `max_tokens`) through the float64
    reference serial (each alone: generate(), which is generate_lockstep of one case -- called here so
    the bar moves per token) and in lockstep groups of `group`, as `golden refresh` decodes them."""
    model = Model(model_dir)  # its own float64 weights, released when this returns
    streamed = isinstance(model.reference_weights(), StreamedWeights)  # in memory: widened now, not timed
    prompt_ids = [case.encode(model) for case in cases]
    params = [SamplingParams(max_tokens=case.max_tokens) for case in cases]  # as the refresh: eos stops
    total = sum(case.max_tokens for case in cases)
    serial, serial_results = _timed("serial", total, [[i] for i in range(len(cases))], prompt_ids, params, model)
    lockstep, lockstep_results = _timed(f"lockstep (groups of {group})", total,
                                        lockstep_groups(list(range(len(cases))), group), prompt_ids, params, model)
    for run, results in ((serial, serial_results), (lockstep, lockstep_results)):
        run["case_tokens"] = {case.id: len(r.token_ids) for case, r in zip(cases, results)}
    return {"prompts": str(path), "cases": len(cases), "max_tokens_cap": max_tokens, "lockstep_group": group,
            "case_max_tokens": {case.id: case.max_tokens for case in cases},
            "prompt_tokens": sum(len(ids) for ids in prompt_ids),
            "streamed": streamed, "stored_dtypes": model.checkpoint.stored_dtypes,
            "stored_bytes_per_pass": stored_bytes_per_pass(model) if streamed else 0,
            "weight_bytes_f64": streamed_parameters(model.config) * F64_BYTES,
            "same_tokens": [r.token_ids for r in serial_results] == [r.token_ids for r in lockstep_results],
            "serial": serial, "lockstep": lockstep}


def reference_report(timing: dict, machine: Machine) -> dict:
    """run_reference's timings with tokens/s, the lockstep gain and each run against its roofline."""
    bytes_per_pass = timing["weight_bytes_f64"] + timing["stored_bytes_per_pass"]
    pass_s = bytes_per_pass / machine.bandwidth
    runs = {}
    for name in ("serial", "lockstep"):
        run = timing[name]
        roofline_s = run["passes"] * pass_s
        decode_roofline_s = run["decode_passes"] * pass_s
        runs[name] = run | {
            "tok_s": run["tokens"] / run["seconds"], "s_per_pass": run["seconds"] / run["passes"],
            "roofline_s": roofline_s, "roofline_fraction": roofline_s / run["seconds"],
            "decode_roofline_fraction": decode_roofline_s / run["decode_s"] if run["decode_s"] else None}
    return timing | runs | {
        "bytes_per_pass": bytes_per_pass, "bandwidth": machine.bandwidth, "roofline_s_per_pass": pass_s,
        "lockstep_vs_serial": runs["lockstep"]["tok_s"] / runs["serial"]["tok_s"],
        "goals": {f"{name} share of roofline": {"ratio": runs[name]["roofline_fraction"], "goal": ROOFLINE_GOAL}
                  for name in runs}}


def print_reference(ref: dict) -> None:
    cap = f", max_tokens cut to {ref['max_tokens_cap']}" if ref["max_tokens_cap"] else ""
    read = (f"{ref['weight_bytes_f64'] / 1e9:.2f} GB float64"
            + (f" + {ref['stored_bytes_per_pass'] / 1e9:.2f} GB {'/'.join(ref['stored_dtypes'])} streamed"
               if ref["streamed"] else " in memory"))
    print(f"reference refresh: {ref['cases']} cases of {Path(ref['prompts']).name}{cap}, "
          f"{ref['prompt_tokens']} prompt tokens; a pass reads {read}: {ref['roofline_s_per_pass'] * 1e3:.3g} ms at "
          f"{ref['bandwidth'] / 1e9:.1f} GB/s")
    print(f"  {'run':<9} {'tokens':>6} {'passes':>6} {'seconds':>9} {'tok/s':>8} {'s/pass':>8} {'roofline s':>10} "
          f"{'% roof':>7} {'prefill s':>9} {'decode s/pass':>13} {'decode % roof':>13}")
    for name in ("serial", "lockstep"):
        run = ref[name]
        decode = (f"{run['decode_s'] / run['decode_passes']:>13.3f} {100 * run['decode_roofline_fraction']:>12.2g}%"
                  if run["decode_passes"] else f"{'-':>13} {'-':>13}")
        print(f"  {name:<9} {run['tokens']:>6} {run['passes']:>6} {run['seconds']:>9.2f} {run['tok_s']:>8.2f} "
              f"{run['s_per_pass']:>8.3f} {run['roofline_s']:>10.3g} {100 * run['roofline_fraction']:>6.2g}% "
              f"{run['prefill_s']:>9.2f} {decode}")
    print(f"  lockstep (groups of {ref['lockstep_group']}) / serial: {ref['lockstep_vs_serial']:.2f}x tokens/s; "
          f"tokens {'identical' if ref['same_tokens'] else 'DIFFER'}")
    for name, goal in ref["goals"].items():
        met = goal["ratio"] >= goal["goal"]
        print(f"goal reference {name}: {goal['ratio']:.2f} (goal >= {goal['goal']}) {'met' if met else 'NOT met'}")
