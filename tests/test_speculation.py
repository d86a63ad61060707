"""Speculative decoding by prompt lookup (EngineConfig.num_speculative_tokens): the drafter, the
verification rule, the KV rollback, the acceptance account (check.speculation, each rule shown failing
on a hand-made trace), the catalogued faults the properties must catch, and the server's flag and
metrics."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from refengine.check.calibrate import calibration_for
from refengine.check.driver import run_batched
from refengine.check.replay import replay
from refengine.check.sampling_oracle import goodness_of_fit, nucleus
from refengine.check.schedule import parse_schedule
from refengine.check.speculation import speculation_problems
from refengine.cli import main
from refengine.engine import EngineConfig, LLMEngine
from refengine.engine.block_manager import BlockManager, BlockTable
from refengine.engine.drafter import prompt_lookup
from refengine.errors import RefengineError
from refengine.sampling import SamplingParams, verify_draft
from refengine.strategies import DEFAULT_MODEL, SAMPLERS, tiny_model
from refengine.suite.harness import PropertyFailure
from refengine.suite.test_sampling import check_first_token_distribution

LOOPING = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # prompt lookup proposes 7, 8, 5, ... after it


def schedule_of(requests: list[dict], k: int = 3, mode: str = "invariant", **engine) -> dict:
    return {"engine": {"mode": mode, "max_num_seqs": 4, "max_num_batched_tokens": 64, "block_size": 4,
                       "num_blocks": 64, "max_model_len": 128, "num_speculative_tokens": k, **engine},
            "requests": requests}


def request(rid: str, prompt: list[int], arrival: int = 0, **fields) -> dict:
    return {"id": rid, "prompt_ids": prompt, "max_tokens": 12, "ignore_eos": True, "arrival_step": arrival, **fields}


def run(schedule: dict, fault: str | None = None):
    parsed = parse_schedule(schedule, "test")
    engine, failure = run_batched(tiny_model(DEFAULT_MODEL), parsed, replace(parsed.engine, fault=fault))
    return parsed, engine, failure


# ---- the drafter -----------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens, k, want", [
    (LOOPING, 3, [7, 8, 5]),              # the 3-gram (8, 5, 6) recurs at position 3: what followed it
    (LOOPING, 9, [7, 8, 5, 6]),           # up to the end of the tokens, no further
    ([1, 2, 3, 9, 2, 3], 2, [9, 2]),      # (9, 2, 3) does not recur, (2, 3) does
    ([4] * 8, 3, [4, 4, 4]),              # the earliest occurrence: the most tokens after it
    ([1, 2, 3, 4], 3, []),                # nothing recurs
    ([7], 3, []),
])
def test_prompt_lookup_proposes_what_followed_the_longest_recurring_suffix(tokens, k, want):
    assert prompt_lookup(tokens, k, 1, 3) == want


def test_prompt_lookup_needs_at_least_min_n_matching_tokens():
    assert prompt_lookup([1, 2, 3, 9, 2, 3], 2, 3, 3) == []
    assert prompt_lookup([1, 2, 3, 9, 2, 3], 2, 2, 2) == [9, 2]


# ---- the verification rule -------------------------------------------------------------------------

def test_greedy_verification_emits_the_argmax_whatever_the_draft():
    row = np.array([0.5, 3.0, 2.9, -1.0], dtype=np.float32)
    greedy = SamplingParams()
    assert [verify_draft(row, greedy, 0, draft) for draft in range(4)] == [1, 1, 1, 1]


@pytest.mark.parametrize("sampler", [SAMPLERS[0], SAMPLERS[4], {"temperature": 0.7, "top_k": 3, "top_p": 0.8}])
@pytest.mark.parametrize("rank", [0, 1, 3])
def test_verified_tokens_are_distributed_as_the_target_and_accept_the_draft_with_its_probability(sampler, rank):
    """Leviathan's rule with a certain draft: the draft comes out with probability p(draft), every other
    token with p(token); 4000 seeds against p itself, and the draft's share within 4 sigma of p(draft)."""
    row = np.random.default_rng(rank).normal(0, 1.5, 64).astype(np.float32)
    params = SamplingParams(**sampler, seed=0)
    target = nucleus(row, sampler["temperature"], sampler["top_k"], sampler["top_p"]).probs  # the oracle's
    support = np.argsort(-target, kind="stable")[:np.count_nonzero(target)]
    draft = int(support[min(rank, len(support) - 1)])
    tokens = [verify_draft(row, replace(params, seed=seed), 5, draft) for seed in range(4000)]
    assert goodness_of_fit(tokens, target).passed(1e-6)
    share, p = tokens.count(draft) / 4000, float(target[draft])
    assert abs(share - p) <= 4 * np.sqrt(p * (1 - p) / 4000) + 1e-12


