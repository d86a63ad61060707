"""The two tolerances a run is judged by, and where each comes from: never from the server under test.

- precision: how far a correct engine at the server's precision (f32, bf16, fp16) is from float64.
  Its bound is the golden file's header (noise.f32_vs_f64, noise.bf16_vs_f64, noise.fp16_vs_f64:
  refengine's own reference, rounded as such an engine rounds, against float64: check.rounded),
  else measured on the local model's folder (--model) the same way (once: measured_bound keeps it). Tolerance = bound x the
  safety factor (check.margin_rule.tolerance). It judges the server's alone answers and its loaded
  answers against the golden file.
- batching: how far the server's loaded answer may be from its own alone answer. By default the
  precision tolerance (a correct 16-bit engine whose kernels are not batch-invariant may round a
  near-tie either way, and no more); zero for an engine that claims batch invariance (the seeds'
  "batch and serial must be bit-identical", vLLM's batch-invariant mode); zero, too, where no
  bound is known (a prompts file and no model folder), which the report says.

The precision is given (--precision), or read from the model folder's config.json (`dtype`, what
vLLM and transformers serve take for `--dtype auto`), else float32.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from .. import __version__
from ..check.margin_rule import SAFETY_FACTOR
from ..check.rounded import BOUND_KEYS, PRECISIONS, precision_noise
from ..errors import RefengineError
from ..model.cache import cache_dir

CONFIG_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class Tolerances:
    precision: str                  # f32 | bf16 | fp16
    precision_from: str             # settings | the model's config.json | default
    bound: float | None             # max |logit - float64 logit| of a correct engine at that precision
    bound_from: str | None          # golden | model | None (unknown)
    safety_factor: int
    precision_tolerance: float | None  # None: no bound known
    batching: float
    batching_from: str              # precision | batch_invariant | margin_tolerance | no bound

    def report(self) -> dict:
        return asdict(self)


def config_precision(model) -> str | None:
    """The precision the model's config.json names (`dtype`, or the older `torch_dtype`), if one we know."""
    try:
        config = json.loads((model.path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return CONFIG_DTYPES.get(config.get("dtype") or config.get("torch_dtype"))


def measured_bound(model, precision: str) -> float:
    """check.rounded.precision_noise(model, precision)'s max, measured once per model, precision and
    refengine version (the rounding it models may change between versions) and kept in the cache folder
    (REFENGINE_CACHE, default ~/.cache/refengine) under bounds/: on a large model it takes minutes."""
    path = cache_dir() / "bounds" / f"{model.fingerprint.removeprefix('sha256:')}-{precision}-{__version__}.json"
    try:
        return float(json.loads(path.read_text(encoding="utf-8"))["max"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    noise = precision_noise(model, precision)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(json.dumps({"model_fingerprint": model.fingerprint, "precision": precision, **noise}),
                       encoding="utf-8")
    staging.replace(path)  # atomic: a process racing for the same bound reads a whole file or none
    return noise["max"]


def tolerances(precision: str, margin_tolerance: float | None, batch_invariant: bool, golden=None,
               model=None) -> Tolerances:
    """`precision`: one of PRECISIONS or "auto"; `golden`: check.golden.Golden; `model`: the local model."""
    if precision == "auto":
        named = config_precision(model) if model is not None else None
        precision, precision_from = (named, "the model's config.json") if named else ("f32", "default")
    elif precision in PRECISIONS:
        precision_from = "settings"
    else:
        raise RefengineError(f"precision: expected auto or one of {', '.join(PRECISIONS)}, got {precision!r}")
    key = BOUND_KEYS[precision]
    noise = golden.header["noise"] if golden is not None else {}
    bound, bound_from, safety = None, None, noise.get("safety_factor", SAFETY_FACTOR)
    if key in noise:
        bound, bound_from = float(noise[key]), "golden"
    elif model is not None:
        bound, bound_from = measured_bound(model, precision), "model"
    elif golden is not None and margin_tolerance is None:
        raise RefengineError(f"precision {precision}: the golden file {golden.path} has no noise.{key} (made before "
                             f"16-bit bounds): refresh it, or give the model's folder (--model DIR)")
    precision_tolerance = None if bound is None else bound * safety
    if margin_tolerance is not None:
        precision_tolerance = margin_tolerance
    if batch_invariant:
        batching, batching_from = 0.0, "batch_invariant"
    elif margin_tolerance is not None:
        batching, batching_from = margin_tolerance, "margin_tolerance"
    elif precision_tolerance is not None:
        batching, batching_from = precision_tolerance, "precision"
    else:
        batching, batching_from = 0.0, "no bound"
    return Tolerances(precision, precision_from, bound, bound_from, safety, precision_tolerance, batching,
                      batching_from)
