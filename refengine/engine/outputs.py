"""What the engine hands out: a TokenEvent per request and step, a RequestOutput per request."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..sampling import PromptLogprob, StepRecord
from .sequence import Sequence


@dataclass(frozen=True)
class TokenEvent:
    """One request's news from one step: a new token, or (token_id None) its abort."""
    request_id: str
    step: int
    token_id: int | None
    top2_margin: float | None
    logits_sha256: str | None
    text_delta: str
    finish_reason: str | None  # None | "stop" | "length" | "abort"
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    logprob: float | None = None  # the token's own log-probability, when its request asked for logprobs
    prompt_logprobs: list[PromptLogprob] | None = None  # on a request's first token, where it asked for them


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # None while unfinished
    steps: list[StepRecord]
    arrival_step: int
    first_token_step: int | None
    finish_step: int | None
    num_preemptions: int
    ttft_steps: int | None     # steps from arrival up to and including the first token's step
    ttft_s: float | None
    tpot_steps: float | None   # steps per output token after the first
    tpot_s: float | None
    num_cached_tokens: int = 0  # prompt tokens whose KV its first admission took from the prefix cache
    prompt_logprobs: list[PromptLogprob] | None = None  # positions 1.. scored so far; None: not asked for

    def to_json(self) -> dict:
        """The per-request object of the run-output format (FORMATS.md)."""
        return {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason,
                "steps": [{"step": s.step, "token_id": s.token_id, "top2_margin": s.top2_margin,
                           "logits_sha256": s.logits_sha256} for s in self.steps],
                "prompt_ids": self.prompt_ids, "num_preemptions": self.num_preemptions,
                "num_cached_tokens": self.num_cached_tokens, "ttft_steps": self.ttft_steps,
                "tpot_steps": self.tpot_steps,
                **({} if self.prompt_logprobs is None else {"prompt_logprobs": [
                    {"position": p.position, "token_id": p.token_id, "logprob": p.logprob, "rank": p.rank,
                     "top_logprobs": p.top_logprobs, "logits_sha256": p.logits_sha256}
                    for p in self.prompt_logprobs]})}


def request_output(seq: Sequence) -> RequestOutput:
    first = seq.records[0].step if seq.records else None
    n = len(seq.output_ids)
    ttft_s = seq.first_token_time - seq.arrival_time if seq.first_token_time is not None else None
    has_tpot = seq.finish_step is not None and n > 1 and seq.finish_reason != "abort"
    return RequestOutput(
        request_id=seq.request_id, prompt_ids=list(seq.prompt_ids), token_ids=list(seq.output_ids),
        text=seq.visible_text(), finish_reason=seq.finish_reason, steps=list(seq.records),
        arrival_step=seq.arrival_step, first_token_step=first, finish_step=seq.finish_step,
        num_preemptions=seq.num_preemptions,
        ttft_steps=None if first is None else first - seq.arrival_step + 1, ttft_s=ttft_s,
        tpot_steps=(seq.records[-1].step - first) / (n - 1) if has_tpot else None,
        tpot_s=(seq.finish_time - seq.first_token_time) / (n - 1) if has_tpot else None,
        num_cached_tokens=seq.num_cached_tokens or 0,
        prompt_logprobs=None if seq.params.prompt_logprobs is None else list(seq.prompt_logprobs))
