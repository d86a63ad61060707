"""Property 7: seeded sampling is judged against the float64 reference, not only against itself.

The batched-vs-alone properties compare two runs of the same `sample_token`, so a wrong nucleus,
top-k or temperature that is wrong the same way alone and batched is invisible there. Here the
judge is refengine.check.sampling_oracle, written afresh from the HF/vLLM definitions:
- support: on Hypothesis join/leave schedules where every request samples with a seed, every drawn
  token lies in the oracle's support computed on the FLOAT64 reference logits of its prefix (prompt
  + the tokens generated before it, and its images on the vision model), processed by the float64
  definition of its penalties, bias and min_tokens (reference.adjusted_logits), with boundary tokens
  the calibrated f32-vs-f64 noise can flip allowed either way; and every engine row stays within that
  noise of the reference row.
- distribution: for each sampler of SAMPLERS (and of PROCESSED_SAMPLERS, with penalties and bias),
  DRAWS first tokens of one prompt under seeds 0..DRAWS-1 (the engine's draw for token 0 depends only
  on (seed, 0), so the logits are computed once and only the seed varies) fit the oracle's target
  distribution: Pearson's chi-square over bins pooled to an expected count >= 20, failing at p < ALPHA
  (and on any draw outside the support). Fixed seeds make the verdict deterministic; for a correct
  engine the chance that a sampler's check fails is ALPHA, about 31 x ALPHA for the whole set.
"""
from __future__ import annotations

import functools
import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import currently_in_test_context, event, given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ..check.calibrate import calibration_for
from ..check.comparison import logit_deviation
from ..check.driver import configured, run_batched
from ..check.margin_rule import processed_noise_gain, tolerance
from ..check.sampling_oracle import goodness_of_fit, nucleus
from ..check.schedule import parse_schedule
from ..engine import EngineConfig, LLMEngine
from ..engine.sequence import Sequence
from ..reference import adjusted_logits, prompt_logits
from ..sampling import SamplingParams, top2_margin
from ..strategies import SAMPLERS, schedules, seeded, tiny_model_names
from ..strategies.engine_settings import MODES, draft_model_dir
from ..strategies.models import DEFAULT_MODEL, VOCAB_SIZE, tiny_model
from ..strategies.schedules import MAX_REQUESTS
from ..vision_reference import prompt_logits_with_images
from .harness import PropertyFailure, coverage, prepared

pytestmark = pytest.mark.invariants

SUPPORT = "sampled-tokens-in-float64-support"
DISTRIBUTION = "sampling-distribution"
DRAWS = 1000
ALPHA = 1e-6
# Candidate prompts for the distribution check: the first on which no sampler has a token within noise
# of a top-k / top-p boundary (there the target would be undefined) is used.
PROMPTS = ([5, 9, 13, 21], [17, 250, 3, 98, 411], [300, 42, 7, 7, 150, 88])
# Logits processors for the distribution check, without top-k / top-p cuts (so no boundary is in play).
PROCESSED_SAMPLERS = [
    {"temperature": 1.0, "repetition_penalty": 2.0},
    {"temperature": 1.0, "repetition_penalty": 0.5, "presence_penalty": 1.0},
    {"temperature": 1.5, "frequency_penalty": 2.0},
    {"temperature": 1.0, "frequency_penalty": -1.0, "logit_bias": ((5, 3.0), (98, -100.0), (250, 2.0))},
]


def _all_seeded(example) -> dict:
    schedule, samplers = example
    return {**schedule, "requests": [{**r, "sampling": r.get("sampling", samplers[n])}
                                     for n, r in enumerate(schedule["requests"])]}


# Join/leave schedules of either kernel mode in which every request samples with a seed.
SAMPLED = {mode: st.tuples(schedules(VOCAB_SIZE, mode, allow_seeded=True),
                           st.lists(seeded, min_size=MAX_REQUESTS, max_size=MAX_REQUESTS)) for mode in MODES}
sampled_schedules = st.sampled_from(MODES).flatmap(SAMPLED.get).map(_all_seeded)


def noise_bound(model) -> float:
    """How far an engine logit may be from float64: the f32-vs-f64 noise tolerance the suite enforces."""
    return tolerance(calibration_for(model), "f32_vs_f64")


