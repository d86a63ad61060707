"""Prompt logprobs: the engine scores every prompt token as the float64 reference defines it (the
log-softmax of the row before it, computed here with numpy from reference.prompt_logits, not with the
helpers the engine shares), however its prompt is chunked, batched, preempted or found in the prefix
cache; and check.comparison judges them (what differs, where, against which bound)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from refengine.check.comparison import compare_request, prompt_difference
from refengine.check.schedule import parse_schedule
from refengine.engine import EngineConfig, LLMEngine
from refengine.errors import RefengineError
from refengine.reference import prompt_logits
from refengine.sampling import PromptLogprob, SamplingParams

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19, 71, 69, 39, 93, 75]


def float64_logprobs(model, prompt_ids) -> np.ndarray:
    rows = prompt_logits(model, prompt_ids)                       # [len, vocab]
    shifted = rows - rows.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def run(model, requests, **config):
    engine = LLMEngine(model, EngineConfig(mode="invariant", **config), keep_logits=True)
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params=params)
    outputs = engine.run()
    engine.check_invariants()
    return engine, outputs


@pytest.mark.parametrize("config", [dict(max_num_batched_tokens=512), dict(max_num_batched_tokens=6),
                                    dict(max_num_batched_tokens=7, block_size=4, num_blocks=9)],
                         ids=["one-chunk", "chunked", "chunked-and-preempted"])
def test_every_prompt_token_is_scored_once_as_float64_scores_it(tiny_model, config):
    """Two requests beside a third without prompt logprobs; the small pool preempts one (it recomputes its
    prompt and must not score it twice)."""
    params = SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=3)
    requests = [("a", PROMPT, params), ("plain", PROMPT[::-1], replace(params, prompt_logprobs=None)),
                ("b", PROMPT[5:], replace(params, prompt_logprobs=0))]
    engine, outputs = run(tiny_model, requests, max_num_seqs=3, **config)
    if "num_blocks" in config:
        assert sum(o.num_preemptions for o in outputs.values()) > 0
    assert outputs["plain"].prompt_logprobs is None
    for rid, prompt, params in [requests[0], requests[2]]:
        f64 = float64_logprobs(tiny_model, prompt)
        got = outputs[rid].prompt_logprobs
        assert [(p.position, p.token_id) for p in got] == [(i, prompt[i]) for i in range(1, len(prompt))]
        for p in got:
            row = f64[p.position - 1]
            assert abs(p.logprob - row[p.token_id]) < 1e-4
            assert 1 + np.sum(row > row[p.token_id] + 1e-4) <= p.rank <= 1 + np.sum(row > row[p.token_id] - 1e-4)
            assert [i for i, _ in p.top_logprobs] == list(np.argsort(-row, kind="stable")[:params.prompt_logprobs]) \
                or np.ptp(np.sort(row)[-params.prompt_logprobs - 1:]) < 1e-4  # a near-tie may order them either way
    alone = run(tiny_model, [requests[0]], max_num_seqs=1, max_num_batched_tokens=512)[1]["a"]
    assert [(p.logprob, p.rank, p.top_logprobs, p.logits_sha256) for p in alone.prompt_logprobs] == \
        [(p.logprob, p.rank, p.top_logprobs, p.logits_sha256) for p in outputs["a"].prompt_logprobs]
    assert engine.status()["prompt_logprob_tokens"] == (len(PROMPT) - 1) + (len(PROMPT) - 6)


def test_a_request_still_to_score_its_prompt_takes_no_cache_hit(tiny_model):
    """vLLM's rule: the cached positions would compute no rows to score. A request without prompt logprobs
    takes the same prefix from the cache."""
    params = SamplingParams(max_tokens=2)
    requests = [("first", PROMPT, params), ("scored", PROMPT, replace(params, prompt_logprobs=1)),
                ("cached", PROMPT, params)]
    engine = LLMEngine(tiny_model, EngineConfig(mode="invariant", max_num_seqs=1, block_size=4,
                                                enable_prefix_caching=True))
    for rid, prompt, p in requests:
        engine.add_request(rid, prompt, params=p)
        engine.run()
    assert engine.output("scored").num_cached_tokens == 0 and len(engine.output("scored").prompt_logprobs) == 24
    assert engine.output("cached").num_cached_tokens == 24


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_a_bad_prompt_logprobs_is_refused_naming_it(value):
    with pytest.raises(RefengineError, match="^prompt_logprobs: "):
        SamplingParams(prompt_logprobs=value)
    schedule = {"requests": [{"id": "r0", "prompt_ids": [1, 2], "prompt_logprobs": value}]}
    with pytest.raises(RefengineError, match=r"request 'r0'\.prompt_logprobs"):
        parse_schedule(schedule, "s.json")


# --- the judge --------------------------------------------------------------------------------
def entry(position, token=7, logprob=-1.0, rank=2, top=((3, -0.5), (7, -1.0)), sha="x", logits=None):
    return PromptLogprob(position, token, logprob, rank, list(top), sha, logits)


class Run:
    def __init__(self, prompt_logprobs, token_ids=(5,), finish_reason="length"):
        self.prompt_logprobs, self.token_ids, self.finish_reason = prompt_logprobs, list(token_ids), finish_reason
        self.steps = []


BASE = [entry(1), entry(2, token=9)]


@pytest.mark.parametrize("got, problem", [
    ([entry(1), entry(2, token=9)], None),
    ([entry(1), entry(2, token=8)], "for token 8 at position 2"),
    ([entry(1), entry(3, token=9)], "at position 3"),
    ([entry(1, logprob=-1.0 + 1e-12), entry(2, token=9)], "logprob not bit-identical"),
    ([entry(1, rank=3), entry(2, token=9)], "rank not bit-identical"),
    ([entry(1, top=((3, -0.5), (8, -1.0))), entry(2, token=9)], "top_logprobs not bit-identical"),
    ([entry(1, sha="y"), entry(2, token=9)], "logits row differs"),
    ([entry(1, sha=None), entry(2, token=9)], None),  # no digest on one side: the values still compared
])
def test_exact_prompt_logprobs_are_bit_for_bit(got, problem):
    found = prompt_difference(got, BASE, 2, exact=True)
    assert (found is None) if problem is None else (found is not None and problem in found[1]), found


def row(*values):
    return np.array(values, dtype=np.float32)


def test_inexact_prompt_logprobs_are_held_to_twice_the_noise_against_the_baseline_row():
    want_row = np.log(np.array([0.5, 0.3, 0.2]))             # logprobs of a row already normalized
    want = [PromptLogprob(1, 1, float(want_row[1]), 2, [(0, float(want_row[0]))], None, want_row)]
    close = [PromptLogprob(1, 1, float(want_row[1]) + 1.5e-3, 2, [(0, float(want_row[0]))], None, want_row)]
    assert prompt_difference(close, want, 1, exact=False, noise_tolerance=1e-3) is None       # within 2 x 1e-3
    assert prompt_difference(close, want, 1, exact=False, noise_tolerance=5e-4) is not None   # beyond 2 x 5e-4
    ranked = [replace(close[0], rank=3)]
    assert "rank 3" in prompt_difference(ranked, want, 1, exact=False, noise_tolerance=1e-3)[1]
    tied = np.log(np.array([0.3, 0.3, 0.4]))                 # ids 0 and 1 tie: rank 2 or 3 both fit
    tie = [PromptLogprob(1, 1, float(tied[1]), 3, [(2, float(tied[2]))], None, tied)]
    assert prompt_difference(tie, [replace(tie[0], rank=2)], 1, exact=False, noise_tolerance=1e-6) is None
    far_row = [replace(close[0], logits=want_row + 0.01)]
    assert "logit deviation" in prompt_difference(far_row, want, 1, exact=False, noise_tolerance=1e-3)[1]


@pytest.mark.parametrize("got, want, kind, where", [
    (Run(BASE), Run(BASE), "match", None),
    (Run(None), Run(BASE), "diverged", None),
    (Run(BASE[:1]), Run(BASE), "diverged", 2),                                  # one scored too few
    (Run(BASE + [entry(3)]), Run(BASE), "diverged", 3),
    (Run(BASE[:1], token_ids=(), finish_reason="abort"), Run(BASE), "match", None),   # aborted mid-prefill: a prefix
    (Run(BASE[:1], token_ids=(5,), finish_reason="abort"), Run(BASE), "diverged", 2),  # it had its first token
    (Run([entry(2, token=9)]), Run(BASE), "diverged", 1),                       # the first one missing
])
def test_a_run_scores_the_prompt_its_baseline_scores(got, want, kind, where):
    verdict = compare_request("r0", got, want, exact=True, num_prompt_logprobs=2)
    assert verdict.kind == kind and (kind == "match" or (verdict.compared_by, verdict.index) ==
                                     ("prompt_logprobs", where)), verdict
    assert compare_request("r0", Run(None), want, exact=True).kind == "match"  # not asked for: not compared


# --- the catalogued faults, on the schedules the dev profile shrank them to ---------------------------
ENGINE = {"mode": "invariant", "max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 1, "max_model_len": 128,
          "num_blocks": 6}
SHORT, SCORED = {"id": "r0", "prompt_ids": [0], "max_tokens": 4}, {"id": "r1", "prompt_ids": [0, 0], "max_tokens": 4,
                                                                   "prompt_logprobs": 0}
SHRUNK = {  # fault -> (schedule, against, other budget)
    "prompt-logprobs-shifted-by-one": ({"engine": ENGINE, "requests": [SHORT, SCORED]}, "reference", None),
    "prompt-logprobs-chunk-end-dropped": ({"engine": ENGINE, "requests": [SHORT, SCORED]}, "budget", 1),
    "prompt-logprobs-rescored-on-resume": ({"engine": ENGINE, "requests": [SHORT, SCORED]}, "serial", None),
    "prompt-logprobs-rows-from-step-start": ({"engine": {**ENGINE, "block_size": 4, "num_blocks": 2}, "requests": [
        SHORT, {**SCORED, "prompt_ids": [0, 0, 0]}]}, "serial", None),
    "prompt-logprobs-from-cached-blocks": ({"engine": {**ENGINE, "enable_prefix_caching": True}, "requests": [
        SHORT, {**SCORED, "arrival_step": 1, "prompt_logprobs": 1}]}, "serial", None),
}


@pytest.mark.parametrize("fault", SHRUNK)
def test_each_prompt_logprobs_fault_fails_its_shrunk_schedule_and_only_with_the_fault(fault):
    from refengine.check.calibrate import calibration_for
    from refengine.check.replay import replay
    from refengine.strategies import tiny_model
    schedule, against, budget = SHRUNK[fault]
    model = tiny_model("qwen3-gqa2-tied")
    calibration = calibration_for(model, "qwen3-gqa2-tied") if against == "reference" else None
    for injected, passes in ((fault, False), (None, True)):
        result = replay(model, parse_schedule(schedule, fault), against=against, other_budget=budget, fault=injected,
                        calibration=calibration)
        assert result.passed is passes, result.report()
        if not passes:
            assert result.verdicts["r1"].compared_by == "prompt_logprobs", result.report()