def test_a_draft_outside_the_support_is_never_emitted():
    row = np.array([4.0, 3.0, -9.0, 2.0], dtype=np.float32)
    params = SamplingParams(temperature=1.0, top_k=2, seed=0)
    assert 2 not in {verify_draft(row, replace(params, seed=s), 0, 2) for s in range(500)}


def test_resampling_the_target_on_rejection_is_caught_by_the_distribution_property():
    """rejection-resamples-target: every token still in the support, the draft too likely. The
    shipped property's check fails it, for the likeliest token as the draft as for the second (on a
    sampler that leaves both likely; a flat one hides the second's excess)."""
    sampler = {"temperature": 1.0, "top_k": 2, "top_p": 1.0}
    for rank in (0, 1):
        check_first_token_distribution(sampler, draft_rank=rank)
        with pytest.raises(PropertyFailure, match="verifying draft token"):
            check_first_token_distribution(sampler, fault="rejection-resamples-target", draft_rank=rank)


def test_pricing_a_draft_model_draw_untempered_is_caught_by_the_distribution_property():
    """draft-probs-untempered: the draft drawn at the request's temperature but verified against the
    draft model's plain softmax. With the model as its own draft (q is p), a hot sampler's draws then
    favour what the untempered softmax underprices; the shipped check fails it and passes without.
    Where the two distributions agree (temperature 1, nothing truncated) the fault changes nothing."""
    hot = {"temperature": 1.5, "top_k": 0, "top_p": 1.0}
    check_first_token_distribution(hot, draft_model="self")
    with pytest.raises(PropertyFailure, match="verifying draft model 'self'"):
        check_first_token_distribution(hot, fault="draft-probs-untempered", draft_model="self")
    check_first_token_distribution({"temperature": 1.0, "top_k": 0, "top_p": 1.0},
                                   fault="draft-probs-untempered", draft_model="self")


# ---- the engine ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["invariant", "fast"])
def test_greedy_answers_and_logits_equal_the_unspeculated_engine(mode):
    schedule = schedule_of([request("r0", LOOPING), request("r1", [9, 10, 11, 12], 1),
                            request("r2", [20, 21, 20, 21, 20], 2, max_tokens=9)], mode=mode)
    parsed, engine, failure = run(schedule)
    assert failure is None
    off, _ = run_batched(tiny_model(DEFAULT_MODEL), parsed, replace(parsed.engine, num_speculative_tokens=0))
    status = engine.status()
    assert status["spec_decode_draft_tokens"] > status["spec_decode_accepted_tokens"] > 0  # some rejected
    assert engine.num_steps < off.num_steps
    for rid, out in off.outputs().items():
        assert engine.output(rid).token_ids == out.token_ids
        if mode == "invariant":
            assert [s.logits_sha256 for s in engine.output(rid).steps] == [s.logits_sha256 for s in out.steps]


def test_rejected_drafts_give_their_blocks_back_and_the_pool_ends_empty():
    schedule = schedule_of([request("r0", LOOPING, max_tokens=20), request("r1", [1, 2, 3, 1, 2], 0)], k=4,
                           block_size=1)
    parsed, engine, failure = run(schedule)  # run_batched checks the KV accounting after every step
    assert failure is None and engine.block_manager.num_used_blocks == 0
    assert any(c.get("draft", 0) > c.get("accepted", 0) for e in engine.trace for c in e["scheduled"])


def test_trim_gives_back_the_blocks_past_the_tokens_kept():
    manager = BlockManager(8, 4)
    table = BlockTable("r0")
    manager.allocate(table, 13)
    kept = table.block_ids[:2]
    manager.trim(table, 5)
    assert table.block_ids == kept and manager.num_free_blocks == 6
    manager.trim(table, 8)
    assert table.block_ids == kept


