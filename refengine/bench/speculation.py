"""The speculation scenario: what each drafter buys a decode, and whether it is what its acceptance
predicts.

A repetitive workload (each prompt a random phrase said REPEATS times, as a request quoting a document
does) runs greedy in fast mode three ways, the engines stepping in turn (the machine drifts within
minutes: bench.interleaved): plain; prompt lookup of NGRAM_TOKENS; and a draft model of DRAFT_TOKENS,
the target's first DRAFT_LAYERS layers and its head (model.tiny.first_layers: no training, the same
vocabulary). Per engine, over its decode steps (those that only decode): the tokens the step gave its
requests and its seconds. The speed-up is the ratio of tokens per second.

What the acceptance predicts is measured, not assumed. Leviathan et al. take a verifying forward to
cost what a decode's does; on a CPU whose cores saturate at a few rows that fails (a step's product is
compute-bound past them). So each speculating step is priced as a plain step, plus what the target's
forward over the step's shape (the rows each decode fed) costs beyond a plain step's forward, plus the
draft model's forwards: one per draft position, a row per drafting decode (the catch-up chunk that
starts a proposal priced as one row); each forward the median of timed ones right after the engines
ran (`forward_seconds`). Where the measured speed-up falls short of that prediction, the difference is
what speculating costs outside the target's forward: drafting beyond its forwards, verification, the
bookkeeping.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..engine import EngineConfig, LLMEngine
from ..engine.block_manager import BlockManager, BlockTable
from ..engine.model_runner import ModelRunner
from ..engine.scheduler import ScheduledChunk
from ..model import Model, load_model
from ..model.cache import cached_model
from ..model.tiny import first_layers
from ..sampling import SamplingParams

PHRASE_TOKENS = 12
REPEATS = 4
NGRAM_TOKENS = 4
DRAFT_LAYERS = 1
DRAFT_TOKENS = 2
BLOCK_SIZE = 16
TIMED_FORWARDS = 5  # per row count: the median of these


def repetitive_prompts(model: Model, count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    high = min(model.config.vocab_size, model.tokenizer.vocab_size)
    return [rng.integers(0, high, PHRASE_TOKENS).tolist() * REPEATS for _ in range(count)]


def draft_model_dir(model: Model) -> Path:
    """The target's first DRAFT_LAYERS layers, cut once per model (by its fingerprint) into the cache."""
    return cached_model(f"draft-{model.fingerprint[:16]}-first-{DRAFT_LAYERS}",
                        lambda folder: first_layers(model.path, folder, DRAFT_LAYERS))


