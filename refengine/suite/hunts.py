"""Which property of the shipped suite hunts each catalogued fault, and one example of that property
with a fault switched on. The fault catalog's negative control (tests/test_invariants_faults.py) and the
bench's fault-power scenario (refengine.bench.faults) both read this, so both hunt as the suite's
properties do: their corners first (corner_examples), then draws from their strategies.

A fault that only the serve layer shows, or that is not schedule-shaped, names the property that
catches it elsewhere (CAUGHT_BY) and has no hunt here (HUNTS). The state machine also catches the faults
of STATE_MACHINE_CATCHES by its own invariants (the text its failure matches).
"""
from __future__ import annotations

from random import Random
from typing import Callable

from hypothesis import find, settings
from hypothesis import strategies as st

from ..strategies import shared_prefix_schedules, tiny_model_names
from .corners import corners
from .harness import PropertyFailure, any_mode_schedules, check, greedy_schedules, invariant_schedules, other_budgets
from .test_finish import check_finish, finish_schedules
from .test_speculation import speculating_schedules

MAX_SHRUNK_REQUESTS = 3  # what the catalog promises a hunt shrinks a failure to


class SmallEnough(BaseException):
    """Carries the first failing example that is already as small as a hunt asserts (and its failure, where
    the hunt keeps it), out of Hypothesis (a BaseException is not a test failure to it, so it neither shrinks
    nor replays it). Shrinking from there only makes the example smaller and costs most of a hunt: the
    shrinker reaching an example this small within the budget is what the hunt shows."""

    def __init__(self, example, failure: PropertyFailure | None = None):
        super().__init__()
        self.example, self.failure = example, failure


