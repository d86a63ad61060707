"""The speculation scenario: what prompt lookup buys a decode, and whether it is what its acceptance
predicts.

A repetitive workload (each prompt a random phrase said REPEATS times, as a request quoting a document
does) runs greedy in fast mode with and without speculation, the two engines stepping in turn (the
machine drifts within minutes: bench.interleaved), at each batch size. Per engine, over its decode
steps (those that only decode): the tokens the step gave its requests, its seconds. The speed-up is the
ratio of tokens per second; what the acceptance predicts is the tokens per step over the step's cost in
the roofline (a verifying step feeds 1 + drafts rows per request, which costs more where the step is
compute-bound, nothing more where it reads the weights once either way).
"""
from __future__ import annotations

import time

import numpy as np
from tqdm import tqdm

from ..engine import EngineConfig, LLMEngine
from ..model import Model
from ..sampling import SamplingParams
from .roofline import Roofline

PHRASE_TOKENS = 12
REPEATS = 4
SPECULATIVE_TOKENS = 4


def repetitive_prompts(model: Model, count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    high = min(model.config.vocab_size, model.tokenizer.vocab_size)
    return [rng.integers(0, high, PHRASE_TOKENS).tolist() * REPEATS for _ in range(count)]


def _engine(model: Model, prompts: list[list[int]], max_tokens: int, speculative: int) -> LLMEngine:
    length = PHRASE_TOKENS * REPEATS + max_tokens
    config = EngineConfig(mode="fast", max_num_seqs=len(prompts), max_model_len=length, block_size=16,
                          num_blocks=len(prompts) * -(-length // 16),  # every request's blocks: none preempted
                          max_num_batched_tokens=max(2048, length), num_speculative_tokens=speculative)
    engine = LLMEngine(model, config, digest_logits=False)
    for n, prompt in enumerate(prompts):
        engine.add_request(f"r{n}", prompt, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return engine


def run_speculation(model: Model, batch_sizes: list[int], max_tokens: int, roofline: Roofline) -> dict:
    """Per batch size, plain and speculating engines in turn (see module)."""
    result = {"phrase_tokens": PHRASE_TOKENS, "repeats": REPEATS, "num_speculative_tokens": SPECULATIVE_TOKENS,
              "batches": {}}
    for speculative in (0, SPECULATIVE_TOKENS):  # one-time costs (compiling each step shape) out of the timing
        _engine(model, repetitive_prompts(model, 1, seed=1), 8, speculative).run()
    for batch in batch_sizes:
        prompts = repetitive_prompts(model, batch)
        engines = {"plain": _engine(model, prompts, max_tokens, 0),
                   "speculating": _engine(model, prompts, max_tokens, SPECULATIVE_TOKENS)}
        steps = {name: [] for name in engines}  # (seconds, tokens, rows, positions read) per decode-only step
        order = list(engines.items())
        with tqdm(total=2 * batch * max_tokens, desc=f"speculation B={batch}", unit="tok", leave=False) as bar:
            while any(e.has_unfinished() for e in engines.values()):
                for name, engine in order:
                    if not engine.has_unfinished():
                        continue
                    started = time.perf_counter()
                    events = engine.step()
                    seconds = time.perf_counter() - started
                    scheduled = engine.trace[-1]["scheduled"]
                    tokens = sum(e.token_id is not None for e in events)
                    if scheduled and all(c["phase"] == "decode" for c in scheduled):
                        context = sum(c["start"] + c["num_tokens"] for c in scheduled)  # positions read
                        steps[name].append((seconds, tokens, sum(c["num_tokens"] for c in scheduled), context))
                    bar.update(tokens)
                order.reverse()
        runs = {}
        for name, taken in steps.items():
            seconds, tokens = sum(s[0] for s in taken), sum(s[1] for s in taken)
            roofline_s = sum(roofline.forward_seconds(s[2], s[2], s[3]) for s in taken)
            runs[name] = {"decode_steps": len(taken), "decode_tokens": tokens, "decode_s": seconds,
                          "decode_tok_s": tokens / seconds, "tokens_per_step": tokens / len(taken),
                          "roofline_tok_s": tokens / roofline_s}
        status = engines["speculating"].status()
        runs["speculating"] |= {"drafts": status["spec_decode_drafts"],
                                "draft_tokens": status["spec_decode_draft_tokens"],
                                "accepted_tokens": status["spec_decode_accepted_tokens"]}
        plain, spec = runs["plain"], runs["speculating"]
        same = all(engines["plain"].output(r).token_ids == engines["speculating"].output(r).token_ids
                   for r in engines["plain"].sequences)
        result["batches"][str(batch)] = {
            **runs, "speedup": spec["decode_tok_s"] / plain["decode_tok_s"],
            "predicted_speedup": spec["roofline_tok_s"] / plain["roofline_tok_s"], "same_answers": same}
    return result


def print_speculation(result: dict) -> None:
    print(f"speculation: prompts of a {result['phrase_tokens']}-token phrase said {result['repeats']} times, greedy, "
          f"fast mode, prompt lookup of {result['num_speculative_tokens']} tokens; engines in turn")
    for batch, data in result["batches"].items():
        plain, spec = data["plain"], data["speculating"]
        accepted = spec["accepted_tokens"] / spec["draft_tokens"] if spec["draft_tokens"] else 0.0
        print(f"  B={batch}: plain {plain['decode_tok_s']:.1f} tok/s, speculating {spec['decode_tok_s']:.1f} tok/s "
              f"({spec['tokens_per_step']:.2f} tokens per step, {accepted:.0%} of {spec['draft_tokens']} draft tokens "
              f"accepted): {data['speedup']:.2f}x, the roofline at that acceptance predicts "
              f"{data['predicted_speedup']:.2f}x; same answers: {data['same_answers']}")