def _config(batch: int, length: int, mode: str = "fast", **speculation) -> EngineConfig:
    return EngineConfig(mode=mode, max_num_seqs=batch, max_model_len=length, block_size=BLOCK_SIZE,
                        num_blocks=batch * -(-length // BLOCK_SIZE),  # every request's blocks: none preempted
                        max_num_batched_tokens=max(2048, length), **speculation)


def _engine(model: Model, prompts: list[list[int]], max_tokens: int, **speculation) -> LLMEngine:
    engine = LLMEngine(model, _config(len(prompts), PHRASE_TOKENS * REPEATS + max_tokens, **speculation),
                       digest_logits=False)
    for n, prompt in enumerate(prompts):
        engine.add_request(f"r{n}", prompt, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return engine


@dataclass
class _Rows:
    """What a runner reads of a sequence it is timed on: tokens (their values do not change the cost)
    and a table of blocks holding them."""
    token_ids: list[int]
    block_table: BlockTable


def forward_seconds(model: Model, mode: str, shapes: set[tuple[int, ...]], context: int) -> dict[tuple, float]:
    """Per step shape (the rows each decode feeds: 1, or 1 + its drafts), the median seconds of the
    model's forward over such decodes, each its own sequence at `context` positions. The tokens and
    the cached keys read are placeholders (the pool's, whatever their values): the cost is the same."""
    most, longest = max(map(len, shapes)), max(map(max, shapes))
    config = _config(most, context + longest, mode)
    runner, blocks = ModelRunner(model, config), BlockManager(config.num_blocks, BLOCK_SIZE)
    sequences = []
    for n in range(most):
        table = BlockTable(f"timed{n}")
        blocks.allocate(table, context + longest)
        sequences.append(_Rows([n % model.config.vocab_size] * (context + 1), table))
    seconds = {}
    for shape in sorted(shapes):
        chunks = [ScheduledChunk(s, context, rows, "decode", True, draft=(0,) * (rows - 1))
                  for s, rows in zip(sequences, shape)]
        runner.execute(chunks, blocks)  # this shape's first call compiles
        taken = []
        for _ in range(TIMED_FORWARDS):
            started = time.perf_counter()
            runner.execute(chunks, blocks)
            taken.append(time.perf_counter() - started)
        seconds[shape] = float(np.median(taken))
    return seconds


def _in_turns(engines: dict[str, LLMEngine], batch: int, max_tokens: int) -> dict[str, list[tuple]]:
    """Step the engines in turn, the order reversed every round; per engine, its decode-only steps as
    (seconds, tokens given, the step's shape: the rows each decode fed, sorted, and the drafting shape:
    one row per decode that drafted, as many times as the most drafts one of them had)."""
    steps = {name: [] for name in engines}
    order = list(engines.items())
    with tqdm(total=len(engines) * batch * max_tokens, desc=f"speculation B={batch}", unit="tok", leave=False) as bar:
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
                    drafts = [c["draft"] for c in scheduled if c.get("draft")]
                    steps[name].append((seconds, tokens, tuple(sorted(c["num_tokens"] for c in scheduled)),
                                        ((1,) * len(drafts), max(drafts, default=0))))
                bar.update(tokens)
            order.reverse()
    return steps


def run_speculation(model: Model, batch_sizes: list[int], max_tokens: int) -> dict:
    """Per batch size, the plain and the two speculating engines in turn, then the forwards that price
    their steps (see module)."""
    draft = load_model(draft_model_dir(model))
    drafters = {"prompt lookup": dict(num_speculative_tokens=NGRAM_TOKENS),
                "draft model": dict(num_speculative_tokens=DRAFT_TOKENS, speculative_model=str(draft.path))}
    result = {"phrase_tokens": PHRASE_TOKENS, "repeats": REPEATS,
              "drafters": {"prompt lookup": {"num_speculative_tokens": NGRAM_TOKENS},
                           "draft model": {"num_speculative_tokens": DRAFT_TOKENS, "layers": DRAFT_LAYERS,
                                           "of_layers": model.config.num_layers,
                                           "parameters": draft.config.num_parameters}},
              "batches": {}}
    context = PHRASE_TOKENS * REPEATS + max_tokens // 2  # a decode's mean context
    for batch in batch_sizes:
        for speculation in ({}, *drafters.values()):  # one-time costs (compiling step shapes) out of the timing
            _engine(model, repetitive_prompts(model, batch, seed=1), 8, **speculation).run()
        prompts = repetitive_prompts(model, batch)
        engines = {"plain": _engine(model, prompts, max_tokens)} | \
            {name: _engine(model, prompts, max_tokens, **speculation) for name, speculation in drafters.items()}
        steps = _in_turns(engines, batch, max_tokens)
        plain_shape = (1,) * batch
        target = forward_seconds(model, "fast", {s[2] for taken in steps.values() for s in taken} | {plain_shape},
                                 context)
        drafting = forward_seconds(draft, "invariant",  # its runner's mode, whatever the target's
                                   {s[3][0] for s in steps["draft model"] if s[3][1]} | {(1,)}, context)
        plain_step = float(np.mean([s[0] for s in steps["plain"]]))
        runs = {}
        for name, taken in steps.items():
            seconds, tokens = sum(s[0] for s in taken), sum(s[1] for s in taken)
            priced = sum(plain_step + target[s[2]] - target[plain_shape]
                         + (s[3][1] * drafting[s[3][0]] if name == "draft model" and s[3][1] else 0.0)
                         for s in taken)
            runs[name] = {"decode_steps": len(taken), "decode_tokens": tokens, "decode_s": seconds,
                          "decode_tok_s": tokens / seconds, "tokens_per_step": tokens / len(taken),
                          "priced_tok_s": tokens / priced}
            if name != "plain":
                status = engines[name].status()
                runs[name] |= {"drafts": status["spec_decode_drafts"],
                               "draft_tokens": status["spec_decode_draft_tokens"],
                               "accepted_tokens": status["spec_decode_accepted_tokens"]}
        plain = runs["plain"]
        result["batches"][str(batch)] = {
            "plain": plain, "forward_s": {"+".join(map(str, shape)): s for shape, s in sorted(target.items())},
            "draft_forward_s": {"+".join(map(str, shape)): s for shape, s in sorted(drafting.items())},
            "drafters": {name: runs[name] | {
                "speedup": runs[name]["decode_tok_s"] / plain["decode_tok_s"],
                "predicted_speedup": runs[name]["priced_tok_s"] / plain["priced_tok_s"],
                "same_answers": all(engines["plain"].output(r).token_ids == engines[name].output(r).token_ids
                                    for r in engines["plain"].sequences)} for name in drafters}}
    return result


def print_speculation(result: dict) -> None:
    drafters = result["drafters"]
    lookup, draft = drafters["prompt lookup"], drafters["draft model"]
    print(f"speculation: prompts of a {result['phrase_tokens']}-token phrase said {result['repeats']} times, greedy, "
          f"fast mode; prompt lookup of {lookup['num_speculative_tokens']} tokens, a draft model of "
          f"{draft['num_speculative_tokens']} (the target's first {draft['layers']} of {draft['of_layers']} layers); "
          f"engines in turn; predictions price each step at this machine's timed forwards")
    for batch, data in result["batches"].items():
        print(f"  B={batch}: plain {data['plain']['decode_tok_s']:.1f} tok/s")
        for name, run in data["drafters"].items():
            accepted = run["accepted_tokens"] / run["draft_tokens"] if run["draft_tokens"] else 0.0
            print(f"    {name}: {run['decode_tok_s']:.1f} tok/s ({run['tokens_per_step'] / int(batch):.2f} tokens per "
                  f"request and step, {accepted:.0%} of {run['draft_tokens']} draft tokens accepted): "
                  f"{run['speedup']:.2f}x, predicted {run['predicted_speedup']:.2f}x; "
                  f"same answers: {run['same_answers']}")
