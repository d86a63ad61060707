"""Noise bounds: how far float32 logits move when only batching, or only precision, changes --
bounds that the code under test can never widen.

Three numbers per model, none measured on a run being judged (a corrupted KV cache would then
explain itself), and none taken from the engine when it is itself in question:

- f32_vs_f64: the float32 REFERENCE forward (refengine.reference in float32 weights: the same pure
  math, no scheduler, no paging, no batching) against the float64 reference, on the calibration
  prompts teacher-forced through the float64 greedy answers, as one prefill and token by token
  (a vision-language model's prompts with images, CALIBRATION_IMAGES, as one prefill, the tower in
  float32 too); the largest |logit difference|. The engine's kernels never enter it, so an engine bug cannot
  widen it (an attention bug once made the engine-measured version 2-10 logits, and the properties
  accepted everything).
- f32_batched_vs_serial: the fast-mode engine, a request inside the calibration's batched schedules
  against the same request alone; the largest |logit difference| over every token they agree on.
  It can only come from the engine, so for every model of the suite it is COMMITTED
  (refengine/data/golden/*.calibration.json, found through refengine.data.shipped) and re-measured
  by tests/test_invariants_calibration.py, which fails if it grew.
- the ceiling (below): no bound is ever adopted above it. A measurement above it -- batched vs
  serial, or the engine against float64 (`measured.engine_vs_f64`, checked on every calibration,
  never used as a tolerance) -- is refused as a failure of the engine, naming the model and the bound.

The tolerance the suite applies is bound x SAFETY_FACTOR, for both the logit-deviation check on
agreeing tokens and the top-2 margin that may explain a flipped token.

SAFETY_FACTOR = 8 = 2 x 4. The 2: a flip needs the top-2 margin to close, and both logits can move
by the bound in opposite directions. The 4: headroom for schedules, prompts and positions the
calibration sample did not contain (the suite's `target()` on deviation / tolerance pushes
Hypothesis towards the worst case; docs/concepts/bounds.md says where every bound comes from).

The ceiling, derived from float32 precision and the model's logit scale:

    ceiling = LAMBDA * (4 * layers + 1) * eps_f32 * sqrt(n) * S

- A float32 dot product of length n, rounding to nearest with unit roundoff u = eps_f32 / 2 = 2^-24,
  is off by |fl(a.b) - a.b| <= gamma_n * sum|a_i b_i| (gamma_n = n u / (1 - n u), Higham,
  "Accuracy and Stability of Numerical Algorithms", 3.1). Modelling the roundings as independent
  and mean-zero (Higham & Mary 2019, "A new approach to probabilistic rounding error analysis") the
  error is <= LAMBDA * sqrt(n) * u * sum|a_i b_i| with probability >= 1 - 2 exp(-LAMBDA^2 / 2):
  LAMBDA = 6 gives 3e-8 per dot product.
- A logit is the dot product of the final normed hidden state h with a head row w_v, so its own
  rounding is bounded through S = max over rows and tokens of sum_i |h_i w_{v,i}|, the logit scale:
  the float64 reference's |h| @ |W_head|^T at every position of the calibration prompts (never the
  engine's). S >= max |logit|; for the tiny models S is about 23 and max |logit| about 13.
- Every other rounding enters the residual stream as a relative error of the same order, which the
  scale-invariant final norm passes on to h and the head turns into at most that relative error
  times S. Per layer four products write to (or read the whole of) the stream -- q/k/v, the
  attention output projection, gate/up, down -- plus the head: 4 * layers + 1 stages, each of
  reduction length at most n = max(hidden, intermediate, q_size), their errors added as if aligned.
  Norms, RoPE, softmax and the attention reductions (lengths head_dim and context) round at most as
  coarsely as the product that follows them and are covered by the LAMBDA of that stage.
- Batched against serial compares two float32 evaluations, each within u-bounds of the exact value:
  2 u = eps_f32, which is why the formula carries eps_f32, not u. One ceiling serves both bounds
  (float64 is exact at this scale: its u is 2^-53).
- Assumed, not proven: that the layers do not amplify a relative error of the stream by more than
  the slack left. Measured on the six tiny models, every bound is 0.7-2.1 x u sqrt(hidden) S, so the
  ceiling leaves 50-150x; a model whose layers amplify more would have a correct engine refused,
  with an error naming the model and the bound (LAMBDA is the knob), never a loose tolerance.
Measured on the suite's six tiny models, the bounds sit 50-150x below their ceilings (docs/concepts/
bounds.md); with the fault `attention-bound-inflating` in place the engine's error against float64
is 3-6 logits, 2000-5000x above (tests/test_bounds.py).
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .. import blas, reference
from ..data import shipped
from ..engine import (
    exp,
    fused,
    jit,
    kernels,
    model_runner,
    moe,
    packed,
    paged_attention,
)
from ..errors import RefengineError
from ..model import Model
from ..model.cache import cache_dir
from ..model.config import VISION_LANGUAGE
from ..sampling import SamplingParams
from ..vision_reference import generate_with_images, prompt_logits_with_images
from .comparison import logit_deviation
from .driver import run_alone, run_batched
from .images import IMAGE_KEYS, GeneratedImage, placed
from .margin_rule import SAFETY_FACTOR
from .rounded import BOUND_KEYS, MAX_TOKENS, PROMPT_LENGTHS, calibration_prompts, precision_noise, teacher_forced
from .schedule import ScheduledRequest, parse_schedule

LAMBDA = 6  # the ceiling's probabilistic rounding-error multiplier (module docstring)
EPS_F32 = float(np.finfo(np.float32).eps)  # 2^-23
SETTINGS = (  # each a different batching pattern: chunked prefill + mixed steps, wide batches, preemption
    {"max_num_seqs": 4, "max_num_batched_tokens": 16, "block_size": 4},
    {"max_num_seqs": 12, "max_num_batched_tokens": 64, "block_size": 16},
    {"max_num_seqs": 6, "max_num_batched_tokens": 5, "block_size": 1, "num_blocks": 96},
)
# A vision-language model's calibration also runs prompts with an image (check.images: generated) after
# their first token: (calibration prompt, height, width, seed), sizes of 6, 16 and 2 image tokens
CALIBRATION_IMAGES = ((4, 24, 16, 1), (6, 32, 32, 2), (8, 9, 17, 3))
KEYS = ("f32_batched_vs_serial", "f32_vs_f64", "safety_factor")
BOUNDS = ("f32_batched_vs_serial", "f32_vs_f64")
SIXTEEN_BIT_KEYS = (BOUND_KEYS["bf16"], BOUND_KEYS["fp16"])  # optional keys, bounds of 16-bit servers (check.rounded)
STORED_DIR = "golden"  # of the package data: committed calibrations, beside the golden files they went into


def image_prompts(model: Model) -> list[tuple[list[int], GeneratedImage]]:
    """(prompt ids, image) of the calibration's prompts with an image (CALIBRATION_IMAGES); none for a
    text model."""
    if model.config.arch not in VISION_LANGUAGE:
        return []
    prompts = calibration_prompts(model.config.vocab_size)
    return [(placed(model, prompts[n], [(1, GeneratedImage(h, w, seed))]), GeneratedImage(h, w, seed))
            for n, h, w, seed in CALIBRATION_IMAGES]


def calibration_schedules(model: Model) -> list[dict]:
    requests = [{"id": f"c{n}", "prompt_ids": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                 "arrival_step": 2 * n} for n, prompt in enumerate(calibration_prompts(model.config.vocab_size))]
    requests += [{"id": f"i{n}", "prompt_ids": ids, "images": [image.as_json()], "max_tokens": MAX_TOKENS,
                  "ignore_eos": True, "arrival_step": 2 * n + 1} for n, (ids, image) in enumerate(image_prompts(model))]
    return [{"engine": {"mode": "fast", **settings}, "requests": requests} for settings in SETTINGS]


def float64_answer(model: Model, request: ScheduledRequest):
    """The float64 reference's greedy answer to a calibration request, with the logits of every step."""
    if request.images:
        return generate_with_images(model, request.prompt["prompt_ids"], request.image_arrays(), request.params,
                                    top_k_logprobs=0, keep_logits=True)
    return reference.generate(model, request.prompt["prompt_ids"], request.params, top_k_logprobs=0, keep_logits=True)