@functools.lru_cache(maxsize=512)  # shrinking re-runs the same requests
def reference_rows(model_name: str, prompt: tuple, generated: tuple, images: tuple = ()) -> np.ndarray:
    """The float64 logits row each generated token was drawn from: [len(generated), vocab]. `images`: the
    request's (ScheduledRequest.images), one per run of image tokens in `prompt`."""
    model, ids = tiny_model(model_name), list(prompt + generated[:-1])
    logits = prompt_logits_with_images(model, ids, [image.pixels() for image in images]) if images \
        else prompt_logits(model, ids)
    return logits[len(prompt) - 1:]


def check_sampled_support(model_name: str, schedule: dict, fault: str | None = None) -> int:
    """Run `schedule` batched; every sampled token must be in the oracle's support on the float64
    logits of its prefix. Returns how many tokens were judged; PropertyFailure otherwise."""
    model, schedule = tiny_model(model_name), prepared(model_name, schedule)
    noise = noise_bound(model)
    parsed = parse_schedule(schedule, SUPPORT)
    engine, failure = run_batched(model, parsed, configured(parsed.engine, fault=fault))
    if in_test := currently_in_test_context():  # events only: target()'s hill-climbing would double the cost
        for label in sorted(coverage(schedule, engine.trace)):
            event(label)
    problems, judged = [f"engine failure: {failure}"] if failure else [], 0
    for request in parsed.requests:
        out, p = engine.output(request.id), request.params
        if p.greedy or not out.token_ids:
            continue
        rows = reference_rows(model_name, tuple(out.prompt_ids), tuple(out.token_ids), request.images)
        for i, (step, want) in enumerate(zip(out.steps, rows)):
            where = f"{request.id}: generated token {i} (engine step {step.step})"
            deviation = logit_deviation(step.logits, want)
            if deviation > noise:
                problems.append(f"{where}: logit deviation from float64 {deviation:.3g} > noise tolerance {noise:.3g}")
                break
            chosen_from = adjusted_logits(want, out.prompt_ids, out.token_ids[:i], p, model.config.eos_token_ids)
            oracle = nucleus(chosen_from, p.temperature, p.top_k, p.top_p, noise * processed_noise_gain(p))
            if in_test and oracle.ambiguous[step.token_id]:
                event("drew a token within noise of a top-k / top-p boundary")
            if not oracle.allowed[step.token_id]:
                support = oracle.support.tolist()
                problems.append(f"{where}: drew {step.token_id} (float64 probability before the cut "
                                f"{float(nucleus(chosen_from, p.temperature).probs[step.token_id]):.3g}), outside the "
                                f"float64 support of temperature={p.temperature} top_k={p.top_k} top_p={p.top_p}: "
                                f"{support[:12]}{' ...' if len(support) > 12 else ''} ({len(support)} tokens)")
                break
            judged += 1
    if problems:
        raise PropertyFailure(
            f"{SUPPORT} does not hold on model {model_name}{f' (fault {fault})' if fault else ''}:\n"
            + "\n".join(problems) + f"\nshrunk schedule (re-check it with refengine.suite.test_sampling."
            f"check_sampled_support({model_name!r}, SCHEDULE)):\n{json.dumps(schedule)}")
    return judged


@functools.cache
def first_token_rows(model_name: str = DEFAULT_MODEL):
    """(prompt, the engine's float32 logits row for its first token, the float64 reference row) for the
    first of PROMPTS on which no sampler has a boundary token within noise."""
    model = tiny_model(model_name)
    noise = noise_bound(model)
    for prompt in PROMPTS:
        want = prompt_logits(model, prompt)[-1]
        if not any(nucleus(want, logit_noise=noise, **s).ambiguous.any() for s in SAMPLERS):
            engine = LLMEngine(model, EngineConfig(mode="invariant", max_num_seqs=1, max_model_len=64),
                               keep_logits=True)
            engine.add_request("r0", prompt, params=SamplingParams(max_tokens=1, ignore_eos=True))
            return prompt, engine.run()["r0"].steps[0].logits, want
    raise AssertionError("every candidate prompt has a sampler boundary within noise: add one to PROMPTS")


