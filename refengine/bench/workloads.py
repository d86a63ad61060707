"""Benchmark workloads on the batching engine, timed step by step.

"Serial" is always the same engine with max_num_seqs=1 in fast mode -- the fastest serial -- so no
mode can look good by slowing its own baseline down. Requests ignore eos so every run does exactly
the work asked for. They decode greedily unless given a sampler (temperature, top_k, top_p), which
each request then samples with, seeded by its index. Decode throughput counts only steps in which
every scheduled chunk is a decode.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..engine import EngineConfig, LLMEngine
from ..errors import RefengineError
from ..model import Model
from ..model.cache import cache_dir, cached_model
from ..model.tiny import PRESETS, make_tiny
from ..sampling import SamplingParams
from .roofline import foreign_cpu_seconds

PERCENTILES = (50, 90, 99)
# A step is "contended" when other processes used more than this share of a core during it. On a
# 2-core machine shared with test runs, BLAS's second thread then waits for a scheduler slice and a
# step can take several times longer; decode figures come from the quiet steps when there are enough of them.
CONTENDED_SHARE = 0.25
MIN_QUIET_STEPS = 5
# How a preset is stored when it is not float32 in one file: the 1.7B shape is what the streamed
# reference is measured on, as `make-tiny --preset qwen3-1.7b-shape --dtype bf16 --shards 2` writes it
# (3.2 GiB instead of 6.4 GiB in float32; its float64 copy is 12.8 GiB either way); the 8B shape as its
# checkpoint is published, bf16 in shards (15.3 GiB; make-tiny writes it a tensor at a time).
PRESET_STORAGE = {"qwen3-1.7b-shape": {"dtype": "BF16", "shards": 2}, "qwen3-8b-shape": {"dtype": "BF16", "shards": 5}}


def preset_model_dir(name: str) -> Path:
    """A preset's random-weight model in the cache folder, generated on first use (never committed)."""
    if name not in PRESETS:
        raise RefengineError(f"preset: unknown preset {name!r} (choose {', '.join(PRESETS)})")
    if not (cache_dir() / "models" / name / "config.json").exists():
        print(f"generating {name} into {cache_dir() / 'models'} (once)", file=sys.stderr)
    return cached_model(name, lambda folder: make_tiny(folder, PRESETS[name], **PRESET_STORAGE.get(name, {})))


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: dict | None = None  # SamplingParams fields (temperature, top_k, top_p, seed); None: greedy

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, ignore_eos=True, **(self.sampling or {}))


def random_requests(model: Model, count: int, prompt_len: int, max_tokens: int, seed: int = 0,
                    sampler: dict | None = None) -> list[BenchRequest]:
    """Prompts of ids the tokenizer knows, the same for every run with the same seed; with a `sampler`
    (temperature, top_k, top_p), request i samples with it and seed i."""
    rng = np.random.default_rng(seed)
    high = min(model.config.vocab_size, model.tokenizer.vocab_size)
    return [BenchRequest(f"r{i}", rng.integers(0, high, prompt_len).tolist(), max_tokens,
                         None if sampler is None else {**sampler, "seed": i}) for i in range(count)]


def _percentiles(seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None}
    ms = np.asarray(seconds) * 1e3
    return {f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES} | {"mean": float(ms.mean())}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


@dataclass(frozen=True)
class RunStats:
    mode: str
    max_num_seqs: int
    requests: int
    wall_s: float
    steps: int
    generated_tokens: int
    decode_steps: int           # decode-only steps the figures below come from
    decode_tokens: int
    decode_s: float
    decode_step_ms: dict        # percentiles over those steps
    contended_steps: int        # decode-only steps during which a neighbour competed for the cores
    quiet_only: bool            # figures from the uncontended steps only (False: too few of them, all steps)
    mean_decode_context: float  # mean KV prefix a decode token attends over
    ttft_s_mean: float | None
    tpot_s_mean: float | None
    latency_s_mean: float | None  # arrival to last token
    latency_s_first: float | None  # the earliest finished request's: what the head of a queue waits
    # each request's generated ids, for comparing answers across engines (bench.llama_cpp); not in to_json
    token_ids: dict[str, list[int]] = field(default_factory=dict, repr=False)

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else float("nan")

    @property
    def mean_decode_batch(self) -> float:
        return self.decode_tokens / self.decode_steps if self.decode_steps else float("nan")

    def to_json(self) -> dict:
        return ({k: v for k, v in asdict(self).items() if k != "token_ids"}
                | {"decode_tok_s": self.decode_tok_s, "mean_decode_batch": self.mean_decode_batch})


