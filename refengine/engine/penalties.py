"""Logits processors with per-request state kept by batch row, as serving engines keep it (vLLM's
persistent batch): a request that asks for penalties, a logit bias or min_tokens owns a row of
output-token counts, a prompt mask and a bias vector while it runs; a leaving request's row is
filled by moving the last row into it (vLLM's condense), and a request resumed after a preemption
gets a fresh row rebuilt from its tokens. Rows are batch state, so this is where continuous-batching
bugs in these parameters live (the faults below each break one of those moves).

Every operation is elementwise along a row, in float64 on the model's float32 row, so a row's result
never depends on the rows beside it. The definition it must agree with is reference.adjusted_logits
(written apart: they share no code).
"""
from __future__ import annotations

import numpy as np

from ..sampling import SamplingParams
from .faults import Fault
from .sequence import Sequence

ROW_ARRAYS = ("counts", "in_prompt", "bias", "stops", "scalars")


class PenaltyRows:
    def __init__(self, vocab_size: int, eos_token_ids, fault: Fault | None):
        self.vocab_size, self.eos = vocab_size, set(eos_token_ids)
        self.ids: list[str] = []                                # the request in each row
        self.counts = np.zeros((0, vocab_size), np.int32)       # output-token counts
        self.in_prompt = np.zeros((0, vocab_size), bool)
        self.bias = np.zeros((0, vocab_size), np.float64)
        self.stops = np.zeros((0, vocab_size), bool)            # what min_tokens masks
        self.scalars = np.zeros((0, 4), np.float64)             # presence, frequency, repetition, min_tokens
        # Condensing moves a row's request and all its arrays, but Fault.PENALTY_COUNTS_BY_BATCH_ROW leaves its
        # counts behind and Fault.LOGIT_BIAS_WRONG_ROW its bias.
        left = {Fault.PENALTY_COUNTS_BY_BATCH_ROW: "counts", Fault.LOGIT_BIAS_WRONG_ROW: "bias"}.get(fault)
        self._moved = tuple(a for a in ROW_ARRAYS if a != left)
        # What a new row counts as output: Fault.PENALTY_COUNTS_LOST_ON_RESUME, a resumed request's row counts
        # only what it generates from now on; Fault.FREQUENCY_PENALTY_COUNTS_PROMPT, the prompt counts too.
        self._counted = {Fault.PENALTY_COUNTS_LOST_ON_RESUME: lambda seq: [] if seq.num_preemptions else seq.output_ids,
                         Fault.FREQUENCY_PENALTY_COUNTS_PROMPT: lambda seq: seq.token_ids,
                         }.get(fault, lambda seq: seq.output_ids)
        # Fault.MIN_TOKENS_COUNTS_PROMPT: min_tokens held against prompt + output tokens.
        self._generated = (lambda seq: seq.num_tokens) if fault is Fault.MIN_TOKENS_COUNTS_PROMPT \
            else (lambda seq: len(seq.output_ids))
        # Fault.REPETITION_PENALTY_IGNORES_SIGN: every seen logit divided by the penalty, negative ones too.
        self._negative_factor = (lambda r: 1 / r) if fault is Fault.REPETITION_PENALTY_IGNORES_SIGN else (lambda r: r)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.ids

    def add(self, seq: Sequence) -> None:
        """A row for `seq`, built from its tokens so far (a resumed request's output counts too)."""
        p: SamplingParams = seq.params
        counts = np.bincount(np.asarray(self._counted(seq), np.int64), minlength=self.vocab_size)
        in_prompt = np.zeros(self.vocab_size, bool)
        in_prompt[seq.prompt_ids] = True
        bias = np.zeros(self.vocab_size, np.float64)
        for token, value in p.logit_bias:
            bias[token] = value
        stops = np.zeros(self.vocab_size, bool)
        stops[[t for t in set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos) if t < self.vocab_size]] = True
        row = dict(counts=counts.astype(np.int32), in_prompt=in_prompt, bias=bias, stops=stops,
                   scalars=np.array([p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens]))
        for name in ROW_ARRAYS:
            setattr(self, name, np.concatenate([getattr(self, name), row[name][None]]))
        self.ids.append(seq.request_id)

    def remove(self, request_id: str) -> None:
        """Free the request's row: the last row moves into it, and the arrays shrink by one."""
        row, last = self.ids.index(request_id), len(self.ids) - 1
        for name in self._moved:
            getattr(self, name)[row] = getattr(self, name)[last]
        self.ids[row] = self.ids[last]
        self.ids.pop()
        for name in ROW_ARRAYS:
            setattr(self, name, getattr(self, name)[:last])

    def record(self, request_id: str, token: int) -> None:
        self.counts[self.ids.index(request_id), token] += 1

    def apply(self, seqs: list[Sequence], logits: np.ndarray) -> np.ndarray:
        """The float64 rows the tokens of `seqs` (each with a row here) are chosen from, from their float32
        logits rows [len(seqs), vocab]."""
        rows = np.array([self.ids.index(s.request_id) for s in seqs], dtype=np.int64)
        x = logits.astype(np.float64)                                            # [n, vocab]
        presence, frequency, repetition, min_tokens = self.scalars[rows].T        # [n] each
        short = np.array([self._generated(s) for s in seqs]) < min_tokens         # [n]
        x[short[:, None] & self.stops[rows]] = -np.inf
        x += self.bias[rows]
        counts = self.counts[rows]                                                # [n, vocab]
        seen = (counts > 0) | self.in_prompt[rows]
        r = repetition[:, None]
        x = np.where(seen, np.where(x > 0, x / r, x * self._negative_factor(r)), x)
        return x - frequency[:, None] * counts - presence[:, None] * (counts > 0)