def check_first_token_distribution(sampler: dict, fault: str | None = None, model_name: str = DEFAULT_MODEL,
                                   draws: int = DRAWS, alpha: float = ALPHA, repeats: bool = False,
                                   draft_rank: int | None = None, draft_model: str | None = None):
    """The engine's first-token draws under seeds 0..draws-1 against the oracle's target (see module).
    A sampler may carry logits processors (PROCESSED_SAMPLERS); with `repeats`, the draw is judged as if
    the request had already generated its row's two likeliest tokens, the first of them twice (so the
    frequency and presence penalties have counts to act on): the engine's own per-request rows
    (engine/penalties.py) against reference.adjusted_logits. With `draft_rank` the row verifies a draft
    token, the reference row's likeliest but `draft_rank` (speculative decoding, engine.verify_token):
    what it emits must have the same distribution. With `draft_model` each seed's draft is a draft
    model's, drawn from its own distribution q under the sampler and verified against q: "self", the
    model itself (q is p: a good draft's overlap), or "draft", the strategies' draft model
    (strategies.engine_settings.draft_model_dir: q far from p, most drafts replaced from the residual)."""
    prompt, row, want = first_token_rows(model_name)
    model = tiny_model(model_name)
    speculation = dict(num_speculative_tokens=1, speculative_model=str(model.path) if draft_model == "self"
                       else draft_model_dir()) if draft_model else {}
    engine = LLMEngine(model, EngineConfig(mode="invariant", max_num_seqs=1, max_model_len=64, fault=fault,
                                           **speculation))
    params = SamplingParams(max_tokens=8, seed=0, **sampler)
    generated = [int(t) for t in np.argsort(-want, kind="stable")[[0, 1, 0]]] if repeats else []
    if params.processes_logits:
        seq = Sequence("r0", prompt, params, model.tokenizer.detokenizer(), 0)
        seq.output_ids = generated
        engine.penalties.add(seq)
        row = engine.penalties.apply([seq], row[None])[0]
        want = adjusted_logits(want, prompt, generated, params, model.config.eos_token_ids)
    if draft_model:
        tokens = [_verify_drafted(engine, prompt, row, replace(params, seed=seed)) for seed in range(draws)]
    elif draft_rank is None:
        tokens = [engine.choose_token(row, replace(params, seed=seed), len(generated)) for seed in range(draws)]
    else:
        draft = int(np.argsort(-want, kind="stable")[draft_rank])
        tokens = [engine.verify_token(row, replace(params, seed=seed), len(generated), draft) for seed in range(draws)]
    target = nucleus(want, sampler["temperature"], sampler.get("top_k", 0), sampler.get("top_p", 1.0)).probs
    fit = goodness_of_fit(tokens, target)
    if not fit.passed(alpha):
        after = (f" after {generated}" if generated else "") + \
            (f", verifying draft token {draft}" if draft_rank is not None else "") + \
            (f", verifying draft model {draft_model!r}'s draws" if draft_model else "")
        faulty = f" (fault {fault})" if fault else ""
        raise PropertyFailure(f"{DISTRIBUTION} does not hold on model {model_name}{faulty}"
                              f": {draws} draws of prompt {prompt}{after} with {sampler} (seeds 0..{draws - 1}) "
                              f"do not fit the float64 target (alpha {alpha:g}): {fit.describe()}")
    return fit


def _verify_drafted(engine: LLMEngine, prompt: list[int], row, params: SamplingParams) -> int:
    """The first token a request of `params` gets from verification row `row` (its target logits)
    where the engine's draft model proposed it one token: drawn by the drafter, verified against the
    distribution the drafter says it drew from."""
    drafter = engine.scheduler.drafter
    seq = Sequence("r0", prompt, params, engine.model.tokenizer.detokenizer(), 0)
    (draft,), = drafter.propose([(seq, 1)])
    q = drafter.draft_probs(seq, 0)
    drafter.forget(seq)
    return engine.verify_token(row, params, 0, draft, q)


@given(model=tiny_model_names(), schedule=sampled_schedules)
def test_sampled_tokens_lie_in_the_float64_support(model, schedule):
    check_sampled_support(model, schedule)


@pytest.mark.parametrize("sampler", SAMPLERS, ids=lambda s: "T{temperature}-k{top_k}-p{top_p}".format(**s))
def test_first_token_distribution_fits_the_float64_target(sampler):
    check_first_token_distribution(sampler)


@pytest.mark.parametrize("sampler", PROCESSED_SAMPLERS, ids=lambda s: "-".join(k for k in s if k != "temperature"))
def test_token_distribution_with_penalties_and_bias_fits_the_float64_target(sampler):
    check_first_token_distribution(sampler, repeats=True)


@given(arrays(np.float32, st.integers(2, 64), elements=st.floats(-50, 50, width=32)))
def test_top2_margin_is_the_gap_between_the_two_largest(row):
    """The margin every tolerance is compared with: a wrong one would explain any divergence, and the
    reference would compute it just as wrong (a survivor of mutation testing)."""
    top = np.sort(row)[::-1]
    assert top2_margin(row) == float(top[0] - top[1])
