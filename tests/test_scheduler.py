"""The scheduler + KV state machine, driven without a forward pass: every sampled token is id 1."""
import hashlib
from dataclasses import replace

import pytest

from refengine.check.driver import run_batched
from refengine.check.schedule import load_schedule, parse_schedule
from refengine.data import shipped
from refengine.engine import EngineConfig
from refengine.engine.block_manager import BlockManager
from refengine.engine.config import SCHEDULING_POLICIES
from refengine.engine.scheduler import Scheduler
from refengine.engine.sequence import Sequence, SequenceStatus
from refengine.errors import RefengineError
from refengine.sampling import SamplingParams, StepRecord


def make(tiny_model, **settings):
    config = EngineConfig(**settings).resolved(tiny_model.config)
    manager = BlockManager(config.num_blocks, config.block_size)
    return Scheduler(config, manager), manager


def new_seq(tiny_model, request_id, prompt_len, max_tokens, step=0):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(request_id, list(range(3, 3 + prompt_len)), params, tiny_model.tokenizer.detokenizer(), step)


def run_step(scheduler, manager, step):
    """One step of the engine's bookkeeping; returns the scheduler output."""
    output = scheduler.schedule()
    assert output.num_tokens <= scheduler.max_num_batched_tokens
    assert len(output.chunks) <= scheduler.max_num_seqs
    scheduler.postprocess(output)
    for chunk in output.chunks:
        if chunk.samples:
            seq = chunk.seq
            seq.append_token(StepRecord(1, 1.0, step=step))
            if len(seq.output_ids) == seq.params.max_tokens:
                scheduler.finish(seq, "length", step)
    manager.check_invariants()
    return output


def test_chunked_prefill_then_decodes_within_the_token_budget(tiny_model):
    scheduler, manager = make(tiny_model, max_num_batched_tokens=8, block_size=4, num_blocks=20)
    seq = new_seq(tiny_model, "long", 21, 3)
    scheduler.add(seq)
    chunks = [run_step(scheduler, manager, s).chunks for s in range(5)]
    assert [(c[0].start, c[0].num_tokens, c[0].phase) for c in chunks] == [
        (0, 8, "prefill"), (8, 8, "prefill"), (16, 5, "prefill"), (21, 1, "decode"), (22, 1, "decode")]
    assert seq.is_finished and seq.output_ids == [1, 1, 1] and not seq.block_table.block_ids
    manager.check_invariants([seq.block_table])


def test_fcfs_running_first_then_waiting_and_steps_mix_prefill_with_decode(tiny_model):
    scheduler, manager = make(tiny_model, max_num_seqs=2, max_num_batched_tokens=6, block_size=4, num_blocks=30)
    a, b, c = (new_seq(tiny_model, name, 4, 4) for name in "abc")
    for seq in (a, b, c):
        scheduler.add(seq)
    first = run_step(scheduler, manager, 0)
    assert [(ch.seq.request_id, ch.num_tokens) for ch in first.chunks] == [("a", 4), ("b", 2)]
    second = run_step(scheduler, manager, 1)
    assert [(ch.seq.request_id, ch.phase) for ch in second.chunks] == [("a", "decode"), ("b", "prefill")]
    assert c.status is SequenceStatus.WAITING  # max_num_seqs=2 keeps it out while a and b run


def test_preemption_evicts_the_most_recent_and_it_recomputes_prompt_plus_generated(tiny_model):
    scheduler, manager = make(tiny_model, max_num_seqs=3, max_num_batched_tokens=16, block_size=2, num_blocks=8)
    old, new = new_seq(tiny_model, "old", 6, 8), new_seq(tiny_model, "new", 4, 8)
    scheduler.add(old)
    scheduler.add(new)
    preempted_at, resumed = None, None
    for step in range(40):
        output = run_step(scheduler, manager, step)
        if output.preempted and preempted_at is None:
            preempted_at = step
            assert [s.request_id for s in output.preempted] == ["new"]
            assert scheduler.waiting[0] is new and new.num_computed_tokens == 0 and not new.block_table.block_ids
            generated_before = len(new.output_ids)
            assert generated_before > 0
        elif preempted_at is not None and any(c.seq is new for c in output.chunks) and new.num_computed_tokens:
            resumed = next(c for c in output.chunks if c.seq is new)
            break
    assert preempted_at is not None, "the pool was sized to force a preemption"
    assert resumed is not None and resumed.start == 0 and resumed.phase == "prefill"
    assert resumed.num_tokens == new.num_prompt_tokens + generated_before
    assert new.num_preemptions == 1 and old.num_preemptions == 0


