"""Where a suite example's time goes: the properties of `refengine bench --scenario suite` (same
settings: fixed example count, derandomized, default tiny model) under cProfile, one at a time.

    python benchmarks/profile_suite.py invariant_mode_is_exact any_chunk_size --examples 25 --top 25

Each name is matched as a substring of the property's pytest id; the listing is sorted by own time
(tottime), then the same functions by cumulative time, so per-step Python overhead in the engine,
scheduler, runner and harness shows up beside the numpy calls it makes.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats

from refengine.bench.suite import suite_properties, suite_settings, time_property


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("properties", nargs="+", help="substrings of property ids, e.g. invariant_mode_is_exact")
    parser.add_argument("--examples", type=int, help="examples per property (default: the dev profile's)")
    parser.add_argument("--top", type=int, default=25, help="entries listed per sort order")
    args = parser.parse_args()
    with suite_settings(args.examples) as bench_settings:
        chosen = [p for p in suite_properties(bench_settings) if any(s in p.name for s in args.properties)]
        if not chosen:
            parser.error(f"no property id contains any of {args.properties}")
        for prop in chosen:
            profiler = cProfile.Profile()
            row = profiler.runcall(time_property, prop)
            print(f"== {prop.name}: {row['examples']} examples in {row['seconds']:.2f} s "
                  f"({row['schedules_per_s']:.2f} schedules/s; profiled, so slower than the bench)")
            stats = pstats.Stats(profiler).strip_dirs()
            stats.sort_stats("tottime").print_stats(args.top)
            stats.sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