def agreeing_deviations(got, want) -> list[float]:
    """|logit difference| per generated token, up to the first token the runs disagree on."""
    deviations = []
    for g, w in zip(got.steps, want.steps):
        if g.token_id != w.token_id:
            break
        deviations.append(logit_deviation(g.logits, w.logits))
    return deviations


def reduction_length(model: Model) -> int:
    cfg = model.config
    return max(cfg.hidden_size, cfg.intermediate_size, cfg.q_size)


@functools.lru_cache(maxsize=64)  # one float64 forward per calibration prompt; the suite asks per example
def _logit_scale(model: Model) -> float:
    weights, cfg = model.weights(np.float64), model.config
    head = np.abs(weights.lm_head)                                                   # [vocab, hidden]
    return max(float((np.abs(reference.final_hidden(weights, cfg, prompt, reference.KVCache())) @ head.T).max())
               for prompt in calibration_prompts(cfg.vocab_size))


def logit_scale(model: Model) -> float:
    """S: the largest sum_i |h_i w_{v,i}| of the float64 reference at every position of the calibration
    prompts -- what the rounding error of a logit is proportional to (module docstring)."""
    return _logit_scale(model)


def ceiling(model: Model) -> dict:
    """The fixed ceiling on any float32 noise bound of `model`, with what it is made of."""
    layers, n, scale = model.config.num_layers, reduction_length(model), logit_scale(model)
    value = LAMBDA * (4 * layers + 1) * EPS_F32 * math.sqrt(n) * scale
    return {"value": value, "formula": "LAMBDA * (4 * layers + 1) * eps_f32 * sqrt(n) * S", "LAMBDA": LAMBDA,
            "layers": layers, "eps_f32": EPS_F32, "n": n, "S": scale}


