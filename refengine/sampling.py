"""Choosing the next token from one logits row, recording it, and deciding when a request stops:
shared by the float64 reference and the engine (which must not import each other).

Every function reads one row only, so a row's result never depends on the batch around it.
Seeded sampling draws its random number from (seed, token index) alone, so a sampled request
produces the same tokens whatever else is scheduled beside it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from .errors import RefengineError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0            # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0         # how many top alternatives to report per step
    # vLLM's prompt_logprobs: each prompt token's log-probability given the tokens before it, with this
    # many top alternatives (0: its own only); None: not asked for (reference.prompt_logprobs defines them)
    prompt_logprobs: int | None = None
    # OpenAI's n: this many answers to the prompt, each its own sequence (a child); child k samples with
    # seed + k (vLLM's derivation), so child k's answer is the request's with n=1 and that seed
    n: int = 1
    # Logits processors (vLLM's semantics; the float64 definition is reference.adjusted_logits, the
    # engine's engine/penalties.py: they share no code): stop ids masked for the first min_tokens
    # tokens, then logit_bias added, then the repetition penalty over prompt and output tokens, then
    # the frequency and presence penalties over output tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) by id
    min_tokens: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RefengineError(f"max_tokens: must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise RefengineError(f"temperature: must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RefengineError(f"top_k: must be a non-negative integer, got {self.top_k!r}")
        if self.prompt_logprobs is not None and not (isinstance(self.prompt_logprobs, int)
                                                     and not isinstance(self.prompt_logprobs, bool)
                                                     and self.prompt_logprobs >= 0):
            raise RefengineError(f"prompt_logprobs: must be an integer >= 0, got {self.prompt_logprobs!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise RefengineError(f"n: must be a positive integer, got {self.n!r}")
        if not 0 < self.top_p <= 1:
            raise RefengineError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if self.temperature > 0 and self.seed is None:
            raise RefengineError("seed: sampling with temperature > 0 needs a seed (draws are keyed by it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise RefengineError(f"{name}: must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0 < self.repetition_penalty <= 2:
            raise RefengineError(f"repetition_penalty: must be in (0, 2], got {self.repetition_penalty!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise RefengineError(f"min_tokens: must be an integer in [0, max_tokens ({self.max_tokens})], "
                                 f"got {self.min_tokens!r}")
        ids = [token for token, _ in self.logit_bias]
        if ids != sorted(set(ids)) or any(not (isinstance(t, int) and t >= 0) for t in ids):
            raise RefengineError(f"logit_bias: token ids must be distinct non-negative integers, got {ids!r}")
        if any(not -100 <= bias <= 100 for _, bias in self.logit_bias):
            raise RefengineError(f"logit_bias: every bias must be in [-100, 100], got {dict(self.logit_bias)!r}")

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processor changes its rows (else the row is sampled as the model gave it)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)

    def check_vocabulary(self, vocab_size: int) -> None:
        """RefengineError naming logit_bias for a token id outside a vocabulary of `vocab_size`."""
        outside = [token for token, _ in self.logit_bias if token >= vocab_size]
        if outside:
            raise RefengineError(f"logit_bias: token id(s) {outside} outside the vocabulary (0-{vocab_size - 1})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


PROCESSOR_KEYS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens")


def processor_params(obj: dict) -> dict:
    """SamplingParams keyword arguments from the PROCESSOR_KEYS of a JSON object (a schedule's request or
    an OpenAI request body): `logit_bias` as OpenAI sends it, {"token id": bias}; RefengineError naming
    the field for a value of the wrong type (ranges are SamplingParams's to check)."""
    out = {}
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = obj.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RefengineError(f"{name}: expected a number, got {value!r}")
            out[name] = float(value)
    min_tokens = obj.get("min_tokens")
    if min_tokens is not None:
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int):
            raise RefengineError(f"min_tokens: expected an integer, got {min_tokens!r}")
        out["min_tokens"] = min_tokens
    bias = obj.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise RefengineError(f"logit_bias: expected an object of token id -> bias, got {bias!r}")
        pairs = {}
        for key, value in bias.items():
            token = key if isinstance(key, int) and not isinstance(key, bool) else \
                int(key) if isinstance(key, str) and key.isdigit() and key.isascii() else None
            if token is None:
                raise RefengineError(f"logit_bias: key {key!r} is not a token id (a non-negative integer)")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RefengineError(f"logit_bias: the bias of token {key} must be a number, got {value!r}")
            if token in pairs:
                raise RefengineError(f"logit_bias: token {token} given twice")
            pairs[token] = float(value)
        out["logit_bias"] = tuple(sorted(pairs.items()))
    return out