def test_a_decode_that_cannot_verify_whole_waits_and_nothing_is_admitted_past_it():
    """Budget 4 and three draft tokens: a running request whose verifying decode the budget left cannot
    hold waits for the next step (with budget to spare) instead of running without its drafts."""
    schedule = schedule_of([request("r0", LOOPING), request("r1", [1, 2, 3], 1), request("r2", [3, 4], 1)],
                           max_num_batched_tokens=4)
    parsed, engine, failure = run(schedule)
    assert failure is None
    ran = {rid: [e["step"] for e in engine.trace if any(c["id"] == rid for c in e["scheduled"])]
           for rid in ("r0", "r1", "r2")}
    waited = [e["step"] for e in engine.trace if sum(c["num_tokens"] for c in e["scheduled"]) < 4 and any(
        steps[0] < e["step"] < steps[-1] and e["step"] not in steps for steps in ran.values())]
    assert waited  # e.g. a request left out of a 3-token step, its decode with drafts needing more
    for entry in engine.trace:
        assert sum(c["num_tokens"] for c in entry["scheduled"]) <= 4
        assert all(c["num_tokens"] == 1 + c["draft"] for c in entry["scheduled"] if "draft" in c)
    assert replay(tiny_model(DEFAULT_MODEL), parsed, against="unspeculated").passed


@pytest.mark.parametrize("draft_model", [False, True])
def test_a_request_with_logits_processors_verifies_each_row_with_the_drafts_before_it_counted(draft_model):
    """Penalties, a bias and min_tokens read the tokens generated so far: verification row j is
    processed with drafts 0..j-1 counted, as the decode of that prefix would be, so the answers, greedy
    and seeded, are the unspeculated ones where every draft is greedy-verified, bit for bit."""
    from refengine.strategies.engine_settings import draft_model_dir
    processors = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "logit_bias": {"7": 2.0}, "min_tokens": 3}
    schedule = schedule_of([request("r0", LOOPING, **processors), request("r1", [4] * 8, presence_penalty=-1.0)],
                           **({"speculative_model": draft_model_dir()} if draft_model else {}))
    parsed, engine, failure = run(schedule)
    assert failure is None
    drafted = {c["id"] for e in engine.trace for c in e["scheduled"] if c.get("draft")}
    assert drafted == ({"r0", "r1"} if draft_model else {"r1"})  # r0's penalties keep its answer from repeating
    assert replay(tiny_model(DEFAULT_MODEL), parsed, against="unspeculated").passed


@pytest.mark.parametrize("k, budget, field", [(-1, 64, "num_speculative_tokens"), (True, 64, "num_speculative_tokens"),
                                              (4, 4, "max_num_batched_tokens")])
def test_bad_speculation_settings_name_the_field(k, budget, field):
    with pytest.raises(RefengineError, match=f"^{field}:"):
        EngineConfig(num_speculative_tokens=k, max_num_batched_tokens=budget)
    with pytest.raises(RefengineError, match="^prompt_lookup_min:"):
        EngineConfig(prompt_lookup_min=3, prompt_lookup_max=2)


def test_settings_carry_the_speculation_keys_only_when_it_is_on():
    assert "num_speculative_tokens" not in EngineConfig().settings()
    assert EngineConfig(num_speculative_tokens=2).settings()["num_speculative_tokens"] == 2


# ---- the acceptance account ------------------------------------------------------------------------

def _account(chunks: list[dict], tokens: dict[str, list[int]], status: dict, finish_step=None):
    trace = [{"step": 0, "scheduled": chunks}]
    outputs = {rid: SimpleNamespace(steps=[SimpleNamespace(step=s) for s in steps], finish_step=finish_step)
               for rid, steps in tokens.items()}
    return speculation_problems(outputs, trace, status)


def _status(drafts, draft_tokens, accepted, per_position):
    return {"spec_decode_drafts": drafts, "spec_decode_draft_tokens": draft_tokens,
            "spec_decode_accepted_tokens": accepted, "spec_decode_accepted_per_position": per_position}


def test_the_account_of_a_clean_run_adds_up():
    parsed, engine, failure = run(schedule_of([request("r0", LOOPING), request("r1", [4, 4, 4, 4], 1)]))
    assert failure is None
    assert speculation_problems(engine.outputs(), engine.trace, engine.status()) == []


