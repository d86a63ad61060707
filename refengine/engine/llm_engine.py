"""The continuous-batching float32 engine: the public API the suite, the server and the CLI use.

    config = EngineConfig(mode="invariant", max_num_seqs=8, max_num_batched_tokens=512,
                          block_size=16, num_blocks=None, max_model_len=None, fault=None)
    engine = LLMEngine(model, config, keep_logits=False, digest_logits=True)  # model: refengine.model.Model;
                                                 # keep_logits keeps each sampled f32 row in StepRecord.logits;
                                                 # digest_logits=False leaves StepRecord.logits_sha256 None
    engine.add_request("r0", [5, 9, 13], params=SamplingParams(max_tokens=8))
    engine.add_request("r1", prompt="Hello", params=...)        # or messages=[{role, content}]
    events = engine.step()                       # list[TokenEvent], one per request that got a token
    engine.abort("r1")                           # frees it now; its final TokenEvent (finish_reason
                                                 # "abort", token_id None) comes out of the next step();
                                                 # True if it stopped it, False (a no-op) if it had already
                                                 # finished: a finished request keeps its finish_reason
    outputs = engine.run()                       # steps until has_unfinished() is False
    outputs["r0"].token_ids, .text, .finish_reason, .steps[i].logits_sha256, .ttft_steps, ...
    engine.trace, engine.metrics, engine.status(), engine.check_invariants(), engine.release("r0")
    engine.choose_token(row, params, token_index)  # the token the engine draws from one logits row
    engine.verify_token(row, params, token_index, draft)  # ... from a row verifying a draft token

Defaults: num_blocks=None -> enough for max_num_seqs sequences of min(max_model_len, 2048) tokens;
max_model_len=None -> the model's max_position_embeddings. Serial operation is max_num_seqs=1.
Every bad input raises RefengineError naming the request or field; the engine stays usable.
Finished requests are kept (for outputs()) until release(); the trace grows one entry per step.
Every request gets exactly one final TokenEvent (finish_reason set): the one carrying its last token
("stop" / "length"), or, for an abort, one with token_id None; aborting a finished request changes
nothing (returns False, no event), aborting a released one raises RefengineError (unknown id).
Not thread-safe: one thread drives it (a server serializes add_request/abort/step).
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from itertools import accumulate

import numpy as np

from ..errors import RefengineError
from ..model import Model
from ..model.image import preprocess_image
from ..sampling import (
    SamplingParams,
    StepRecord,
    finish_reason,
    greedy_token,
    log_softmax,
    ranked_logprobs,
    sample_token,
    top2_margin,
    verify_draft,
)
from .block_manager import BlockManager, salt_root
from .config import EngineConfig
from .drafter import drafter
from .faults import Fault
from .kernels import top2
from .metrics import EngineMetrics, SpeculationCounters
from .model_runner import ModelRunner
from .multimodal import RequestImages, longer_side
from .outputs import RequestOutput, TokenEvent, request_output
from .penalties import PenaltyRows
from .prompt_logprobs import PromptScorer
from .scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from .sequence import Sequence, SequenceStatus


class LLMEngine:
    def __init__(self, model: Model, config: EngineConfig | None = None, *, keep_logits: bool = False,
                 digest_logits: bool = True):
        """keep_logits: also keep every sampled float32 logits row (StepRecord.logits), for comparisons.
        digest_logits: each sampled row's sha256 (StepRecord.logits_sha256), which every bit-exactness
        check compares; off only where nothing reads it (refengine bench's throughput runs: hashing a
        full-vocabulary row per token is a visible share of a large batch's step, docs/performance/history.md)."""
        self.model = model
        self.keep_logits, self.digest_logits = keep_logits, digest_logits
        self.config = (config or EngineConfig()).resolved(model.config)
        fault = self.config.injected
        self.block_manager = BlockManager(self.config.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching,
                                          count_shares=fault is not Fault.CACHED_BLOCK_NOT_REFCOUNTED,
                                          evict_on_reuse=fault is not Fault.EVICTED_BLOCK_STILL_CACHED,
                                          unlist_hits=fault is not Fault.CACHED_BLOCK_LEFT_ON_FREE_LIST,
                                          count_forks=fault is not Fault.FORKED_BLOCKS_NOT_REFCOUNTED)
        self.scheduler = Scheduler(self.config, self.block_manager, drafter(self.config, model.config.vocab_size))
        self.runner = ModelRunner(model, self.config)
        self.penalties = PenaltyRows(model.config.vocab_size, model.config.eos_token_ids, fault)
        self.prompt_scorer = PromptScorer(fault, keep_logits, digest_logits)
        self.requests_with_logits_processors = 0
        self.sequences: dict[str, Sequence] = {}
        self.families: dict[str, list[str]] = {}  # an n > 1 request's id -> its children's ids
        # child k samples with seed + k (Fault.N_CHILDREN_SHARE_SEED: all with the request's seed)
        self._child_seed = (lambda seed, k: seed) if fault is Fault.N_CHILDREN_SHARE_SEED \
            else (lambda seed, k: seed + k)
        self.num_steps = 0
        self.trace: list[dict] = []
        self._metrics = EngineMetrics()
        self._pending_aborts: list[Sequence] = []
        self._last_batch_size = 0
        self._finished_last_step = False  # for Fault.LOGITS_ROWS_MISASSIGNED_AFTER_LEAVE
        self._misassign_after_leave = self.config.injected is Fault.LOGITS_ROWS_MISASSIGNED_AFTER_LEAVE
        self._leak_seed = self.config.injected is Fault.SEED_LEAK
        self._cut_crossing_token = self.config.injected is Fault.TOP_P_EXCLUDES_CROSSING_TOKEN
        self._refinish_on_abort = self.config.injected is Fault.ABORT_AFTER_FINISH_REWRITES_FINISH
        self._normalize_over_step = self.config.injected is Fault.LOGPROB_NORMALIZATION
        self._salt_root = (lambda salt: b"") if self.config.injected is Fault.CACHE_SALT_IGNORED else salt_root
        self._register_sampled = self.scheduler.register_sampled \
            if self.config.injected is Fault.CACHED_BLOCK_WITH_UNCOMPUTED_TOKEN else (lambda seq: None)
        self.speculation = SpeculationCounters(self.config.num_speculative_tokens)
        # verification row of draft token j, of n (Fault.DRAFT_COMPARED_ONE_ROW_LATE: the row after it)
        self._verified_row = (lambda j, n: min(j + 1, n)) if fault is Fault.DRAFT_COMPARED_ONE_ROW_LATE \
            else (lambda j, n: j)
        self._duplicate_bonus = fault is Fault.BONUS_TOKEN_DUPLICATED
        self._residual = fault is not Fault.REJECTION_RESAMPLES_TARGET
        self._image_span = (lambda rows, cols: 1) if fault is Fault.TEXT_AFTER_IMAGE_ONE_POSITION else longer_side

    def add_request(self, request_id: str, prompt_ids=None, *, prompt: str | None = None,
                    messages: list[dict] | None = None, params: SamplingParams = SamplingParams(),
                    cache_salt: str | None = None, images: list | None = None) -> None:
        """`cache_salt`: a request shares cached KV blocks only with requests given the same salt (vLLM's).
        `images` (a vision-language model's): RGB uint8 arrays [height, width, 3], in order one per run of
        image tokens in `prompt_ids`, or one per image part of `messages` (each part rendered as the
        model's template does, its pad widened to the image's tokens)."""
        if not isinstance(request_id, str) or not request_id:
            raise RefengineError(f"request id: expected a non-empty string, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise RefengineError(f"request {request_id!r}: params must be a SamplingParams")
        ids = [request_id] if params.n == 1 else [f"{k}_{request_id}" for k in range(params.n)]
        if request_id in self.sequences or request_id in self.families or any(i in self.sequences for i in ids):
            raise RefengineError(f"request {request_id!r}: duplicate request id")
        if sum(x is not None for x in (prompt_ids, prompt, messages)) != 1:
            raise RefengineError(f"request {request_id!r}: give exactly one of prompt_ids, prompt, messages")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise RefengineError(f"request {request_id!r}: cache_salt: expected a non-empty string, got {cache_salt!r}")
        try:
            params.check_vocabulary(self.model.config.vocab_size)
        except RefengineError as e:
            raise RefengineError(f"request {request_id!r}: {e}") from None
        tokenizer = self.model.tokenizer
        images = images or None  # no images: a text request
        try:
            if images is not None and prompt is not None:
                raise RefengineError("images: give them with prompt_ids or messages")
            if prompt is not None:
                prompt_ids = tokenizer.encode(prompt)
            processed = None if images is None else \
                [preprocess_image(image, self.model.image_processor) for image in images]
            if messages is not None and images is not None:
                vision = self.model.vision_config
                prompt_ids = tokenizer.encode_chat_with_images(messages, [vision.image_tokens(p.grid_thw)
                                                                          for p in processed])
            elif messages is not None:
                prompt_ids = tokenizer.encode_chat(messages)
            prompt_ids = self.model.check_prompt(prompt_ids, what="prompt")
            request_images = RequestImages(self.model, prompt_ids, processed, self._image_span) \
                if images is not None else None
        except (TypeError, ValueError) as e:  # RefengineError is a ValueError
            raise RefengineError(f"request {request_id!r}: {e}") from None
        family = None if params.n == 1 else request_id
        root = self._salt_root(cache_salt)
        if request_images is not None:  # its blocks' KV depends on its images: so do their hashes
            root = hashlib.sha256(root + request_images.digest).digest()
        seqs = [Sequence(rid, prompt_ids, self._child(params, k), tokenizer.detokenizer(), self.num_steps, root, family)
                for k, rid in enumerate(ids)]
        for seq in seqs:
            seq.images = request_images
        self.scheduler.check_admissible(seqs[0])  # before any child is queued: all or none
        self.requests_with_logits_processors += params.processes_logits
        for seq in seqs:
            self.scheduler.add(seq)
            self.sequences[seq.request_id] = seq
        if family is not None:
            self.families[family] = ids

    def _child(self, params: SamplingParams, k: int) -> SamplingParams:
        """Child k's parameters: n 1, and seed + k (vLLM's; greedy children need no seed)."""
        if params.n == 1:
            return params
        return replace(params, n=1, seed=None if params.seed is None else self._child_seed(params.seed, k))

    def request_ids(self, request_id: str) -> list[str]:
        """The ids a request runs under: its children's (`<k>_<id>`) for n > 1, else its own."""
        return self.families.get(request_id, [request_id])

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks: True, and its final event (finish_reason "abort")
        comes out of the next step(). False if it had already finished (stopped, ran to its length or
        was aborted before): a no-op, its output and finish_reason stay as they were and no event follows.
        An n > 1 request's id aborts every child not yet released (True if it stopped any)."""
        if request_id in self.families:
            return any([self.abort(child) for child in self.families[request_id] if child in self.sequences])
        seq = self.sequences.get(request_id)
        if seq is None:
            raise RefengineError(f"request {request_id!r}: unknown request id, nothing to abort")
        if seq.is_finished and not self._refinish_on_abort:  # Fault.ABORT_AFTER_FINISH_REWRITES_FINISH
            return False
        self.scheduler.finish(seq, "abort", self.num_steps)
        self._pending_aborts.append(seq)
        self._release_penalty_rows()
        return True

    def has_unfinished(self) -> bool:
        """Whether step() has more to do: requests to run, or abort events not yet delivered."""
        return self.scheduler.has_unfinished() or bool(self._pending_aborts)

    def step(self) -> list[TokenEvent]:
        step, started = self.num_steps, time.perf_counter()
        events = [TokenEvent(s.request_id, step, None, None, None, s.take_text_delta(), "abort")
                  for s in self._pending_aborts]
        for seq in self._pending_aborts:
            seq.final_events += 1
        aborted, self._pending_aborts = [s.request_id for s in self._pending_aborts], []
        output = self.scheduler.draft(self.scheduler.schedule())
        self._release_penalty_rows()
        kv_blocks_used = self.block_manager.num_used_blocks
        sampling = [c for c in output.chunks if c.samples]
        rows = list(accumulate([1 + len(c.draft) for c in sampling], initial=0))  # chunk i's first logits row: rows[i]
        scored = self.prompt_scorer.positions(output.chunks)
        logits = self.runner.execute(output.chunks, self.block_manager, scored, output.copies) if output.chunks else ()
        if scored:  # the prompt rows follow the sampling rows; a first token's event carries its prompt's
            self.prompt_scorer.record(output.chunks, scored, logits[rows[-1]:])
            logits = logits[:rows[-1]]
        self.scheduler.postprocess(output)
        left = self._finished_last_step or bool(aborted)
        if self._misassign_after_leave and left and len(sampling) > 1:
            logits = np.roll(logits, 1, axis=0)
        seeds = [c.seq.params.seed for c in sampling if not c.seq.params.greedy]
        leaked_seed = seeds[0] if self._leak_seed and seeds else None
        logprobs = self._step_logprobs(logits, [c.seq.params.logprobs > 0 for c in sampling
                                                for _ in range(1 + len(c.draft))])
        best, margins = top2(logits) if sampling else ((), ())
        verified: dict[str, int] = {}  # accepted drafts, by request
        own_rows = logits if rows[-1] == len(sampling) else logits[rows[:-1]]  # each sampling chunk's first row
        for chunk, first, adjusted in zip(sampling, rows, self._adjusted(sampling, own_rows)):
            if chunk.draft:
                chunk_events, verified[chunk.seq.request_id] = self._verify(chunk, logits, best, margins, logprobs,
                                                                           first, step, leaked_seed)
                events += chunk_events
                continue
            row_best, margin = (best[first], margins[first]) if adjusted is None else \
                (greedy_token(adjusted), top2_margin(adjusted))
            events.append(self._append_token(chunk.seq, logits[first], int(row_best), float(margin), step,
                                             leaked_seed, logprobs[first], adjusted))
        self._finished_last_step = any(e.finish_reason for e in events if e.token_id is not None)
        self._release_penalty_rows()
        self._record(step, output, aborted, kv_blocks_used, verified, time.perf_counter() - started)
        self.num_steps += 1
        return events

    def _verify(self, chunk: ScheduledChunk, logits, best, margins, logprobs, first: int, step: int,
                leaked_seed: int | None) -> tuple[list[TokenEvent], int]:
        """(verify) Row j of a verifying decode predicts the token after its j-th input: it settles draft
        token j (verify_draft), and the first token that is not the draft ends the chunk; when every
        draft is accepted the last row yields the bonus token. The sequence then counts its input and
        the accepted drafts as computed (Scheduler.verified). Returns the events and how many drafts it
        accepted."""
        seq, draft, events, accepted = chunk.seq, chunk.draft, [], 0
        for j in range(len(draft) + 1):
            row = first + self._verified_row(j, len(draft))
            proposed = draft[j] if j < len(draft) else None
            # a processed row counts the drafts accepted before it: recorded as each was appended
            adjusted = self.penalties.apply([seq], logits[row][None])[0] if seq.params.processes_logits else None
            row_best, margin = (best[row], margins[row]) if adjusted is None else \
                (greedy_token(adjusted), top2_margin(adjusted))
            events.append(self._append_token(seq, logits[row], int(row_best), float(margin), step,
                                             leaked_seed, logprobs[row], adjusted, draft=proposed,
                                             draft_probs=self.scheduler.drafter.draft_probs(seq, j)
                                             if proposed is not None else None))
            if events[-1].token_id != proposed:
                break
            accepted += 1
            if events[-1].finish_reason:
                break
        if self._duplicate_bonus and draft and accepted == len(draft) and not seq.is_finished:
            events.append(self._append_token(seq, logits[row], int(row_best), float(margin), step,
                                             leaked_seed, logprobs[row], adjusted))
        self.scheduler.verified(chunk, accepted)
        self.speculation.record(len(draft), accepted)
        return events, accepted

    def _release_penalty_rows(self) -> None:
        """Free the penalty rows of requests no longer running (at an abort; after scheduling: preempted, and
        a preempted request gets a new row, rebuilt from its tokens, when it samples again; after sampling:
        finished), so that between steps only running requests hold rows (check_invariants)."""
        for request_id in [r for r in self.penalties.ids if r not in self.sequences
                           or self.sequences[r].status is not SequenceStatus.RUNNING]:
            self.penalties.remove(request_id)

    def _adjusted(self, sampling, logits: np.ndarray) -> list[np.ndarray | None]:
        """Per sampling chunk, the float64 row its logits processors make (engine/penalties.py), or None
        for a request without processors (its float32 row is chosen from as it is)."""
        wanted = [i for i, c in enumerate(sampling) if c.seq.params.processes_logits]
        adjusted: list[np.ndarray | None] = [None] * len(sampling)
        if not wanted:
            return adjusted
        for i in wanted:
            if sampling[i].seq.request_id not in self.penalties:
                self.penalties.add(sampling[i].seq)
        for i, row in zip(wanted, self.penalties.apply([sampling[i].seq for i in wanted], logits[wanted])):
            adjusted[i] = row
        return adjusted

    def _step_logprobs(self, logits: np.ndarray, wanted: list[bool]) -> list[np.ndarray | None]:
        """The float64 log-softmax of each sampled row whose request asked for logprobs (None for the
        others), each normalized over its own row: a row's logprobs never depend on the batch."""
        if not any(wanted):
            return [None] * len(wanted)
        if self._normalize_over_step:  # Fault.LOGPROB_NORMALIZATION: one normalizer for the whole step
            every = log_softmax(np.asarray(logits, dtype=np.float64).ravel()).reshape(np.shape(logits))
            return [row if want else None for row, want in zip(every, wanted)]
        return [log_softmax(row.astype(np.float64)) if want else None for row, want in zip(logits, wanted)]

    def _append_token(self, seq: Sequence, logits: np.ndarray, best: int, margin: float, step: int,
                      leaked_seed: int | None, row_logprobs: np.ndarray | None = None,
                      adjusted: np.ndarray | None = None, draft: int | None = None,
                      draft_probs: np.ndarray | None = None) -> TokenEvent:
        """The row's token (`best`, its greedy token, where the request is greedy) and its record.
        `margin` is the top-2 margin of the row the token is chosen from: `adjusted` where the request's
        logits processors made one, else `logits` (which the record's digest and logprobs are of).
        `draft`: the draft token this row verifies, drawn from `draft_probs` (sampling.verify_draft decides)."""
        params = seq.params
        if params.greedy:
            token = best
        else:
            drawn = params if leaked_seed is None else replace(params, seed=leaked_seed)
            if draft is None:
                token = self.choose_token(logits if adjusted is None else adjusted, drawn, len(seq.output_ids))
            else:
                token = self.verify_token(logits if adjusted is None else adjusted, drawn, len(seq.output_ids), draft,
                                          draft_probs)
        logprob, alternatives = (None, []) if row_logprobs is None else \
            ranked_logprobs(row_logprobs, token, params.logprobs)
        record = StepRecord(token, margin, alternatives, logprob, step,
                            hashlib.sha256(logits.tobytes()).hexdigest() if self.digest_logits else None,
                            logits.copy() if self.keep_logits else None,
                            adjusted if self.keep_logits else None)
        seq.append_token(record)
        if adjusted is not None:
            self.penalties.record(seq.request_id, token)
        self._register_sampled(seq)
        reason = finish_reason(token, len(seq.output_ids), seq.detokenizer.text, params,
                               self.model.config.eos_token_ids, seq.stop_from)
        if reason is not None:
            self.scheduler.finish(seq, reason, step)
            seq.final_events += 1
        first = len(seq.output_ids) == 1 and params.prompt_logprobs is not None
        return TokenEvent(seq.request_id, step, token, record.top2_margin, record.logits_sha256,
                          seq.take_text_delta(), reason, record.top_logprobs, record.logprob,
                          list(seq.prompt_logprobs) if first else None)

    def choose_token(self, logits: np.ndarray, params: SamplingParams, token_index: int) -> int:
        """The token the engine draws from one logits row for generated token `token_index`."""
        if self._cut_crossing_token and not params.greedy and params.top_p < 1:
            logits, params = _nucleus_without_crossing_token(logits, params)
        return sample_token(logits, params, token_index)

    def verify_token(self, logits: np.ndarray, params: SamplingParams, token_index: int, draft: int,
                     draft_probs: np.ndarray | None = None) -> int:
        """The token the engine emits for generated token `token_index` from a verification row whose
        draft token was `draft`, drawn from `draft_probs` (None: proposed with certainty;
        sampling.verify_draft; the draft was accepted where they are equal)."""
        return verify_draft(logits, params, token_index, draft, self._residual, draft_probs)

    def _record(self, step: int, output: SchedulerOutput, aborted: list[str], kv_blocks_used: int,
                verified: dict[str, int], seconds: float) -> None:
        """The step's trace entry; a decode that verified drafts also records how many (`draft`, of
        num_tokens) and how many it `accepted`."""
        self.trace.append({
            "step": step,
            "scheduled": [{"id": c.seq.request_id, "phase": c.phase, "start": c.start, "num_tokens": c.num_tokens,
                           "draft": len(c.draft), "accepted": verified[c.seq.request_id]} if c.draft else
                          {"id": c.seq.request_id, "phase": c.phase, "start": c.start, "num_tokens": c.num_tokens}
                          for c in output.chunks],
            "preempted": [s.request_id for s in output.preempted], "aborted": aborted,
            "kv_blocks_used": kv_blocks_used})
        self._metrics.record_step(output, seconds)
        self._last_batch_size = len(output.chunks)

    def run(self) -> dict[str, RequestOutput]:
        """Step until every request has finished; the outputs of all requests, by id."""
        while self.has_unfinished():
            self.step()
        return self.outputs()

    def output(self, request_id: str) -> RequestOutput:
        if request_id not in self.sequences:
            raise RefengineError(f"request {request_id!r}: unknown request id")
        return request_output(self.sequences[request_id])

    def outputs(self) -> dict[str, RequestOutput]:
        return {rid: request_output(seq) for rid, seq in self.sequences.items()}

    def release(self, request_id: str) -> RequestOutput:
        """Forget a finished request (a long-running server calls this); returns its output."""
        out = self.output(request_id)
        if out.finish_reason is None:
            raise RefengineError(f"request {request_id!r}: still running; abort it first")
        family = self.sequences.pop(request_id).family
        if family is not None and not any(i in self.sequences for i in self.families[family]):
            del self.families[family]
        return out

    @property
    def metrics(self) -> dict:
        summary = self._metrics.summary(self.outputs().values())
        return summary | self.speculation.status() if self.config.num_speculative_tokens else summary

    def status(self) -> dict:
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "kv_blocks_used": self.block_manager.num_used_blocks,
                "kv_blocks_free": self.block_manager.num_free_blocks,
                "kv_block_size": self.block_manager.block_size, "steps": self.num_steps,
                "preemptions": self._metrics.preemptions, "batch_active": self._last_batch_size,
                "prefix_cache_queries": self.scheduler.prefix_cache_queries,
                "prefix_cache_hits": self.scheduler.prefix_cache_hits,
                "logits_processor_rows": len(self.penalties.ids),
                "requests_with_logits_processors": self.requests_with_logits_processors,
                "prompt_logprob_tokens": self.prompt_scorer.scored_tokens, "forks": self.scheduler.forks,
                "images_encoded": self.runner.images_encoded,
                **self.speculation.status()}

    def check_invariants(self) -> None:
        """AssertionError unless the KV accounting adds up, finished requests hold no blocks and every
        finished request has streamed exactly one final event (an abort's is due in the next step)."""
        finished = [s.block_table for s in self.sequences.values() if s.is_finished]
        self.block_manager.check_invariants(finished)
        pending = {s.request_id for s in self._pending_aborts}
        for seq in self.sequences.values():
            due = int(seq.is_finished and seq.request_id not in pending)
            assert seq.final_events == due, (f"{seq.request_id}: {seq.final_events} final events streamed, "
                                             f"expected {due} ({seq.status.value}, finish_reason {seq.finish_reason})")
        for seq in self.scheduler.waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.block_table.block_ids, seq
        running = {seq.request_id for seq in self.scheduler.running}
        assert set(self.penalties.ids) <= running, f"penalty rows of requests not running: {self.penalties.ids}"
        for seq in self.scheduler.running:
            assert seq.status is SequenceStatus.RUNNING, seq
            assert len(seq.block_table) == self.block_manager.blocks_for(seq.num_computed_tokens), seq


def _nucleus_without_crossing_token(logits: np.ndarray, params: SamplingParams):
    """Fault.TOP_P_EXCLUDES_CROSSING_TOKEN: the row masked to a nucleus cut one token short (the
    classic off-by-one: `searchsorted(cumsum, top_p)` without the + 1), to be sampled as is."""
    scaled = logits.astype(np.float64) / params.temperature
    order = np.lexsort((np.arange(len(scaled)), -scaled))[:params.top_k or None]
    probs = np.exp(scaled[order] - scaled[order[0]])
    keep = order[:max(1, int(np.searchsorted(np.cumsum(probs / probs.sum()), params.top_p)))]
    masked = np.full_like(logits, -np.inf)
    masked[keep] = logits[keep]
    return masked, replace(params, top_k=0, top_p=1.0)
