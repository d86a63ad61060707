"""The draft tokens of speculative decoding: prompt lookup (no model) or a draft model.

Prompt lookup is vLLM's n-gram speculator (and llama.cpp's lookup decoding): find an earlier
occurrence of the last n tokens, longest n first, and propose the tokens that followed it. A draft
model is a smaller model with the same vocabulary, decoding ahead of the target: greedily for a greedy
request, for a seeded one drawing from its own distribution, which verification then takes into account.

Either is a function of the request's own tokens alone: the draft model runs one request at a time,
row by row (invariant kernels), on KV of its own. So a request proposes the same drafts batched or
alone, which is what lets the suite hold a speculating engine to "same answer as alone"
(suite/test_speculation.py). A drafter is asked for a decode's drafts as the scheduler schedules it,
told how many were verified, and told to forget a request that leaves the running batch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from ..errors import RefengineError
from ..model import Model, load_model
from ..sampling import greedy_token, pick_token, sampling_distribution, token_uniform
from .block_manager import BlockManager, BlockTable
from .config import EngineConfig
from .model_runner import ModelRunner
from .scheduler import ScheduledChunk


def prompt_lookup(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the earliest occurrence of the longest suffix n-gram (n from max_n
    down to min_n) of `token_ids` that starts before the suffix does; none where no suffix recurs. The
    earliest has the most tokens after it: in a run of one repeated token the latest would offer one."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n:]
        for start in range(length - n):
            if token_ids[start:start + n] == suffix:
                return token_ids[start + n:start + n + k]
    return []


class PromptLookup:
    def __init__(self, config: EngineConfig):
        self.lookup = (config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, seq, k: int) -> list[int]:
        return prompt_lookup(seq.token_ids, k, *self.lookup)

    def draft_probs(self, seq, j: int) -> None:
        """The distribution draft j was drawn from: none, it is proposed with certainty."""
        return None

    def verified(self, seq, num_tokens: int) -> None:
        pass

    def forget(self, seq) -> None:
        pass


@dataclass
class _Ahead:
    """What the draft runner reads of a sequence: its tokens and the drafts proposed so far."""
    token_ids: list[int]
    block_table: BlockTable


@functools.lru_cache(maxsize=4)
def _draft_model(path: str) -> Model:  # loaded (and its weights packed) once per process, not per engine
    return load_model(path)


class DraftModel:
    """Drafts from a smaller model (greedy for a greedy request; for a seeded one drawn from the draft
    row's distribution under the request's temperature, top-k and top-p, with the token's third keyed
    uniform, that distribution kept for verification), on a KV pool of its own: each request's table
    there holds the positions it has fed the draft model, `computed` of them still those of the request's
    tokens. The
    pool shares nothing (requests the target's prefix cache or forks let share blocks hold copies here),
    so where it runs short the request that proposed least recently gives its table back and computes it
    again when it next proposes: the same KV, row by row, so the same drafts."""

    def __init__(self, config: EngineConfig, vocab_size: int):
        try:
            self.model = _draft_model(config.speculative_model)
        except (OSError, ValueError) as e:
            raise RefengineError(f"speculative_model: cannot load {config.speculative_model!r}: {e}") from None
        if self.model.config.vocab_size != vocab_size:
            raise RefengineError(f"speculative_model: its vocabulary ({self.model.config.vocab_size} ids) is not the "
                                 f"target's ({vocab_size})")
        # every running request's tokens and its drafts; invariant kernels whatever the target's mode, and
        # no fault: the drafts are the request's own, whatever the batch
        longest = -(-(config.max_model_len + config.num_speculative_tokens) // config.block_size)
        blocks = max(config.num_blocks, longest)  # at least one request of the longest at a time
        own = replace(config, mode="invariant", fault=None, num_blocks=blocks, enable_prefix_caching=False)
        self.runner = ModelRunner(self.model, own)
        self.blocks = BlockManager(blocks, config.block_size)
        self.tables: dict[str, BlockTable] = {}
        self.computed: dict[str, int] = {}
        self.probs: dict[str, list] = {}  # a seeded request's last drafts' distributions, over the vocabulary

    def propose(self, seq, k: int) -> list[int]:
        """k drafts: the tokens the draft model has not seen yet in one chunk, then one per draft."""
        table = self.tables.pop(seq.request_id, None) or BlockTable(seq.request_id)
        tokens, drafts = seq.token_ids, []
        while not self.blocks.can_allocate(table, len(tokens) + k - 1):
            self._forget(next(iter(self.tables)))  # the least recently proposing request's
        self.tables[seq.request_id] = table  # the most recent
        self.blocks.allocate(table, len(tokens) + k - 1)
        start, params, probs = self.computed.get(seq.request_id, 0), seq.params, []
        for j in range(k):
            end = len(tokens) + j
            chunk = ScheduledChunk(_Ahead(tokens + drafts, table), start, end - start, "prefill", True)
            row = self.runner.execute([chunk], self.blocks)[0]
            if params.greedy:
                drafts.append(greedy_token(row))
            else:
                order, kept = sampling_distribution(row, params)
                q = np.zeros(len(row))
                q[order[:len(kept)]] = kept
                drafts.append(pick_token(order, kept, token_uniform(params.seed, len(seq.output_ids) + j, draw=2)))
                probs.append(q)
            start = end
        self.computed[seq.request_id] = len(tokens) + k - 1
        self.probs[seq.request_id] = probs
        return drafts

    def draft_probs(self, seq, j: int) -> np.ndarray | None:
        """The distribution draft j of its last proposal was drawn from: None for a greedy request's."""
        probs = self.probs.get(seq.request_id)
        return probs[j] if probs else None

    def verified(self, seq, num_tokens: int) -> None:
        """Its first `num_tokens` tokens are the request's: the KV past them is a rejected draft's."""
        if seq.request_id not in self.tables:  # given back while others proposed
            return
        computed = min(self.computed[seq.request_id], num_tokens)
        self.computed[seq.request_id] = computed
        self.blocks.trim(self.tables[seq.request_id], computed)

    def forget(self, seq) -> None:
        self._forget(seq.request_id)
        self.probs.pop(seq.request_id, None)

    def _forget(self, request_id: str) -> None:
        """Give back the request's table (its last drafts' distributions stay: it may be verifying them)."""
        table = self.tables.pop(request_id, None)
        if table is not None:
            self.blocks.free(table)
        self.computed.pop(request_id, None)


def drafter(config: EngineConfig, vocab_size: int) -> PromptLookup | DraftModel | None:
    """The engine's drafter: None without speculation."""
    if not config.num_speculative_tokens:
        return None
    return DraftModel(config, vocab_size) if config.speculative_model else PromptLookup(config)