@pytest.mark.parametrize("chunk, received, status, finish_step, problem", [
    ({"num_tokens": 3, "draft": 2, "accepted": 1}, 2, _status(1, 2, 1, [1, 0]), None, None),
    ({"num_tokens": 3, "draft": 2, "accepted": 2}, 2, _status(1, 2, 2, [1, 1, 0]), 0, None),  # ended on a draft
    ({"num_tokens": 1, "draft": 0, "accepted": 0}, 1, _status(0, 0, 0, [0]), None, None),  # nothing proposed
    ({"num_tokens": 2, "draft": 2, "accepted": 1}, 2, _status(1, 2, 1, [1, 0]), None, "fed 2 tokens"),
    ({"num_tokens": 3, "draft": 2, "accepted": 3}, 4, _status(1, 2, 3, [1, 1, 1]), None, "accepted 3 of 2"),
    ({"num_tokens": 3, "draft": 2, "accepted": 2}, 4, _status(1, 2, 2, [1, 1]), None, "received 4 tokens"),
    ({"num_tokens": 3, "draft": 2, "accepted": 1}, 1, _status(1, 2, 1, [1, 0]), None, "received 1 tokens"),
    ({"num_tokens": 3, "draft": 2, "accepted": 2}, 2, _status(1, 2, 2, [1, 1]), None, "received 2 tokens"),
    ({"num_tokens": 1, "draft": 0, "accepted": 0}, 0, _status(0, 0, 0, [0]), 0, "received 0 tokens"),
    ({"num_tokens": 3, "draft": 2, "accepted": 1}, 2, _status(2, 2, 1, [1, 0]), None, "counters: drafts"),
    ({"num_tokens": 3, "draft": 2, "accepted": 1}, 2, _status(1, 3, 1, [1, 0]), None, "counters: drafts"),
    ({"num_tokens": 3, "draft": 2, "accepted": 1}, 2, _status(1, 2, 2, [1, 0]), None, "counters: drafts"),
    ({"num_tokens": 3, "draft": 2, "accepted": 1}, 2, _status(1, 2, 1, [0, 1]), None, "accepted per position"),
    ({"num_tokens": 3, "draft": 2, "accepted": 2}, 3, _status(1, 2, 2, [1]), None, "accepted per position"),
])
def test_each_rule_of_the_account(chunk, received, status, finish_step, problem):
    problems = _account([{"id": "r0", "phase": "decode", "start": 9, **chunk}], {"r0": [0] * received}, status,
                        finish_step)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems


# ---- the catalogued faults -------------------------------------------------------------------------

@pytest.mark.parametrize("fault, against, failure", [
    ("bonus-token-duplicated", "serial", "speculative decoding: step"),
    ("draft-compared-one-row-late", "unspeculated", None),
    ("rejected-draft-blocks-kept", "serial", "after step"),  # the KV accounting, checked after every step
    ("draft-positions-off-on-join", "serial", None),
])
def test_each_fault_fails_a_small_schedule_and_the_clean_engine_passes_it(fault, against, failure):
    schedule = parse_schedule(schedule_of([request("r0", LOOPING), request("r1", [20, 21, 20, 21, 20], 1)]), "t")
    model = tiny_model(DEFAULT_MODEL)
    assert replay(model, schedule, against=against).passed
    result = replay(model, schedule, against=against, fault=fault)
    assert not result.passed
    if failure is None:
        assert result.divergences and result.engine_failure is None
    else:
        assert failure in (result.engine_failure or ""), result.engine_failure


