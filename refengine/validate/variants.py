"""The variants of a case: the same prompt sent with the request surface beyond plain greedy decoding
(penalties, logit_bias with min_tokens, prompt logprobs, n). No golden answer has them, so each is judged
only against the same server's answer to it alone (the serial baseline): a server that keeps a request's
penalty counts, bias, prompt positions or forked answers in batch state it gets wrong is caught where the
variant runs beside others. validate's load sends them (plan: Settings.variant_rate), and so does the
HTTP property `test_answers_equal_the_servers_own_alone_answers`, beside the golden cases.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

# A variant's answer is cut at this many tokens: per-request state goes wrong in the steps after a
# neighbour joins or leaves, which a short answer has as well as a long one; a long answer's variant
# only adds time (each is sent alone too).
VARIANT_MAX_TOKENS = 32


@dataclass(frozen=True)
class ProcessedCase:
    """A case sent with extra fields (logits processors, prompt logprobs, n): no golden answer has them, so
    it is judged only against the same server's answer to it alone (the serial baseline). Everything but its
    id and max_tokens is its base case's; its id is `<base id>+<variant>` (validate.repro resolves it back:
    variants())."""
    base: object  # check.golden.GoldenCase or PromptCase
    variant: str
    fields_json: str  # the request fields it adds, as JSON (hashable)
    max_tokens: int  # its base's, at most VARIANT_MAX_TOKENS

    @property
    def id(self) -> str:
        return f"{self.base.id}+{self.variant}"

    @property
    def fields(self) -> dict:
        return json.loads(self.fields_json)

    def __getattr__(self, name):
        if name == "base":  # not set yet (a copy being built): no base to ask
            raise AttributeError(name)
        return getattr(self.base, name)


def variants(case) -> list[ProcessedCase]:
    """The processed variants of `case`: "penalties" (frequency, presence and repetition penalties),
    "prompt-logprobs" (vLLM's prompt_logprobs, 2 alternatives: the serial baseline compares them too), "n"
    (two answers, each judged against the alone answer's at its index), and
    where its golden answer is known, "bias" (-100 on the golden answer's first token, and min_tokens 2:
    a different answer that must still be two tokens long at least). Each asks for at most
    VARIANT_MAX_TOKENS tokens."""
    most = min(case.max_tokens, VARIANT_MAX_TOKENS)
    out = [ProcessedCase(case, "penalties", json.dumps({"frequency_penalty": 1.5, "presence_penalty": 0.5,
                                                        "repetition_penalty": 1.3}), most),
           ProcessedCase(case, "prompt-logprobs", json.dumps({"prompt_logprobs": 2}), most),
           ProcessedCase(case, "n", json.dumps({"n": 2}), most)]
    answer = getattr(case, "token_ids", None)
    if answer:
        out.append(ProcessedCase(case, "bias", json.dumps({"logit_bias": {str(answer[0]): -100.0},
                                                           "min_tokens": min(2, most)}), most))
    return out