def require_within_ceiling(model: Model, name: str, bounds: dict, what: str) -> float:
    """RefengineError naming the model and the bound when any of `bounds` (name -> value) exceeds the
    ceiling: such a bound is a failure of what measured it, never a tolerance."""
    limit = ceiling(model)["value"]
    for bound, value in bounds.items():
        if not value <= limit:
            raise RefengineError(
                f"{what}: model {name} ({model.fingerprint[:19]}): {bound} {value:.3g} exceeds the float32 ceiling "
                f"{limit:.3g} (LAMBDA * (4 * layers + 1) * eps_f32 * sqrt(n) * logit scale; "
                f"refengine.check.calibrate) -- the engine is broken, this is not float32 noise")
    return limit


def reference_noise(model: Model) -> dict:
    """f32_vs_f64 from the reference alone: the float32 reference forward against the float64 one, over
    the calibration prompts teacher-forced through the float64 greedy answers, as one prefill of the
    whole sequence and as a prefill of the prompt followed by one token at a time (the engine's two
    paths). -> {"max": largest |logit difference|, "median": ..., "rows": rows compared}."""
    cfg, w32 = model.config, model.weights(np.float32)
    deviations = []
    for prompt, answer, ids, rows, want in teacher_forced(model):
        prefilled = reference.forward(w32, cfg, ids, reference.KVCache())[rows]     # [tokens, vocab]
        cache = reference.KVCache()
        decoded = np.stack([reference.forward(w32, cfg, prompt, cache)[-1]]
                           + [reference.forward(w32, cfg, [t], cache)[-1] for t in answer[:-1]])
        for got in (prefilled, decoded):
            deviations += np.abs(got.astype(np.float64) - want).max(axis=-1).tolist()
    for prompt, image in image_prompts(model):  # no cached decode with images in the reference: one prefill
        pixels = [image.pixels()]
        answer = generate_with_images(model, prompt, pixels, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                                      top_k_logprobs=0)
        ids = prompt + answer.token_ids[:-1]
        rows = slice(len(prompt) - 1, len(ids))
        want = prompt_logits_with_images(model, ids, pixels)[rows]                   # [tokens, vocab] float64
        got = prompt_logits_with_images(model, ids, pixels, np.float32)[rows]        # [tokens, vocab] float32
        deviations += np.abs(got.astype(np.float64) - want).max(axis=-1).tolist()
    return {"max": float(max(deviations)), "median": float(np.median(deviations)), "rows": len(deviations)}


