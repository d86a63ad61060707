"""Margins from the local model: where a server reports no logprobs (HF `transformers serve`, most
embedded servers) or no token ids, the float64 reference measures the top-2 margin at a divergence,
teacher-forced along the baseline answer's tokens. The margin rule then has a number to judge by
(0.032: rounding may flip it; 0.71: a bug) instead of holding every divergence strictly.

The margin comes from the model folder on the validating machine, through refengine.reference, never
from what the server sent: the code under test cannot move it. Where the server reports text only,
its answers are mapped to ids by the local tokenizer, and the mapping is used only where it is
unambiguous at the divergence (text_divergence says when it is not, and the verdict says so). A case
with images is measured by the reference with its images (vision_reference), as its golden answer was.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from ..model import Model
from ..reference import adjusted_logits, prompt_logits
from ..sampling import SamplingParams
from ..vision_reference import prompt_logits_with_images


@dataclass(frozen=True)
class TextDivergence:
    """Where two answer texts part, as a token index of the baseline text's local encoding."""
    index: int | None        # the first token of the baseline's encoding the other answer does not share
    baseline_ids: list[int]  # the baseline text's encoding (teacher-forced up to index)
    got_ids: list[int]       # the other text's encoding
    problem: str = ""        # why no index: the mapping is not unique there


def text_divergence(model: Model, baseline_text: str, got_text: str) -> TextDivergence:
    """Map both texts to ids with the model's tokenizer. The index is unique when each text's encoding
    decodes back to the text (round trip) and the two encodings' shared tokens are how the tokenizer
    encodes their shared text on its own: then no merge across the point where the answers part
    could have given the server other tokens before it."""
    tokenizer = model.tokenizer
    encoded = {}
    for name, text in (("baseline", baseline_text), ("received", got_text)):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if tokenizer.decode(ids, skip_special_tokens=False) != text:
            return TextDivergence(None, [], [], f"the {name} text does not round-trip through the local tokenizer")
        encoded[name] = ids
    want, got = encoded["baseline"], encoded["received"]
    index = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    shared = tokenizer.decode(want[:index], skip_special_tokens=False)
    if tokenizer.encode(shared, add_special_tokens=False) != want[:index]:
        return TextDivergence(None, want, got, f"the shared text's tokens depend on what follows it (token {index}): "
                                          f"which tokens the server chose before the divergence is not unique")
    return TextDivergence(index, want, got)


class LocalMargins:
    """The float64 reference's top-2 margin after a prompt and an answer prefix, on `model`."""

    def __init__(self, model: Model):
        self.model = model
        self.measured = 0
        self._memo: dict[tuple, float] = {}
        self._lock = threading.Lock()  # validate judges answers on its request threads: each margin once

    @property
    def fingerprint(self) -> str:
        return self.model.fingerprint

    def prompt_ids(self, case, reported: list[int] | None) -> list[int]:
        """The prompt as the server saw it: its own report, else the golden prompt ids, else the case
        rendered by the local tokenizer (its chat template for messages)."""
        if reported is not None:
            return list(reported)
        if getattr(case, "prompt_ids", None) is not None:
            return list(case.prompt_ids)
        return case.encode(self.model)

    def margin(self, prompt_ids: list[int], answer_ids: list[int], index: int,
               params: SamplingParams | None = None, images: tuple = ()) -> float:
        """Top-1 minus top-2 float64 logit at generated position `index`, given answer_ids[:index]; of
        the row `params`' logits processors make (reference.adjusted_logits), where they have any.
        `images`: the case's (check.case_images.CaseImage), one per run of image tokens in prompt_ids."""
        key = (tuple(prompt_ids), tuple(answer_ids[:index]), params, tuple(image.sha256 for image in images))
        with self._lock:
            if key not in self._memo:
                ids = list(prompt_ids) + list(answer_ids[:index])
                logits = prompt_logits_with_images(self.model, ids, [image.pixels() for image in images])[-1] \
                    if images else prompt_logits(self.model, ids)[-1]                                    # [vocab]
                if params is not None and params.processes_logits:
                    logits = adjusted_logits(logits, prompt_ids, answer_ids[:index], params,
                                             self.model.config.eos_token_ids)
                second, first = np.partition(logits, -2)[-2:]
                self._memo[key] = float(first - second)
                self.measured += 1
            return self._memo[key]
