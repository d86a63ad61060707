"""What a request's output must be, defined apart from refengine/sampling.py, which the engine and the
float64 reference both call: a rule wrong there moves both sides of every comparison at once, so no
property could see it (check/sampling_oracle.py does the same for the sampling distribution).

- Finish (OpenAI and vLLM semantics): a request ends at the first generated token that is an eos id
  (unless `ignore_eos`), one of its `stop_token_ids`, or that completes text containing one of its
  `stop` strings — "stop"; else once it has `max_tokens` tokens — "length". None of its first
  `min_tokens` tokens stops it (vLLM: they cannot be a stop id, and a stop string counts only where it
  ends past their text). The eos or stop id is kept among its tokens; the text is cut before the
  earliest stop string that counts.
- A token's log-probability: its logit minus the logsumexp of its row, in float64.
The suite's streaming property (suite.harness.check_streaming) holds the engine's finish and text to
these; the comparisons of reported logprobs with a baseline row (check.comparison) use this one.
Guarded by tests/test_mutants.py: mutants of refengine/sampling.py's rules fail the shipped properties.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def settled_length(text: str) -> int:
    """How many characters of a decode are settled: all but a trailing incomplete character (U+FFFD)."""
    return len(text.rstrip("\ufffd"))


def stop_cut(text: str, stops: Sequence[str], after: int = 0) -> str:
    """`text` up to the first position at which one of `stops` begins and ends past character `after`
    (the text of the first min_tokens tokens, which no stop string may end in); all of it where none does."""
    for position in range(len(text)):
        if any(stop and text.startswith(stop, position) and position + len(stop) > after for stop in stops):
            return text[:position]
    return text


def expected_finish(token_ids: Sequence[int], decode: Callable[[list[int]], str], params,
                    eos_token_ids) -> tuple[int, str | None]:
    """(how many of `token_ids` the request keeps, its finish reason) when it generates `token_ids` in
    order under `params` (max_tokens, min_tokens, stop, stop_token_ids, ignore_eos); None where they run
    out first.
    `decode`: ids -> text (settled text: a stop string never matches a half-decoded character)."""
    after = settled_length(decode(list(token_ids[:params.min_tokens]))) if params.min_tokens else 0
    for count, token in enumerate(token_ids, start=1):
        if count <= params.min_tokens:
            if count == params.max_tokens:
                return count, "length"
            continue
        if (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return count, "stop"
        if params.stop and stop_cut(decode(list(token_ids[:count])), params.stop, after) != \
                decode(list(token_ids[:count])):
            return count, "stop"
        if count == params.max_tokens:
            return count, "length"
    return len(token_ids), None


def log_softmax(logits) -> np.ndarray:
    """Each logit minus the row's logsumexp, in float64."""
    row = np.asarray(logits, dtype=np.float64)
    return row - np.logaddexp.reduce(row)
