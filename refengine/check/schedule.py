"""Schedules as data: load and validate a schedule file (FORMATS.md); check.driver runs them.

Unknown keys inside `engine`, a request or its `sampling` are errors, so a typo cannot silently
change what runs; free-form extra information (a repro file's `found_by`, `model`, ...) belongs at
the top level.

A request's optional `logprobs`: K (an integer >= 0) asks for the chosen token's log-probability at
every step and the K most likely alternatives with theirs (0: the chosen token's only); absent, none.
Logits processors (vLLM's names and semantics, reference.adjusted_logits): `presence_penalty`,
`frequency_penalty` (each in [-2, 2]), `repetition_penalty` (in (0, 2]), `logit_bias` ({"token id":
bias in [-100, 100]}) and `min_tokens` (0 to max_tokens).
A request's optional `n` (>= 1, default 1) asks for that many answers (`children`).
A request's optional `prompt_logprobs`: K (an integer >= 0) asks for each prompt token's log-probability
given the tokens before it, its rank and the K most likely ids there (vLLM's; reference.prompt_logprobs).
The engine is asked as the server asks it (SamplingParams.logprobs = max(K, 1): it reports at least
one alternative); ScheduledRequest.logprobs keeps K, the number of alternatives compared.
A request's optional `images` (a vision-language model's): generated images, `{"height", "width", "seed"}`
each (check.images), one per run of image tokens in its prompt_ids or image part of its messages.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from ..engine import EngineConfig
from ..engine.config import SETTINGS, SPECULATION_SETTINGS
from ..errors import RefengineError
from ..sampling import PROCESSOR_KEYS, SamplingParams, processor_params
from .images import parse_image

ENGINE_KEYS = set(SETTINGS) | set(SPECULATION_SETTINGS)
PROMPT_KEYS = ("prompt_ids", "prompt", "messages")
REQUEST_KEYS = {"id", *PROMPT_KEYS, "max_tokens", "arrival_step", "abort_step", "sampling", "stop",
                "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "n", "cache_salt", "images",
                *PROCESSOR_KEYS}
SAMPLING_KEYS = {"temperature", "top_k", "top_p", "seed"}


@dataclass(frozen=True)
class ScheduledRequest:
    id: str
    prompt: dict          # exactly one of prompt_ids / prompt / messages, as add_request takes it
    params: SamplingParams
    arrival_step: int
    abort_step: int | None
    logprobs: int | None = None  # alternatives requested per step (0: the chosen token's only); None: no logprobs
    cache_salt: str | None = None  # shares cached KV blocks only with requests of the same salt
    images: tuple = ()  # in prompt order, each with pixels(): check.images.GeneratedImage, a golden case's CaseImage

    def image_arrays(self) -> list | None:
        """The request's images as add_request takes them (None: a text request)."""
        return [image.pixels() for image in self.images] or None


@dataclass(frozen=True)
class Schedule:
    source: str
    engine: EngineConfig
    requests: list[ScheduledRequest]


def children(request: ScheduledRequest) -> list[ScheduledRequest]:
    """What an n > 1 request must answer, as requests of their own: child k is `<k>_<id>` (vLLM's name)
    with n 1 and seed + k (vLLM's derivation; greedy children are the request itself); an n = 1 request
    is its own only child. Defined here, apart from the engine's forking: a child's answer is judged
    against this request run alone."""
    params = request.params
    if params.n == 1:
        return [request]
    return [replace(request, id=f"{k}_{request.id}",
                    params=replace(params, n=1, seed=None if params.seed is None else params.seed + k))
            for k in range(params.n)]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_keys(obj, allowed: set[str], where: str) -> None:
    if not isinstance(obj, dict):
        raise RefengineError(f"{where}: expected an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise RefengineError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})")


