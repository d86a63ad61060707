"""The judge's own tests kill its mutants: each hand-written mutant below changes one thing in a copy of
the package (a boundary, a dropped condition, a swapped source), and the tests named with it must fail
on that copy. A mutant whose text is no longer in its module fails here too, so the list cannot rot.
Covers validate/aborts, validate/bounds, validate/effects, validate/junit, the finish-reason dialect
of validate/baseline, board's abort count, validate/cache with the cached-token figures it reads,
the cache groups and salts, check/prefix_cache, refengine/sampling.py's finish, stop-cut and
log-softmax rules, which the shipped properties hold to check/output_oracle, the oracle's min_tokens
rules, the processed-row comparison and its noise gain, validate/surface's probe, the prompt-logprob
comparisons (check/comparison, validate/baseline), the reading of prompt logprobs, of choices and of a
refusal's field name, the children of an n > 1 request the judge expects, every choice judged, and the
variants the load sends (validate/plan, board, variants' report), golden answers decoded with
their special tokens written (check/golden, validate/baseline), the progress the driver watches
alone and serial runs for (check/driver, check/replay), the scheduler's policy read from a run
(check/policy), speculative decoding's account (check/speculation) and its baseline without
speculation (check/replay), images in schedules, the float64 reference and the calibration (check/images,
check/schedule, check/driver, check/replay, check/calibrate), images in prompt and golden files and what
validate sends and measures of them (check/case_images, check/golden_check, validate/plan, margins,
baseline), and the golden refresh on Ray (check/golden_ray; slow: a pytest run per mutant)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ABORTS, BOUNDS, EFFECTS, JUNIT = (f"refengine/validate/{m}.py" for m in ("aborts", "bounds", "effects", "junit"))
T_ABORTS = ["tests/test_aborts.py"]
T_EFFECTS = ["tests/test_effects.py"]
CACHE, T_CACHE = "refengine/validate/cache.py", ["tests/test_validate_cache.py"]
SAMPLING, T_STREAMING = "refengine/sampling.py", ["refengine/suite/test_streaming.py"]
ORACLE, T_ORACLE = "refengine/check/output_oracle.py", ["tests/test_output_oracle.py"]
T_PENALTIES = ["tests/test_penalties.py"]
SURFACE, T_SURFACE = "refengine/validate/surface.py", ["tests/test_validate_surface.py"]
T_PROBE = ["tests/test_invariants_http.py", "-k", "ignores_processors"]
COMPARISON, T_PROMPT = "refengine/check/comparison.py", ["tests/test_prompt_logprobs.py"]
T_FORKS = ["tests/test_forks.py"]
BASELINE, T_BASELINES = "refengine/validate/baseline.py", ["tests/test_validate_baselines.py", "-k", "prompt_logprobs"]
WIRE, BOARD, PLAN = (f"refengine/validate/{m}.py" for m in ("wire", "board", "plan"))
T_CHOICES = ["tests/test_validate_baselines.py", "-k", "choice"]
T_SERVER_FAILED = ["tests/test_dialects.py", "-k", "broken_by or 5xx"]
T_SPECIALS = ["tests/test_effects.py", "tests/test_dialects.py", "-k", "special or hf"]
DRIVER = "refengine/check/driver.py"
POLICY, T_POLICY = "refengine/check/policy.py", ["tests/test_policy.py"]
RAY, T_RAY = "refengine/check/golden_ray.py", ["tests/test_golden_ray.py"]
SPECULATION, T_SPECULATION = "refengine/check/speculation.py", ["tests/test_speculation.py", "-k", "account or fault"]
T_STUCK = ["tests/test_invariants_faults.py", "-k", "never_ends or allowance"]
IMAGES, T_IMAGES = "refengine/check/images.py", ["tests/test_schedule_images.py"]
CASE_IMAGES, T_GOLDEN_IMAGES = "refengine/check/case_images.py", ["tests/test_golden_images.py"]
T_VALIDATE_IMAGES = ["tests/test_validate_images.py", "-k", "data_urls or margins or serial_baseline or passes"]
T_VARIANTS = ["tests/test_validate.py", "tests/test_dialects.py", "tests/test_validate_baselines.py", "-k",
              "variant or every_answer or clean_server or passes"]

MUTANTS = [  # (module, text, mutated text, tests that must fail)
    (ABORTS, "(to_come(r) or 0) > ABORT_SLACK", "(to_come(r) or 0) >= ABORT_SLACK", T_ABORTS),
    (ABORTS, "any(began >= hung_up and", "any(", T_ABORTS),
    (ABORTS, 'start + record["done_s"] + CLOCK_SLACK_S', 'start + record["done_s"]', T_ABORTS),
    (ABORTS, "state.finished - finished_before <= sum(", "state.finished - finished_before < sum(", T_ABORTS),
    (ABORTS, "state.finished - finished_before <= sum(", "state.finished <= sum(", T_ABORTS),
    (ABORTS, "for t in ends if t <= began)", "for t in ends)", T_ABORTS),
    (ABORTS, 'if r["verdict"] in COMPARED]', 'if r["verdict"] != "error"]', T_ABORTS),
    (ABORTS, "if not proving or unfinished_after_hang_up(", "if unfinished_after_hang_up(", T_ABORTS),
    (ABORTS, "if not proving or unfinished_after_hang_up(", "if not proving or True or (", T_ABORTS),
    (ABORTS, "before is not None and before.finished is not None", "before is not None", T_ABORTS),
    (ABORTS, "ok = len(must) <= counted <= may", "ok = len(must) < counted <= may", T_ABORTS),
    (ABORTS, "ok = len(must) <= counted <= may", "ok = len(must) <= counted < may", T_ABORTS),
    (ABORTS, "ok = len(must) <= counted <= may", "ok = counted <= may", T_ABORTS),
    (ABORTS, 'r["verdict"] in ("cancelled", "error") for r in records)', 'r["verdict"] == "cancelled" for r in records)',
     T_ABORTS),
    ("refengine/validate/drain.py", "else self.ended - self.aborted", "else self.ended", T_ABORTS),
    ("refengine/validate/baseline.py", "return len(case.token_ids) == case.max_tokens and (", "return (",
     ["tests/test_dialects.py"]),
    ("refengine/validate/baseline.py", '(case.finish_reason, finish_reason) == ("stop", "length")',
     '{case.finish_reason, finish_reason} == {"stop", "length"}', ["tests/test_dialects.py"]),
    ("refengine/validate/board.py", "before_load = poller.before or drain_baseline if",
     "before_load = drain_baseline if", ["tests/test_validate.py"]),
    (BOUNDS, "precision_tolerance = None if bound is None else bound * safety",
     "precision_tolerance = bound", T_EFFECTS),
    (BOUNDS, "        precision_tolerance = margin_tolerance\n", "        pass\n", T_EFFECTS),
    (BOUNDS, "    if batch_invariant:\n", "    if False:\n", T_EFFECTS),
    (BOUNDS, '(named, "the model\'s config.json") if named', '(named, "the model\'s config.json") if False',
     T_EFFECTS),
    (BOUNDS, "elif golden is not None and margin_tolerance is None:", "elif False:", T_EFFECTS),
    (BOUNDS, 'batching, batching_from = precision_tolerance, "precision"', 'batching, batching_from = 0.0, "precision"',
     T_EFFECTS),
    (EFFECTS, 'if r["verdict"] in KINDS[1:]]', 'if r["verdict"] == "diverged"]', ["tests/test_effects.py"]),
    (EFFECTS, 'batching = [r["batching"]["verdict"] for r in requests if "batching" in r]', "batching = []",
     T_EFFECTS),
    (JUNIT, "    elif aborts and not aborts[\"ok\"]:\n", "    elif False:\n", T_EFFECTS),
    (JUNIT, 'elif aborts and not aborts.get("alone", {"ok": True})["ok"]:', "elif False:", T_EFFECTS),
    (JUNIT, 'if report["drain"]["checked"] and not report["drain"]["drained"]:', 'if not report["drain"]["drained"]:',
     T_EFFECTS),
    (JUNIT, '            if batching.get("verdict") == "diverged":', '            if False:', T_EFFECTS),
    (JUNIT, 'skipped += 1', 'skipped += 0', T_EFFECTS),
    # the prefix cache's part of the report and where its figures come from
    (CACHE, '"hits": sum(1 for c in reported if c > 0)}', '"hits": sum(1 for c in reported if c >= 0)}', T_CACHE),
    (CACHE, 'return r.get("cache", "warm") if salt_sent else "warm"', 'return r.get("cache", "warm")', T_CACHE),
    (CACHE, 'for r in groups["cold"] if r.get("cached_tokens")]', 'for r in requests if r.get("cached_tokens")]',
     T_CACHE),
    (CACHE, '"load": load}', '"load": _counters(start, end)}', T_CACHE),
    (CACHE, '"hits": after.cache_hits - before.cache_hits', '"hits": after.cache_hits', T_CACHE),
    (CACHE, '"cached_tokens": sum(reported) if reported else None', '"cached_tokens": sum(reported)', T_CACHE),
    (CACHE, '**({"batching": {k: batching.count(k) for k in KINDS}} if batching else {})',
     '"batching": {k: batching.count(k) for k in KINDS}', T_CACHE),
    ("refengine/validate/wire.py", '_dict(obj.get("timings")).get("cache_n")):', "):", T_CACHE),
    ("refengine/validate/wire.py", "cached_tokens(chunk) if cached_tokens(chunk) is not None else self.cached_tokens",
     "cached_tokens(chunk)", T_CACHE),
    ("refengine/validate/plan.py", "CACHE[rank * len(CACHE) // len(planned)]", "CACHE[rank % 2]", T_CACHE),
    ("refengine/validate/dialect.py", '"shared": f"{self.salt}:load"}', '"shared": self.salt}', T_CACHE),
    ("refengine/validate/repro.py", 'cache=r.get("cache", "warm")))', "))", T_CACHE),
    ("refengine/validate/drain.py", '("cache_queries", "prefix_cache_queries"), ("cache_hits", "prefix_cache_hits"))}',
     ")}", T_CACHE),
    ("refengine/check/prefix_cache.py", "if reported != start:", "if False:", ["tests/test_prefix_caching.py"]),
    ("refengine/check/prefix_cache.py", "if other != rid and salts[other] == salts[rid]), default=0)",
     "if other != rid), default=0)", ["tests/test_invariants_faults.py", "-k", "cache-salt-ignored and dev"]),
    ("refengine/check/replay.py", "if config.enable_prefix_caching and failure is None:", "if False:",
     ["tests/test_prefix_caching.py"]),
    # the rules refengine/sampling.py gives the engine and the reference alike: check.output_oracle's own
    (SAMPLING, "any(s and s in text[max(0, stop_from - len(s) + 1):] for s in params.stop)",
     "any(s and text.endswith(s) for s in params.stop)",
     T_STREAMING),
    (SAMPLING, "if num_generated >= params.max_tokens:", "if num_generated > params.max_tokens:", T_STREAMING),
    (SAMPLING, "return text[:min(cuts)] if cuts else text", "return text[:max(cuts)] if cuts else text", T_STREAMING),
    (SAMPLING, "return shifted - np.log(np.sum(np.exp(shifted)))", "return shifted",
     ["refengine/suite/test_batching.py", "refengine/suite/test_reference.py"]),
    (ORACLE, "        if count <= params.min_tokens:\n", "        if count < params.min_tokens:\n", T_ORACLE),
    (ORACLE, "and position + len(stop) > after for stop in stops", "for stop in stops", T_ORACLE),
    (ORACLE, 'return len(text.rstrip("\\ufffd"))', "return len(text)", T_ORACLE),
    ("refengine/check/comparison.py", "if processed is not None and (", "if False and (", T_PENALTIES),
    ("refengine/check/comparison.py", "out=np.zeros_like(g), where=~both)", "out=np.zeros_like(g))", T_PENALTIES),
    ("refengine/check/margin_rule.py", "    return max(r, 1 / r)\n", "    return r\n", T_PENALTIES),
    ("refengine/check/replay.py", "(tol or 0.0) * processed_noise_gain(request.params)", "(tol or 0.0)",
     T_PENALTIES),
    (SURFACE, "if margin < gain / 2:", "if margin < gain:", T_SURFACE),
    (SURFACE, "gain = PENALTY * (k - rival) if", "gain = PENALTY * k if", T_SURFACE),
    (SURFACE, "else PENALTY * (rival == 0)", "else PENALTY", T_SURFACE),
    (SURFACE, "        if not k or margin is None:\n", "        if margin is None:\n", T_SURFACE),
    (SURFACE, "        elif _changed(plain, got, step):\n", "        elif True:\n", T_PROBE),
    (SURFACE, "for name, v in verdicts.items() if v[\"verdict\"] in FINDINGS]",
     "for name, v in verdicts.items() if v[\"verdict\"] == \"ignored\"]", T_SURFACE),
    (SURFACE, "if got.text.endswith(plain.text):", "if True:", T_SURFACE),
    (SURFACE, "if not entries or entries[0] is not None or", "if not entries or", T_SURFACE),
    (SURFACE, "len(entries) != len(ids) or any(", "any(", T_SURFACE),
    (SURFACE, "got.prompt_token_ids or plain.prompt_token_ids", "got.prompt_token_ids", T_SURFACE),
    (SURFACE, "if name in REPORTS:", "if False:", T_PROBE),
    (COMPARISON, "if (g.position, g.token_id) != (w.position, w.token_id):", "if g.position != w.position:", T_PROMPT),
    (COMPARISON, "g.logits_sha256 is not None and w.logits_sha256 is not None and g.logits_sha256 != w.logits_sha256",
     "False", T_PROMPT),
    (COMPARISON, 'for name in ("logprob", "rank", "top_logprobs")', 'for name in ("logprob", "top_logprobs")',
     T_PROMPT),
    (COMPARISON, "if deviation is not None and deviation > noise_tolerance:\n            return g.position",
     "if False:\n            return g.position", T_PROMPT),
    (COMPARISON, "if not low <= g.rank <= high:", "if False:", T_PROMPT),
    (COMPARISON, "np.count_nonzero(others > own - 2 * tolerance)", "np.count_nonzero(row > own - 2 * tolerance)",
     T_PROMPT),
    (COMPARISON, 'run.finish_reason == "abort" and not run.token_ids for', 'run.finish_reason == "abort" for',
     T_PROMPT),
    (COMPARISON, "if part is None and len(got_list) != len(want_list)", "if False and len(got_list) != len(want_list)",
     T_PROMPT),
    ("refengine/check/replay.py", "num_prompt_logprobs=request.params.prompt_logprobs", "num_prompt_logprobs=None",
     T_PROMPT),
    (BASELINE, "bound = 2 * tolerance", "bound = tolerance", T_BASELINES),
    (BASELINE, "tolerance == 0 and set(w) != set(h)", "False", T_BASELINES),
    (BASELINE, "    if len(want) != len(have):\n", "    if False:\n", T_BASELINES),
    (BASELINE, "if (want is None) != (have is None):", "if False:", T_BASELINES),
    (BASELINE, "prompt_logprobs_difference(alone, completion, self.tolerance) if not", "None if not", T_BASELINES),
    ("refengine/validate/dialect.py", 'return re.search(rf"(?<![A-Za-z0-9_]){re.escape(field)}(?![A-Za-z0-9_])"',
     "return re.search(re.escape(field)", ["tests/test_dialects.py", "-k", "names_a_field"]),
    ("refengine/validate/wire.py", "if len(values) != len(entry) or None in values.values():", "if False:",
     T_SURFACE),
    (WIRE, "if not isinstance(index, int) or isinstance(index, bool) or index == 0:", "if True:", T_SURFACE),
    (WIRE, "first, *others = sorted(choices, key=lambda c: _index(c, choices))", "first, *others = choices", T_SURFACE),
    (WIRE, "return index if isinstance(index, int) and not isinstance(index, bool) else", "return", T_SURFACE),
    (WIRE, "usage = usage_tokens(data) if not others else None", "usage = usage_tokens(data)", T_SURFACE),
    (WIRE, "usage = None if cancelled or self.others else self.usage", "usage = None if cancelled else self.usage",
     T_SURFACE),
    (WIRE, "for i in sorted(self.others)))", "for i in self.others))", T_SURFACE),
    (BASELINE, "if completion.num_choices != alone.num_choices:", "if False:", T_CHOICES),
    (BASELINE, 'if k and fields["verdict"] != "match":', 'if fields["verdict"] != "match":', T_CHOICES),
    (BASELINE, 'if fields["verdict"] in ("diverged", "error"):', 'if fields["verdict"] == "diverged":', T_CHOICES),
    (BASELINE, '(worst["verdict"], fields["verdict"]) == ("match", "explained")', "False", T_CHOICES),
    (BASELINE, 'if getattr(p.case, "fields", None):  # a variant', "if False:  # a variant", T_VARIANTS),
    (BOARD, 'r.get("variant") and r["verdict"] == "error" and r.get("status") in REFUSAL_STATUSES',
     'r.get("variant") and r["verdict"] == "error"', T_VARIANTS),
    (BOARD, 'r.get("variant") and r["verdict"] == "error" and', 'r["verdict"] == "error" and', T_VARIANTS),
    (BOARD, "return alone, records + _send_each(", "return alone, records or _send_each(", T_VARIANTS),
    (BOARD, 'r["verdict"] == "error" and (r["case"], r["api"]) not in refused for r', 'r["verdict"] == "error" for r',
     T_VARIANTS),
    (BOARD, "if self.golden is None or isinstance(p.case, ProcessedCase):", "if self.golden is None:", T_VARIANTS),
    (BOARD, "counts[r[\"verdict\"]] = counts.get(r[\"verdict\"], 0) + 1", "counts[r[\"verdict\"]] = 1", T_VARIANTS),
    (PLAN, "if pick.random() < settings.variant_rate:", "if pick.random() <= settings.variant_rate / 2:", T_VARIANTS),
    (PLAN, "sent = case if (variant.id, case_api(variant, settings.api, source)) in refused else variant",
     "sent = variant", T_VARIANTS),
    (PLAN, 'rng, pick = random.Random(settings.seed), random.Random(f"{settings.seed}:variants")',
     "rng = pick = random.Random(settings.seed)", T_VARIANTS),
    (PLAN, "            p = replace(p, case=p.case.base)\n", "", T_VARIANTS),
    ("refengine/validate/load.py", 'status = {"status": e.status} if', "status = {} if", T_VARIANTS),
    ("refengine/validate/precision.py", 'in ("explained", "diverged") and not r.get("variant")]',
     'in ("explained", "diverged")]', ["tests/test_precision.py", "-k", "variant"]),
    ("refengine/validate/report.py", 'if r["verdict"] == "error" and f"{r[\'case\']}@{r[\'api\']}" not in refused:',
     'if r["verdict"] == "error":', ["tests/test_dialects.py", "-k", "hf_serve_refuses"]),
    ("refengine/validate/report.py", 'for name, counts in sorted(v["sent"].items())) or "none"',
     'for name, counts in v["sent"].items()) or "none"', T_VARIANTS),
    (SURFACE, "        if got.num_choices == N:\n", "        if got.num_choices >= N:\n", T_SURFACE),
    (SURFACE, 'verdict = "ignored" if got.num_choices == 1 else "wrong"', 'verdict = "ignored"', T_SURFACE),
    ("refengine/check/schedule.py", "seed=None if params.seed is None else params.seed + k))", "seed=params.seed))",
     T_FORKS),
    ("refengine/check/replay.py", "for child in children(r)]", "for child in children(r)[:1]]", T_FORKS),
    (BASELINE, "if t in specials and specials[t] in got_text}", "if t in specials}", T_SPECIALS),
    (BASELINE, "if t in specials and specials[t] in got_text}", "if False}", T_SPECIALS),
    (BASELINE, '({"special_tokens_rendered": rendered} if rendered else {})', "{}", T_SPECIALS),
    ("refengine/check/golden.py", "                moved += len(specials[token])\n            offsets.append(",
     "            offsets.append(", T_SPECIALS),
    ("refengine/check/golden.py", "any(not k.isdigit() or not isinstance(v, str) or not v", "any(not v", T_SPECIALS),
    ("refengine/validate/report.py", "    if rendered:\n", "    if False:\n", T_SPECIALS),
    ("refengine/validate/variants.py", "most = min(case.max_tokens, VARIANT_MAX_TOKENS)", "most = case.max_tokens",
     T_SURFACE),
    (PLAN, "cancel_after=min(rng.randint(1, length - 1), max(1, sent.max_tokens - 1)) if cancel",
     "cancel_after=rng.randint(1, length - 1) if cancel", T_VARIANTS),
    (PLAN, "            length = expected_length(case)\n", "            length = expected_length(sent)\n", T_VARIANTS),
    (SURFACE, 'FINDINGS = ("ignored", "wrong", "failed")', 'FINDINGS = ("ignored", "wrong")', T_SERVER_FAILED),
    (SURFACE, "e.status is None or e.status >= 500", "e.status is None or e.status > 500", T_SERVER_FAILED),
    (SURFACE, "out[name] = failure(e, lambda: send(endpoint, api, body, None, dialect, salt=salt), dialect)",
     'out[name] = {"verdict": "error", "why": str(e)}', T_SERVER_FAILED),
    (SURFACE, 'return {"verdict": "error", "why": f"{why} (the server answers the plain request after it)"}',
     'return {"verdict": "failed", "why": why}', T_SERVER_FAILED),
    # the alone and serial runs watched for progress (a baseline that never ends fails, not hangs)
    (DRIVER, 'if not engine.trace[-1]["scheduled"] and status["running"] + status["waiting"]:',
     'if not engine.trace[-1]["scheduled"] and status["running"]:', T_STUCK),
    (DRIVER, "    if engine.num_steps > max_steps:\n", "    if False:\n", T_STUCK),
    (DRIVER, "max_steps = engine.num_steps + allowance(engine, request)",
     "max_steps = engine.num_steps + allowance(engine, request) + 1", T_STUCK),
    ("refengine/check/replay.py", "except EngineStuck as e:", "except ZeroDivisionError as e:", T_STUCK),
    ("refengine/check/replay.py", "failure = failure or str(e)", "failure = failure", T_STUCK),
    (DRIVER, "            return engine, str(e)\n", "            break\n", T_STUCK),
    # the scheduler's policy, read from the run
    (POLICY, "if not running or running[-1] != rid:", "if not running:", T_POLICY),
    (POLICY, "waiting.insert(0, running.pop())", "waiting.append(running.pop())", T_POLICY),
    (POLICY, "if ran != running[:len(ran)]:", "if False:", T_POLICY),
    (POLICY, 'in_order = schedule.engine.scheduling_policy == "fcfs"', "in_order = False", T_POLICY),
    (POLICY, 'in_order = schedule.engine.scheduling_policy == "fcfs"', "in_order = True", T_POLICY),
    (POLICY, 'if admitted and (entry["preempted"] or len(ran) < len(running)):', 'if admitted and entry["preempted"]:',
     T_POLICY),
    (POLICY, 'if admitted and (entry["preempted"] or len(ran) < len(running)):',
     "if admitted and len(ran) < len(running):", T_POLICY),
    (POLICY, "        running = [r for r in running if r not in finished[step]]\n", "", T_POLICY),
    (POLICY, "        running = [r for r in running if r not in gone]\n", "", T_POLICY),
    (POLICY, "        waiting = [r for r in waiting if r not in gone]\n", "", T_POLICY),
    (POLICY, "arrivals[request.arrival_step] += [child.id for child in children(request)]",
     "arrivals[request.arrival_step] += [request.id]", T_POLICY),
    ("refengine/check/replay.py", "        problems = policy_problems(schedule, outputs, engine.trace)\n",
     "        problems = []\n", T_POLICY),
    # speculative decoding's account, read from the run, and the baseline without speculation
    (SPECULATION, 'if chunk["num_tokens"] != 1 + draft:', "if False:", T_SPECULATION),
    (SPECULATION, "if accepted > draft:", "if accepted > draft + 1:", T_SPECULATION),
    (SPECULATION, "if received != accepted + 1 and not ended_on_draft:",
     "if received > accepted + 1 and not ended_on_draft:", T_SPECULATION),
    (SPECULATION, "ended_on_draft = received == accepted and draft and outputs[rid].finish_step == step",
     "ended_on_draft = received == accepted and draft", T_SPECULATION),
    (SPECULATION, "drafts += draft > 0", "drafts += 1", T_SPECULATION),
    (SPECULATION, "per_position.update(range(accepted))", "per_position.update(range(draft))", T_SPECULATION),
    (SPECULATION, "any(i >= len(positions) for i in per_position)", "False", T_SPECULATION),
    ("refengine/check/replay.py", "        problems = speculation_problems(outputs, engine.trace, engine.status())\n",
     "        problems = []\n", T_SPECULATION),
    ("refengine/check/replay.py", "baselines.alone(model, replace(config, num_speculative_tokens=0), request)",
     "baselines.alone(model, config, request)", T_SPECULATION),
    ("refengine/check/replay.py", 'if against == "unspeculated" and not request.params.greedy:',
     "if False:", ["tests/test_speculation.py", "-k", "unspeculated"]),
    # images in schedules: their format, their place in the prompt, the reference and the calibration with them
    (IMAGES, "set(raw) != set(IMAGE_KEYS)", "not set(IMAGE_KEYS) <= set(raw)", T_IMAGES),
    (IMAGES, "return [v.vision_start_token_id, *[v.image_token_id] * tokens, v.vision_end_token_id]",
     "return [v.vision_start_token_id, *[v.image_token_id] * tokens]", T_IMAGES),
    (IMAGES, "out = [0 if token == pad else token for token in prompt]", "out = list(prompt)", T_IMAGES),
    (IMAGES, "for at, image in reversed(images):", "for at, image in images:", T_IMAGES),
    ("refengine/check/schedule.py", 'if images and "prompt" in prompt:', "if False:", T_IMAGES),
    (DRIVER, "images=request.image_arrays())", "images=None)", T_IMAGES),
    ("refengine/check/replay.py", "        if images:\n            return generate_with_images(", "        if False:\n"
     "            return generate_with_images(", T_IMAGES),
    ("refengine/check/calibrate.py", "    if model.config.arch not in VISION_LANGUAGE:\n        return []",
     "    if True:\n        return []", T_IMAGES),
    ("refengine/check/calibrate.py", "    for prompt, image in image_prompts(model):", "    for prompt, image in []:",
     T_IMAGES),
    # images in prompt and golden files: pinned, never fetched, sent to chat as data URLs, measured with them
    (CASE_IMAGES, "if given is not None and given.lower() != digest:", "if False:", T_GOLDEN_IMAGES),
    (CASE_IMAGES, "    elif URL_SCHEME.match(url):\n", "    elif False:\n", T_GOLDEN_IMAGES),
    (CASE_IMAGES, "if given is None and require_sha256:", "if False:", T_GOLDEN_IMAGES),
    ("refengine/check/golden_check.py", "images=c.images)", ")", T_GOLDEN_IMAGES),
    (PLAN, 'if api == "completions" and case.images:', "if False:", T_VALIDATE_IMAGES),
    (PLAN, "inline_messages(p.case.messages, p.case.images) if p.case.images else p.case.messages",
     "p.case.messages", T_VALIDATE_IMAGES),
    ("refengine/validate/margins.py", "if images else prompt_logits(self.model, ids)[-1]",
     "if False else prompt_logits(self.model, ids)[-1]", T_VALIDATE_IMAGES),
    (BASELINE, "processed(case), case.images)", "processed(case))", T_VALIDATE_IMAGES),
    # the golden refresh on Ray (skipped, and so not killed, where the ray extra is missing)
    (RAY, "    if here != numerics:\n", "    if False:\n", T_RAY),
    (RAY, "cases = [case for n in range(len(groups)) for case in answers[n]]",
     "cases = [case for n in reversed(range(len(groups))) for case in answers[n]]", T_RAY),
    (RAY, "started = not ray.is_initialized()", "started = True", T_RAY),
]


def package_copy(tmp_path: Path) -> Path:
    for part in ("refengine", "tests"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("conftest.py", "pyproject.toml"):
        shutil.copy(ROOT / part, tmp_path / part)
    return tmp_path


def run_in(copy: Path, *args: str) -> subprocess.CompletedProcess:
    """`python args` in the copy, which it imports ahead of any installed refengine."""
    return subprocess.run([sys.executable, *args], cwd=copy, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(copy)})


@pytest.mark.slow
def test_the_runs_import_the_mutated_copy(tmp_path):
    copy = package_copy(tmp_path)
    imported = run_in(copy, "-c", "import refengine.validate.aborts as m; print(m.__file__)").stdout.strip()
    assert Path(imported) == copy / ABORTS


@pytest.mark.slow
@pytest.mark.parametrize("module, text, mutated, tests", MUTANTS,
                         ids=[f"{Path(m).stem}-{n}" for n, (m, *_) in enumerate(MUTANTS)])
def test_the_tests_kill_the_mutant(module, text, mutated, tests, tmp_path):
    copy = package_copy(tmp_path)
    source = (copy / module).read_text(encoding="utf-8")
    assert source.count(text) == 1, f"{module}: the mutated text is not there exactly once: {text!r}"
    (copy / module).write_text(source.replace(text, mutated), encoding="utf-8")
    run = run_in(copy, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests)
    assert run.returncode == 1, f"mutant survived ({module}: {text!r} -> {mutated!r}):\n{run.stdout[-1500:]}"
