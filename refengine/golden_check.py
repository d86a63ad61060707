"""`golden check`: the float32 engine replays every case of a golden file as one random join/leave
schedule (requests arrive at random steps, share steps with whoever is running, leave when done)
and each answer is judged by the margin rule against the float64 golden tokens.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from .engine import EngineConfig, LLMEngine
from .golden import Golden
from .margin_rule import Verdict, describe, judge_ids
from .model import Model
from .sampling import SamplingParams


@dataclass(frozen=True)
class CheckResult:
    golden: Golden
    config: EngineConfig
    seed: int
    arrivals: dict[str, int]
    verdicts: dict[str, Verdict]
    trace: list[dict]

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts.values())

    @property
    def batch_sizes(self) -> list[int]:
        return [len(step["scheduled"]) for step in self.trace]

    def count(self, kind: str) -> int:
        return sum(v.kind == kind for v in self.verdicts.values())

    def report(self, decode=None) -> str:
        tolerance = self.golden.tolerance
        compared = sum(len(c.token_ids) if self.verdicts[c.id].kind == "match" else self.verdicts[c.id].step
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
        lines += ["  " + describe(case_id, v, tolerance, decode).replace("\n", "\n  ")
                  for case_id, v in self.verdicts.items() if v.kind != "match"]
        lines.append("PASS" if self.passed else "FAIL")
        return "\n".join(lines)


def random_arrivals(golden: Golden, seed: int) -> dict[str, int]:
    """Arrival steps spread over the longest answer, so short requests join and leave long ones."""
    rng = random.Random(seed)
    horizon = max(c.max_tokens for c in golden.cases)
    return {c.id: rng.randrange(horizon) for c in golden.cases}


def check(golden: Golden, model: Model, mode: str = "fast", seed: int = 0, max_num_seqs: int = 4,
          max_num_batched_tokens: int = 32) -> CheckResult:
    golden.require_model(model)
    config = EngineConfig(mode=mode, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    engine = LLMEngine(model, config)
    arrivals = random_arrivals(golden, seed)
    pending = sorted(golden.cases, key=lambda c: arrivals[c.id])
    clock = 0
    while pending or engine.has_unfinished():
        if not engine.has_unfinished():  # idle steps batch nothing: jump to the next arrival
            clock = max(clock, arrivals[pending[0].id])
        while pending and arrivals[pending[0].id] <= clock:
            case = pending.pop(0)
            engine.add_request(case.id, case.prompt_ids, params=SamplingParams(max_tokens=case.max_tokens))
        engine.step()
        clock += 1
    outputs = engine.outputs()
    verdicts = {c.id: judge_ids(c, outputs[c.id].token_ids, outputs[c.id].text, golden.tolerance)
                for c in golden.cases}
    return CheckResult(golden, engine.config, seed, arrivals, verdicts, engine.trace)
