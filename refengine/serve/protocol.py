"""The OpenAI wire format: request bodies -> engine requests, generated tokens -> response objects.

Extensions beyond OpenAI: every choice carries `token_ids` (the generated ids; per chunk when
streaming) and `prompt_token_ids` (non-streaming, and the first streamed chunk); chat logprob
entries carry `token_id`; `top_k`, `stop_token_ids`, `ignore_eos`, `repetition_penalty` and
`min_tokens` are accepted as in vLLM (beside OpenAI's `presence_penalty`, `frequency_penalty` and
`logit_bias`), and so is `chat_template_kwargs` on chat requests (template arguments such as
`enable_thinking`). `prompt_logprobs`: K (0-MAX_LOGPROBS) returns, as vLLM does, a list with an entry per
prompt token (null for the first): {"token id": {"logprob", "rank", "decoded_token"}} for the prompt
token and the K most likely ids there, in the choice (completions) or the response object (chat).
`echo` (completions only): the prompt's text before the answer's, and with `logprobs` K the prompt's
tokens first in the choice's logprobs (the first with a null logprob), as OpenAI's legacy API did.
`n` (1-MAX_N): that many choices, `index` 0.. (streamed: each chunk carries one choice); choice k is the
answer with seed + k (vLLM's); usage counts every choice's tokens.
`temperature` defaults to 0 (greedy), and sampling with temperature > 0 needs a `seed`.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from ..errors import RefengineError
from ..model import Model
from ..model.config import VISION_LANGUAGE
from ..model.image import image_grid
from ..model.tokenizer import IMAGE_PART_TYPES
from ..sampling import SamplingParams, processor_params
from .images import decode_image_part

MAX_LOGPROBS = 20
DEFAULT_COMPLETION_MAX_TOKENS = 16  # as OpenAI's completions endpoint
# Accepted only at their neutral value, so a client relying on them hears about it.
NEUTRAL_VALUES = {"best_of": 1, "suffix": ""}
MAX_N = 16  # answers to one prompt


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def engine_error(error: RefengineError) -> ApiError:
    """Engine messages start with the field they are about ("max_tokens: ..."); name it as the param."""
    message = str(error)
    head = message.split(":", 1)[0]
    return ApiError(400, message, param=head if head.isidentifier() else None, code="invalid_value")


@dataclass(frozen=True)
class Generated:
    """One generated token as the server reports it."""
    token_id: int
    text: str                                 # the text this token made visible (may be empty)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GenerationRequest:
    kind: str                  # "completion" | "chat"
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: int | None       # None: not requested; else how many alternatives per token
    cache_salt: str | None = None  # vLLM's: shares cached KV blocks only with requests of the same salt
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field: None, not asked for (echo may still score)
    echo: str | None = None    # completions with echo: the prompt's text, sent before the answer's
    images: list | None = None  # a chat's images (RGB uint8 arrays), in the order of its image parts
    created: int = field(default_factory=lambda: int(time.time()))


def _typed(body: dict, name: str, types, default, what: str):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise ApiError(400, f"{name}: expected {what}, got {value!r}", param=name, code="invalid_type")
    return value


def _stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, f"stop: expected a string or a list of strings, got {stop!r}", param="stop",
                       code="invalid_type")
    return tuple(stops)


def _int_list(body: dict, name: str) -> list[int]:
    value = _typed(body, name, (list,), [], "a list of integers")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ApiError(400, f"{name}: expected a list of integers, got {value!r}", param=name, code="invalid_type")
    return value


def _message_text(content):
    """OpenAI content may be a list of parts; only text parts are supported."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return content


def _chat_images(messages: list, model: Model) -> tuple[list, list[np.ndarray], list[int]]:
    """A chat's image parts decoded (serve/images.py: data URLs only), each replaced by the plain image
    part a vision-language template renders as its placeholder: (the messages, their images in order,
    the placeholder tokens each becomes). An image the model cannot take is refused naming its part."""
    out, images, tokens = [], [], []
    for n, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for k, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                where = f"messages[{n}].content[{k}]"
                images.append(decode_image_part(part, where))
                try:
                    tokens.append(model.vision_config.image_tokens(image_grid(images[-1], model.image_processor)))
                except RefengineError as e:
                    raise RefengineError(f"{where}: {e}") from None
                part = {"type": "image"}
            parts.append(part)
        out.append({**message, "content": parts})
    return out, images, tokens


def _prompt_ids(kind: str, body: dict, model: Model) -> tuple[list[int], list[np.ndarray] | None]:
    """The request's prompt ids, and a chat's images (None without)."""
    try:
        if kind == "chat":
            messages = body.get("messages")
            if messages is None:
                raise ApiError(400, "messages: required", param="messages", code="missing_field")
            template_kwargs = _typed(body, "chat_template_kwargs", (dict,), {}, "an object")
            if isinstance(messages, list) and model.config.arch in VISION_LANGUAGE:
                messages, images, tokens = _chat_images(messages, model)
                if images:
                    ids = model.tokenizer.encode_chat_with_images(messages, tokens, **template_kwargs)
                    return model.check_prompt(ids, "messages"), images
            if isinstance(messages, list):
                messages = [{**m, "content": _message_text(m.get("content"))} if isinstance(m, dict) else m
                            for m in messages]
            return model.check_prompt(model.tokenizer.encode_chat(messages, **template_kwargs), "messages"), None
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return model.check_prompt(model.tokenizer.encode(prompt), "prompt"), None
        if isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            return model.check_prompt(prompt, "prompt"), None
        raise ApiError(400, "prompt: expected a string or a list of token ids (one prompt per request)",
                       param="prompt", code="invalid_type")
    except RefengineError as e:
        param = "messages" if kind == "chat" else "prompt"
        if str(e).startswith("chat_template_kwargs:"):
            param = "chat_template_kwargs"
        raise ApiError(400, str(e), param=param, code="invalid_value") from None


