"""`refengine bench --scenario faults`: how reliably and how fast the shipped suite finds each catalogued
fault — the suite's power, which decides whether a bug in somebody's engine fails their CI run or slips
through it on an unlucky draw.

For every fault a schedule property hunts (suite.hunts), `runs` independent runs of that property as a
developer's run of the dev profile runs it (its corners first, as the suite's test runs its @examples,
then its example budget of random draws, no example database, targeting and shrinking on) with the fault
switched on. Each run records whether it found the fault, the
seconds to the first failing example, the size of that example (requests), and the seconds until the
shrinker reached a failing example of at most MAX_SHRUNK_REQUESTS requests (what the catalog promises; a
run stops there). Seconds count from the run's start, so they are what the property adds to a suite run
that hits the fault; each property runs once with no fault first, so model loading and calibration are
not counted. Run r of every fault draws with the seed base + r: the runs are the same on every call.

The goals (#41): found in at least 19 runs of 20, the median run finding it within 10 s and the worst
within 60 s.
"""
from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import dataclass

from ..errors import RefengineError

RUNS = 20
FOUND_GOAL = 0.95    # share of runs that find the fault
MEDIAN_GOAL_S = 10.0  # median seconds to the first failing example
WORST_GOAL_S = 60.0   # the slowest run that finds it


@dataclass(frozen=True)
class Hunt:
    found: bool
    first_s: float | None        # seconds to the first failing example
    first_requests: int | None   # its size
    small_s: float | None        # seconds to a failing example of at most MAX_SHRUNK_REQUESTS requests


def hunt_once(fault: str, examples: int, seed: int) -> Hunt:
    """One run of the property that hunts `fault`, with the fault on (see module)."""
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.errors import NoSuchExample

    from ..suite.hunts import hunt

    first: list[tuple[float, int]] = []
    start = time.perf_counter()

    def seen(example) -> None:
        if not first:
            first.append((time.perf_counter() - start, len(example[1]["requests"])))

    budget = settings(max_examples=examples, database=None, deadline=None, print_blob=False,
                      suppress_health_check=list(HealthCheck), phases=[p for p in Phase if p is not Phase.explain])
    try:
        small = hunt(fault, budget, random.Random(seed), seen)
    except NoSuchExample:
        return Hunt(False, None, None, None)
    return Hunt(True, *first[0], None if small is None else time.perf_counter() - start)


def warm_up() -> None:
    """One example of every hunting property with no fault: the models, calibrations and compiled kernels
    a first run would otherwise count."""
    from hypothesis import HealthCheck, Phase, find, settings
    from hypothesis.errors import NoSuchExample

    from ..suite.hunts import HUNTS

    for strategy, run in HUNTS.values():
        try:
            find(strategy, lambda example, run=run: run(example, None) or False,
                 settings=settings(max_examples=1, database=None, deadline=None, phases=[Phase.generate],
                                   suppress_health_check=list(HealthCheck)),
                 random=random.Random(0))
        except NoSuchExample:
            pass


def _row(fault: str, prop: str, hunts: list[Hunt]) -> dict:
    found = [h for h in hunts if h.found]
    firsts = sorted(h.first_s for h in found)
    small = [h.small_s for h in found if h.small_s is not None]
    row = {"fault": fault, "property": prop, "runs": len(hunts), "found": len(found),
           "median_first_s": statistics.median(firsts) if firsts else None,
           "worst_first_s": firsts[-1] if firsts else None,
           "median_first_requests": statistics.median(h.first_requests for h in found) if found else None,
           "shrunk": len(small), "median_shrunk_s": statistics.median(small) if small else None}
    row["meets_goals"] = (row["found"] >= FOUND_GOAL * row["runs"] and bool(firsts)
                          and row["median_first_s"] <= MEDIAN_GOAL_S and row["worst_first_s"] <= WORST_GOAL_S)
    return row


def run_faults(runs: int, examples: int | None, faults: tuple[str, ...] = (), seed: int = 0) -> dict:
    """`runs` hunts of each fault (`faults`, default every one a schedule property hunts); the report."""
    import os

    from tqdm import tqdm
    try:
        from ..suite.harness import REPRO_DIR_VAR
        from ..suite.hunts import CAUGHT_BY, hunted
        from ..suite.plugin import PROFILES
    except ImportError as e:
        raise RefengineError(f"scenario: faults needs pytest and hypothesis (pip install 'refengine[test]'): "
                             f"{e}") from None

    chosen = list(faults) or hunted()
    unhunted = [f for f in chosen if f not in hunted()]
    if unhunted:
        known = ", ".join(hunted())
        raise RefengineError(f"faults: {', '.join(unhunted)} not hunted by a schedule property (one of: {known})")
    examples = examples or PROFILES["dev"]["max_examples"]
    saved = os.environ.get(REPRO_DIR_VAR)
    with tempfile.TemporaryDirectory(prefix="refengine-fault-power-") as repros:
        os.environ[REPRO_DIR_VAR] = repros  # the failures' repro files, not wanted here
        try:
            warm_up()
            rows = []
            with tqdm(total=len(chosen) * runs, desc="fault hunts", unit="run") as bar:
                for fault in chosen:
                    hunts = []
                    for r in range(runs):
                        hunts.append(hunt_once(fault, examples, seed + r))
                        bar.update()
                    rows.append(_row(fault, CAUGHT_BY[fault], hunts))
        finally:
            if saved is None:
                os.environ.pop(REPRO_DIR_VAR, None)
            else:
                os.environ[REPRO_DIR_VAR] = saved
    not_hunted = {f: p for f, p in CAUGHT_BY.items() if f not in hunted()}
    return {"runs": runs, "examples": examples, "seed": seed, "faults": rows, "not_measured": not_hunted,
            "goals": {"found": FOUND_GOAL, "median_first_s": MEDIAN_GOAL_S, "worst_first_s": WORST_GOAL_S},
            "meeting_goals": sum(r["meets_goals"] for r in rows)}


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_faults(result: dict) -> None:
    """The report as a Markdown table (the docs' fault-power page is this output)."""
    print(f"fault power: {result['runs']} runs per fault, {result['examples']} examples each (random draws, seeds "
          f"{result['seed']}..{result['seed'] + result['runs'] - 1}; no example database); goals: found in "
          f">= {result['goals']['found']:.0%} of runs, median <= {result['goals']['median_first_s']:g} s, worst "
          f"<= {result['goals']['worst_first_s']:g} s to the first failing example")
    print()
    print("| fault | property | found | median s | worst s | first failure, requests | shrunk to <= 3 | "
          "median s to it | goals |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in result["faults"]:
        size = "-" if row["median_first_requests"] is None else f"{row['median_first_requests']:g}"
        print(f"| {row['fault']} | {row['property']} | {row['found']}/{row['runs']} | "
              f"{_seconds(row['median_first_s'])} | {_seconds(row['worst_first_s'])} | {size} | "
              f"{row['shrunk']}/{row['found']} | {_seconds(row['median_shrunk_s'])} | "
              f"{'met' if row['meets_goals'] else 'MISSED'} |")
    print()
    print(f"{result['meeting_goals']} of {len(result['faults'])} faults meet every goal")
    if result["not_measured"]:
        print("not measured here (no schedule property hunts them): " + ", ".join(
            f"{fault} ({prop})" for fault, prop in result["not_measured"].items()))