def test_every_request_finishes_under_heavy_contention(tiny_model):
    scheduler, manager = make(tiny_model, max_num_seqs=4, max_num_batched_tokens=5, block_size=2, num_blocks=9)
    seqs = [new_seq(tiny_model, f"r{i}", 3 + (i * 5) % 9, 2 + i % 6) for i in range(12)]
    preemptions = 0
    for step in range(1000):
        if step < len(seqs):
            scheduler.add(seqs[step])
        preemptions += len(run_step(scheduler, manager, step).preempted)
        if step >= len(seqs) and not scheduler.has_unfinished():
            break
    assert all(s.is_finished and len(s.output_ids) == s.params.max_tokens for s in seqs)
    assert preemptions > 0 and manager.num_used_blocks == 0
    manager.check_invariants([s.block_table for s in seqs])


def test_abort_frees_blocks_from_running_and_waiting(tiny_model):
    scheduler, manager = make(tiny_model, max_num_seqs=1, max_num_batched_tokens=4, block_size=2, num_blocks=10)
    running, waiting = new_seq(tiny_model, "run", 6, 4), new_seq(tiny_model, "wait", 3, 4)
    scheduler.add(running)
    scheduler.add(waiting)
    run_step(scheduler, manager, 0)
    assert running.block_table.block_ids and waiting.status is SequenceStatus.WAITING
    scheduler.finish(running, "abort", 1)
    scheduler.finish(waiting, "abort", 1)
    assert not scheduler.has_unfinished() and manager.num_used_blocks == 0
    manager.check_invariants([running.block_table, waiting.block_table])


@pytest.mark.parametrize("prompt_len, max_tokens, message", [
    (10, 10, "exceeds max_model_len 16"),
    (5, 8, "needs up to 7 KV blocks .* pool holds 6"),
])
def test_impossible_requests_are_rejected_at_admission(tiny_model, prompt_len, max_tokens, message):
    scheduler, _ = make(tiny_model, block_size=2, num_blocks=6, max_model_len=16)
    with pytest.raises(RefengineError, match=f"'big'.*{message}"):
        scheduler.add(new_seq(tiny_model, "big", prompt_len, max_tokens))
    assert not scheduler.has_unfinished()


def mixed_step(tiny_model, **policy):
    """Two decodes (a, b) and a long prompt (c) joining: c's first chunk is a partial prefill.
    Returns the scheduler, its block manager and the third step's output."""
    scheduler, manager = make(tiny_model, max_num_seqs=4, max_num_batched_tokens=6, block_size=4,
                              num_blocks=30, **policy)
    for name in "ab":
        scheduler.add(new_seq(tiny_model, name, 2, 8))
    run_step(scheduler, manager, 0)  # a and b prefill whole
    run_step(scheduler, manager, 1)  # a and b decode
    scheduler.add(new_seq(tiny_model, "c", 10, 4))
    return scheduler, manager, run_step(scheduler, manager, 2)


def described(output):
    return [(c.seq.request_id, c.start, c.num_tokens, c.phase) for c in output.chunks]


def test_each_policy_orders_the_same_chunks_of_a_mixed_step(tiny_model):
    fcfs = described(mixed_step(tiny_model)[2])
    assert fcfs == [("a", 3, 1, "decode"), ("b", 3, 1, "decode"), ("c", 0, 4, "prefill")]  # partial chunk last
    prefill_first = described(mixed_step(tiny_model, scheduling_policy="prefill-first")[2])
    assert prefill_first == [fcfs[2], fcfs[0], fcfs[1]]
    orders = set()
    for seed in range(8):
        shuffled = described(mixed_step(tiny_model, scheduling_policy="shuffled", scheduling_seed=seed)[2])
        key = [hashlib.sha256(f"{seed}:2:{chunk[0]}".encode()).digest() for chunk in fcfs]
        assert shuffled == [chunk for _, chunk in sorted(zip(key, fcfs))]  # sha256("seed:step:id") order
        assert shuffled == described(mixed_step(tiny_model, scheduling_policy="shuffled", scheduling_seed=seed)[2])
        orders.add(tuple(chunk[0] for chunk in shuffled))
    assert len(orders) > 2 and any(order[-1] != "c" for order in orders)