def _logprobs(kind: str, body: dict) -> int | None:
    if kind == "chat":
        wanted = _typed(body, "logprobs", (bool,), False, "a boolean")
        top = _typed(body, "top_logprobs", (int,), 0, "an integer")
        if top and not wanted:
            raise ApiError(400, "top_logprobs: requires logprobs: true", param="top_logprobs", code="invalid_value")
        name, count = "top_logprobs", top if wanted else None
    else:
        name = "logprobs"
        count = _typed(body, "logprobs", (int,), None, "an integer")
    if count is not None and not 0 <= count <= MAX_LOGPROBS:
        raise ApiError(400, f"{name}: must be between 0 and {MAX_LOGPROBS}, got {count}", param=name,
                       code="invalid_value")
    return count


def _n(body: dict) -> int:
    n = _typed(body, "n", (int,), 1, "an integer")
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n: must be between 1 and {MAX_N}, got {n}", param="n", code="invalid_value")
    return n


def _echo(kind: str, body: dict, model: Model, prompt_ids: list[int]) -> str | None:
    """The prompt text a completions request with `echo` gets back first; None without echo."""
    if not _typed(body, "echo", (bool,), False, "a boolean"):
        return None
    if kind == "chat":
        raise ApiError(400, "echo: only on /v1/completions (a chat answer does not repeat its messages)",
                       param="echo", code="unsupported_value")
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else model.tokenizer.decode(prompt_ids, skip_special_tokens=False)


def parse_request(kind: str, body, model: Model, served_name: str, context_tokens: int) -> GenerationRequest:
    """Validate one request body. `context_tokens` is the most tokens one request may hold
    (max_model_len, and the KV pool); it also bounds a chat request's default max_tokens."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body: expected a JSON object", code="invalid_json")
    name = body.get("model", served_name)
    if name != served_name:
        raise ApiError(404, f"model: {name!r} is not served here (this server serves {served_name!r})",
                       param="model", code="model_not_found")
    for key, neutral in NEUTRAL_VALUES.items():
        if body.get(key) not in (None, neutral):
            raise ApiError(400, f"{key}: only {neutral!r} is supported, got {body[key]!r}", param=key,
                           code="unsupported_value")
    prompt_ids, images = _prompt_ids(kind, body, model)
    max_tokens_key = "max_completion_tokens" if kind == "chat" and "max_completion_tokens" in body else "max_tokens"
    default_max = DEFAULT_COMPLETION_MAX_TOKENS if kind == "completion" else max(1, context_tokens - len(prompt_ids))
    stream = _typed(body, "stream", (bool,), False, "a boolean")
    stream_options = _typed(body, "stream_options", (dict,), {}, "an object")
    logprobs = _logprobs(kind, body)
    echo = _echo(kind, body, model, prompt_ids)
    prompt_logprobs = _typed(body, "prompt_logprobs", (int,), None, "an integer")
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"prompt_logprobs: must be between 0 and {MAX_LOGPROBS}, got {prompt_logprobs}",
                       param="prompt_logprobs", code="invalid_value")
    scored = [k for k in (prompt_logprobs, logprobs if echo is not None else None) if k is not None]
    try:
        params = SamplingParams(
            max_tokens=_typed(body, max_tokens_key, (int,), default_max, "an integer"),
            temperature=float(_typed(body, "temperature", (int, float), 0.0, "a number")),
            top_k=_typed(body, "top_k", (int,), 0, "an integer"),
            top_p=float(_typed(body, "top_p", (int, float), 1.0, "a number")),
            seed=_typed(body, "seed", (int,), None, "an integer"),
            stop=_stop_strings(body),
            stop_token_ids=tuple(_int_list(body, "stop_token_ids")),
            ignore_eos=_typed(body, "ignore_eos", (bool,), False, "a boolean"),
            logprobs=0 if logprobs is None else max(logprobs, 1),  # >= 1: the greedy token's own logprob
            prompt_logprobs=max(scored) if scored else None,  # echo with logprobs scores the prompt it repeats
            n=_n(body),
            **processor_params(body))
        params.check_vocabulary(model.config.vocab_size)
    except RefengineError as e:
        raise engine_error(e) from None
    if len(prompt_ids) + params.max_tokens > context_tokens:  # per choice: each is a sequence of its own
        raise ApiError(400, f"{max_tokens_key}: prompt ({len(prompt_ids)} tokens) + {max_tokens_key} "
                            f"({params.max_tokens}) exceeds this server's context of {context_tokens} tokens",
                       param=max_tokens_key, code="context_length_exceeded")
    cache_salt = _typed(body, "cache_salt", (str,), None, "a string")
    if cache_salt == "":
        raise ApiError(400, "cache_salt: must be a non-empty string when given", param="cache_salt",
                       code="invalid_value")
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return GenerationRequest(kind, f"{prefix}-{uuid.uuid4().hex}", prompt_ids, params, stream,
                             bool(stream_options.get("include_usage")), logprobs, cache_salt, prompt_logprobs, echo,
                             images=images)