# property -> (what Hypothesis draws: (model, schedule[, other budget]), one run of it with a fault on)
HUNTS = {
    "invariant-mode-is-exact": (
        st.tuples(tiny_model_names(), invariant_schedules),
        lambda example, fault: check("invariant-mode-is-exact", *example, fault=fault)),
    "chunking-consistency": (
        st.tuples(tiny_model_names(), any_mode_schedules, other_budgets),
        lambda example, fault: check("chunking-consistency", example[0], example[1], against="budget",
                                     other_budget=example[2], fault=fault)),
    "reference-agreement": (
        st.tuples(tiny_model_names(), greedy_schedules),
        lambda example, fault: check("reference-agreement", *example, against="reference", fault=fault)),
    "finish-semantics": (
        st.tuples(tiny_model_names(), finish_schedules()),
        lambda example, fault: check_finish("finish-semantics", *example, fault=fault)),
    "speculation-changes-no-greedy-answer": (
        st.tuples(tiny_model_names(), speculating_schedules),
        lambda example, fault: check("speculation-changes-no-greedy-answer", *example, against="unspeculated",
                                     fault=fault)),
    "prefix-caching-is-exact": (
        st.tuples(tiny_model_names(), shared_prefix_schedules("invariant", scoring=None)),
        lambda example, fault: check("prefix-caching-is-exact", *example, fault=fault)),
}
CAUGHT_BY = {
    "stale-block-table-after-preemption": "invariant-mode-is-exact",
    "position-off-by-one-on-join": "invariant-mode-is-exact",
    "logits-rows-misassigned-after-leave": "invariant-mode-is-exact",
    "chunked-prefill-past-off-by-one": "chunking-consistency",
    "no-recompute-on-resume": "invariant-mode-is-exact",
    "seed-leak": "invariant-mode-is-exact",
    "kv-write-block-boundary-off-by-one": "reference-agreement",
    "abort-leaks-blocks": "invariant-mode-is-exact",
    "abort-after-finish-rewrites-finish": "finish-semantics",
    "chunk-order-dependent-logits-row": "invariant-mode-is-exact",
    "decode-context-after-prefill": "invariant-mode-is-exact",
    "attention-bound-inflating": "reference-agreement",
    "logprob-normalization": "invariant-mode-is-exact",
    "top-p-excludes-crossing-token": "sampling-distribution",  # not schedule-shaped: tests/test_sampling_oracle.py
    "hang-up-without-abort": "http-hang-ups-are-aborts",  # serve layer: caught by tests/test_invariants_http.py
    "slot-leak": "http-server-drains",  # serve layer: caught by tests/test_invariants_http.py
    "prefix-hash-not-chained": "prefix-caching-is-exact",
    "cached-block-not-refcounted": "prefix-caching-is-exact",
    "evicted-block-still-cached": "prefix-caching-is-exact",
    "cached-block-left-on-free-list": "prefix-caching-is-exact",
    "cached-prefix-last-block-dropped": "prefix-caching-is-exact",
    "cache-salt-ignored": "prefix-caching-is-exact",
    "cached-block-with-uncomputed-token": "prefix-caching-is-exact",
    "penalty-counts-by-batch-row": "invariant-mode-is-exact",
    "logit-bias-wrong-row": "invariant-mode-is-exact",
    "penalty-counts-lost-on-resume": "invariant-mode-is-exact",
    "frequency-penalty-counts-prompt": "reference-agreement",
    "repetition-penalty-ignores-sign": "reference-agreement",
    "min-tokens-counts-prompt": "reference-agreement",
    "logits-processors-ignored": "http-applies-what-it-accepts",  # serve layer: tests/test_invariants_http.py
    "prompt-logprobs-shifted-by-one": "reference-agreement",
    "prompt-logprobs-chunk-end-dropped": "chunking-consistency",
    "prompt-logprobs-rescored-on-resume": "invariant-mode-is-exact",
    "prompt-logprobs-from-cached-blocks": "prefix-caching-is-exact",
    "prompt-logprobs-rows-from-step-start": "invariant-mode-is-exact",
    "echo-ignored": "http-applies-what-it-accepts",  # serve layer: tests/test_invariants_http.py
    "n-children-share-seed": "invariant-mode-is-exact",
    "forked-partial-block-shared": "invariant-mode-is-exact",
    "fork-copy-skipped": "invariant-mode-is-exact",
    "forked-blocks-not-refcounted": "invariant-mode-is-exact",
    "fork-before-prefill-done": "invariant-mode-is-exact",
    "last-admission-slot-unused": "invariant-mode-is-exact",
    "preempted-requeued-last": "invariant-mode-is-exact",
    "bonus-token-duplicated": "speculation-changes-no-greedy-answer",
    "draft-compared-one-row-late": "speculation-changes-no-greedy-answer",
    "rejected-draft-blocks-kept": "speculation-changes-no-greedy-answer",
    "rejection-resamples-target": "speculative-sampling-distribution",  # not schedule-shaped: tests/test_speculation.py
    "draft-positions-off-on-join": "invariant-mode-is-exact",
    "draft-probs-untempered": "speculative-sampling-distribution",  # not schedule-shaped: tests/test_speculation.py
    "image-positions-from-step-rows": "invariant-mode-is-exact",
    "image-features-from-neighbour": "invariant-mode-is-exact",
    "deepstack-one-layer-late": "reference-agreement",
    "text-after-image-one-position": "reference-agreement",
    "image-features-restart-at-chunk": "chunking-consistency",
}
STATE_MACHINE_CATCHES = {"abort-leaks-blocks": "KV accounting", "stale-block-table-after-preemption": "KV accounting",
                         "evicted-block-still-cached":
                             "holds other KV than when it was registered|reads KV computed for something else",
                         "forked-partial-block-shared":
                             "a full block of the prompt siblings forked|holds other KV|reads KV computed for",
                         "forked-blocks-not-refcounted": "KV accounting",
                         "cache-salt-ignored": "reads KV computed for something else",
                         "last-admission-slot-unused": "no progress",
                         "preempted-requeued-last": "scheduling policy"}


def corner_examples(prop: str) -> list[tuple]:
    """What the hunt of `prop` tries before drawing: its corners (suite.corners), the @examples the suite's
    test of it runs first."""
    return [tuple(args.values()) for args in corners(prop)]


def hunt(fault: str, budget: settings, rng: Random | None = None,
         on_failure: Callable[[tuple], None] = lambda example: None):
    """One hunt for `fault` as the suite's property runs (its corners first, then `budget`'s draws, `rng`
    seeding them): the first failing example of at most MAX_SHRUNK_REQUESTS requests; None where examples
    failed but none that small (a corner's, which the suite does not shrink, or the shrinker's last);
    hypothesis.errors.NoSuchExample where none failed. `on_failure(example)` sees every failing example."""
    strategy, run = HUNTS[CAUGHT_BY[fault]]

    def fails(example) -> bool:
        try:
            run(example, fault)
        except PropertyFailure:
            on_failure(example)
            if len(example[1]["requests"]) <= MAX_SHRUNK_REQUESTS:
                raise SmallEnough(example) from None
            return True
        return False

    try:
        if any(fails(corner) for corner in corner_examples(CAUGHT_BY[fault])):  # the suite stops at a failing @example
            return None
        find(strategy, fails, settings=budget, random=rng)
    except SmallEnough as small:
        return small.example
    return None


def hunted() -> list[str]:
    """The faults a schedule property of HUNTS hunts, in catalog order."""
    return [fault for fault, prop in CAUGHT_BY.items() if prop in HUNTS]
