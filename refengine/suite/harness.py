"""What the invariants properties share: what they draw, running a schedule, judging it, reporting
a failure.

Each `check_*` runs one example and raises PropertyFailure (an AssertionError whose message is the
full report) when the property does not hold; the @given tests and the fault-catalog tests both
call them. Before raising, the schedule is written as a repro file (check.repro: the schedule format
plus top-level keys saying which model and which comparison found it):
    $REFENGINE_REPRO_DIR/<property>.json   (default .hypothesis/repros/, relative to the run's cwd)
Hypothesis replays the shrunk example last, so the file ends up holding the minimal schedule;
`refengine replay FILE` re-runs the same comparison.
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path

from hypothesis import currently_in_test_context, event, target
from hypothesis import strategies as st

from ..check.calibrate import calibration_for
from ..check.driver import run_batched
from ..check.images import GeneratedImage, placed
from ..check.output_oracle import expected_finish, settled_length, stop_cut
from ..check.replay import Baselines, ReplayResult, replay
from ..check.repro import write_repro
from ..check.schedule import children, parse_schedule
from ..model.config import VISION_LANGUAGE
from ..strategies import schedules
from ..strategies.engine_settings import MODES
from ..strategies.models import VOCAB_SIZE, make_tiny_command, tiny_model
from ..strategies.schedules import blocks_for

REPRO_DIR_VAR = "REFENGINE_REPRO_DIR"
MEMO_SIZE = 2048
COVERAGE = ("batch size > 1", "mixed prefill+decode step", "preemption", "abort", "chunked prefill",
            "prefill before a decode", "partial prefill not last", "logprobs requested", "prompt logprobs requested",
            "draft rejected", "every draft accepted")


# What the engine properties draw (the fault-catalog tests hunt with the same strategies).
# Swarm testing: each example switches requests asking for n answers on or off (off first: what the
# shrinker goes to where a failure does not need them), one property covering plain and forked batches.
invariant_schedules = st.booleans().flatmap(lambda forks: schedules(VOCAB_SIZE, mode="invariant", forks=forks))
fast_schedules = schedules(VOCAB_SIZE, mode="fast")
any_mode_schedules = st.sampled_from(MODES).flatmap(lambda mode: schedules(VOCAB_SIZE, mode))
greedy_schedules = st.sampled_from(MODES).flatmap(lambda mode: schedules(VOCAB_SIZE, mode, allow_seeded=False))
other_budgets = st.integers(1, 64)


class PropertyFailure(AssertionError):
    """A property that does not hold; `repro` is the file the failing example was written to, if any."""

    def __init__(self, message: str, repro: Path | None = None):
        super().__init__(message)
        self.repro = repro


def repro_dir() -> Path:
    return Path(os.environ.get(REPRO_DIR_VAR) or ".hypothesis/repros")


def fail(name: str, model_name: str, schedule: dict, report: str, fault: str | None = None,
         comparison: dict | None = None):
    comparison = comparison or {}
    path = write_repro(repro_dir() / f"{name}.json", schedule, found_by=name, model=tiny_model(model_name),
                       model_command=make_tiny_command(model_name), against=comparison.get("against", "serial"),
                       other_budget=comparison.get("other_budget"), fault=fault)
    raise PropertyFailure(
        f"{name} does not hold on model {model_name}:\n{report}\n"
        f"shrunk schedule (written to {path}; re-run it with `refengine replay {path}`):\n"
        f"{json.dumps(schedule)}", path)


def _remember(memo: OrderedDict, key, run):
    if key not in memo:
        memo[key] = run()
        if len(memo) > MEMO_SIZE:
            memo.popitem(last=False)
    return memo[key]


class MemoizedBaselines(Baselines):
    """Request-alone and float64 runs keyed by (model, settings, request): shrinking re-runs them."""

    def __init__(self):
        self.runs: OrderedDict = OrderedDict()

    def alone(self, model, config, request):
        key = ("alone", str(model.path), config, json.dumps(request.prompt, sort_keys=True), request.params,
               request.images)
        return _remember(self.runs, key, lambda: super(MemoizedBaselines, self).alone(model, config, request))

    def reference(self, model, prompt_ids, params, images=()):
        key = ("reference", str(model.path), tuple(prompt_ids), params, images)
        return _remember(self.runs, key,
                         lambda: super(MemoizedBaselines, self).reference(model, prompt_ids, params, images))


baselines = MemoizedBaselines()


def coverage(schedule: dict, trace: list[dict]) -> set[str]:
    """The batching situations (COVERAGE) a run met."""
    prompt_len = {child.id: len(child.prompt["prompt_ids"])  # an n > 1 request runs as its children
                  for r in parse_schedule(schedule, "coverage").requests for child in children(r)}
    seen = {"logprobs requested"} if any("logprobs" in r for r in schedule["requests"]) else set()
    if any("prompt_logprobs" in r for r in schedule["requests"]):
        seen.add("prompt logprobs requested")
    for entry in trace:
        phases = {c["phase"] for c in entry["scheduled"]}
        if len(entry["scheduled"]) > 1:
            seen.add("batch size > 1")
        if phases == {"prefill", "decode"}:
            seen.add("mixed prefill+decode step")
        if entry["preempted"]:
            seen.add("preemption")
        if entry["aborted"]:
            seen.add("abort")
        chunks = entry["scheduled"]
        if any(c["phase"] == "prefill" and c["num_tokens"] < prompt_len[c["id"]] for c in chunks):
            seen.add("chunked prefill")
        if any(a["phase"] == "prefill" and b["phase"] == "decode" for a, b in zip(chunks, chunks[1:])):
            seen.add("prefill before a decode")  # scheduling orders other than fcfs reach the runner
        if any(c["phase"] == "prefill" and c["num_tokens"] < prompt_len[c["id"]] for c in chunks[:-1]):
            seen.add("partial prefill not last")
        drafted = [c for c in chunks if c.get("draft")]
        if any(c["accepted"] < c["draft"] for c in drafted):
            seen.add("draft rejected")
        if any(c["accepted"] == c["draft"] for c in drafted):
            seen.add("every draft accepted")
    return seen


def observe(schedule: dict, trace: list[dict]) -> set[str]:
    """Report coverage to Hypothesis: events for --hypothesis-show-statistics, targets to steer."""
    seen = coverage(schedule, trace)
    if currently_in_test_context():
        for label in sorted(seen):
            event(label)
        event(f"scheduling policy {schedule['engine'].get('scheduling_policy', 'fcfs')}")
        target(max((len(e["scheduled"]) for e in trace), default=0), label="batch size")
        target(sum(len(e["preempted"]) for e in trace), label="preemptions")
    return seen


def resolve_images(model_name: str, schedule: dict) -> dict:
    """The schedule with each drawn image (strategies.schedules.IMAGES: `{"at", "height", "width", "seed"}`)
    in its request's prompt, as the schedule format has it: its run of image tokens (check.images.image_run)
    before the prompt's token `at` (at its end where `at` is past it), the request's `images` the
    (height, width, seed) objects in prompt order; an image token drawn as text made 0, so the runs are the
    images'; the pool grown to hold the longest request alone. A model without vision, and a conversation
    (`continues`: its next turn resends the earlier prompt, cut where it must fit), take the requests
    without their images. A schedule without drawn images (none, or placed already) comes back as it was."""
    if not any("at" in image for r in schedule["requests"] for image in r.get("images", ())):
        return schedule
    model, engine, out = tiny_model(model_name), dict(schedule["engine"]), []
    vision = model.config.arch in VISION_LANGUAGE
    conversed = {r["continues"] for r in schedule["requests"] if "continues" in r}
    for raw in schedule["requests"]:
        if not any("at" in image for image in raw.get("images", ())):  # none, or placed
            out.append(raw)
            continue
        request = {k: v for k, v in raw.items() if k != "images"}
        if not vision or "continues" in raw or raw["id"] in conversed:
            out.append(request)
            continue
        length = len(raw["prompt_ids"])
        images = sorted(((min(i["at"], length), GeneratedImage(i["height"], i["width"], i["seed"]))
                         for i in raw["images"]), key=lambda image: image[0])  # stable: in drawn order
        prompt = placed(model, raw["prompt_ids"], images)
        request["prompt_ids"] = prompt
        request["images"] = [image.as_json() for _, image in images]
        engine["num_blocks"] = max(engine["num_blocks"], blocks_for(len(prompt) + request["max_tokens"],
                                                                    engine["block_size"]))
        out.append(request)
    return {**schedule, "engine": engine, "requests": out}


def prepared(model_name: str, schedule: dict) -> dict:
    """A drawn schedule as `model_name` runs it: its images placed, its conversations resolved."""
    return resolve_continuations(model_name, resolve_images(model_name, schedule))


def resolve_continuations(model_name: str, schedule: dict) -> dict:
    """The schedule with every `"continues": "rM"` (strategies.shared_prefixes) made a prompt: rM's
    prompt, rM's answer alone (greedy or with its seed: the answer a chat client got), then the
    request's own prompt as the next turn, cut so it fits max_model_len; the pool grown to hold it
    alone. It arrives as a client's next turn does, once it has the answer: its drawn arrival counts
    from when rM would have finished alone (batched, rM may still be running then). A schedule
    without one comes back as it was."""
    if not any("continues" in r for r in schedule["requests"]):
        return schedule
    model, engine, done = tiny_model(model_name), dict(schedule["engine"]), {}
    for raw in schedule["requests"]:
        request = {k: v for k, v in raw.items() if k != "continues"}
        if "continues" in raw:
            earlier = done[raw["continues"]]
            parsed = parse_schedule({"engine": engine, "requests": [earlier]}, "continuation")
            alone = baselines.alone(model, parsed.engine, parsed.requests[0])
            answer = alone.token_ids
            request["arrival_step"] = earlier["arrival_step"] + alone.finish_step + 1 + raw["arrival_step"]
            if "abort_step" in raw:  # as long after its arrival as drawn
                request["abort_step"] = request["arrival_step"] + raw["abort_step"] - raw["arrival_step"]
            head, most = earlier["prompt_ids"] + answer, engine["max_model_len"] - request["max_tokens"]
            # no room for a next turn: the conversation resent as it was, as much of it as fits
            request["prompt_ids"] = head + raw["prompt_ids"][:most - len(head)] if len(head) < most else head[:most]
            engine["num_blocks"] = max(engine["num_blocks"], blocks_for(len(request["prompt_ids"]) +
                                                                        request["max_tokens"], engine["block_size"]))
        done[request["id"]] = request
    return {**schedule, "engine": engine, "requests": list(done.values())}


def check(name: str, model_name: str, schedule: dict, against: str = "serial", other_budget: int | None = None,
          fault: str | None = None, on_events=None) -> ReplayResult:
    """Properties 1-4: replay `schedule` and judge every request against `against` (refengine.replay)."""
    schedule = prepared(model_name, schedule)
    if other_budget is not None:  # a verifying decode runs whole: no budget below it
        other_budget = max(other_budget, 1 + schedule["engine"].get("num_speculative_tokens", 0))
    model = tiny_model(model_name)
    needs_calibration = schedule["engine"]["mode"] == "fast" or against == "reference"
    result = replay(model, parse_schedule(schedule, name), against=against, other_budget=other_budget, fault=fault,
                    calibration=calibration_for(model, model_name) if needs_calibration else None, baselines=baselines,
                    on_events=on_events)
    observe(schedule, result.trace)
    if result.tolerance and currently_in_test_context():
        worst = max(v.max_agreeing_deviation for v in result.verdicts.values())
        target(worst / result.tolerance, label="logit deviation / tolerance")
    if not result.passed:
        comparison = {"against": against, **({"other_budget": other_budget} if other_budget else {})}
        fail(name, model_name, schedule, result.report(), fault, comparison)
    return result


def check_streaming(name: str, model_name: str, schedule: dict, choose_stops) -> None:
    """Property 6. `choose_stops(text)` picks stop strings for a request given the text it produces
    without any (so stops really occur). Then, for every request of the batched run: streamed deltas
    concatenate to the final text; the final text is the full decode of its tokens cut at the
    earliest stop string; it keeps exactly the tokens of its stop-free run up to the first one that
    completes a stop string (or an eos, or max_tokens), with that finish reason (check.output_oracle:
    defined apart from the engine's rules); and alone it gives the same tokens and text."""
    model, schedule = tiny_model(model_name), prepared(model_name, schedule)
    config = parse_schedule(schedule, name).engine
    free = {r.id: baselines.alone(model, config, r) for r in parse_schedule(schedule, name).requests}
    stopped = {**schedule, "requests": [{**r, "stop": choose_stops(free[r["id"]].text)}
                                        for r in schedule["requests"]]}
    parsed = parse_schedule(stopped, name)
    streamed = {r.id: "" for r in parsed.requests}

    def collect(events):
        for e in events:
            streamed[e.request_id] += e.text_delta

    engine, failure = run_batched(model, parsed, config, on_events=collect)
    observe(stopped, engine.trace)
    problems = [f"engine failure: {failure}"] if failure else []
    for request in parsed.requests:
        out, stops = engine.output(request.id), request.params.stop
        full = model.tokenizer.decode(out.token_ids)
        minimum = request.params.min_tokens  # no stop string ends in its first min_tokens tokens' text
        after = settled_length(model.tokenizer.decode(out.token_ids[:minimum])) if minimum else 0
        expected = stop_cut(full, stops, after)
        kept, reason = expected_finish(free[request.id].token_ids, model.tokenizer.decode, request.params,
                                       model.config.eos_token_ids)
        if streamed[request.id] != out.text:
            problems.append(f"{request.id}: streamed {streamed[request.id]!r} != final text {out.text!r}")
        if out.text != expected:
            problems.append(f"{request.id}: final text {out.text!r} != the decode of its tokens cut at {stops}: "
                            f"{expected!r} (full decode {full!r})")
        if out.finish_reason != "abort" and (out.token_ids, out.finish_reason) != \
                (free[request.id].token_ids[:kept], reason):
            problems.append(f"{request.id}: {len(out.token_ids)} tokens {out.token_ids}, finish_reason "
                            f"{out.finish_reason!r}; its stop-free tokens {free[request.id].token_ids} under stops "
                            f"{stops} end after {kept}, {reason!r}")
        if out.token_ids != free[request.id].token_ids[:len(out.token_ids)]:
            problems.append(f"{request.id}: tokens with stops {out.token_ids} are not a prefix of the tokens "
                            f"without {free[request.id].token_ids}")
        if out.finish_reason != "abort":
            solo = baselines.alone(model, config, request)
            if (solo.token_ids, solo.text) != (out.token_ids, out.text):
                problems.append(f"{request.id}: alone {solo.token_ids} {solo.text!r} != batched "
                                f"{out.token_ids} {out.text!r}")
    if problems:
        fail(name, model_name, stopped, "\n".join(problems))
