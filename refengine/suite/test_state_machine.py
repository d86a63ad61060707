"""Property 5: the scheduler and the KV cache as a state machine (the one test that reads internals).

It starts with 1-3 requests; rules add more, abort any of them (finished ones too) and step the
engine, on tiny pools, budgets and block sizes, under any scheduling policy (the order of a step's
chunks: fcfs, prefill-first, shuffled), with prefix caching on or off, speculating 0-3 draft tokens by
prompt lookup (the tiny models' answers repeat themselves: drafts are found, accepted and rejected) or,
in a second machine, by a draft model (its own KV pool, all given back when every request has ended); an
added request may start
with an earlier one's first tokens, may carry a cache_salt, may ask for 2 or 3 answers (n: children
forking a sibling's prompt blocks) and for its prompt's logprobs (no cache hits while it scores them).
After every rule: the KV accounting adds up (free + used = total, refcounts = owners, finished and
aborted requests hold no block, a registered hash maps to one block); a registered block a sequence
holds is registered under that sequence's own hash at that place (chained from its salt through its
computed tokens: the same KV), and only registered blocks are held by two sequences; a registered
block's KV (every layer's keys and values) never changes while it stays registered under the same
hash, shared, cached on the free list or neither (nothing writes into KV another request may take; a
block the engine evicted and registered again within one step holds new KV); a
block held by several sequences is a registered one or a full block of the prompt that siblings forked
(never the partial block a fork copies), and its KV never changes while they hold it;
each running sequence holds
exactly the blocks its computed tokens need (LLMEngine.check_invariants: and only running sequences
hold penalty rows); a step never exceeds max_num_batched_tokens or
max_num_seqs; a step with work to do schedules something; a running request is left out of a step only
when the budget is spent (or too little is left to verify its drafts whole); under prefill-first no prefill chunk
follows a decode. At the end every request finishes, every block is free, and the run kept the
scheduler's policy (check.policy: admissions, preemptions, running order), and each verifying decode
gave its request what it accepted (check.speculation). A failure writes the
rules so far as a schedule (arrival and abort steps) to
$REFENGINE_REPRO_DIR/scheduler-kv-state-machine.json, which `refengine replay` re-runs.
"""
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from ..check.driver import STEP_ALLOWANCE
from ..check.policy import policy_problems
from ..check.schedule import parse_schedule
from ..check.speculation import speculation_problems
from ..engine import EngineConfig, LLMEngine
from ..engine.block_manager import block_hashes, salt_root
from ..sampling import SamplingParams
from ..strategies import MAX_PROMPT_LEN, MAX_TOKENS, tiny_model
from ..strategies.engine_settings import draft_model_dir, scheduling_policies
from ..strategies.models import DEFAULT_MODEL, VOCAB_SIZE
from ..strategies.shared_prefixes import SALTS
from .harness import fail, observe

MAX_REQUESTS = 6
NAME = "scheduler-kv-state-machine"


