"""Engine counters per step, and the summary the run output and the server report."""
from __future__ import annotations

from collections import Counter

from .scheduler import SchedulerOutput


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


class EngineMetrics:
    def __init__(self):
        self.prefill_steps = 0   # steps with at least one prefill chunk
        self.decode_steps = 0    # steps with only decodes
        self.mixed_steps = 0     # steps with prefill chunks and decodes together
        self.idle_steps = 0
        self.preemptions = 0
        self.batch_sizes: Counter[int] = Counter()
        self.tokens_computed = 0
        self.step_time_s = 0.0

    def record_step(self, output: SchedulerOutput, seconds: float) -> None:
        phases = {c.phase for c in output.chunks}
        if not phases:
            self.idle_steps += 1
        elif "prefill" in phases:
            self.prefill_steps += 1
            self.mixed_steps += "decode" in phases
        else:
            self.decode_steps += 1
        if phases:
            self.batch_sizes[len(output.chunks)] += 1
        self.preemptions += len(output.preempted)
        self.tokens_computed += output.num_tokens
        self.step_time_s += seconds

    def summary(self, outputs) -> dict:
        outputs = list(outputs)
        return {
            "prefill_steps": self.prefill_steps, "decode_steps": self.decode_steps,
            "mixed_steps": self.mixed_steps, "idle_steps": self.idle_steps, "preemptions": self.preemptions,
            "max_batch_size": max(self.batch_sizes, default=0),
            "batch_size_histogram": {str(size): n for size, n in sorted(self.batch_sizes.items())},
            "tokens_computed": self.tokens_computed,
            "tokens_generated": sum(len(o.token_ids) for o in outputs),
            "step_time_s": self.step_time_s,
            "ttft_steps_mean": _mean(o.ttft_steps for o in outputs),
            "ttft_s_mean": _mean(o.ttft_s for o in outputs),
            "tpot_steps_mean": _mean(o.tpot_steps for o in outputs),
            "tpot_s_mean": _mean(o.tpot_s for o in outputs),
        }


class SpeculationCounters:
    """Speculative decoding's acceptance, counted as vLLM counts it (its spec_decode counters): a draft
    is one verifying decode that proposed at least one token; accepted_per_position[i] counts the
    drafts whose token i was accepted. A verifying decode yields accepted + 1 tokens unless its request
    finished on an accepted draft (suite/test_speculation.py holds the counts to the streamed tokens)."""

    def __init__(self, num_speculative_tokens: int):
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens

    def record(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    def status(self) -> dict:
        return {"spec_decode_drafts": self.drafts, "spec_decode_draft_tokens": self.draft_tokens,
                "spec_decode_accepted_tokens": self.accepted_tokens,
                "spec_decode_accepted_per_position": list(self.accepted_per_position)}