def calibrate(model: Model, name: str | None = None, fault: str | None = None) -> dict:
    """Measure `model`'s bounds (the dict golden headers embed as `noise`). `name` labels errors (default:
    the folder's name); `fault` plants a catalogued bug in the engine runs (tests only: what the bounds do
    when the code under test is wrong). RefengineError when a measurement exceeds the ceiling."""
    name = name or model.path.name
    precision = reference_noise(model)
    limit = require_within_ceiling(model, name, {"f32_vs_f64 (float32 reference)": precision["max"]},
                                   "calibration: the float32 reference itself")
    batch_noise, engine_noise = [], []
    schedules = [parse_schedule(s, "calibration") for s in calibration_schedules(model)]
    references = {r.id: float64_answer(model, r) for r in schedules[0].requests}
    for schedule in tqdm(schedules, desc="calibrate", unit="schedule", leave=False):
        config = replace(schedule.engine, fault=fault) if fault else schedule.engine
        engine, failure = run_batched(model, schedule, config)
        if failure:
            raise RefengineError(f"calibration: model {name}: the engine itself is broken ({failure})")
        batched = engine.outputs()
        for request in schedule.requests:
            alone = run_alone(model, config, request)
            batch_noise += agreeing_deviations(batched[request.id], alone)
            for run in (batched[request.id], alone):
                engine_noise += agreeing_deviations(run, references[request.id])
        measured_batched, measured_engine = float(max(batch_noise)), float(max(engine_noise))
        require_within_ceiling(model, name, {"f32_batched_vs_serial": measured_batched,  # after every schedule:
                                             "engine_vs_f64 (the engine against float64)": measured_engine},
                               "calibration: the engine under test")             # a broken engine fails fast
    sixteen_bit = {p: precision_noise(model, p) for p in ("bf16", "fp16")}
    return {
        "model_fingerprint": model.fingerprint,
        "f32_batched_vs_serial": measured_batched,
        "f32_vs_f64": precision["max"],
        **{BOUND_KEYS[p]: noise["max"] for p, noise in sixteen_bit.items()},
        "safety_factor": SAFETY_FACTOR,
        "ceiling": limit,
        "measured": {
            "prompts": len(PROMPT_LENGTHS), "prompt_lengths": list(PROMPT_LENGTHS), "max_tokens": MAX_TOKENS,
            **({"image_prompts": [{**dict(zip(("prompt", *IMAGE_KEYS), i)), "arrival_step": 2 * n + 1}
                                  for n, i in enumerate(CALIBRATION_IMAGES)]} if image_prompts(model) else {}),
            "settings": list(SETTINGS), "arrivals": "request n joins at step 2n",
            "batched_vs_serial_mode": "fast",
            "batched_vs_serial_tokens": len(batch_noise),
            "batched_vs_serial_median": float(np.median(batch_noise)),
            "f32_vs_f64_source": "float32 reference forward vs float64 reference, teacher-forced through the "
                                 "float64 greedy answers, as one prefill and token by token",
            "f32_vs_f64_rows": precision["rows"],
            "f32_vs_f64_median": precision["median"],
            **sixteen_bit_measured(sixteen_bit),
            "engine_vs_f64": measured_engine,
            "engine_vs_f64_tokens": len(engine_noise),
            "engine_vs_f64_use": "a check against the ceiling only, never a tolerance",
            "ceiling": ceiling(model),
            "statistic": "max |logit difference| over tokens both runs agree on",
        },
        "numerics": blas.blas_identity(),  # the BLAS measured on (optional: stored calibrations predate it)
    }


