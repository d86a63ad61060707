"""Whole engine decode steps at batch 1, 8 and 32, both modes, on the mid-size model.

Each round is one real `LLMEngine.step()` of B running requests (prompt 64, so the KV prefix grows
from 65 during the rounds); `extra_info` has the decode tokens/s and the rate relative to batch 1
is what `refengine bench` reports as "x serial"."""
from __future__ import annotations

import pytest
from bench_models import BATCH_SIZES, MODES

from refengine.bench.workloads import random_requests
from refengine.engine import EngineConfig, LLMEngine
from refengine.sampling import SamplingParams

PROMPT_LEN = 64
ROUNDS = 12


@pytest.mark.parametrize("batch", BATCH_SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_decode_step(benchmark, mid_model, mode, batch):
    max_tokens = 4 + ROUNDS
    engine = LLMEngine(mid_model, EngineConfig(mode=mode, max_num_seqs=batch, max_num_batched_tokens=batch * PROMPT_LEN,
                                               max_model_len=PROMPT_LEN + max_tokens))
    for r in random_requests(mid_model, batch, PROMPT_LEN, max_tokens):
        engine.add_request(r.request_id, r.prompt_ids, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while len(engine.step()) < batch:  # prefill (the last prompt may finish in a second step)
        pass
    warmup = engine.num_steps

    def step():
        events = engine.step()
        assert len(events) == batch and all(e.token_id is not None for e in events)

    benchmark.pedantic(step, rounds=ROUNDS, iterations=1)
    assert {s["phase"] for entry in engine.trace[warmup:] for s in entry["scheduled"]} == {"decode"}
    benchmark.extra_info.update(decode_tok_s=batch / benchmark.stats.stats.median)
