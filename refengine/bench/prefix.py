"""The prefix scenario: what prefix caching saves a request that starts with a long shared system
prompt. Each of QUESTIONS requests is SYSTEM_TOKENS tokens of one system prompt then a question of
its own, sent alone, max_tokens 1: its time to first token is its prefill. Cold (a cache_salt of its
own: nothing to take) and hot (no salt: the system prompt's full blocks computed once, by a warm-up
request) alternate on one engine with caching on, so both see the same machine from moment to
moment; the figure is their ratio, per mode.
"""
from __future__ import annotations

import statistics

import numpy as np
from tqdm import tqdm

from ..engine import EngineConfig, LLMEngine
from ..model import Model
from ..sampling import SamplingParams

SYSTEM_TOKENS = 1000
QUESTION_TOKENS = 16
QUESTIONS = 8


def prompts(model: Model, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """(the system prompt, the questions): ids the tokenizer knows, the same for every run."""
    rng = np.random.default_rng(seed)
    high = min(model.config.vocab_size, model.tokenizer.vocab_size)
    return (rng.integers(0, high, SYSTEM_TOKENS).tolist(),
            [rng.integers(0, high, QUESTION_TOKENS).tolist() for _ in range(QUESTIONS)])


def run_prefix(model: Model, modes: list[str]) -> dict:
    system, questions = prompts(model)
    result = {"system_tokens": SYSTEM_TOKENS, "question_tokens": QUESTION_TOKENS, "questions": QUESTIONS}
    for mode in modes:
        length = SYSTEM_TOKENS + QUESTION_TOKENS + 1
        config = EngineConfig(mode=mode, max_num_seqs=1, max_model_len=length, max_num_batched_tokens=length,
                              num_blocks=4 * -(-length // 16), block_size=16,  # a cold request evicts no hot block
                              enable_prefix_caching=True)
        engine = LLMEngine(model, config, digest_logits=False)
        params = SamplingParams(max_tokens=1, ignore_eos=True)

        def ttft(request_id: str, prompt: list[int], salt: str | None):
            engine.add_request(request_id, prompt, params=params, cache_salt=salt)
            output = engine.run()[request_id]
            return output.ttft_s, output.num_cached_tokens

        ttft("warm-up", system + questions[0][::-1], None)  # puts the system prompt's blocks in the cache
        cold, hot, cached = [], [], []
        for n, question in enumerate(tqdm(questions, desc=f"prefix {mode}", leave=False)):
            cold.append(ttft(f"cold{n}", system + question, f"cold{n}")[0])
            seconds, tokens = ttft(f"hot{n}", system + question, None)
            hot.append(seconds)
            cached.append(tokens)
        result[mode] = {"cold_ttft_ms": statistics.median(cold) * 1e3, "hot_ttft_ms": statistics.median(hot) * 1e3,
                        "cold_over_hot": statistics.median(c / h for c, h in zip(cold, hot)),
                        "hot_cached_tokens": min(cached)}
    return result


def print_prefix(result: dict) -> None:
    print(f"prefix: a {result['system_tokens']}-token shared system prompt + a {result['question_tokens']}-token "
          f"question, {result['questions']} requests each way, alone, cold and hot in turn")
    for mode, r in result.items():
        if isinstance(r, dict):
            print(f"  {mode:<9} TTFT cold {r['cold_ttft_ms']:8.2f} ms  hot {r['hot_ttft_ms']:7.2f} ms  "
                  f"cold / hot {r['cold_over_hot']:5.1f}x  ({r['hot_cached_tokens']} prompt tokens from the cache)")
