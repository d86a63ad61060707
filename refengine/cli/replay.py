"""replay: re-run a schedule (a repro file) and judge every request against a baseline (by default
the same request alone), exactly as the invariants property that wrote the file did.

Exit 0 when every request matches (or, in fast mode, diverges only where the calibrated margin
explains it), 1 on a real divergence, 2 on bad input.
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..check.calibrate import calibration_for, load_calibration
from ..check.driver import settings_text
from ..check.replay import AGAINST, replay
from ..check.repro import load_repro
from ..check.timeline import plot_timeline, timeline
from ..data import shipped
from ..engine import MODES
from ..model.cache import default_model_dir
from .common import FAULT_ENV, add_model_argument, fault_from, print_json
from .run_schedule import EXAMPLE


def run(args) -> int:
    repro = load_repro(args.file or shipped(*EXAMPLE))
    model = repro.model(args.model, default_model_dir)
    if note := repro.fingerprint_note(model):
        print(f"note: {note}", file=sys.stderr)
    fault = fault_from(args)
    if repro.fault and not fault:
        print(f"note: {repro.path} was found with the fault {repro.fault!r} switched on; "
              f"--fault {repro.fault} (or {FAULT_ENV}={repro.fault}) reproduces that", file=sys.stderr)
    against = args.against or repro.against
    calibration = None
    if (args.mode or repro.schedule.engine.mode) == "fast" or against == "reference":
        calibration = load_calibration(args.calibration) if args.calibration else calibration_for(model)
    result = replay(model, repro.schedule, against=against, other_budget=args.other_budget or repro.other_budget,
                    mode=args.mode, fault=fault, calibration=calibration)
    if args.plot:
        plot_timeline(timeline(result.trace, result.outputs, result.verdicts), len(result.trace), args.plot,
                      f"{Path(repro.schedule.source).name}: {result.comparison}\n{settings_text(result.config)}")
    if args.json:
        print_json(result.as_dict())
    else:
        print(result.report(lambda token_id: model.tokenizer.decode([token_id])))
    return 0 if result.passed else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("replay", help="re-run a schedule batched and serial; report the first divergence")
    p.add_argument("file", metavar="FILE", nargs="?", help="schedule / repro JSON file (FORMATS.md; default: the "
                   "shipped example schedule)")
    add_model_argument(p)
    p.add_argument("--mode", choices=MODES, help="override the schedule's engine mode")
    p.add_argument("--against", choices=AGAINST, help="the baseline each request is judged against (default: the "
                   "file's `against`, else serial): " + "; ".join(f"{k}: {v}" for k, v in AGAINST.items()))
    p.add_argument("--other-budget", type=int, metavar="N",
                   help="with --against budget: the other max_num_batched_tokens (default: the file's `other_budget`)")
    p.add_argument("--fault", help=f"inject a catalogued fault (default: ${FAULT_ENV}; see `refengine faults`)")
    p.add_argument("--calibration", metavar="FILE", help="fast mode: noise calibration JSON "
                   "(default: the stored one for this model, else measured now)")
    p.add_argument("--json", action="store_true", help="print verdicts, outputs and trace as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="draw the batched run as a timeline: requests as rows, "
                   "engine steps as columns, the first divergence marked with its margin")
    p.set_defaults(func=run)
