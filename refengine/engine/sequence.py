"""One request as the scheduler and the model runner see it: its tokens, its KV blocks, its progress."""
from __future__ import annotations

import time
from enum import Enum

from ..model.tokenizer import IncrementalDetokenizer
from ..sampling import PromptLogprob, SamplingParams, StepRecord, cut_at_stop_string
from .block_manager import BlockTable, block_hashes


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 detokenizer: IncrementalDetokenizer, arrival_step: int, hash_root: bytes = b"",
                 family: str | None = None):
        self.request_id = request_id
        self.family = family  # the request id of an n > 1 request it is a child of (None: a request of its own)
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table = BlockTable(request_id)
        self.detokenizer = detokenizer
        self.finish_reason: str | None = None
        self.records: list[StepRecord] = []
        self.arrival_step = arrival_step
        self.arrival_time = time.perf_counter()
        self.finish_step: int | None = None
        self.finish_time: float | None = None
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        self.emitted_text = ""
        self.final_events = 0  # TokenEvents with a finish_reason streamed so far: exactly 1 once finished
        self.num_cached_tokens: int | None = None  # prompt tokens its first admission found cached
        self._block_hashes: list[bytes] = []  # of its full blocks so far (its tokens only ever grow)
        self.hash_root = hash_root  # its first block's parent hash (block_manager.salt_root)
        self.stop_from = 0  # stop strings count where they end past this: its text up to its min_tokens-th token
        self.images = None  # engine.multimodal.RequestImages of a request with images
        self.prompt_logprobs: list[PromptLogprob] = []  # scored so far, positions 1.. (engine/prompt_logprobs.py)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def max_num_tokens(self) -> int:
        """The most tokens this request can ever hold: prompt plus every allowed generated token."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def scoring_prompt(self) -> bool:
        """Whether it asked for prompt logprobs and has prompt tokens left to score."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def block_hashes(self, num_tokens: int, block_size: int) -> list[bytes]:
        """The chained hashes of the full blocks of its first `num_tokens` tokens (block_manager)."""
        full = num_tokens // block_size
        if full > len(self._block_hashes):
            done = len(self._block_hashes) * block_size
            self._block_hashes += block_hashes(self.token_ids[done:full * block_size], block_size,
                                               self._block_hashes[-1] if self._block_hashes else self.hash_root)
        return self._block_hashes[:full]

    def is_decode(self, start: int, num_tokens: int) -> bool:
        """A chunk is a decode when it feeds exactly the last sampled token; anything else is prefill
        (including recomputing generated tokens after a preemption)."""
        return bool(self.output_ids) and num_tokens == 1 and start == self.num_tokens - 1

    def append_token(self, record: StepRecord) -> None:
        self.output_ids.append(record.token_id)
        self.records.append(record)
        self.detokenizer.push(record.token_id)
        if len(self.output_ids) <= self.params.min_tokens:  # (an abort may come before the min_tokens-th)
            self.stop_from = len(self.detokenizer.text)
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()

    def finish(self, reason: str, step: int) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_step = step
        self.finish_time = time.perf_counter()
        self.detokenizer.flush()

    def visible_text(self) -> str:
        """The text a client may see now: cut at a stop string once finished; while running, a tail
        that could still grow into a stop string is held back so streamed text never needs recalling."""
        text = self.detokenizer.text
        if self.is_finished:
            return cut_at_stop_string(text, self.params.stop, self.stop_from)
        held = 0
        for stop in self.params.stop:
            for n in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:n]):
                    held = n
                    break
        return text[:len(text) - held]

    def take_text_delta(self) -> str:
        visible = self.visible_text()
        delta = visible[len(self.emitted_text):] if visible.startswith(self.emitted_text) else ""
        self.emitted_text += delta
        return delta

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"generated={len(self.output_ids)}, computed={self.num_computed_tokens})")