def sixteen_bit_measured(noise: dict) -> dict:
    """The `measured` entries of the bf16 and fp16 bounds (check.rounded)."""
    out = {}
    for precision, n in noise.items():
        key = BOUND_KEYS[precision]
        out |= {f"{key}_source": f"the float64 reference rounded as a {precision} accelerator stores tensors "
                                 f"(check.rounded) vs float64, teacher-forced through the float64 greedy answers, "
                                 f"as one prefill", f"{key}_rows": n["rows"], f"{key}_median": n["median"]}
    return out


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
    for key in SIXTEEN_BIT_KEYS:  # optional: calibrations made before the bf16 / fp16 bounds have none
        value = data.get(key, 0)
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
    data = _committed_calibrations().get(model.fingerprint)
    return None if data is None else copy.deepcopy(data)  # callers may change theirs


@functools.cache  # package data does not change under a running process, and the suite asks per example
def _committed_calibrations() -> dict[str, dict]:
    """Every shipped calibration by its model's fingerprint (the first file, in name order, for each)."""
    found: dict[str, dict] = {}
    for path in sorted(shipped(STORED_DIR).glob("*.calibration.json")):
        data = load_calibration(path)
        found.setdefault(data.get("model_fingerprint"), data)
    return found


@functools.cache  # neither the sources nor the loaded libraries change under a running process
def numerics_digest() -> str:
    """Of the sources whose arithmetic the bounds measure, of the BLAS that does part of it (library,
    version, CPU kernel: refengine.blas.blas_numerics) and of the compiler that builds the engine's
    kernels (engine/jit.py: its version and the CPU features it compiles for): a bound cached under
    another digest was measured on other kernels, and may be too loose or too tight for these."""
    digest = hashlib.sha256()
    for module in (kernels, exp, fused, model_runner, moe, packed, paged_attention, jit, reference):
        digest.update(Path(module.__file__).read_bytes())
    digest.update(json.dumps(blas.blas_numerics(), sort_keys=True).encode())
    digest.update(json.dumps(jit.compiler_identity(), sort_keys=True).encode())
    return digest.hexdigest()[:12]


def cached_calibration_path(model: Model) -> Path:
    return cache_dir() / "calibration" / f"{model.fingerprint.removeprefix('sha256:')[:16]}-{numerics_digest()}.json"


def calibration_for(model: Model, name: str | None = None) -> dict:
    """The calibration of this model: the package's committed one (every model of the suite has one),
    else the refengine cache's, else measured now (`calibrate`, the f32-vs-f64 bound from the reference)
    and cached. Whichever it is, a bound above the ceiling is refused (RefengineError naming the model and
    the bound), never used as a tolerance."""
    name = name or model.path.name
    stored = stored_calibration(model)
    if stored is not None:
        require_within_ceiling(model, name, {b: stored[b] for b in BOUNDS}, "the committed calibration")
        return stored
    cached = cached_calibration_path(model)
    if cached.exists():
        data = load_calibration(cached)
        require_within_ceiling(model, name, {b: data[b] for b in BOUNDS}, f"the cached calibration {cached}")
        return data
    data = calibrate(model, name)
    write_calibration(data, cached)
    return data