@dataclass(frozen=True)
class StepRecord:
    """What one generated token looked like, in the reference (no engine step) or the engine."""
    token_id: int
    top2_margin: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    logprob: float | None = None       # the token's own log-probability, when logprobs were asked for
    step: int | None = None            # the engine step that produced it; None in the reference
    logits_sha256: str | None = None   # of the float32 logits row (the engine's bit-exactness check)
    logits: np.ndarray | None = field(default=None, repr=False, compare=False)  # kept only on request
    # The float64 row its logits processors made from `logits` (what the token was chosen from), kept
    # with `logits` where the request has processors.
    adjusted: np.ndarray | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's log-probability given the tokens before it (vLLM's prompt_logprobs): read from
    the logits row of the position before it, in the reference or the engine."""
    position: int                      # the token's position in the prompt (>= 1: the first has none)
    token_id: int
    logprob: float
    rank: int                          # 1 + how many ids the row rates strictly more likely (vLLM's rank)
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    logits_sha256: str | None = None   # of the float32 row (the engine's bit-exactness check)
    logits: np.ndarray | None = field(default=None, repr=False, compare=False)  # kept only on request


def greedy_token(logits: np.ndarray) -> int:
    """argmax; on an exact tie the lowest id wins (np.argmax returns the first maximum)."""
    return int(np.argmax(logits))


def top2_margin(logits: np.ndarray) -> float:
    """top-1 logit minus top-2 logit: how far the greedy decision is from flipping (the greedy token's
    logit minus the best of the other ids; nan where the row has a nan)."""
    best = int(np.argmax(logits))  # two max passes, no copy: cheaper than a partition on a real vocabulary
    second = max(logits[:best].max(initial=-np.inf), logits[best + 1:].max(initial=-np.inf))
    return float(logits[best] - second)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - np.max(logits)
    return shifted - np.log(np.sum(np.exp(shifted)))


def top_logprobs(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely ids with their log-probabilities, ties broken by lower id."""
    return token_logprobs(logits, None, k)[1]


def token_logprobs(logits: np.ndarray, token: int | None, k: int) -> tuple[float | None, list[tuple[int, float]]]:
    """`token`'s log-probability (None for no token) and the k most likely ids with theirs."""
    return ranked_logprobs(log_softmax(logits.astype(np.float64)), token, k)


def token_rank(logprobs: np.ndarray, token: int) -> int:
    """1 + how many ids of the row are strictly more likely than `token` (ties share a rank)."""
    return 1 + int(np.count_nonzero(logprobs > logprobs[token]))


def _largest_ids(values: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest `values` (k > 0), descending, lower id first on ties, NaN last:
    np.argsort(-values, kind="stable")[:k]. Only the values at or above the k-th largest can rank, so
    only they are sorted (a partition is linear; a whole-row sort per token is not); where fewer than k
    values are not NaN (NaN partitions above everything, but ranks below it) the whole row is sorted."""
    if k < len(values):
        negated = -values
        kth = np.partition(negated, k - 1)[k - 1]
        candidates = np.flatnonzero(negated <= kth)  # every id the first k can hold; never a NaN
        if len(candidates) >= k:
            return candidates[np.argsort(negated[candidates], kind="stable")[:k]]
    return np.argsort(-values, kind="stable")[:k]


def ranked_logprobs(logprobs: np.ndarray, token: int | None, k: int) -> tuple[float | None, list[tuple[int, float]]]:
    """From a row of log-probabilities: `token`'s (None for no token) and the k most likely ids with
    theirs, ties broken by lower id."""
    own = None if token is None else float(logprobs[token])
    if k <= 0:
        return own, []
    return own, [(int(i), float(logprobs[i])) for i in _largest_ids(logprobs, k)]


_PHILOX = threading.local()  # token_uniform's generator, one per thread


def token_uniform(seed: int, token_index: int, draw: int = 0) -> float:
    """The uniform draw for token `token_index` of a request seeded with `seed`: the first double of
    numpy's Philox keyed by (seed mod 2**64, token_index), as Generator(Philox(key=...)).random() draws
    it; `draw` 1 is the stream's second double (speculative decoding's acceptance test). The key is set
    on a generator kept per thread: building one per token cost more than the token's whole sort."""
    philox = getattr(_PHILOX, "generator", None)
    if philox is None:
        philox = _PHILOX.generator = np.random.Philox(0)
    philox.state = {"bit_generator": "Philox", "buffer": np.zeros(4, np.uint64), "buffer_pos": 4,
                    "has_uint32": 0, "uinteger": 0,
                    "state": {"counter": np.zeros(4, np.uint64),
                              "key": np.array([seed & (2**64 - 1), token_index], dtype=np.uint64)}}
    return (int(philox.random_raw(draw + 1)[-1]) >> 11) * 2.0**-53  # the top 53 bits, as Generator.random()


# Temperatures for which logits / temperature in float64 orders a float32 row exactly as the row itself:
# no finite value overflows, none leaves float64's normal range, distinct values stay distinct.
ORDER_SAFE_TEMPERATURES = (1e-30, 1e30)


