"""Measured noise bounds: how far float32 logits move when only batching, or only precision, changes.

Measured on the model with the calibration's own prompts and schedules — never on a run being
judged (a corrupted KV cache would then explain itself):
- f32_batched_vs_serial: fast-mode engine, a request inside a batched schedule against the same
  request alone; the largest |logit difference| over every token the two runs agree on.
- f32_vs_f64: the engine (both modes, batched and alone) against the float64 reference, likewise.
The tolerance the suite applies is bound x SAFETY_FACTOR, for both the logit-deviation check on
agreeing tokens and the top-2 margin that may explain a flipped token.

SAFETY_FACTOR = 8 = 2 x 4. The 2: a flip needs the top-2 margin to close, and both logits can move
by the bound in opposite directions. The 4: headroom for schedules, prompts and positions the
calibration sample did not contain (the suite's `target()` on deviation / tolerance pushes
Hypothesis towards the worst case; README "Tolerances" has the largest ratio it found).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .. import blas, reference
from ..data import shipped
from ..engine import kernels, model_runner
from ..errors import RefengineError
from ..model import Model
from ..model.cache import cache_dir
from .comparison import logit_deviation
from .driver import run_alone, run_batched
from .schedule import parse_schedule

SAFETY_FACTOR = 8
SEED = 0
PROMPT_LENGTHS = (1, 2, 3, 5, 8, 13, 16, 17, 24, 31, 33, 48)
MAX_TOKENS = 16
SETTINGS = (  # each a different batching pattern: chunked prefill + mixed steps, wide batches, preemption
    {"max_num_seqs": 4, "max_num_batched_tokens": 16, "block_size": 4},
    {"max_num_seqs": 12, "max_num_batched_tokens": 64, "block_size": 16},
    {"max_num_seqs": 6, "max_num_batched_tokens": 5, "block_size": 1, "num_blocks": 96},
)
KEYS = ("f32_batched_vs_serial", "f32_vs_f64", "safety_factor")
STORED_DIR = "golden"  # of the package data: committed calibrations, beside the golden files they went into


def calibration_schedules(vocab_size: int) -> list[dict]:
    rng = np.random.default_rng(SEED)
    requests = [{"id": f"c{n}", "prompt_ids": rng.integers(0, vocab_size, size=length).tolist(),
                 "max_tokens": MAX_TOKENS, "ignore_eos": True, "arrival_step": 2 * n}
                for n, length in enumerate(PROMPT_LENGTHS)]
    return [{"engine": {"mode": "fast", **settings}, "requests": requests} for settings in SETTINGS]


def agreeing_deviations(got, want) -> list[float]:
    """|logit difference| per generated token, up to the first token the runs disagree on."""
    deviations = []
    for g, w in zip(got.steps, want.steps):
        if g.token_id != w.token_id:
            break
        deviations.append(logit_deviation(g.logits, w.logits))
    return deviations


def calibrate(model: Model) -> dict:
    """Measure both bounds on `model`; the dict golden headers embed as `noise`."""

    batch_noise, precision_noise = [], []
    schedules = [parse_schedule(s, "calibration") for s in calibration_schedules(model.config.vocab_size)]
    references = {r.id: reference.generate(model, r.prompt["prompt_ids"], r.params, top_k_logprobs=0, keep_logits=True)
                  for r in schedules[0].requests}
    for schedule in tqdm(schedules, desc="calibrate", unit="schedule", leave=False):
        for mode in ("fast", "invariant"):
            config = replace(schedule.engine, mode=mode)
            engine, failure = run_batched(model, schedule, config)
            if failure:
                raise RefengineError(f"calibration: the engine itself is broken ({failure})")
            batched = engine.outputs()
            for request in schedule.requests:
                alone = run_alone(model, config, request)
                if mode == "fast":
                    batch_noise += agreeing_deviations(batched[request.id], alone)
                for run in (batched[request.id], alone):
                    precision_noise += agreeing_deviations(run, references[request.id])
    return {
        "model_fingerprint": model.fingerprint,
        "f32_batched_vs_serial": float(max(batch_noise)),
        "f32_vs_f64": float(max(precision_noise)),
        "safety_factor": SAFETY_FACTOR,
        "measured": {
            "prompts": len(PROMPT_LENGTHS), "prompt_lengths": list(PROMPT_LENGTHS), "max_tokens": MAX_TOKENS,
            "settings": list(SETTINGS), "arrivals": "request n joins at step 2n",
            "batched_vs_serial_mode": "fast", "f32_vs_f64_modes": ["fast", "invariant"],
            "batched_vs_serial_tokens": len(batch_noise),
            "batched_vs_serial_median": float(np.median(batch_noise)),
            "f32_vs_f64_tokens": len(precision_noise),
            "f32_vs_f64_median": float(np.median(precision_noise)),
            "statistic": "max |logit difference| over tokens both runs agree on",
        },
        "numerics": blas.blas_identity(),  # the BLAS measured on (optional: stored calibrations predate it)
    }


def load_calibration(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise RefengineError(f"{path}: cannot read calibration ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise RefengineError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(data, dict):
        raise RefengineError(f"{path}: expected a JSON object with {', '.join(KEYS)}")
    for key in KEYS:
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise RefengineError(f"{path}: {key}: expected a number >= 0, got {value!r}")
    if not isinstance(data.get("numerics", {}), dict):
        raise RefengineError(f"{path}: numerics: expected a JSON object (the BLAS it was measured on), "
                             f"got {data['numerics']!r}")
    return data


def write_calibration(calibration: dict, path: str | Path) -> None:
    """Atomically, so parallel test workers never read half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(dir=path.parent, prefix=".calibration-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(calibration, indent=2) + "\n")
    os.replace(staging, path)


def stored_calibration(model: Model) -> dict | None:
    """The calibration shipped beside the golden files (refengine/data/golden/*.calibration.json) for this model:
    float64 BLAS results differ in the last bits between CPUs, so a bound measured anew on another
    machine would make a golden refresh there differ byte-wise."""
    for path in sorted(shipped(STORED_DIR).glob("*.calibration.json")):
        data = load_calibration(path)
        if data.get("model_fingerprint") == model.fingerprint:
            return data
    return None


@functools.cache  # neither the sources nor the loaded BLAS change under a running process
def numerics_digest() -> str:
    """Of the sources whose arithmetic the bounds measure and of the BLAS that does it (library, version,
    CPU kernel: refengine.blas.blas_numerics): a bound cached under another digest was measured on other
    kernels, and may be too loose or too tight for these."""
    digest = hashlib.sha256()
    for module in (kernels, model_runner, reference):
        digest.update(Path(module.__file__).read_bytes())
    digest.update(json.dumps(blas.blas_numerics(), sort_keys=True).encode())
    return digest.hexdigest()[:12]


def cached_calibration_path(model: Model) -> Path:
    return cache_dir() / "calibration" / f"{model.fingerprint.removeprefix('sha256:')[:16]}-{numerics_digest()}.json"


def calibration_for(model: Model) -> dict:
    """The stored calibration of this model (the package's, then the refengine cache), measured and cached
    on first use."""
    stored = stored_calibration(model)
    if stored is not None:
        return stored
    cached = cached_calibration_path(model)
    if cached.exists():
        return load_calibration(cached)
    data = calibrate(model)
    write_calibration(data, cached)
    return data
