"""The suite's throughput in two source trees, measured the same way and in turns.

    git worktree add /tmp/previous f3e10ed
    python benchmarks/suite_pairs.py /tmp/previous . --pairs 8

A tree's own `refengine bench --scenario suite` is not a fair judge of another tree: what it warms up
before its clocks start (compiled kernels, Hypothesis's first test) is part of the code being
compared. So every process here runs one harness whatever the tree: it imports that tree's
refengine (PYTHONPATH), runs an engine in each mode and one trivial Hypothesis test, then every engine
property of refengine.bench.suite `--repeats` times in a row (the same examples each time: the
properties are derandomized) and reports the fastest and the median repetition. The two trees take
turns, the first of each pair alternating, since this machine's speed drifts between minutes by more
than most changes move it; each pair's ratio compares two processes run back to back.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HARNESS = r"""
import json, sys
from hypothesis import given, settings, strategies as st
from refengine.bench.suite import suite_properties, suite_settings, time_property
from refengine.engine import EngineConfig, LLMEngine
from refengine.sampling import SamplingParams
from refengine.strategies.models import tiny_model

with suite_settings(None) as bench_settings:
    for mode in ("fast", "invariant"):
        engine = LLMEngine(tiny_model(), EngineConfig(mode=mode))
        engine.add_request("warm-up", [1, 2, 3], params=SamplingParams(max_tokens=2))
        engine.run()
    given(st.integers())(settings(bench_settings, max_examples=1)(lambda _: None))()
    properties = suite_properties(bench_settings)
    totals = []
    for _ in range(int(sys.argv[1])):
        rows = [time_property(p) for p in properties]
        totals.append((sum(r["examples"] for r in rows), sum(r["seconds"] for r in rows)))
import refengine
print(json.dumps({"examples": totals[0][0], "seconds": [s for _, s in totals], "package": refengine.__file__}))
"""


def measure(tree: Path, repeats: int) -> dict:
    """One process on `tree`'s refengine: examples per repetition and each repetition's seconds."""
    tree = tree.resolve()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # in the tree, since `python -c` puts its working directory first on sys.path
    done = subprocess.run([sys.executable, "-c", HARNESS, str(repeats)], env=env, capture_output=True, text=True,
                          check=False, cwd=tree)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: the harness failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(result["package"]).is_relative_to(tree):
        raise SystemExit(f"{tree}: the harness imported refengine from {result['package']}, not from the tree")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="source tree of the baseline (a checkout holding refengine/)")
    parser.add_argument("after", type=Path, help="source tree measured against it")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="repetitions of the whole suite per process")
    args = parser.parse_args()
    for tree in (args.before, args.after):
        if not (tree / "refengine" / "bench" / "suite.py").is_file():
            parser.error(f"{tree}: no refengine/bench/suite.py (give a checkout of refengine)")
    fastest, medians = [], []
    for n in range(args.pairs):
        order = (args.before, args.after) if n % 2 == 0 else (args.after, args.before)
        runs = {tree: measure(tree, args.repeats) for tree in order}
        before, after = runs[args.before], runs[args.after]
        if before["examples"] != after["examples"]:
            raise SystemExit(f"the trees ran {before['examples']} and {after['examples']} examples: not comparable")
        fastest.append(min(before["seconds"]) / min(after["seconds"]))
        medians.append(statistics.median(before["seconds"]) / statistics.median(after["seconds"]))
        print(f"pair {n + 1}: {before['examples']} examples; before {min(before['seconds']):.2f} s fastest, "
              f"{statistics.median(before['seconds']):.2f} s median; after {min(after['seconds']):.2f} s, "
              f"{statistics.median(after['seconds']):.2f} s; after/before speed {fastest[-1]:.2f}x fastest, "
              f"{medians[-1]:.2f}x median", flush=True)
    print(f"{args.pairs} pairs: speed ratio of the fastest repetitions median {statistics.median(fastest):.2f}x "
          f"(range {min(fastest):.2f}-{max(fastest):.2f}), of the median repetitions median "
          f"{statistics.median(medians):.2f}x (range {min(medians):.2f}-{max(medians):.2f})")


if __name__ == "__main__":
    main()
