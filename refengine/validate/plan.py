"""What board validation sends: its settings, the random join/leave schedule of the cases (fixed by
the seed), and each request's body. A third of the schedule's requests go to each of the CACHE
groups, each with its own `cache_salt` (validate.dialect): a server with prefix caching shares KV
only within one salt, so a `cold` request (a salt of its own) computes its whole prompt in the
running batch; a `shared` one (one salt for the whole load) takes only KV the load itself computed,
often while the request computing it still runs; a `warm` one (the alone phase's salt) may take the
KV its alone answer left. A case comes from a golden file (GoldenCase) or a prompts file
(PromptCase): requests need only its prompt or messages and max_tokens. A share of the requests
(`variant_rate`) goes as one of its case's variants (validate.variants: penalties, logit_bias with
min_tokens, prompt logprobs, n), drawn apart too; a variant the server refused alone goes as its case.
A case's images (check.case_images) go to the chat API as data URLs, whatever the file gave.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from ..check.case_images import inline_messages
from ..check.golden import GoldenCase, PromptCase
from ..errors import RefengineError
from .variants import ProcessedCase, variants

APIS = ("auto", "completions", "chat")
BASELINES = ("golden", "serial")
CACHE = ("cold", "shared", "warm")  # prefix-cache groups: a cache_salt of its own, the load's, the alone phase's


@dataclass(frozen=True)
class Settings:
    concurrency: int = 4
    seed: int = 0
    cancel_rate: float = 0.2
    margin_tolerance: float | None = None  # None: golden's calibrated noise bound; serial: 0 (bit-identical)
    api: str = "auto"
    arrival_spread: float | None = None    # seconds over which arrivals are spread; None: from the alone latency
    repeat: int = 1
    timeout: float = 600.0
    baseline: str = "golden"
    precision: str = "auto"               # the server's: f32 | bf16 | fp16 | auto (validate.bounds)
    batch_invariant: bool = False         # hold loaded answers to their alone answers bit for bit
    variant_rate: float = 0.25            # share of requests sent as a variant of their case (validate.variants)
    # the serial baseline's server: each case's answer alone from another server (the same model served
    # another way: speculation off, another build); None: the server under test's own
    baseline_url: str | None = None

    def __post_init__(self):
        if self.concurrency < 1:
            raise RefengineError(f"concurrency: must be >= 1, got {self.concurrency}")
        if not 0 <= self.cancel_rate < 1:
            raise RefengineError(f"cancel_rate: must be in [0, 1), got {self.cancel_rate}")
        if self.margin_tolerance is not None and self.margin_tolerance < 0:
            raise RefengineError(f"margin_tolerance: must be >= 0, got {self.margin_tolerance}")
        if self.api not in APIS:
            raise RefengineError(f"api: expected one of {', '.join(APIS)}, got {self.api!r}")
        if self.arrival_spread is not None and self.arrival_spread < 0:
            raise RefengineError(f"arrival_spread: must be >= 0 seconds, got {self.arrival_spread}")
        if self.repeat < 1:
            raise RefengineError(f"repeat: must be >= 1, got {self.repeat}")
        if not self.timeout > 0:
            raise RefengineError(f"timeout: must be > 0 seconds, got {self.timeout}")
        if not 0 <= self.variant_rate <= 1:
            raise RefengineError(f"variant_rate: must be in [0, 1], got {self.variant_rate}")
        if self.baseline_url is not None and self.baseline != "serial":
            raise RefengineError(f"baseline_url: the alone answers of another server are the serial baseline; "
                                 f"the {self.baseline} baseline has its own")
        if self.baseline not in BASELINES:
            raise RefengineError(f"baseline: expected one of {', '.join(BASELINES)}, got {self.baseline!r}")


@dataclass(frozen=True)
class Planned:
    id: str
    case: GoldenCase | PromptCase
    api: str                 # "completions" | "chat"
    arrival_s: float
    stream: bool
    cancel_after: int | None  # hang up after this many token-carrying chunks
    cache: str = "warm"       # one of CACHE: which cache_salt it goes with


def case_api(case, api: str, source) -> str:
    """The API a case goes to under `api` (auto: chat cases to chat, text prompts to completions)."""
    if api == "chat" and not case.messages:
        raise RefengineError(f"{source}: case {case.id!r} is a raw text prompt; api chat needs "
                             f"chat messages (use api auto or completions)")
    if api == "completions" and case.messages and getattr(case, "prompt_ids", None) is None:
        raise RefengineError(f"{source}: case {case.id!r} is a chat case without prompt ids; api completions "
                             f"sends a golden file's prompt ids (use api auto or chat, or a golden file)")
    if api == "completions" and case.images:
        raise RefengineError(f"{source}: case {case.id!r} shows images; api completions would send its prompt ids "
                             f"without them (use api auto or chat)")
    return "chat" if case.messages and api != "completions" else "completions"


def plan(cases: list, settings: Settings, spread: float, source="cases",
         refused: frozenset = frozenset()) -> list[Planned]:
    """The random join/leave schedule, fixed by the seed; arrivals uniform over `spread` seconds. A
    request may hang up only where its case's answer has at least two tokens to come. The cache groups
    and the variants are drawn apart (their own generators: they move no other draw), a third of the
    requests in each group; a variant whose (case id, api) is in `refused` goes as its case. Whether and
    where a request hangs up is drawn from its case's answer, and a variant's shorter answer only cuts
    the hang-up point down to it: the draws stay the case's."""
    rng, pick = random.Random(settings.seed), random.Random(f"{settings.seed}:variants")
    planned = []
    for copy in range(settings.repeat):
        for case in cases:
            sent = case
            if pick.random() < settings.variant_rate:
                variant = pick.choice(variants(case))
                sent = case if (variant.id, case_api(variant, settings.api, source)) in refused else variant
            api = case_api(sent, settings.api, source)
            length = expected_length(case)
            cancel = length > 1 and rng.random() < settings.cancel_rate
            planned.append(Planned(
                sent.id if settings.repeat == 1 else f"{sent.id}#{copy}", sent, api,
                round(rng.uniform(0, 1) * spread, 3), stream=cancel or rng.random() < 0.5,
                cancel_after=min(rng.randint(1, length - 1), max(1, sent.max_tokens - 1)) if cancel else None))
    order = random.Random(f"{settings.seed}:cache").sample(range(len(planned)), len(planned))
    groups = {n: CACHE[rank * len(CACHE) // len(planned)] for rank, n in enumerate(order)}
    planned = [replace(p, cache=groups[n]) for n, p in enumerate(planned)]
    return sorted(planned, key=lambda p: p.arrival_s)


def expected_length(case) -> int:
    """Tokens the answer is expected to have: the golden answer's, else max_tokens."""
    token_ids = getattr(case, "token_ids", None)
    return len(token_ids) if token_ids is not None else case.max_tokens


def request_body(p: Planned, served_model: str) -> dict:
    body = {"model": served_model, "max_tokens": p.case.max_tokens, "temperature": 0, "stream": p.stream}
    if p.api == "chat":
        body["messages"] = inline_messages(p.case.messages, p.case.images) if p.case.images else p.case.messages
        if p.case.chat_template_kwargs is not None:  # the template arguments the golden prompt was rendered with
            body["chat_template_kwargs"] = p.case.chat_template_kwargs
    else:  # chat cases sent as completions carry the golden prompt ids: exactly the tokens the reference saw
        body["prompt"] = p.case.prompt if p.case.prompt is not None else p.case.prompt_ids
    return body | getattr(p.case, "fields", {})  # a ProcessedCase's fields (validate.variants)


def prompt_size(case) -> int:
    prompt_ids = getattr(case, "prompt_ids", None)
    return len(prompt_ids) if prompt_ids is not None else len(case.prompt or "") + len(str(case.messages or ""))


def probe_bodies(planned: list[Planned], served_name: str) -> dict[str, dict]:
    """Per API in the plan, the request body of its case with the shortest prompt (the dialect probe): a
    case's own, never a variant's."""
    shortest = {}
    for p in planned:
        if isinstance(p.case, ProcessedCase):
            p = replace(p, case=p.case.base)
        if p.api not in shortest or prompt_size(p.case) < prompt_size(shortest[p.api].case):
            shortest[p.api] = p
    return {api: request_body(p, served_name) for api, p in sorted(shortest.items())}
