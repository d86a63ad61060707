"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's log-probability given the tokens
before it, read from the logits row of the position before it.

A prefill chunk feeding positions [start, end) computes the rows that score prompt tokens start + 1 ..
end, so a request's prompt is scored chunk by chunk, as its prefill goes. The rows a chunk adds to the
step's head product are the positions no earlier chunk scored: a request resumed after a preemption
recomputes its prompt, and must not score it twice. A request still to be scored takes no prefix-cache
hit (as in vLLM): a cached block's positions compute no rows, so their tokens could not be scored.

Each row is normalized on its own, in float64 (a row's logprobs never depend on the batch). The
definition it must agree with is reference.prompt_logprobs (written apart: they share no code but
sampling's row helpers, which the float64 comparisons re-derive in check.output_oracle). The faults
below each break one of these moves.
"""
from __future__ import annotations

import hashlib

import numpy as np

from ..sampling import PromptLogprob, log_softmax, ranked_logprobs, token_rank
from .faults import Fault
from .scheduler import ScheduledChunk


class PromptScorer:
    def __init__(self, fault: Fault | None, keep_logits: bool, digest_logits: bool):
        self.keep_logits, self.digest_logits = keep_logits, digest_logits
        self.scored_tokens = 0  # prompt tokens scored so far (refengine_prompt_logprob_tokens)
        # Fault.PROMPT_LOGPROBS_CHUNK_END_DROPPED: a non-final chunk's last row taken for a sampling row only
        self._last = (lambda seq, end: min(end, seq.num_prompt_tokens) - 1) \
            if fault is Fault.PROMPT_LOGPROBS_CHUNK_END_DROPPED \
            else (lambda seq, end: min(end, seq.num_prompt_tokens - 1))
        # Fault.PROMPT_LOGPROBS_RESCORED_ON_RESUME: a recomputed prompt is scored again
        self._first = (lambda seq, start: start) if fault is Fault.PROMPT_LOGPROBS_RESCORED_ON_RESUME \
            else (lambda seq, start: max(start, len(seq.prompt_logprobs)))
        # Fault.PROMPT_LOGPROBS_SHIFTED_BY_ONE: row p scores the token at p, not the one after it
        self._scored = (lambda p: p) if fault is Fault.PROMPT_LOGPROBS_SHIFTED_BY_ONE else (lambda p: p + 1)

    def positions(self, chunks: list[ScheduledChunk]) -> list[tuple[int, range]]:
        """(chunk index, the positions whose rows score a prompt token) for each chunk that has some."""
        out = []
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            if seq.params.prompt_logprobs is not None:
                rows = range(self._first(seq, chunk.start), self._last(seq, chunk.end))
                if rows:
                    out.append((i, rows))
        return out

    def record(self, chunks: list[ScheduledChunk], positions: list[tuple[int, range]], logits: np.ndarray) -> None:
        """Append each scored token's PromptLogprob to its sequence; `logits` [rows, vocab]: the rows of
        `positions`, in order."""
        rows = iter(logits)
        for i, span in positions:
            seq = chunks[i].seq
            for p in span:
                row = next(rows)
                position = self._scored(p)
                token = seq.prompt_ids[position]
                logprobs = log_softmax(row.astype(np.float64))
                own, top = ranked_logprobs(logprobs, token, seq.params.prompt_logprobs)
                seq.prompt_logprobs.append(PromptLogprob(
                    position, token, own, token_rank(logprobs, token), top,
                    hashlib.sha256(row.tobytes()).hexdigest() if self.digest_logits else None,
                    row.copy() if self.keep_logits else None))
                self.scored_tokens += 1
