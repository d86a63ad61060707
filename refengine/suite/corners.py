"""Known-hard corners: small schedules every run of a property tries first (as Hypothesis `@example`s),
so that what random draws reach only now and then is checked on every run. Each is a situation, not a
bug: a request carrying per-request state preempted and resumed, a prompt scored while another request
runs, n answers forked beside other requests and from a chunked prefill, a preempted request and a later
arrival both waiting, an abort a step after arrival,
a cache hit on a running request's prompt (with and without prompt logprobs), the same prompt under
another cache_salt, a conversation's next turn,
draft tokens verified, all accepted and some rejected, behind another request's chunk, two requests'
images fed in one step behind a text request with a chunk boundary inside an image, text after a
three-row image.
A corner runs on the suite's base model unless it names another (a top-level "model": a vision-language
one for images); a chunking-consistency corner also gives its "other_budget".
Random runs of the dev profile's budget reach them only now and then (refengine bench --scenario faults;
the performance pages have the figures); the fault hunts (suite.hunts) try them first too.
"""
from __future__ import annotations

import copy

from hypothesis import example

from ..strategies.models import DEFAULT_MODEL, VISION_MODEL


def _engine(**settings) -> dict:
    return {"mode": "invariant", "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 128, **settings}


SAMPLED = {"temperature": 1.5, "top_k": 0, "top_p": 1.0}
LOOPING = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # prompt lookup proposes 7, 8, 5 after it


def _image(at: int, height: int, width: int, seed: int) -> dict:  # as strategies.schedules.IMAGE draws one
    return {"at": at, "height": height, "width": width, "seed": seed}


# Behind a one-token text request, two requests with a 16x16 image (4 image tokens) after their first
# token, 8 tokens each: a budget of 12 feeds all of the first and the second's first image token in step 0,
# the rest of the second's image in step 1
IMAGES_IN_ONE_STEP = {"model": VISION_MODEL, "engine": _engine(block_size=2, num_blocks=24, max_num_batched_tokens=12),
                      "requests": [
    {"id": "r0", "prompt_ids": [0], "arrival_step": 0, "max_tokens": 4},
    {"id": "r1", "prompt_ids": [0, 0], "arrival_step": 0, "max_tokens": 4, "images": [_image(1, 16, 16, 1)]},
    {"id": "r2", "prompt_ids": [0, 0], "arrival_step": 0, "max_tokens": 4, "images": [_image(1, 16, 16, 2)]}]}

CORNERS = {  # property -> {situation: schedule}
    "invariant-mode-is-exact": {
        # two requests fill a pool of 6 one-token blocks while decoding: the later one, with penalties and
        # prompt logprobs, is preempted and resumes by recomputing
        "stateful-request-resumed": {"engine": _engine(block_size=1, num_blocks=6), "requests": [
            {"id": "r0", "prompt_ids": [0], "arrival_step": 0, "max_tokens": 4},
            {"id": "r1", "prompt_ids": [0, 0], "arrival_step": 0, "max_tokens": 4, "frequency_penalty": -2.0,
             "presence_penalty": 2.0, "prompt_logprobs": 0}]},
        "scoring-request-joins": {"engine": _engine(block_size=1, num_blocks=6), "requests": [
            {"id": "r0", "prompt_ids": [0], "arrival_step": 0, "max_tokens": 4},
            {"id": "r1", "prompt_ids": [0, 0], "arrival_step": 1, "max_tokens": 4, "prompt_logprobs": 0}]},
        "answers-forked-beside-another": {"engine": _engine(block_size=3, num_blocks=4), "requests": [
            {"id": "r0", "prompt_ids": [0], "arrival_step": 0, "max_tokens": 4},
            {"id": "r1", "prompt_ids": [0, 0], "arrival_step": 0, "max_tokens": 4, "n": 2,
             "sampling": {**SAMPLED, "seed": 1}}]},
        "answers-forked-from-a-chunked-prefill": {
            "engine": _engine(block_size=2, num_blocks=19, max_num_batched_tokens=32), "requests": [
                {"id": "r0", "prompt_ids": [0], "arrival_step": 0, "max_tokens": 4},
                {"id": "r1", "prompt_ids": [0], "arrival_step": 0, "max_tokens": 4},
                {"id": "r2", "prompt_ids": [0] * 32, "arrival_step": 0, "max_tokens": 4, "n": 2,
                 "sampling": {**SAMPLED, "seed": 2}}]},
        # three plain requests on a pool of 5 one-token blocks: the second is preempted while the third waits,
        # and must be readmitted before it (check.policy)
        "preempted-ahead-of-a-waiting-request": {"engine": _engine(block_size=1, num_blocks=5), "requests": [
            {"id": f"r{n}", "prompt_ids": [0], "arrival_step": 0, "max_tokens": 4} for n in range(3)]},
        "aborted-a-step-after-arrival": {"engine": _engine(block_size=1, num_blocks=9), "requests": [
            {"id": "r0", "prompt_ids": [0], "arrival_step": 0, "abort_step": 1, "max_tokens": 8}]},
        # a request whose prompt repeats itself verifies drafts while it is not the step's first chunk
        "images-fed-in-one-step": IMAGES_IN_ONE_STEP,
        "drafts-verified-behind-another": {"engine": _engine(block_size=2, num_blocks=16, num_speculative_tokens=3),
                                           "requests": [
            {"id": "r0", "prompt_ids": [0], "arrival_step": 0, "max_tokens": 6},
            {"id": "r1", "prompt_ids": LOOPING, "arrival_step": 0, "max_tokens": 6}]},
    },
    "chunking-consistency": {
        "image-split-by-a-chunk": {**IMAGES_IN_ONE_STEP, "other_budget": 64},
    },
    "reference-agreement": {
        # a 24x16 image (3 rows of 2 merged patches) between two text tokens
        "text-after-an-image": {"model": VISION_MODEL, "engine": _engine(block_size=2, num_blocks=12), "requests": [
            {"id": "r0", "prompt_ids": [0, 0], "arrival_step": 0, "max_tokens": 4, "images": [_image(1, 24, 16, 1)]}]},
    },
    "speculation-changes-no-greedy-answer": {
        # prompts that repeat themselves: r0's drafts all accepted, r1's three drafts one accepted, on one-token
        # blocks (the rejected ones held blocks of their own)
        "drafts-accepted-and-rejected": {"engine": _engine(block_size=1, num_blocks=40, num_speculative_tokens=3),
                                         "requests": [
            {"id": "r0", "prompt_ids": LOOPING, "arrival_step": 0, "max_tokens": 8},
            {"id": "r1", "prompt_ids": [4] * 8, "arrival_step": 0, "max_tokens": 8}]},
    },
    "finish-semantics": {
        # an abort that arrives after the request finished by max_tokens, before the run ends
        "aborted-after-it-finished": {"engine": _engine(block_size=2, num_blocks=8), "requests": [
            {"id": "r0", "prompt_ids": [0], "arrival_step": 0, "max_tokens": 2, "abort_step": 4},
            {"id": "r1", "prompt_ids": [0, 0], "arrival_step": 0, "max_tokens": 8}]},
    },
    "prefix-caching-is-exact": {
        "hit-on-a-running-prompt": {"engine": _engine(block_size=1, num_blocks=6, enable_prefix_caching=True),
                                    "requests": [
            {"id": "r0", "prompt_ids": [0], "arrival_step": 0, "max_tokens": 4},
            {"id": "r1", "prompt_ids": [0, 0], "arrival_step": 1, "max_tokens": 4}]},
        "scoring-request-on-a-running-prompt": {
            "engine": _engine(block_size=1, num_blocks=6, enable_prefix_caching=True), "requests": [
                {"id": "r0", "prompt_ids": [0], "arrival_step": 0, "max_tokens": 4},
                {"id": "r1", "prompt_ids": [0, 0], "arrival_step": 1, "max_tokens": 4, "prompt_logprobs": 1}]},
        # the same prompt under two salts, the second arriving once the first's blocks are registered
        "same-prompt-another-salt": {"engine": _engine(block_size=2, num_blocks=16, enable_prefix_caching=True),
                                     "requests": [
            {"id": "r0", "prompt_ids": [0] * 5, "arrival_step": 0, "max_tokens": 4, "cache_salt": "a"},
            {"id": "r1", "prompt_ids": [0] * 5, "arrival_step": 1, "max_tokens": 4, "cache_salt": "b"}]},
        # the first answer ends exactly at a block edge (1 + 5 tokens, blocks of 2)
        "next-turn-after-a-block-edge": {"engine": _engine(block_size=2, num_blocks=5, enable_prefix_caching=True),
                                         "requests": [
            {"id": "r0", "prompt_ids": [0], "arrival_step": 0, "max_tokens": 5},
            {"id": "r1", "prompt_ids": [0], "arrival_step": 0, "max_tokens": 4, "continues": "r0"}]},
    },
}


def corners(prop: str) -> list[dict]:
    """The corners of property `prop` as its test's arguments: `model`, `schedule` (a fresh copy: a check
    may rewrite its schedule) and, where the corner gives one, `other_budget`."""
    out = []
    for corner in copy.deepcopy(list(CORNERS.get(prop, {}).values())):
        args = {"model": corner.pop("model", DEFAULT_MODEL), "schedule": corner}
        if "other_budget" in corner:
            args["other_budget"] = corner.pop("other_budget")
        out.append(args)
    return out


def with_corners(prop: str):
    """Decorate a property's @given test (parameters `model`, `schedule`[, `other_budget`]) with `prop`'s
    corners."""
    def decorate(test):
        for args in reversed(corners(prop)):  # decorators apply bottom-up: tried in the listed order
            test = example(**args)(test)
        return test
    return decorate
