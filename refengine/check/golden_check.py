"""`golden check`: the float32 engine replays every case of a golden file as one random join/leave
schedule (requests arrive at random steps, share steps with whoever is running, leave when done;
run by check.driver) and each answer is judged by the margin rule against the float64 golden tokens.
An image case's request carries its images (decoded from the golden file's verified bytes) with its
prompt ids, which hold each image's run of placeholder tokens.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from ..engine import EngineConfig
from ..model import Model
from ..sampling import SamplingParams
from .driver import run_batched
from .golden import Golden
from .margin_rule import Verdict, describe, judge_ids
from .schedule import Schedule, ScheduledRequest


@dataclass(frozen=True)
class CheckResult:
    golden: Golden
    config: EngineConfig
    seed: int
    arrivals: dict[str, int]
    verdicts: dict[str, Verdict]
    trace: list[dict]
    engine_failure: str | None = None

    @property
    def passed(self) -> bool:
        return self.engine_failure is None and all(v.passed for v in self.verdicts.values())

    @property
    def batch_sizes(self) -> list[int]:
        """Per step that ran anything (steps before an arrival are idle)."""
        return [len(step["scheduled"]) for step in self.trace if step["scheduled"]]

    def count(self, kind: str) -> int:
        return sum(v.kind == kind for v in self.verdicts.values())

    def report(self, decode=None) -> str:
        tolerance = self.golden.tolerance
        compared = sum(len(c.token_ids) if self.verdicts[c.id].kind == "match" else self.verdicts[c.id].index
                       for c in self.golden.cases)
        sizes = self.batch_sizes
        lines = [
            f"golden check {self.golden.path}: mode {self.config.mode}, seed {self.seed}, "
            f"max_num_seqs {self.config.max_num_seqs}, max_num_batched_tokens {self.config.max_num_batched_tokens}"
            + (f", injected fault {self.config.fault}" if self.config.fault else ""),
            f"  {len(self.verdicts)} cases, {compared} tokens compared, {len(sizes)} engine steps, "
            f"max batch {max(sizes)}, {sum(s > 1 for s in sizes)} steps with more than one sequence",
            f"  match {self.count('match')}, explained {self.count('explained')}, "
            f"diverged {self.count('diverged')} (tolerance {tolerance:.6g})"]
        lines += ["  " + describe(v, "got", "golden", decode).replace("\n", "\n  ")
                  for v in self.verdicts.values() if v.kind != "match"]
        if self.engine_failure:
            lines.append(f"  engine failure: {self.engine_failure}")
        lines.append("PASS" if self.passed else "FAIL")
        return "\n".join(lines)


def random_arrivals(golden: Golden, seed: int) -> dict[str, int]:
    """Arrival steps spread over the longest answer, so short requests join and leave long ones."""
    rng = random.Random(seed)
    horizon = max(c.max_tokens for c in golden.cases)
    return {c.id: rng.randrange(horizon) for c in golden.cases}


def check(golden: Golden, model: Model, mode: str = "fast", seed: int = 0, max_num_seqs: int = 4,
          max_num_batched_tokens: int = 32, fault: str | None = None) -> CheckResult:
    golden.require_model(model)
    config = EngineConfig(mode=mode, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          fault=fault)
    arrivals = random_arrivals(golden, seed)
    requests = [ScheduledRequest(c.id, {"prompt_ids": c.prompt_ids}, SamplingParams(max_tokens=c.max_tokens),
                                 arrivals[c.id], None, images=c.images) for c in golden.cases]
    engine, failure = run_batched(model, Schedule(str(golden.path), config, requests), config, keep_logits=False)
    outputs = engine.outputs()
    verdicts = {c.id: judge_ids(c, outputs[c.id].token_ids, outputs[c.id].text, golden.tolerance)
                for c in golden.cases if c.id in outputs}
    return CheckResult(golden, engine.config, seed, arrivals, verdicts, engine.trace, failure)
