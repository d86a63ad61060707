"""The draft tokens of speculative decoding: prompt lookup (no model) or a draft model.

Prompt lookup is vLLM's n-gram speculator (and llama.cpp's lookup decoding): find an earlier
occurrence of the last n tokens, longest n first, and propose the tokens that followed it. A draft
model is a smaller model with the same vocabulary, decoding ahead of the target: greedily for a greedy
request, for a seeded one drawing from its own distribution, which verification then takes into account.

Either is a function of the request's own tokens alone: the draft model runs every drafting request's
rows in one forward per draft position, on invariant kernels (a row is the same bits batched or alone)
and on KV of its own. So a request proposes the same drafts batched or alone, which is what lets the
suite hold a speculating engine to "same answer as alone" (suite/test_speculation.py). A drafter is
asked, as the scheduler schedules a decode, how many drafts it will verify (`reserve`), then once the
step is scheduled for all of them at once (`propose`); it is told how many were verified, and told to
forget a request that leaves the running batch.
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
from .faults import Fault
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
        self.found: dict[str, list[int]] = {}  # a reserved decode's drafts, until proposed

    def reserve(self, seq, room: int) -> int:
        """How many drafts the decode of `seq` will verify: what the lookup finds, up to `room`."""
        self.found[seq.request_id] = prompt_lookup(seq.token_ids, room, *self.lookup)
        return len(self.found[seq.request_id])

    def propose(self, requests: list[tuple]) -> list[list[int]]:
        """Each (seq, k)'s k drafts: what its reservation found."""
        return [self.found.pop(seq.request_id)[:k] for seq, k in requests]

    def draft_probs(self, seq, j: int) -> None:
        """The distribution draft j was drawn from: none, it is proposed with certainty."""
        return None

    def verified(self, seq, num_tokens: int) -> None:
        pass

    def forget(self, seq) -> None:
        self.found.pop(seq.request_id, None)


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
    again when it next proposes: the same KV (invariant kernels), so the same drafts."""

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
        self._draft_distribution = _untempered if config.injected is Fault.DRAFT_PROBS_UNTEMPERED else _drawn_from

    def reserve(self, seq, room: int) -> int:
        """How many drafts the decode of `seq` will verify, with room for `room`: all of them."""
        return room

    def propose(self, requests: list[tuple]) -> list[list[int]]:
        """Each (seq, k)'s k drafts. Every request's rows go into one forward per draft position: first
        each one's tokens the draft model has not seen yet, a chunk each, then a row each per draft
        (invariant kernels: a request's rows are its own, batched or alone). Requests whose tables the
        pool cannot hold together run in turns."""
        drafts, group = {}, []
        for seq, k in requests:
            if not self._make_room(seq, k, group):
                self._draft(group, drafts)
                group = []
                self._make_room(seq, k, group)  # alone it fits: the pool holds one request of the longest
            group.append((seq, k))
        self._draft(group, drafts)
        return [drafts[seq.request_id] for seq, _ in requests]

    def _make_room(self, seq, k: int, group: list[tuple]) -> bool:
        """Grow the table of `seq` to its tokens and k - 1 drafts (the last draft is never fed), giving back
        the tables of the least recently proposing requests outside `group`; False where only the
        group's are left to give back."""
        table = self.tables.pop(seq.request_id, None) or BlockTable(seq.request_id)
        self.tables[seq.request_id] = table  # the most recent
        busy = {s.request_id for s, _ in group} | {seq.request_id}
        while not self.blocks.can_allocate(table, len(seq.token_ids) + k - 1):
            idle = next((request_id for request_id in self.tables if request_id not in busy), None)
            if idle is None:
                return False
            self._forget(idle)
        self.blocks.allocate(table, len(seq.token_ids) + k - 1)
        return True

    def _draft(self, group: list[tuple], drafts: dict[str, list[int]]) -> None:
        """Draft position j of every request of `group` drafting more than j, one forward per position."""
        for seq, _ in group:
            drafts[seq.request_id], self.probs[seq.request_id] = [], []
        for j in range(max((k for _, k in group), default=0)):
            live = [seq for seq, k in group if k > j]
            chunks = []
            for seq in live:
                start, end = self.computed.get(seq.request_id, 0), len(seq.token_ids) + j
                chunks.append(ScheduledChunk(_Ahead(seq.token_ids + drafts[seq.request_id],
                                                    self.tables[seq.request_id]), start, end - start, "prefill",
                                             True))
                self.computed[seq.request_id] = end
            for seq, row in zip(live, self.runner.execute(chunks, self.blocks)):
                params = seq.params
                if params.greedy:
                    drafts[seq.request_id].append(greedy_token(row))
                    continue
                order, kept = sampling_distribution(row, params)
                drafts[seq.request_id].append(
                    pick_token(order, kept, token_uniform(params.seed, len(seq.output_ids) + j, draw=2)))
                self.probs[seq.request_id].append(self._draft_distribution(row, order, kept))

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


def _drawn_from(row, order, kept) -> np.ndarray:
    """The distribution a seeded draft was drawn from, over the vocabulary: `kept`'s mass at `order`."""
    q = np.zeros(len(row))
    q[order[:len(kept)]] = kept
    return q


def _untempered(row, order, kept) -> np.ndarray:  # Fault.DRAFT_PROBS_UNTEMPERED
    """The draft row's plain softmax: no temperature, top-k or top-p, unlike the draw it prices."""
    shifted = np.exp(row.astype(np.float64) - row.max())
    return shifted / shifted.sum()


def drafter(config: EngineConfig, vocab_size: int) -> PromptLookup | DraftModel | None:
    """The engine's drafter: None without speculation."""
    if not config.num_speculative_tokens:
        return None
    return DraftModel(config, vocab_size) if config.speculative_model else PromptLookup(config)