# ---- the server ------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["ngram", "ngram:0", "draft:3", "draft::3", "eagle:/models/x:3", "ngram:two"])
def test_serve_refuses_a_bad_speculative_flag_in_one_line(spec, capsys):
    assert main(["serve", "--port", "0", "--speculative", spec]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--speculative" in err


def test_a_speculating_server_streams_the_unspeculated_answers_and_counts_its_drafts(tiny_model):
    """Three greedy completions at once, one streamed, from a server speculating 3 tokens: each the
    unspeculated engine's answer alone, one SSE event per token; /metrics counts the drafts under vLLM's
    names, and its accepted tokens per position add up to the accepted tokens."""
    import http.client
    import json
    from concurrent.futures import ThreadPoolExecutor

    from prometheus_client.parser import text_string_to_metric_families

    from refengine.serve.server import OpenAIServer

    prompts = [LOOPING, [20, 21, 20, 21, 20], [9, 10, 11, 12, 9, 10]]
    server = OpenAIServer(tiny_model, EngineConfig(mode="invariant", num_speculative_tokens=3))
    server.start()

    def post(prompt, stream):
        conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 12, "ignore_eos": True,
                                                            "stream": stream}),
                     {"Content-Type": "application/json"})
        raw = conn.getresponse().read()
        conn.close()
        if not stream:
            return json.loads(raw)["choices"][0]["token_ids"]
        events = [json.loads(f[6:]) for f in raw.decode().split("\n\n") if f.startswith("data: {")]
        assert all(len(e["choices"][0]["token_ids"]) == 1 for e in events if e["choices"])
        return [t for e in events if e["choices"] for t in e["choices"][0]["token_ids"]]

    try:
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(post, prompts, [False, True, False]))
        conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
    finally:
        server.close()
    for prompt, answer in zip(prompts, answers):
        alone = LLMEngine(tiny_model, EngineConfig(mode="invariant", max_num_seqs=1))
        alone.add_request("r", prompt, params=SamplingParams(max_tokens=12, ignore_eos=True))
        assert answer == alone.run()["r"].token_ids
    samples = {(s.name, s.labels.get("position")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["vllm:spec_decode_num_drafts_total", None] > 0
    assert samples["vllm:spec_decode_num_draft_tokens_total", None] >= samples[
        "vllm:spec_decode_num_accepted_tokens_total", None] > 0
    assert sum(samples["vllm:spec_decode_num_accepted_tokens_per_pos_total", str(p)] for p in range(3)) == \
        samples["vllm:spec_decode_num_accepted_tokens_total", None]


def test_against_the_unspeculated_engine_a_seeded_request_is_skipped_not_compared():
    """Under speculation a seeded request draws other tokens from the same distribution (the verified
    token's property holds it to that): here its answer differs from the unspeculated one, and the
    baseline skips it while it judges the greedy request beside it."""
    sampled = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 0}
    parsed = parse_schedule(schedule_of([request("r0", LOOPING), request("r1", [4] * 8, sampling=sampled)]), "t")
    result = replay(tiny_model(DEFAULT_MODEL), parsed, against="unspeculated")
    off, _ = run_batched(tiny_model(DEFAULT_MODEL), parsed, replace(parsed.engine, num_speculative_tokens=0))
    assert result.outputs["r1"].token_ids != off.output("r1").token_ids
    assert result.passed and {rid: v.kind for rid, v in result.verdicts.items()} == {"r0": "match", "r1": "skipped"}


def test_the_bench_runs_plain_and_speculating_engines_on_a_repetitive_workload():
    import json
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "refengine", "bench", "--scenario", "speculation", "--requests", "2",
                           "--max-tokens", "8", "--json"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    batches = json.loads(done.stdout)["speculation"]["batches"]
    assert set(batches) == {"1", "2"}
    for batch, data in batches.items():
        plain = data["plain"]
        assert plain["tokens_per_step"] == int(batch)  # one token per request and step
        assert "+".join(["1"] * int(batch)) in data["forward_s"] and data["draft_forward_s"]["1"] > 0
        assert set(data["drafters"]) == {"prompt lookup", "draft model"}
        for spec in data["drafters"].values():
            assert spec["same_answers"] and spec["accepted_tokens"] > 0
            assert spec["tokens_per_step"] > plain["tokens_per_step"]
            assert spec["decode_tokens"] == plain["decode_tokens"]  # the same answers, so the same first tokens left
            assert spec["speedup"] == spec["decode_tok_s"] / plain["decode_tok_s"]
            assert spec["predicted_speedup"] == spec["priced_tok_s"] / plain["priced_tok_s"]


# ---- the draft model -------------------------------------------------------------------------------

def test_the_target_as_its_own_draft_model_has_every_draft_accepted():
    """Its greedy drafts are the target's own greedy tokens (the draft runner attends row by row, as a
    decode): every draft token is accepted, and the answers are the unspeculated ones."""
    from refengine.strategies.models import tiny_model_dir
    schedule = schedule_of([request("r0", LOOPING), request("r1", [9, 10, 11, 12], 1)], k=3,
                           speculative_model=str(tiny_model_dir(DEFAULT_MODEL)))
    parsed, engine, failure = run(schedule)
    status = engine.status()
    assert failure is None and status["spec_decode_draft_tokens"] == status["spec_decode_accepted_tokens"] > 0
    assert replay(tiny_model(DEFAULT_MODEL), parsed, against="unspeculated").passed
    assert engine.scheduler.drafter.blocks.num_used_blocks == 0 and not engine.scheduler.drafter.tables


@pytest.mark.parametrize("mode", ["invariant", "fast"])
def test_another_draft_model_preempted_with_its_request_changes_no_answer(mode):
    """A draft model of another architecture proposes drafts the target partly rejects; on a pool of 26
    one-token blocks the requests preempt each other, and the draft model's KV goes with theirs."""
    from refengine.strategies.engine_settings import draft_model_dir
    schedule = schedule_of([request("r0", LOOPING), request("r1", [4] * 8), request("r2", [20, 21, 20], 1)], k=3,
                           mode=mode, block_size=1, num_blocks=26, speculative_model=draft_model_dir())
    parsed, engine, failure = run(schedule)
    status = engine.status()
    assert failure is None and status["preemptions"] > 0
    assert status["spec_decode_draft_tokens"] > status["spec_decode_accepted_tokens"] > 0
    assert engine.scheduler.drafter.blocks.num_used_blocks == 0
    model = tiny_model(DEFAULT_MODEL)
    assert replay(model, parsed, against="unspeculated", calibration=calibration_for(model, DEFAULT_MODEL)).passed


def test_a_draft_model_that_cannot_serve_is_refused_naming_the_field(tmp_path):
    from refengine.model.cache import default_model_dir
    model = tiny_model(DEFAULT_MODEL)
    with pytest.raises(RefengineError, match="^speculative_model: cannot load"):
        LLMEngine(model, EngineConfig(num_speculative_tokens=2, speculative_model=str(tmp_path / "none")))
    with pytest.raises(RefengineError, match="^speculative_model: its vocabulary"):  # tiny-chat's is not 512 ids
        LLMEngine(model, EngineConfig(num_speculative_tokens=2, speculative_model=str(default_model_dir())))


def test_serve_refuses_a_draft_model_it_cannot_load_in_one_line(tmp_path, capsys):
    assert main(["serve", "--port", "0", "--speculative", f"draft:{tmp_path / 'none'}:3"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "cannot load" in err and str(tmp_path / "none") in err


def test_a_draft_model_short_of_blocks_gives_back_the_least_recent_table_and_drafts_the_same():
    """Two requests share a 30-token prompt through the target's prefix cache (46 one-token blocks); the
    draft model holds a copy each, more than its pool of one longest request (51 blocks) holds, so each
    proposal takes the other's table and computes its own again: row by row, the same KV and drafts."""
    from refengine.strategies.engine_settings import draft_model_dir
    prompt = [(7 * n) % 500 for n in range(30)]
    schedule = schedule_of([request("r0", prompt, max_tokens=8), request("r1", prompt, 1, max_tokens=8)], k=3,
                           block_size=1, num_blocks=46, max_model_len=48, enable_prefix_caching=True,
                           speculative_model=draft_model_dir())
    parsed, engine, failure = run(schedule)
    drafter = engine.scheduler.drafter
    assert failure is None and engine.output("r1").num_cached_tokens > 0
    assert 2 * (len(prompt) + 8) > drafter.blocks.num_blocks  # both tables never fit at once
    assert engine.status()["spec_decode_drafts"] > 0 and drafter.blocks.num_used_blocks == 0
    assert replay(tiny_model(DEFAULT_MODEL), parsed, against="unspeculated").passed


@pytest.mark.parametrize("residual", [True, False])
def test_a_draft_drawn_from_its_own_distribution_is_verified_to_the_target(residual):
    """A draft model's seeded draft, drawn from its distribution q, accepted with min(1, p/q) and
    replaced from max(p - q, 0) when rejected: what comes out is distributed as p, and the draft is
    accepted with probability sum(min(p, q)). Drawing a rejected position from p itself
    (rejection-resamples-target) is not: too much of the tokens q favours."""
    from refengine.sampling import pick_token, token_uniform
    rng = np.random.default_rng(5)
    row = rng.normal(0, 1.5, 64).astype(np.float32)
    params = SamplingParams(temperature=1.0, seed=0)
    p = nucleus(row, 1.0).probs  # the oracle's target
    q = rng.dirichlet(np.full(64, 0.3))  # a draft model that disagrees with the target
    draws = 4000
    drafts = [pick_token(np.arange(64), q, token_uniform(seed, 5, draw=2)) for seed in range(draws)]
    tokens = [verify_draft(row, replace(params, seed=seed), 5, d, residual, q) for seed, d in enumerate(drafts)]
    fits = goodness_of_fit(tokens, p).passed(1e-6)
    assert fits == residual
    if residual:
        accepted = sum(t == d for t, d in zip(tokens, drafts)) / draws
        expected = float(np.minimum(p, q).sum())
        assert abs(accepted - expected) <= 4 * np.sqrt(expected * (1 - expected) / draws)


def test_a_draft_model_drafts_a_steps_decodes_in_one_forward_per_draft_position():
    """Four requests decoding together: each step's proposal runs the draft model once per draft position
    (the first over every request's unseen tokens, then a row each), not once per request and draft;
    and the answers are the unspeculated ones alone."""
    from refengine.strategies.engine_settings import draft_model_dir
    schedule = schedule_of([request(f"r{n}", [3 + n, 9, 3 + n, 9]) for n in range(4)], k=3,
                           speculative_model=draft_model_dir())
    parsed = parse_schedule(schedule, "test")
    engine = LLMEngine(tiny_model(DEFAULT_MODEL), parsed.engine)
    drafter, forwards = engine.scheduler.drafter, []
    execute = drafter.runner.execute
    drafter.runner.execute = lambda chunks, blocks: forwards.append(len(chunks)) or execute(chunks, blocks)
    for r in parsed.requests:
        engine.add_request(r.id, **r.prompt, params=r.params)
    drafting = []  # per step that proposed: the drafts of each verifying decode
    while engine.has_unfinished():
        engine.step()
        drafts = [c["draft"] for c in engine.trace[-1]["scheduled"] if c.get("draft")]
        drafting += [drafts] if drafts else []
    # a forward per draft position, each over the decodes drafting that many: all four in one
    assert forwards == [sum(d > j for d in drafts) for drafts in drafting for j in range(max(drafts))]
    assert max(forwards) == 4
    assert replay(tiny_model(DEFAULT_MODEL), parsed, against="unspeculated").passed


def test_a_seeded_request_resumed_after_preemption_verifies_the_tokens_it_verifies_alone():
    """On a pool of 5 one-token blocks r1 (seeded) is preempted while r0 grows. Resumed, it recomputes all
    but its last token, which then runs as the verifying decode it is alone: the same tokens verified
    against the same drafts, so the same answer (its prefill sampling that token instead would draw it
    with other uniforms than verification does: chunking-consistency found that)."""
    from refengine.strategies.engine_settings import draft_model_dir
    sampled = {"temperature": 1.5, "top_k": 0, "top_p": 1.0}
    schedule = schedule_of([request("r0", [0], max_tokens=4), request("r1", [0], max_tokens=4,
                                                                      sampling={**sampled, "seed": 0})],
                           k=1, block_size=1, num_blocks=5, speculative_model=draft_model_dir())
    for budget in (64, 2):  # preempted, and alone in every step
        parsed, engine, failure = run({**schedule, "engine": {**schedule["engine"], "max_num_batched_tokens": budget}})
        assert failure is None and engine.status()["spec_decode_drafts"] > 0
        assert (engine.output("r1").num_preemptions > 0) == (budget == 64)
        assert replay(tiny_model(DEFAULT_MODEL), parsed).passed


def test_a_draft_model_samples_a_seeded_requests_drafts_and_batched_equals_alone():
    """Seeded requests under a draft model: drafts drawn with their own keyed uniforms, so a request's
    drafts, and so its answer, are its own batched or alone, bit for bit in invariant mode."""
    from refengine.strategies.engine_settings import draft_model_dir
    sampled = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    schedule = schedule_of([request("r0", LOOPING, sampling={**sampled, "seed": 1}),
                            request("r1", [4] * 8, 1, sampling={**sampled, "seed": 2}), request("r2", [20, 21])],
                           speculative_model=draft_model_dir())
    parsed, engine, failure = run(schedule)
    status = engine.status()
    assert failure is None and status["spec_decode_draft_tokens"] > status["spec_decode_accepted_tokens"] > 0
    assert replay(tiny_model(DEFAULT_MODEL), parsed).passed
