"""Iteration-level FCFS scheduling with chunked prefill and preemption by recompute (vLLM v1 style).

Every step is decided afresh: running sequences first, in admission order, each gets the tokens it
still needs (1 for a decode, plus its draft tokens when speculating: a decode the budget left cannot
hold whole waits for the next step, and nothing is admitted after it; a chunk of its prompt otherwise)
within the step's token budget; then
waiting sequences are admitted in arrival order while seats, budget and KV blocks last. When a
running sequence cannot get blocks, the most recently admitted running sequence is preempted: its
blocks are freed and it goes back to the front of the waiting queue, to recompute prompt + generated
tokens when readmitted (when speculating, all but the last, which then runs as a decode: `_short`).
The oldest running sequence therefore always progresses, so nothing starves. A step's verifying
decodes get their draft tokens once the step is scheduled (`draft`).

A child of an n > 1 request is admitted by forking a running sibling once that sibling has computed their
shared tokens (the prompt but its last token, which the child computes itself to get its own row): the
full blocks are shared, the partial last block is copied (block_manager), and so are its prompt logprobs,
where asked for. While a running sibling still computes them, the child waits at the head of the queue
(as vLLM v0 forked after the prompt's prefill).

Which chunks a step runs is always that decision; `scheduling_policy` only orders them (how the
step's rows are laid out for the runner, which must give the same outputs in any order): "fcfs" as
decided (running first, a partial prefill chunk last), "prefill-first" the prefill chunks and then
the decodes, each in that order, "shuffled" sorted by sha256("seed:step:request id"), a permutation
that only the schedule's settings, the step number and the request ids determine.
"""
from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, replace

from ..errors import RefengineError
from .block_manager import BlockManager, block_hashes
from .config import EngineConfig
from .faults import Fault
from .sequence import Sequence, SequenceStatus

