"""Speculative decoding's own account, judged from the run: what a verifying decode says it did must
be what its request received.

A speculating engine reports, per verifying decode, how many draft tokens it fed and how many of them
it accepted (the trace's `draft` and `accepted`; vLLM's spec_decode counters sum the same). The
promise, read from the trace and the tokens each request got in each step (the outputs' step records),
never from the engine's counters alone:
- a decode feeds its input token and its drafts: num_tokens = 1 + draft;
- it accepts at most what it drafted;
- its request gets accepted + 1 tokens in that step (the accepted drafts, then the first token that is
  not a draft, or the bonus token after the last row), or accepted tokens where the request finished
  on its last accepted draft; a decode without drafts gets its one token;
- the engine's counters (LLMEngine.status) sum the trace: drafts (decodes that drafted), draft tokens,
  accepted tokens, and per position the decodes that accepted at least that many.
A bonus token emitted twice, or a token counted but never streamed, breaks it where no answer
comparison can see it: the same engine alone does the same. Guarded by tests/test_speculation.py.
"""
from __future__ import annotations

from collections import Counter

from ..engine import RequestOutput


def speculation_problems(outputs: dict[str, RequestOutput], trace: list[dict], status: dict) -> list[str]:
    """One line per verifying decode, or counter, that breaks the promise (see module); empty when the
    run kept it."""
    got = Counter((rid, record.step) for rid, out in outputs.items() for record in out.steps)
    problems = []
    drafts = draft_tokens = accepted_tokens = 0
    per_position = Counter()
    for entry in trace:
        for chunk in entry["scheduled"]:
            if "draft" not in chunk:
                continue
            rid, step, draft, accepted = chunk["id"], entry["step"], chunk["draft"], chunk["accepted"]
            where = f"step {step}, {rid}"
            if chunk["num_tokens"] != 1 + draft:
                problems.append(f"{where}: fed {chunk['num_tokens']} tokens for 1 input and {draft} drafts")
            if accepted > draft:
                problems.append(f"{where}: accepted {accepted} of {draft} draft tokens")
            received = got[rid, step]
            ended_on_draft = received == accepted and draft and outputs[rid].finish_step == step
            if received != accepted + 1 and not ended_on_draft:
                problems.append(f"{where}: accepted {accepted} of {draft} drafts but received {received} tokens "
                                f"(expected {accepted + 1})")
            drafts += draft > 0
            draft_tokens += draft
            accepted_tokens += accepted
            per_position.update(range(accepted))
    counted = (status.get("spec_decode_drafts", 0), status.get("spec_decode_draft_tokens", 0),
               status.get("spec_decode_accepted_tokens", 0))
    if counted != (drafts, draft_tokens, accepted_tokens):
        problems.append(f"counters: drafts, draft tokens, accepted tokens {list(counted)}, the trace sums "
                        f"{[drafts, draft_tokens, accepted_tokens]}")
    positions = status.get("spec_decode_accepted_per_position", [])
    if any(positions[i] != per_position[i] for i in range(len(positions))) or \
            any(i >= len(positions) for i in per_position):
        problems.append(f"counters: accepted per position {positions}, the trace sums "
                        f"{[per_position[i] for i in range(max(per_position, default=-1) + 1)]}")
    return problems