class SchedulerKVMachine(RuleBasedStateMachine):
    fault: str | None = None  # the fault-catalog test runs a subclass with a fault switched on
    by_draft_model = False  # speculate by prompt lookup; a subclass speculates by the draft model

    @initialize(max_num_seqs=st.integers(1, 4), budget=st.integers(1, 16), block_size=st.integers(1, 8),
                num_blocks=st.integers(2, 12), first_requests=st.integers(1, 3), policy=scheduling_policies(),
                caching=st.booleans(), speculative=st.integers(0, 3), data=st.data())
    def start(self, max_num_seqs, budget, block_size, num_blocks, first_requests, policy, caching, speculative, data):
        settings = {"mode": "fast", "max_num_seqs": max_num_seqs, "max_num_batched_tokens": budget,
                    "block_size": block_size, "num_blocks": num_blocks, "max_model_len": 128,
                    "scheduling_policy": policy[0], "scheduling_seed": policy[1], "enable_prefix_caching": caching,
                    "num_speculative_tokens": min(speculative, budget - 1)}
        if settings["num_speculative_tokens"] and self.by_draft_model:
            settings["speculative_model"] = draft_model_dir()
        self.engine = LLMEngine(tiny_model(), EngineConfig(**settings, fault=self.fault))
        self.evicted: set[int] = set()  # the registered blocks the engine evicted (unregistered) in the last step
        self.engine.block_manager._evict = self.observed(self.engine.block_manager)
        self.schedule = {"engine": settings, "requests": []}
        self.capacity = num_blocks * block_size
        self.failed = False
        self.preemptions: dict[str, int] = {}  # per request, counted from the trace
        self.registered: dict[bytes, tuple[int, bytes]] = {}  # hash -> (block, its KV when first seen registered)
        self.shared: dict[tuple[int, frozenset], bytes] = {}  # (block, the sequences holding it) -> its KV then
        for _ in range(first_requests):
            self.add(data)

    def observed(self, manager):
        """The block manager's eviction, noting each block it takes out of the cache: a free block may be
        evicted, recomputed (in fast mode, other bits) and registered again under the same hash in one step;
        one reused without being evicted (Fault.EVICTED_BLOCK_STILL_CACHED) is not noted."""
        evict = manager._evict

        def noting(block_id: int) -> None:
            registered = block_id in manager.hash_of
            evict(block_id)
            if registered and block_id not in manager.hash_of:
                self.evicted.add(block_id)
        return noting

    def check(self, condition: bool, message: str) -> None:
        if not condition:
            self.failed = True  # teardown must not bury the first failure under its own
            fail(NAME, DEFAULT_MODEL, self.schedule, message, self.fault)

    def live(self) -> list[str]:
        return [i for i in self.sequence_ids() if self.engine.output(i).finish_reason is None]

    @precondition(lambda self: len(self.schedule["requests"]) < MAX_REQUESTS)
    @rule(data=st.data())
    def add(self, data):
        max_tokens = data.draw(st.integers(1, min(MAX_TOKENS, self.capacity - 1)), label="max_tokens")
        length = data.draw(st.integers(1, min(MAX_PROMPT_LEN, self.capacity - max_tokens)), label="prompt length")
        prompt = [(7 * n + len(self.schedule["requests"])) % VOCAB_SIZE for n in range(length)]  # values don't matter here
        source = data.draw(st.integers(-1, len(self.schedule["requests"]) - 1), label="shares the prefix of")
        if source >= 0:
            theirs = self.schedule["requests"][source]["prompt_ids"]
            shared = data.draw(st.integers(1, min(len(theirs), length)), label="shared tokens")
            prompt = theirs[:shared] + prompt[shared:]
        salt = data.draw(st.sampled_from((None, *SALTS)), label="cache_salt")
        n = data.draw(st.integers(1, 3), label="n")
        scoring = data.draw(st.booleans(), label="prompt logprobs")
        request_id = f"r{len(self.schedule['requests'])}"
        self.schedule["requests"].append({"id": request_id, "prompt_ids": prompt, "max_tokens": max_tokens,
                                          "arrival_step": self.engine.num_steps,
                                          **({"cache_salt": salt} if salt else {}), **({"n": n} if n > 1 else {}),
                                          **({"prompt_logprobs": 0} if scoring else {})})
        self.engine.add_request(request_id, prompt, cache_salt=salt, params=SamplingParams(
            max_tokens=max_tokens, n=n, prompt_logprobs=0 if scoring else None))

    def sequence_ids(self) -> list[str]:
        """Every sequence the requests run as (an n > 1 request's children)."""
        return [i for r in self.schedule["requests"] for i in self.engine.request_ids(r["id"])]

    @precondition(lambda self: self.schedule["requests"])
    @rule(data=st.data())
    def abort(self, data):
        """Any request, finished ones included: aborting those must change nothing."""
        request = data.draw(st.sampled_from(self.schedule["requests"]), label="abort")
        if self.engine.abort(request["id"]):
            request["abort_step"] = self.engine.num_steps

    @rule()
    def step(self):
        status = self.engine.status()
        running_before = [s.request_id for s in self.engine.scheduler.running]
        self.evicted = set()
        self.engine.step()
        entry = self.engine.trace[-1]
        scheduled = sum(c["num_tokens"] for c in entry["scheduled"])
        config = self.engine.config
        self.check(scheduled <= config.max_num_batched_tokens,
                   f"step {entry['step']} scheduled {scheduled} tokens, budget {config.max_num_batched_tokens}")
        self.check(len(entry["scheduled"]) <= config.max_num_seqs,
                   f"step {entry['step']} ran {len(entry['scheduled'])} sequences, max_num_seqs {config.max_num_seqs}")
        self.check(bool(entry["scheduled"]) or not status["running"] + status["waiting"],
                   f"step {entry['step']} scheduled nothing with {status['running']} running and "
                   f"{status['waiting']} waiting: no progress")
        phases = [c["phase"] for c in entry["scheduled"]]
        self.check(config.scheduling_policy != "prefill-first" or phases == sorted(phases, reverse=True),
                   f"step {entry['step']} ran its chunks as {phases} under prefill-first")
        self.check(all(c["num_tokens"] >= 1 for c in entry["scheduled"]),
                   f"step {entry['step']} scheduled an empty chunk: {entry['scheduled']}")
        ids = {c["id"] for c in entry["scheduled"]}
        skipped = [r for r in running_before if r not in ids and r not in entry["preempted"]]
        # a verifying decode waits where the budget left cannot hold it whole
        self.check(config.max_num_batched_tokens - scheduled < 1 + config.num_speculative_tokens or not skipped,
                   f"step {entry['step']} left running {skipped} unscheduled with {scheduled} of "
                   f"{config.max_num_batched_tokens} tokens used")
        for request_id in entry["preempted"]:
            self.preemptions[request_id] = self.preemptions.get(request_id, 0) + 1
        for request_id in self.sequence_ids():
            got = self.engine.output(request_id).num_preemptions
            self.check(got == self.preemptions.get(request_id, 0),
                       f"{request_id} reports {got} preemptions, the trace shows {self.preemptions.get(request_id, 0)}")

    @invariant()
    def kv_accounting_adds_up(self):
        try:
            self.engine.check_invariants()
        except AssertionError as e:
            self.check(False, f"after step {self.engine.num_steps - 1}: KV accounting: {e}")
        running = self.engine.scheduler.running
        self.check(len(running) <= self.engine.config.max_num_seqs,
                   f"{len(running)} running sequences, max_num_seqs {self.engine.config.max_num_seqs}")
        manager, holders = self.engine.block_manager, {}
        size = manager.block_size
        salts = {r["id"]: r.get("cache_salt") for r in self.schedule["requests"]}
        for seq in self.engine.sequences.values():
            # its full blocks' hashes as its computed tokens and its salt define them (not as the engine kept them)
            salt = salt_root(salts[seq.family or seq.request_id])
            mine = block_hashes(seq.token_ids[:seq.num_computed_tokens], size, salt)
            for index, block in enumerate(seq.block_table.block_ids):
                # a full block of the tokens a fork shares (the prompt but its last), that it has computed
                forked = seq.family is not None and (index + 1) * size <= min(seq.num_prompt_tokens - 1,
                                                                               seq.num_computed_tokens)
                holders.setdefault(block, []).append((seq.request_id, seq.family if forked else None))
                registered = manager.hash_of.get(block)
                self.check(registered is None or mine[index:index + 1] == [registered],
                           f"{seq.request_id} holds block {block} as its block {index}, registered under a hash "
                           f"that is not its own tokens' and salt's there: it reads KV computed for something else")
            if seq.is_finished:
                self.check(not seq.block_table.block_ids,
                           f"{seq.request_id} finished ({seq.finish_reason}) but holds blocks {seq.block_table.block_ids}")
        shared = {block: [i for i, _ in held] for block, held in holders.items() if len(held) > 1
                  and block not in manager.hash_of and (None in {f for _, f in held} or len({f for _, f in held}) > 1)}
        self.check(not shared, f"blocks held by several requests without being a registered prefix block or a "
                               f"full block of the prompt siblings forked: {shared}: one of them reads the other's KV")
        self.cached_kv_never_changes()
        self.shared_kv_never_changes({block: frozenset(i for i, _ in held) for block, held in holders.items()
                                      if len(held) > 1})

    def cached_kv_never_changes(self):
        runner, seen = self.engine.runner, {}
        for block_hash, block in self.engine.block_manager.cached.items():
            kv = runner.k_cache[:, block].tobytes() + runner.v_cache[:, block].tobytes()
            first = self.registered.get(block_hash)
            again = block in self.evicted  # evicted and registered again since it was seen: new KV
            self.check(first is None or first[0] != block or first[1] == kv or again,
                       f"after step {self.engine.num_steps - 1}: block {block}, registered under one hash since "
                       f"then, holds other KV than when it was registered: written while others may take it")
            seen[block_hash] = first if first is not None and first[0] == block and not again else (block, kv)
        self.registered = seen

    def shared_kv_never_changes(self, shared: dict[int, frozenset]):
        """`shared`: block -> the sequences holding it, where several do. While the same ones hold it, its KV
        stays as it was (one of them writing there changes what the others read)."""
        runner, seen = self.engine.runner, {}
        for block, held in shared.items():
            kv = runner.k_cache[:, block].tobytes() + runner.v_cache[:, block].tobytes()
            before = self.shared.get((block, held), kv)
            self.check(before == kv, f"after step {self.engine.num_steps - 1}: block {block}, held by {sorted(held)} "
                                     f"since then, holds other KV: one of them wrote where the others read")
            seen[block, held] = kv
        self.shared = seen

    def teardown(self):
        if not hasattr(self, "engine") or self.failed:
            return
        budget = STEP_ALLOWANCE * sum(r.get("n", 1) * (len(r["prompt_ids"]) + r["max_tokens"])
                                      for r in self.schedule["requests"])
        for _ in range(budget):
            if not self.engine.has_unfinished():
                break
            self.step()
            self.kv_accounting_adds_up()
        self.check(not self.engine.has_unfinished(), f"requests {self.live()} never finished in {budget} steps")
        observe(self.schedule, self.engine.trace)
        problems = policy_problems(parse_schedule(self.schedule, NAME), self.engine.outputs(), self.engine.trace)
        self.check(not problems, "scheduling policy: " + "; ".join(problems))
        problems = speculation_problems(self.engine.outputs(), self.engine.trace, self.engine.status())
        self.check(not problems, "speculative decoding: " + "; ".join(problems))
        used = self.engine.block_manager.num_used_blocks
        self.check(used == 0, f"every request finished but {used} KV blocks are still in use")
        drafter = self.engine.scheduler.drafter
        held = getattr(drafter, "blocks", None) and drafter.blocks.num_used_blocks
        self.check(not held, f"every request finished but the draft model still holds {held} KV blocks")


class TestSchedulerKVMachine(SchedulerKVMachine.TestCase):
    pytestmark = pytest.mark.invariants


class DraftModelKVMachine(SchedulerKVMachine):
    """The same machine speculating by the draft model: its own machine, so the draws of the one above
    (and the catches the fault catalog's tests derandomize) stay what they were."""
    by_draft_model = True


class TestDraftModelKVMachine(DraftModelKVMachine.TestCase):
    pytestmark = pytest.mark.invariants


@pytest.mark.invariants
def test_max_num_seqs_holds_with_seats_full_and_requests_waiting():
    """A fixed case the machine's random walk reaches rarely: one seat, two requests waiting for it."""
    engine = LLMEngine(tiny_model(), EngineConfig(mode="fast", max_num_seqs=1, max_num_batched_tokens=16,
                                                  block_size=4, num_blocks=12, max_model_len=128))
    for request_id, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6])):
        engine.add_request(request_id, prompt, params=SamplingParams(max_tokens=4))
    while engine.has_unfinished():
        engine.step()
        assert len(engine.trace[-1]["scheduled"]) <= 1 and len(engine.scheduler.running) <= 1, engine.trace[-1]