WAIT = object()  # _fork_source: a sibling still computes the tokens to fork
UNDRAFTED = -1  # a draft token `schedule` leaves for `draft` to propose


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int       # first position fed this step
    num_tokens: int
    phase: str       # "prefill" | "decode"
    samples: bool    # the chunk reaches the sequence's last token, so its last row yields a new token
    # Speculative decoding: the draft tokens a decode verifies, fed after its input token (num_tokens counts them)
    draft: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[Sequence]
    copies: list[tuple[int, int]] = ()  # (source block, destination block): a fork's partial block, before the run

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, drafter=None):
        """`drafter`: speculative decoding's (engine/drafter.py), None without it."""
        # Fault.LAST_ADMISSION_SLOT_UNUSED: one slot fewer than configured is ever filled
        self.max_num_seqs = config.max_num_seqs - (config.injected is Fault.LAST_ADMISSION_SLOT_UNUSED)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.num_speculative_tokens = config.num_speculative_tokens
        self.drafter = drafter
        self.fault = config.injected
        self.policy, self.seed = config.scheduling_policy, config.scheduling_seed
        self.num_steps = 0  # schedule() calls so far: the engine's step number
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        # a preempted sequence is readmitted first (Fault.PREEMPTED_REQUEUED_LAST: after every later arrival)
        self._requeue = self.waiting.append if config.injected is Fault.PREEMPTED_REQUEUED_LAST \
            else self.waiting.appendleft
        self.running: list[Sequence] = []
        self._hashes = self._unchained_hashes if self.fault is Fault.PREFIX_HASH_NOT_CHAINED else self._chained_hashes
        self._drop_last_hit = self.fault is Fault.CACHED_PREFIX_LAST_BLOCK_DROPPED
        # vLLM's rule: a request still to score its prompt computes every row
        # (Fault.PROMPT_LOGPROBS_FROM_CACHED_BLOCKS: it does not)
        self._looks_up = (lambda seq: True) if self.fault is Fault.PROMPT_LOGPROBS_FROM_CACHED_BLOCKS \
            else (lambda seq: not seq.scoring_prompt)
        self.families: dict[str, list[Sequence]] = {}  # an n > 1 request's id -> its children not all finished
        # Fault.FORK_BEFORE_PREFILL_DONE: a sibling that has computed anything is taken as ready
        self._ready = (lambda source, shared: source.num_computed_tokens > 0) \
            if self.fault is Fault.FORK_BEFORE_PREFILL_DONE \
            else (lambda source, shared: source.num_computed_tokens >= shared)
        self._shares_partial = self.fault is Fault.FORKED_PARTIAL_BLOCK_SHARED
        self._copies = self.fault is not Fault.FORK_COPY_SKIPPED
        self.forks = 0  # children admitted by forking a sibling (refengine_forks_total)
        self.prefix_cache_queries = 0  # tokens looked up at admissions, and those found cached
        self.prefix_cache_hits = 0     # (vLLM's vllm:prefix_cache_queries / _hits, in tokens)

    def check_admissible(self, seq: Sequence) -> None:
        """Reject what could never finish, instead of letting it wait forever."""
        if seq.max_num_tokens > self.max_model_len:
            raise RefengineError(
                f"request {seq.request_id!r}: prompt ({seq.num_prompt_tokens} tokens) + max_tokens "
                f"({seq.params.max_tokens}) exceeds max_model_len {self.max_model_len}")
        blocks = self.block_manager.blocks_for(seq.max_num_tokens)
        if blocks > self.block_manager.num_blocks:
            raise RefengineError(
                f"request {seq.request_id!r}: needs up to {blocks} KV blocks of {self.block_manager.block_size} "
                f"tokens but the pool holds {self.block_manager.num_blocks}")

    def add(self, seq: Sequence) -> None:
        self.check_admissible(seq)
        self.waiting.append(seq)
        if seq.family is not None:
            self.families.setdefault(seq.family, []).append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        index, waits = 0, False
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_tokens = min(self._remaining(seq) - self._short(seq), budget)
            drafts = self._reserve(seq) if self.num_speculative_tokens else 0
            if num_tokens + drafts > budget:  # a verifying decode runs whole or waits: its drafts are its own
                waits = True
                break
            while not self.block_manager.can_allocate(seq.block_table,
                                                      seq.num_computed_tokens + num_tokens + drafts):
                victim = self.running.pop()
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            chunks.append(self._allocate(seq, num_tokens, drafts))
            budget -= num_tokens + drafts
            index += 1
        copies: list[tuple[int, int]] = []
        while not preempted and not waits and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            source = self._fork_source(seq)
            if source is WAIT:
                break
            if source is not None:
                hit, cached = self._forked_blocks(seq, source), seq.num_prompt_tokens - 1
            else:
                hit = self._cached_prefix(seq)
                cached = len(hit) * self.block_manager.block_size
                if self._drop_last_hit:  # Fault.CACHED_PREFIX_LAST_BLOCK_DROPPED: its tokens still count as cached
                    hit = hit[:-1]
            num_tokens = min(self._remaining(seq) - cached - self._short(seq), budget)
            if self.block_manager.num_new_blocks(seq.block_table, cached + num_tokens) - len(hit) > \
                    self.block_manager.num_free_after_hit(hit):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if source is not None:
                self.block_manager.share(seq.block_table, hit)
                seq.num_computed_tokens = cached
                if seq.scoring_prompt:  # the rows it skips scored its prompt in the sibling: the same entries
                    seq.prompt_logprobs = list(source.prompt_logprobs)
                if seq.num_cached_tokens is None:  # what it is told (usage): prompt tokens it did not compute
                    seq.num_cached_tokens = cached
                self.forks += 1
            else:
                self._take_cached(seq, hit, cached)
            chunks.append(self._allocate(seq, num_tokens))
            if source is not None and len(hit) * self.block_manager.block_size < cached and self._copies:
                copies.append((source.block_table.block_ids[len(hit)], seq.block_table.block_ids[len(hit)]))
            budget -= num_tokens
        step, self.num_steps = self.num_steps, self.num_steps + 1
        return SchedulerOutput(self.ordered(chunks, step), preempted, copies)

    def _fork_source(self, seq: Sequence):
        """For a child of an n > 1 request not yet computed: the running sibling whose KV of their shared
        tokens (the prompt but its last token) it forks; WAIT while a running sibling still computes them;
        None where it computes its prompt itself (no sibling runs, or nothing to share)."""
        shared = seq.num_prompt_tokens - 1
        if seq.family is None or seq.num_computed_tokens or shared < 1:
            return None
        running = [s for s in self.families[seq.family] if s is not seq and s.status is SequenceStatus.RUNNING]
        return next((s for s in running if self._ready(s, shared)), WAIT if running else None)

    def _forked_blocks(self, seq: Sequence, source: Sequence) -> list[int]:
        """The sibling's blocks a fork shares: the full blocks of the shared tokens (the partial last one is
        copied; Fault.FORKED_PARTIAL_BLOCK_SHARED: shared too)."""
        shared, size = seq.num_prompt_tokens - 1, self.block_manager.block_size
        full = shared // size + (self._shares_partial and shared % size > 0)
        return source.block_table.block_ids[:full]

    def ordered(self, chunks: list[ScheduledChunk], step: int) -> list[ScheduledChunk]:
        """The step's chunks in the policy's order (the FCFS decision itself is `chunks`)."""
        if self.policy == "prefill-first":
            return sorted(chunks, key=lambda c: c.phase != "prefill")  # stable: FCFS order within each phase
        if self.policy == "shuffled":
            salt = f"{self.seed}:{step}:"
            return sorted(chunks, key=lambda c: hashlib.sha256((salt + c.seq.request_id).encode()).digest())
        return chunks

    def _reserve(self, seq: Sequence) -> int:
        """How many draft tokens a running sequence's decode verifies (engine/drafter.py: prompt lookup in
        its own tokens, or a draft model), up to num_speculative_tokens, always leaving room for the token
        its last verification row yields. Decided here, with the decode's tokens, so the budget and the
        blocks are exactly what it feeds."""
        if self._remaining(seq) != 1 or not seq.output_ids:
            return 0
        room = min(self.num_speculative_tokens, seq.params.max_tokens - len(seq.output_ids) - 1)
        return self.drafter.reserve(seq, room) if room > 0 else 0

    def draft(self, output: SchedulerOutput) -> SchedulerOutput:
        """(draft) The scheduled step with its verifying decodes' draft tokens, proposed for all of them at
        once (a draft model runs them in one forward per draft position)."""
        verifying = [c for c in output.chunks if c.draft]
        if not verifying:
            return output
        proposed = dict(zip((c.seq.request_id for c in verifying),
                            self.drafter.propose([(c.seq, len(c.draft)) for c in verifying])))
        return replace(output, chunks=[replace(c, draft=tuple(proposed[c.seq.request_id])) if c.draft else c
                                       for c in output.chunks])

    def _short(self, seq: Sequence) -> int:
        """1 where a speculating request resumed after a preemption still has more than its last token to
        recompute: it recomputes all but that one, which then runs as the decode it would have been
        without the preemption, drafts and all. So which of its tokens are verified, and with them a
        seeded request's answer, do not depend on preemptions (suite: chunking-consistency); else 0."""
        return int(bool(self.num_speculative_tokens and seq.output_ids) and self._remaining(seq) > 1)

    def _remaining(self, seq: Sequence) -> int:
        """Tokens to compute before the sequence samples again (after a preemption: prompt + generated)."""
        if self.fault is Fault.NO_RECOMPUTE_ON_RESUME and seq.num_preemptions and \
                seq.num_computed_tokens < seq.num_prompt_tokens:
            return seq.num_prompt_tokens - seq.num_computed_tokens
        return seq.num_tokens - seq.num_computed_tokens

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The registered blocks a joining sequence's tokens start with, all but its last token: that
        one is always computed, so a full hit still yields the logits row it samples from. None for a
        sequence whose prompt logprobs are still to be scored (a cached position computes no row to score)."""
        if not self.block_manager.enable_caching or not self._looks_up(seq):
            return []
        return self.block_manager.cached_prefix(self._hashes(seq, seq.num_tokens - 1 - self._short(seq)))

    def _chained_hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        return seq.block_hashes(num_tokens, self.block_manager.block_size)

    def _unchained_hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """Fault.PREFIX_HASH_NOT_CHAINED: each full block hashed on its own tokens."""
        size = self.block_manager.block_size
        return [block_hashes(seq.token_ids[i:i + size], size)[0] for i in range(0, num_tokens // size * size, size)]

    def _take_cached(self, seq: Sequence, hit: list[int], cached: int) -> None:
        """Admit with the hit's blocks shared and their `cached` tokens counted as computed."""
        if not self.block_manager.enable_caching:
            return
        if cached:
            self.block_manager.take_cached(seq.block_table, hit)
            seq.num_computed_tokens = cached
        self.prefix_cache_queries += seq.num_tokens  # every admission, a readmission after preemption too
        self.prefix_cache_hits += cached
        if seq.num_cached_tokens is None:  # its first admission: what the request is told (usage)
            seq.num_cached_tokens = cached

    def _allocate(self, seq: Sequence, num_tokens: int, drafts: int = 0) -> ScheduledChunk:
        """The chunk, its blocks allocated; a verifying decode's `drafts` tokens are placeholders (UNDRAFTED)
        until `draft` proposes them."""
        start = seq.num_computed_tokens
        self.block_manager.allocate(seq.block_table, start + num_tokens + drafts)
        phase = "decode" if seq.is_decode(start, num_tokens) else "prefill"
        return ScheduledChunk(seq, start, num_tokens + drafts, phase, start + num_tokens == seq.num_tokens,
                              (UNDRAFTED,) * drafts)

    def preempt(self, seq: Sequence) -> None:
        freed = list(seq.block_table.block_ids)
        self.block_manager.free(seq.block_table)
        if self.drafter is not None:  # a draft model recomputes its KV with the sequence's
            self.drafter.forget(seq)
        if self.fault is Fault.STALE_BLOCK_TABLE_AFTER_PREEMPTION:
            seq.block_table.block_ids = freed
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._requeue(seq)

    def postprocess(self, output: SchedulerOutput) -> None:
        """The step's forward has written these tokens' KV: full blocks of it become cacheable. A chunk
        that verifies drafts is settled by `verified` once the engine knows how many it accepted."""
        for chunk in output.chunks:
            if chunk.draft:
                continue
            seq = chunk.seq
            seq.num_computed_tokens = chunk.end
            if self.fault is Fault.NO_RECOMPUTE_ON_RESUME and seq.num_preemptions and chunk.end == seq.num_prompt_tokens:
                seq.num_computed_tokens = max(chunk.end, seq.num_tokens - 1)  # skips the generated tokens' KV
            if self.block_manager.enable_caching:  # the blocks this chunk filled; earlier ones had their turn
                self.block_manager.register(seq.block_table, self._hashes(seq, chunk.end),
                                            chunk.start // self.block_manager.block_size)

    def verified(self, chunk: ScheduledChunk, accepted: int) -> None:
        """A verifying decode accepted `accepted` of its draft tokens: its input token and those are
        computed; the blocks allocated for the rejected ones go back to the pool (Fault.REJECTED_DRAFT_BLOCKS_KEPT:
        they stay in its table), the draft model's KV past them is dropped, and its full blocks of verified
        tokens become cacheable."""
        seq = chunk.seq
        if seq.is_finished:  # its blocks are freed already
            return
        seq.num_computed_tokens = chunk.start + 1 + accepted
        self.drafter.verified(seq, seq.num_computed_tokens)
        if self.fault is not Fault.REJECTED_DRAFT_BLOCKS_KEPT:
            self.block_manager.trim(seq.block_table, seq.num_computed_tokens)
        if self.block_manager.enable_caching:
            self.block_manager.register(seq.block_table, self._hashes(seq, seq.num_computed_tokens),
                                        chunk.start // self.block_manager.block_size)

    def register_sampled(self, seq: Sequence) -> None:
        """Fault.CACHED_BLOCK_WITH_UNCOMPUTED_TOKEN: registers the block a just-sampled token filled, whose
        KV no forward has written yet (the engine calls it as it appends a token, with the fault only)."""
        if self.block_manager.enable_caching:
            self.block_manager.register(seq.block_table, self._hashes(seq, seq.num_tokens))

    def finish(self, seq: Sequence, reason: str, step: int) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if not (self.fault is Fault.ABORT_LEAKS_BLOCKS and reason == "abort"):
            self.block_manager.free(seq.block_table)
        if self.drafter is not None:
            self.drafter.forget(seq)
        seq.finish(reason, step)
        if seq.family is not None and all(s.is_finished for s in self.families[seq.family]):
            del self.families[seq.family]