def _parse_request(raw, index: int, source: str) -> ScheduledRequest:
    where = f"{source}: requests[{index}]"
    _check_keys(raw, REQUEST_KEYS, where)
    request_id = raw.get("id")
    if not isinstance(request_id, str) or not request_id:
        raise RefengineError(f"{where}.id: expected a non-empty string, got {request_id!r}")
    where = f"{source}: request {request_id!r}"
    given = [k for k in PROMPT_KEYS if k in raw]
    if len(given) != 1:
        raise RefengineError(f"{where}: give exactly one of {', '.join(PROMPT_KEYS)} (got {given or 'none'})")
    prompt = {given[0]: raw[given[0]]}
    if "prompt_ids" in prompt and not (isinstance(raw["prompt_ids"], list)
                                       and all(_is_int(i) for i in raw["prompt_ids"])):
        raise RefengineError(f"{where}.prompt_ids: expected a list of integers")
    if "prompt" in prompt and not isinstance(raw["prompt"], str):
        raise RefengineError(f"{where}.prompt: expected a string")
    arrival, abort = raw.get("arrival_step", 0), raw.get("abort_step")
    if not _is_int(arrival) or arrival < 0:
        raise RefengineError(f"{where}.arrival_step: expected an integer >= 0, got {arrival!r}")
    if abort is not None and (not _is_int(abort) or abort < arrival):
        raise RefengineError(f"{where}.abort_step: expected an integer >= arrival_step ({arrival}), got {abort!r}")
    sampling = raw.get("sampling", {})
    _check_keys(sampling, SAMPLING_KEYS, f"{where}.sampling")
    for key, kind in (("stop", str), ("stop_token_ids", int)):
        value = raw.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
            raise RefengineError(f"{where}.{key}: expected a list of {kind.__name__}")
    logprobs = raw.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or logprobs < 0):
        raise RefengineError(f"{where}.logprobs: expected an integer >= 0 (alternatives per step), got {logprobs!r}")
    n = raw.get("n", 1)
    if not _is_int(n) or n < 1:
        raise RefengineError(f"{where}.n: expected an integer >= 1 (answers to the prompt), got {n!r}")
    prompt_logprobs = raw.get("prompt_logprobs")
    if prompt_logprobs is not None and (not _is_int(prompt_logprobs) or prompt_logprobs < 0):
        raise RefengineError(f"{where}.prompt_logprobs: expected an integer >= 0 (alternatives per prompt token), "
                             f"got {prompt_logprobs!r}")
    cache_salt = raw.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise RefengineError(f"{where}.cache_salt: expected a non-empty string, got {cache_salt!r}")
    images = raw.get("images", [])
    if not isinstance(images, list):
        raise RefengineError(f"{where}.images: expected a list of images")
    if images and "prompt" in prompt:
        raise RefengineError(f"{where}.images: give them with prompt_ids or messages")
    images = tuple(parse_image(image, f"{where}.images[{i}]") for i, image in enumerate(images))
    try:
        params = SamplingParams(max_tokens=raw.get("max_tokens", SamplingParams.max_tokens), **sampling,
                                stop=tuple(raw.get("stop", ())), stop_token_ids=tuple(raw.get("stop_token_ids", ())),
                                ignore_eos=bool(raw.get("ignore_eos", False)),
                                logprobs=0 if logprobs is None else max(logprobs, 1),
                                prompt_logprobs=prompt_logprobs, n=n, **processor_params(raw))
    except (RefengineError, TypeError) as e:
        raise RefengineError(f"{where}: {e}") from None
    return ScheduledRequest(request_id, prompt, params, arrival, abort, logprobs, cache_salt, images)


def parse_schedule(data, source: str = "<schedule>") -> Schedule:
    if not isinstance(data, dict):
        raise RefengineError(f"{source}: expected a JSON object with 'engine' and 'requests'")
    engine = data.get("engine", {})
    _check_keys(engine, ENGINE_KEYS, f"{source}: engine")
    try:
        config = EngineConfig(**engine)
    except RefengineError as e:
        raise RefengineError(f"{source}: engine.{e}") from None
    raw_requests = data.get("requests")
    if not isinstance(raw_requests, list) or not raw_requests:
        raise RefengineError(f"{source}: requests: expected a non-empty list")
    requests = [_parse_request(raw, i, source) for i, raw in enumerate(raw_requests)]
    seen = set()
    for request in requests:
        if request.id in seen:
            raise RefengineError(f"{source}: request {request.id!r}: duplicate id")
        seen.add(request.id)
    return Schedule(source, config, requests)


def read_json(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise RefengineError(f"{path}: cannot read schedule ({e.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RefengineError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None


def load_schedule(path: str | Path) -> Schedule:
    return parse_schedule(read_json(Path(path)), str(path))