def start_engine(model: Model, requests: list[BenchRequest], mode: str, max_num_seqs: int,
                 max_num_batched_tokens: int = 2048) -> LLMEngine:
    """An engine sized for `requests`, all of them added (arriving at step 0)."""
    max_model_len = max(len(r.prompt_ids) + r.max_tokens for r in requests)
    config = EngineConfig(mode=mode, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          max_num_batched_tokens=max(max_num_batched_tokens, max_model_len))
    engine = LLMEngine(model, config, digest_logits=False)  # a serving engine's work: nothing here reads digests
    for r in requests:
        engine.add_request(r.request_id, r.prompt_ids, params=r.params)
    return engine


def run_requests(model: Model, requests: list[BenchRequest], mode: str, max_num_seqs: int,
                 max_num_batched_tokens: int = 2048, label: str | None = None) -> RunStats:
    """All `requests` arrive at step 0; step the engine until every one has finished."""
    engine = start_engine(model, requests, mode, max_num_seqs, max_num_batched_tokens)
    started = time.perf_counter()  # the runner's weight copies are set-up, not serving
    decodes = []  # (seconds, tokens, contended) per decode-only step
    total = sum(r.max_tokens for r in requests)
    with tqdm(total=total, desc=label or f"{mode} max_num_seqs={max_num_seqs}", unit="tok", leave=False) as bar:
        while engine.has_unfinished():
            foreign, step_started = foreign_cpu_seconds(), time.perf_counter()
            events = engine.step()
            seconds = time.perf_counter() - step_started
            scheduled = engine.trace[-1]["scheduled"]
            if scheduled and all(s["phase"] == "decode" for s in scheduled):
                contended = foreign is not None and foreign_cpu_seconds() - foreign > CONTENDED_SHARE * seconds
                decodes.append((seconds, len(scheduled), contended))
            bar.update(sum(e.token_id is not None for e in events))
    wall = time.perf_counter() - started
    quiet = [d for d in decodes if not d[2]]
    used = quiet if len(quiet) >= MIN_QUIET_STEPS else decodes
    outputs = list(engine.outputs().values())
    latencies = [o.ttft_s + o.tpot_s * (len(o.token_ids) - 1) if o.tpot_s is not None else o.ttft_s
                 for o in outputs if o.ttft_s is not None]
    # the decode yielding token j (j >= 2) attends over prompt + j - 1 positions
    contexts = [len(o.prompt_ids) + j - 1 for o in outputs for j in range(2, len(o.token_ids) + 1)]
    return RunStats(
        mode=mode, max_num_seqs=max_num_seqs, requests=len(requests), wall_s=wall, steps=engine.num_steps,
        generated_tokens=sum(len(o.token_ids) for o in outputs), decode_steps=len(used),
        decode_tokens=sum(d[1] for d in used), decode_s=float(sum(d[0] for d in used)),
        decode_step_ms=_percentiles([d[0] for d in used]), contended_steps=len(decodes) - len(quiet),
        quiet_only=used is quiet,
        mean_decode_context=_mean(contexts) or 0.0,
        ttft_s_mean=_mean(o.ttft_s for o in outputs), tpot_s_mean=_mean(o.tpot_s for o in outputs),
        latency_s_mean=_mean(latencies), latency_s_first=min(latencies, default=None),
        token_ids={request_id: list(o.token_ids) for request_id, o in engine.outputs().items()})


def batch_sweep(model: Model, modes: list[str], batch_sizes: list[int], prompt_len: int, max_tokens: int,
                serial_requests: int, sampler: dict | None = None) -> dict[str, dict[int, RunStats]]:
    """For each mode and batch size B: B concurrent requests. B=1 runs `serial_requests` requests one
    after another, and always in fast mode too: that run is the serial baseline."""
    results: dict[str, dict[int, RunStats]] = {mode: {} for mode in dict.fromkeys(["fast", *modes])}
    for batch in sorted(set(batch_sizes) | {1}):
        for mode in (results if batch == 1 else modes):
            count = serial_requests if batch == 1 else batch
            requests = random_requests(model, count, prompt_len, max_tokens, sampler=sampler)
            results[mode][batch] = run_requests(model, requests, mode, batch, label=f"{mode} B={batch}")
    return results