@pytest.mark.parametrize("policy", SCHEDULING_POLICIES[1:])
def test_a_policy_changes_the_order_never_the_decision(tiny_model, policy):
    """Step for step, the same chunks, preemptions and block tables as fcfs under heavy contention."""
    runs = [make(tiny_model, max_num_seqs=4, max_num_batched_tokens=5, block_size=2, num_blocks=9, **extra)
            for extra in ({}, {"scheduling_policy": policy, "scheduling_seed": 3})]
    seqs = [[new_seq(tiny_model, f"r{i}", 3 + (i * 5) % 9, 2 + i % 6) for i in range(12)] for _ in runs]
    reordered = 0
    for step in range(200):
        outputs = []
        for (scheduler, manager), mine in zip(runs, seqs):
            if step < len(mine):
                scheduler.add(mine[step])
            outputs.append(run_step(scheduler, manager, step))
        (fcfs, other) = outputs
        assert sorted(described(other)) == sorted(described(fcfs)), step
        assert [s.request_id for s in other.preempted] == [s.request_id for s in fcfs.preempted], step
        reordered += described(other) != described(fcfs)
        if step >= len(seqs[0]) and not runs[0][0].has_unfinished():
            break
    assert not runs[1][0].has_unfinished() and reordered > 0
    assert [s.block_table.block_ids for s in seqs[0]] == [s.block_table.block_ids for s in seqs[1]]


def test_join_leave_example_is_bit_identical_under_every_policy(default_model):
    """The shipped example (chunked prefill, preemption, an abort, a sampled request) on the model it
    is written for, the embedded default, in invariant mode."""
    schedule = load_schedule(shipped("examples", "join_leave.json"))
    runs = {}
    for policy in SCHEDULING_POLICIES:
        engine, failure = run_batched(default_model, schedule, replace(schedule.engine, scheduling_policy=policy,
                                                                    scheduling_seed=1), keep_logits=False)
        assert failure is None, failure
        runs[policy] = engine
    fcfs = runs["fcfs"]
    for policy, engine in runs.items():
        assert {rid: (o.token_ids, [s.logits_sha256 for s in o.steps], o.finish_reason)
                for rid, o in engine.outputs().items()} == \
               {rid: (o.token_ids, [s.logits_sha256 for s in o.steps], o.finish_reason)
                for rid, o in fcfs.outputs().items()}, policy
        assert [sorted(map(str, e["scheduled"])) for e in engine.trace] == \
               [sorted(map(str, e["scheduled"])) for e in fcfs.trace], policy
    for policy in SCHEDULING_POLICIES[1:]:  # the example does reach other orders
        assert [e["scheduled"] for e in runs[policy].trace] != [e["scheduled"] for e in fcfs.trace], policy


@pytest.mark.parametrize("engine, message", [
    ({"scheduling_policy": "lifo"}, "engine.scheduling_policy: expected one of fcfs, prefill-first, shuffled"),
    ({"scheduling_seed": -1}, "engine.scheduling_seed: must be a non-negative integer"),
    ({"scheduling_seed": True}, "engine.scheduling_seed: must be a non-negative integer"),
])
def test_bad_scheduling_settings_are_refused_naming_the_field(engine, message):
    with pytest.raises(RefengineError, match=message):
        parse_schedule({"engine": engine, "requests": [{"id": "r0", "prompt_ids": [1]}]}, "s.json")


@pytest.mark.parametrize("budget, block_size, num_blocks", [(5, 2, 9), (16, 1, 20), (3, 4, 6), (64, 2, 12)])
def test_fcfs_never_puts_a_decode_after_a_prefill_chunk(tiny_model, budget, block_size, num_blocks):
    """Under fcfs a step's prefill chunks (a resumed sequence's recompute included) come after its
    decodes, so the order faults chunk-order-dependent-logits-row and decode-context-after-prefill
    are reachable only through the other policies (the strategies draw them)."""
    scheduler, manager = make(tiny_model, max_num_seqs=4, max_num_batched_tokens=budget, block_size=block_size,
                              num_blocks=num_blocks)
    seqs = [new_seq(tiny_model, f"r{i}", 1 + (i * 5) % 9, 2 + i % 6, step=i) for i in range(12)]
    mixed = 0
    for step in range(1000):
        if step < len(seqs):
            scheduler.add(seqs[step])
        output = run_step(scheduler, manager, step)
        phases = [c.phase for c in output.chunks]
        assert phases == sorted(phases), f"step {step}: {phases}"  # "decode" < "prefill"
        mixed += len(set(phases)) == 2
        if step >= len(seqs) and not scheduler.has_unfinished():
            break
    assert all(s.is_finished for s in seqs) and mixed > 0