def sampling_order(logits: np.ndarray, temperature: float, k: int = 0) -> np.ndarray:
    """The ids of `logits` by logits / temperature (float64) descending, lower id first on ties, NaN last:
    np.argsort(-(logits.astype(np.float64) / temperature), kind="stable"), only its first k where k > 0.
    A float32 row at an order-safe temperature is ranked on its own values instead, which is the same
    order: the k first as _largest_ids finds them, the whole row as one sort of unique 64-bit keys
    (order bits above the id), which numpy sorts with its vectorized quicksort: a stable sort of a real
    vocabulary per sampled token cost a large batch more than everything in its step but the products
    (docs/performance/)."""
    n = len(logits)
    if logits.dtype != np.float32 or not ORDER_SAFE_TEMPERATURES[0] <= temperature <= ORDER_SAFE_TEMPERATURES[1]:
        order = np.argsort(-(logits.astype(np.float64) / temperature), kind="stable")
        return order[:k] if k else order
    if 0 < k < n:
        return _largest_ids(logits, k)
    bits = (logits + np.float32(0)).view(np.uint32)  # -0.0 as +0.0: they tie
    descending = bits ^ (((bits >> np.uint32(31)) - np.uint32(1)) & np.uint32(0x7fffffff))  # bigger value, smaller
    descending[np.isnan(logits)] = 0xffffffff
    keys = (descending.astype(np.uint64) << np.uint64(32)) | np.arange(n, dtype=np.uint64)
    keys.sort()
    order = (keys & np.uint64(0xffffffff)).astype(np.intp)
    return order[:k] if k else order


def sampling_distribution(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(ids, probabilities) a sampled request draws from: temperature, then top-k, then top-p, the ids
    most likely first; top-p keeps the first len(probabilities) of the ids."""
    order = sampling_order(logits, params.temperature, params.top_k)
    scaled = logits[order].astype(np.float64) / params.temperature  # [len(order)], descending
    probs = np.exp(scaled - scaled[0])
    probs /= probs.sum()
    if params.top_p < 1:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
        probs = probs[:keep] / probs[:keep].sum()
    return order, probs


def pick_token(order: np.ndarray, probs: np.ndarray, uniform: float) -> int:
    """The id of `order` where `uniform` falls in the cumulative (unnormalized) `probs`."""
    cdf = np.cumsum(probs)
    pick = int(np.searchsorted(cdf, uniform * cdf[-1], side="right"))
    return int(order[min(pick, len(order) - 1)])


def sample_token(logits: np.ndarray, params: SamplingParams, token_index: int) -> int:
    if params.greedy:
        return greedy_token(logits)
    return pick_token(*sampling_distribution(logits, params), token_uniform(params.seed, token_index))


def verify_draft(logits: np.ndarray, params: SamplingParams, token_index: int, draft: int,
                 residual: bool = True, draft_probs: np.ndarray | None = None) -> int:
    """The token speculative decoding emits as generated token `token_index`, where a drafter proposed
    `draft` drawn from its distribution q (`draft_probs` over the vocabulary; None: a drafter that
    proposes with certainty, prompt lookup or greedy drafting, q all on `draft`); the draft is accepted
    where the result is `draft`. Greedy: the argmax. Sampled, with p the request's distribution: `draft`
    with probability min(1, p/q) (the token's second keyed uniform), else a draw from the residual
    max(p - q, 0), normalized (its first): with a certain draft, p without it. The result is distributed
    exactly as p (Leviathan et al., 2023). `residual` False (Fault.REJECTION_RESAMPLES_TARGET) draws a
    rejected position from p itself."""
    if params.greedy:
        return greedy_token(logits)
    order, probs = sampling_distribution(logits, params)
    kept = order[:len(probs)]
    at = np.flatnonzero(kept == draft)
    drafted = float(probs[at[0]]) if len(at) else 0.0
    proposed = 1.0 if draft_probs is None else float(draft_probs[draft])
    if token_uniform(params.seed, token_index, draw=1) * proposed < drafted:  # u < min(1, p / q)
        return draft
    if residual:
        q = np.zeros(len(probs))
        if draft_probs is None:
            q[at] = 1.0
        else:
            q = draft_probs[kept]
        probs = np.maximum(probs - q, 0.0)
    return pick_token(order, probs, token_uniform(params.seed, token_index))


def finish_reason(token_id: int, num_generated: int, text: str, params: SamplingParams,
                  eos_token_ids, stop_from: int = 0) -> str | None:
    """'stop' on an eos id, a stop token id or a stop string; 'length' at max_tokens; else None. The
    first min_tokens tokens never stop (their stop ids are masked before sampling as well), and a stop
    string counts only where it ends past `stop_from`, the length of their text (vLLM looks for stop
    strings only in text that tokens after min_tokens added)."""
    if num_generated <= params.min_tokens:
        return "length" if num_generated >= params.max_tokens else None
    if not params.ignore_eos and token_id in eos_token_ids:
        return "stop"
    if token_id in params.stop_token_ids:
        return "stop"
    if any(s and s in text[max(0, stop_from - len(s) + 1):] for s in params.stop):
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None


def cut_at_stop_string(text: str, stops, stop_from: int = 0) -> str:
    """The text up to (not including) the earliest stop string that ends past `stop_from` (see
    finish_reason), as OpenAI servers return it."""
    cuts = [text.find(s, max(0, stop_from - len(s) + 1)) for s in stops if s]
    cuts = [c for c in cuts if c >= 0]
    return text[:min(cuts)] if cuts else text
