"""The fault catalog: realistic continuous-batching bugs the engine can switch on by name.

They are the invariants suite's negative control: with any one of them on, `pytest -m invariants`
must fail and shrink the failure to a small schedule. Each is injected at the one code point where
the real bug would live (grep the engine for its Fault member). A name is resolved once, when the
EngineConfig is built (a misspelt one is refused there), and the engine's components compare the
resolved member, never the string. The engine reads no environment: the CLI and the server pass the
fault they were asked for; `refengine faults` lists them.
"""
from __future__ import annotations

from enum import Enum

from ..errors import RefengineError


class Fault(Enum):
    STALE_BLOCK_TABLE_AFTER_PREEMPTION = "stale-block-table-after-preemption"
    POSITION_OFF_BY_ONE_ON_JOIN = "position-off-by-one-on-join"
    LOGITS_ROWS_MISASSIGNED_AFTER_LEAVE = "logits-rows-misassigned-after-leave"
    CHUNKED_PREFILL_PAST_OFF_BY_ONE = "chunked-prefill-past-off-by-one"
    NO_RECOMPUTE_ON_RESUME = "no-recompute-on-resume"
    SEED_LEAK = "seed-leak"
    KV_WRITE_BLOCK_BOUNDARY_OFF_BY_ONE = "kv-write-block-boundary-off-by-one"
    ABORT_LEAKS_BLOCKS = "abort-leaks-blocks"
    ABORT_AFTER_FINISH_REWRITES_FINISH = "abort-after-finish-rewrites-finish"
    CHUNK_ORDER_DEPENDENT_LOGITS_ROW = "chunk-order-dependent-logits-row"
    DECODE_CONTEXT_AFTER_PREFILL = "decode-context-after-prefill"
    TOP_P_EXCLUDES_CROSSING_TOKEN = "top-p-excludes-crossing-token"
    ATTENTION_BOUND_INFLATING = "attention-bound-inflating"
    LOGPROB_NORMALIZATION = "logprob-normalization"
    HANG_UP_WITHOUT_ABORT = "hang-up-without-abort"
    SLOT_LEAK = "slot-leak"
    PREFIX_HASH_NOT_CHAINED = "prefix-hash-not-chained"
    CACHED_BLOCK_NOT_REFCOUNTED = "cached-block-not-refcounted"
    EVICTED_BLOCK_STILL_CACHED = "evicted-block-still-cached"
    CACHED_BLOCK_LEFT_ON_FREE_LIST = "cached-block-left-on-free-list"
    CACHED_PREFIX_LAST_BLOCK_DROPPED = "cached-prefix-last-block-dropped"
    CACHE_SALT_IGNORED = "cache-salt-ignored"
    CACHED_BLOCK_WITH_UNCOMPUTED_TOKEN = "cached-block-with-uncomputed-token"
    PENALTY_COUNTS_BY_BATCH_ROW = "penalty-counts-by-batch-row"
    LOGIT_BIAS_WRONG_ROW = "logit-bias-wrong-row"
    PENALTY_COUNTS_LOST_ON_RESUME = "penalty-counts-lost-on-resume"
    FREQUENCY_PENALTY_COUNTS_PROMPT = "frequency-penalty-counts-prompt"
    REPETITION_PENALTY_IGNORES_SIGN = "repetition-penalty-ignores-sign"
    MIN_TOKENS_COUNTS_PROMPT = "min-tokens-counts-prompt"
    LOGITS_PROCESSORS_IGNORED = "logits-processors-ignored"
    PROMPT_LOGPROBS_SHIFTED_BY_ONE = "prompt-logprobs-shifted-by-one"
    PROMPT_LOGPROBS_CHUNK_END_DROPPED = "prompt-logprobs-chunk-end-dropped"
    PROMPT_LOGPROBS_RESCORED_ON_RESUME = "prompt-logprobs-rescored-on-resume"
    PROMPT_LOGPROBS_FROM_CACHED_BLOCKS = "prompt-logprobs-from-cached-blocks"
    PROMPT_LOGPROBS_ROWS_FROM_STEP_START = "prompt-logprobs-rows-from-step-start"
    ECHO_IGNORED = "echo-ignored"
    N_CHILDREN_SHARE_SEED = "n-children-share-seed"
    FORKED_PARTIAL_BLOCK_SHARED = "forked-partial-block-shared"
    FORK_COPY_SKIPPED = "fork-copy-skipped"
    FORKED_BLOCKS_NOT_REFCOUNTED = "forked-blocks-not-refcounted"
    FORK_BEFORE_PREFILL_DONE = "fork-before-prefill-done"
    LAST_ADMISSION_SLOT_UNUSED = "last-admission-slot-unused"
    PREEMPTED_REQUEUED_LAST = "preempted-requeued-last"
    BONUS_TOKEN_DUPLICATED = "bonus-token-duplicated"
    DRAFT_COMPARED_ONE_ROW_LATE = "draft-compared-one-row-late"
    REJECTED_DRAFT_BLOCKS_KEPT = "rejected-draft-blocks-kept"
    REJECTION_RESAMPLES_TARGET = "rejection-resamples-target"
    DRAFT_POSITIONS_OFF_ON_JOIN = "draft-positions-off-on-join"
    DRAFT_PROBS_UNTEMPERED = "draft-probs-untempered"
    IMAGE_POSITIONS_FROM_STEP_ROWS = "image-positions-from-step-rows"
    IMAGE_FEATURES_FROM_NEIGHBOUR = "image-features-from-neighbour"
    DEEPSTACK_ONE_LAYER_LATE = "deepstack-one-layer-late"
    TEXT_AFTER_IMAGE_ONE_POSITION = "text-after-image-one-position"
    IMAGE_FEATURES_RESTART_AT_CHUNK = "image-features-restart-at-chunk"


