"""run-schedule: run a JSON schedule on the continuous-batching engine and report every request."""
from __future__ import annotations

from pathlib import Path

from ..check.driver import run_engine, run_output, settings_text
from ..check.schedule import load_schedule
from ..check.timeline import plot_timeline, timeline
from ..data import shipped
from ..engine import MODES
from .common import add_model_argument, open_model, print_json

EXAMPLE = ("examples", "join_leave.json")  # shipped: joins, an abort, chunked prefill, preemption, sampling


def _table(result: dict) -> str:
    rows = [("id", "finish", "tokens", "min margin", "token ids")]
    for request_id, out in result["requests"].items():
        margins = [s["top2_margin"] for s in out["steps"]]
        ids = ",".join(map(str, out["token_ids"]))
        rows.append((request_id, str(out["finish_reason"]), str(len(out["token_ids"])),
                     f"{min(margins):.4f}" if margins else "-", ids if len(ids) <= 60 else ids[:57] + "..."))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4] for row in rows]
    m = result["metrics"]
    engine = result["engine"]
    if "engine_failure" in result:
        lines.append(f"engine failure: {result['engine_failure']}")
    lines.append(f"-- mode={engine['mode']} serial={result['serial']} steps={len(result['trace'])} "
                 f"prefill_steps={m['prefill_steps']} decode_steps={m['decode_steps']} mixed_steps={m['mixed_steps']} "
                 f"preemptions={m['preemptions']} max_batch_size={m['max_batch_size']} "
                 f"step_time={m['step_time_s']:.3f}s")
    return "\n".join(lines)


def run(args) -> int:
    schedule = load_schedule(args.file or shipped(*EXAMPLE))
    model = open_model(args)
    engine, failure = run_engine(model, schedule, mode=args.mode, serial=args.serial)
    result = run_output(model, engine, failure, args.serial)
    if args.plot:
        plot_timeline(timeline(engine.trace, engine.outputs()), len(engine.trace), args.plot,
                      Path(schedule.source).name + (" (each request alone)" if args.serial else "")
                      + "\n" + settings_text(engine.config))
    if args.json:
        print_json(result)
    else:
        print(_table(result))
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("run-schedule", help="run a JSON schedule (FORMATS.md) on the batching engine")
    parser.add_argument("file", metavar="FILE", nargs="?", help="schedule JSON file (default: the shipped example, "
                        "examples/join_leave.json of the package data)")
    add_model_argument(parser)
    parser.add_argument("--mode", choices=MODES, help="override the schedule's engine mode")
    parser.add_argument("--serial", action="store_true", help="run each request alone (max_num_seqs=1)")
    parser.add_argument("--json", action="store_true", help="print the run output as JSON")
    parser.add_argument("--plot", metavar="OUT.png", help="draw the run as a timeline: requests as rows, engine "
                        "steps as columns (prefill chunks, decodes, waiting, preemption, abort, finish)")
    parser.set_defaults(func=run)
