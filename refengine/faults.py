"""The fault catalog: realistic continuous-batching bugs the engine can switch on by name.

They are the invariants suite's negative control: with any one of them on, `pytest -m invariants`
must fail and shrink the failure to a small schedule. Each is injected at the one code point where
the real bug would live (grep the engine for its name). Select one with EngineConfig(fault=NAME) or,
for the CLI and the server, the environment variable REFENGINE_FAULT=NAME; `refengine faults`
lists them.
"""
from __future__ import annotations

import os

from .errors import RefengineError

ENV_VAR = "REFENGINE_FAULT"

FAULTS = {
    "stale-block-table-after-preemption":
        "preemption returns a sequence's KV blocks to the pool but leaves their ids in its block table; "
        "on resume it writes and reads blocks that now belong to other sequences",
    "position-off-by-one-on-join":
        "a request admitted while others are running gets RoPE positions shifted by one in its first "
        "prefill chunk",
    "logits-rows-misassigned-after-leave":
        "in the step after a request leaves the batch, sampled logits rows are handed out in the "
        "pre-compaction order (shifted by one)",
    "chunked-prefill-past-off-by-one":
        "a prefill chunk that continues an earlier chunk attends with a past length one short, so "
        "each of its queries misses its own key",
    "no-recompute-on-resume":
        "a request resumed after preemption recomputes only its prompt; the KV of its generated tokens "
        "(all but the last) is never rewritten",
    "seed-leak":
        "all seeded requests sampled in one step draw from the seed of the first of them",
    "kv-write-block-boundary-off-by-one":
        "the first token of every KV block after the first is written into that block's last slot "
        "instead of its first (identical batched and alone: only the float64 reference sees it)",
    "abort-leaks-blocks":
        "aborting a request marks it finished but never returns its KV blocks to the pool",
}


def check_fault(name: str | None, where: str = "fault") -> str | None:
    if name is not None and name not in FAULTS:
        raise RefengineError(f"{where}: unknown fault {name!r} (known: {', '.join(FAULTS)}; `refengine faults`)")
    return name


def fault_from_env() -> str | None:
    """The fault named by REFENGINE_FAULT (unset or empty: none)."""
    return check_fault(os.environ.get(ENV_VAR) or None, ENV_VAR)