DESCRIPTIONS = {
    Fault.STALE_BLOCK_TABLE_AFTER_PREEMPTION:
        "preemption returns a sequence's KV blocks to the pool but leaves their ids in its block table; "
        "on resume it writes and reads blocks that now belong to other sequences",
    Fault.POSITION_OFF_BY_ONE_ON_JOIN:
        "a request admitted while others are running gets RoPE positions shifted by one in its first "
        "prefill chunk",
    Fault.LOGITS_ROWS_MISASSIGNED_AFTER_LEAVE:
        "in the step after a request leaves the batch, sampled logits rows are handed out in the "
        "pre-compaction order (shifted by one)",
    Fault.CHUNKED_PREFILL_PAST_OFF_BY_ONE:
        "a prefill chunk that continues an earlier chunk attends with a past length one short, so "
        "each of its queries misses its own key",
    Fault.NO_RECOMPUTE_ON_RESUME:
        "a request resumed after preemption recomputes only its prompt; the KV of its generated tokens "
        "(all but the last) is never rewritten",
    Fault.SEED_LEAK:
        "all seeded requests sampled in one step draw from the seed of the first of them",
    Fault.KV_WRITE_BLOCK_BOUNDARY_OFF_BY_ONE:
        "the first token of every KV block after the first is written into that block's last slot "
        "instead of its first (identical batched and alone: only the float64 reference sees it)",
    Fault.ABORT_LEAKS_BLOCKS:
        "aborting a request marks it finished but never returns its KV blocks to the pool",
    Fault.ABORT_AFTER_FINISH_REWRITES_FINISH:
        "aborting a request that has finished but is not yet released re-finishes it: its finish_reason "
        "becomes abort and a second final event is streamed",
    Fault.CHUNK_ORDER_DEPENDENT_LOGITS_ROW:
        "the logits row of a prefill chunk followed by a decode in the same step is read past its end, "
        "off by the following chunk's length (only orders other than fcfs put a decode after a prefill)",
    Fault.DECODE_CONTEXT_AFTER_PREFILL:
        "a decode that follows a prefill chunk in the same step attends with a context one token short, "
        "missing its own newest key (only orders other than fcfs put a decode after a prefill)",
    Fault.TOP_P_EXCLUDES_CROSSING_TOKEN:
        "the engine's nucleus stops before the token whose cumulative probability crosses top_p (identical "
        "batched and alone, and the reference does not sample: only the sampling oracle sees it)",
    Fault.ATTENTION_BOUND_INFLATING:
        "the attention softmax is exp2-based but drops the log2(e) factor, so every score is scaled by ln 2 "
        "(attention 31% too flat; identical batched and alone: only the float64 reference sees it, and a "
        "calibration measured with this engine would have adopted its error as float32 noise)",
    Fault.LOGPROB_NORMALIZATION:
        "the reported log-probabilities are normalized over the whole step's logits rows instead of per row "
        "(right for a batch of one; batched, every logprob is too low by the other rows' share)",
    Fault.HANG_UP_WITHOUT_ABORT:
        "the server notices that a streaming client hung up but never aborts its request: it runs to "
        "completion, holding its seat and KV blocks (serve layer)",
    Fault.PREFIX_HASH_NOT_CHAINED:
        "with prefix caching, a block is looked up by its own tokens only, not chained through the blocks "
        "before it: a request whose block repeats another's after a different prefix takes that KV",
    Fault.CACHED_BLOCK_NOT_REFCOUNTED:
        "with prefix caching, a cache hit on a block another request holds does not count the new holder: "
        "the first to finish frees the block while the other still reads it, and the next to allocate "
        "overwrites it",
    Fault.EVICTED_BLOCK_STILL_CACHED:
        "with prefix caching, a free cached block handed out for new tokens stays registered under its old "
        "hash: a later request with that prefix takes KV that has since been overwritten",
    Fault.CACHED_BLOCK_LEFT_ON_FREE_LIST:
        "with prefix caching, a cache hit on a block that waits on the free list counts its new holder but "
        "leaves it on the list: the next allocation hands it out again and overwrites KV still in use",
    Fault.CACHED_PREFIX_LAST_BLOCK_DROPPED:
        "with prefix caching, a hit of n blocks counts n blocks of tokens as computed but puts only the first "
        "n - 1 in the request's block table: the last block's positions map to a fresh block, whose stale "
        "contents the request attends to",
    Fault.CACHE_SALT_IGNORED:
        "with prefix caching, a request's cache_salt is left out of its block hashes: requests that chose "
        "different salts to keep their caches apart take each other's KV blocks (the answers stay right; the "
        "isolation the salt promises is gone)",
    Fault.CACHED_BLOCK_WITH_UNCOMPUTED_TOKEN:
        "with prefix caching, a block is registered as soon as the token that fills it is sampled, before "
        "its KV is computed: a finished request's answer ends in a token whose KV was never written, and a "
        "conversation resent with that answer appended takes the block and attends to the unwritten slot",
    Fault.PENALTY_COUNTS_BY_BATCH_ROW:
        "when a request with logits processors leaves, the last penalty row moves into its place but its "
        "output-token counts stay behind: the moved request is penalized for the departed one's tokens",
    Fault.LOGIT_BIAS_WRONG_ROW:
        "when a request with logits processors leaves, the last penalty row moves into its place but its "
        "logit bias stays behind: the moved request is biased as the departed one asked",
    Fault.PENALTY_COUNTS_LOST_ON_RESUME:
        "a request resumed after a preemption gets a penalty row that counts only the tokens it generates "
        "from then on: the frequency and presence penalties forget its earlier output",
    Fault.FREQUENCY_PENALTY_COUNTS_PROMPT:
        "the frequency and presence penalties count the prompt's tokens as output (identical batched and "
        "alone: only the float64 reference sees it)",
    Fault.REPETITION_PENALTY_IGNORES_SIGN:
        "the repetition penalty divides every seen logit by the penalty, so a negative one moves up instead of "
        "down (the original CTRL formula; identical batched and alone: only the float64 reference sees it)",
    Fault.MIN_TOKENS_COUNTS_PROMPT:
        "min_tokens is held against prompt plus output tokens, so a prompt longer than min_tokens lets eos and "
        "stop ids through at once (identical batched and alone: only the float64 reference sees it)",
    Fault.LOGITS_PROCESSORS_IGNORED:
        "the server accepts penalties, logit_bias and min_tokens and drops them before the engine sees the "
        "request: every answer is the plain one (serve layer)",
    Fault.PROMPT_LOGPROBS_SHIFTED_BY_ONE:
        "prompt logprobs are read from the row of each token's own position instead of the one before it: "
        "every prompt token gets the probability of the token after it (identical batched and alone: only "
        "the float64 reference sees it)",
    Fault.PROMPT_LOGPROBS_CHUNK_END_DROPPED:
        "the last row of a prefill chunk that does not end the prompt is taken for a sampling row and not "
        "scored: the prompt token after every chunk boundary gets no logprob (alone, a prompt that fits the "
        "token budget is one chunk)",
    Fault.PROMPT_LOGPROBS_RESCORED_ON_RESUME:
        "a request resumed after a preemption scores its recomputed prompt again: its prompt logprobs are "
        "reported twice",
    Fault.PROMPT_LOGPROBS_FROM_CACHED_BLOCKS:
        "with prefix caching, a request asking for prompt logprobs takes a cache hit like any other: the "
        "cached positions compute no rows, so their prompt tokens get no logprobs",
    Fault.PROMPT_LOGPROBS_ROWS_FROM_STEP_START:
        "the rows a chunk scores are indexed from the step's first row instead of the chunk's own first row: "
        "right while the chunk comes first in its step, another request's rows after that",
    Fault.N_CHILDREN_SHARE_SEED:
        "the n children of a request all sample with the request's seed instead of seed + k: every child "
        "gives the same answer (TensorRT-LLM shipped one seed shared across a batch)",
    Fault.FORKED_PARTIAL_BLOCK_SHARED:
        "a child forking a sibling's prompt shares the partial last block instead of copying it: both write "
        "their own next tokens into the same slots, each overwriting the other's KV",
    Fault.FORK_COPY_SKIPPED:
        "a child forking a sibling's prompt gets a fresh block for the partial last block but the copy of "
        "its KV is never made: the child attends to whatever that block held before",
    Fault.FORKED_BLOCKS_NOT_REFCOUNTED:
        "a child forking a sibling's prompt shares its full blocks without counting the new holder: the "
        "first of them to finish frees blocks the other still reads",
    Fault.FORK_BEFORE_PREFILL_DONE:
        "a child forks as soon as a sibling has computed anything, not its whole prompt: with the sibling's "
        "prefill chunked, the child takes blocks whose KV is not written yet",
    Fault.LAST_ADMISSION_SLOT_UNUSED:
        "the scheduler admits a waiting request only while fewer than max_num_seqs - 1 run: it never fills "
        "its last slot, and with one slot (a request alone, a server at max_num_seqs 1) it admits nothing and "
        "the request never ends (a liveness bug: the properties must fail on it within seconds, not hang)",
    Fault.PREEMPTED_REQUEUED_LAST:
        "a preempted request goes to the back of the waiting queue instead of its front: every request that "
        "arrived after it is admitted first, so under steady load it starves; each answer is still the "
        "request's answer alone (only the scheduling-policy check sees it)",
    Fault.BONUS_TOKEN_DUPLICATED:
        "speculative decoding: when every draft token is accepted, the bonus token from the last verification "
        "row is emitted twice (the second without KV behind it)",
    Fault.DRAFT_COMPARED_ONE_ROW_LATE:
        "speculative decoding: draft token j is verified against the row after the one that predicts it, so "
        "a draft is accepted or replaced by what the target says one position later",
    Fault.REJECTED_DRAFT_BLOCKS_KEPT:
        "speculative decoding: after a rejection the sequence's computed count is rolled back but the KV "
        "blocks it allocated for the rejected draft tokens stay in its block table (a leak the KV accounting "
        "sees; a long run exhausts the pool)",
    Fault.REJECTION_RESAMPLES_TARGET:
        "speculative decoding, seeded sampling: a rejected draft position draws again from the target's "
        "distribution instead of the residual (target minus draft): every token is still one the target "
        "could draw, but the rejected draft gets a second chance, so only a distribution test sees it",
    Fault.DRAFT_POSITIONS_OFF_ON_JOIN:
        "speculative decoding: the draft tokens of a request that is not the step's first chunk get RoPE "
        "positions one too low (counted from its input token instead of after it); alone it is right",
    Fault.DRAFT_PROBS_UNTEMPERED:
        "speculative decoding with a draft model, seeded sampling: the draft's probability that verification "
        "divides by (and the residual subtracts) is the draft model's plain softmax, without the request's "
        "temperature, top-k and top-p that the draft was drawn under: drafts are accepted at the wrong rate, "
        "every token still one the target could draw, so only a distribution test sees it",
    Fault.IMAGE_POSITIONS_FROM_STEP_ROWS:
        "images: a request's three position streams are read at its token indices plus the step rows before "
        "its chunk, as if counted over the packed step without restarting at each request: right whenever its "
        "chunk comes first in the step (alone always), shifted behind another request's chunk",
    Fault.IMAGE_FEATURES_FROM_NEIGHBOUR:
        "images: every image row of a step takes its features from the first request in the step that feeds "
        "image tokens (one feature buffer per step, not per request): right alone, a neighbour's image batched",
    Fault.DEEPSTACK_ONE_LAYER_LATE:
        "images: the tower's deepstack level n is added to the image rows after decoder layer n + 1 instead of "
        "n, the last level after no layer at all (identical batched and alone: only the float64 reference "
        "sees it)",
    Fault.TEXT_AFTER_IMAGE_ONE_POSITION:
        "images: the text after an image continues from the image's start plus one, as if the image were one "
        "token, instead of plus its longer merged side (identical batched and alone, and right for an image of "
        "one merged row and column: only the float64 reference sees it)",
    Fault.IMAGE_FEATURES_RESTART_AT_CHUNK:
        "images: a prefill chunk's image tokens take feature rows counted from the chunk's first image token "
        "instead of their place among the request's: right for a prompt fed in one chunk, and a chunk boundary "
        "inside or after an image gives the image tokens after it the first ones' features",
    Fault.ECHO_IGNORED:
        "the server accepts echo on completions and answers without the prompt's text before the answer's "
        "(serve layer)",
    Fault.SLOT_LEAK:
        "an admission slot is not returned when a request ends by a hang-up (abort) or an error, so "
        "leaked slots turn into refused requests (serve layer)",
}
FAULTS = {fault.value: DESCRIPTIONS[fault] for fault in Fault}  # name -> what the bug does


def resolve_fault(name: str | None, where: str = "fault") -> Fault | None:
    """The catalogued fault called `name` (None or "" for none); RefengineError naming `where` if unknown."""
    if not name:
        return None
    try:
        return Fault(name)
    except ValueError:
        raise RefengineError(f"{where}: unknown fault {name!r} (known: {', '.join(FAULTS)})") from None
