"""replay: re-run a schedule (a repro file) and judge every request against a baseline (by default
the same request alone), exactly as the invariants property that wrote the file did.

Exit 0 when every request matches (or, in fast mode, diverges only where the calibrated margin
explains it), 1 on a real divergence, 2 on bad input.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..calibrate import calibration_for, load_calibration
from ..engine_config import MODES
from ..errors import RefengineError
from ..faults import check_fault, fault_from_env
from ..model import load_model
from ..replay import AGAINST, replay
from ..schedule import load_schedule
from .common import add_model_argument, open_model, print_json


def _model(args, data: dict):
    """--model, else the folder the schedule was found on, else the default tiny model."""
    if args.model:
        return open_model(args)
    found_on = data.get("model")
    if isinstance(found_on, str) and (Path(found_on) / "config.json").exists():
        return load_model(found_on)
    if isinstance(found_on, str):
        how = data.get("model_command", "")
        raise RefengineError(f"{args.file}: model folder {found_on} not found; pass --model DIR"
                             + (f" (it was made with: {how})" if how else ""))
    return open_model(args)


def run(args) -> int:
    schedule = load_schedule(args.file)
    data = json.loads(Path(args.file).read_text(encoding="utf-8"))
    model = _model(args, data)
    expected = data.get("model_fingerprint")
    if expected and expected != model.fingerprint:
        print(f"note: {args.file} was found on {expected}, replaying on {model.fingerprint}", file=sys.stderr)
    fault = check_fault(args.fault, "--fault") if args.fault else fault_from_env()
    if data.get("fault") and not fault:
        print(f"note: {args.file} was found with the fault {data['fault']!r} switched on; "
              f"REFENGINE_FAULT={data['fault']} reproduces that", file=sys.stderr)
    against = args.against or data.get("against", "serial")
    other_budget = args.other_budget or data.get("other_budget")
    calibration = None
    if (args.mode or schedule.engine.mode) == "fast" or against == "reference":
        calibration = load_calibration(args.calibration) if args.calibration else calibration_for(model)
    result = replay(model, schedule, against=against, other_budget=other_budget, mode=args.mode, fault=fault,
                    calibration=calibration)
    if args.json:
        print_json(result.as_dict())
    else:
        print(result.report())
    return 0 if result.passed else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("replay", help="re-run a schedule batched and serial; report the first divergence")
    p.add_argument("file", metavar="FILE", help="schedule / repro JSON file (FORMATS.md)")
    add_model_argument(p)
    p.add_argument("--mode", choices=MODES, help="override the schedule's engine mode")
    p.add_argument("--against", choices=AGAINST, help="the baseline each request is judged against (default: the "
                   "file's `against`, else serial): " + "; ".join(f"{k}: {v}" for k, v in AGAINST.items()))
    p.add_argument("--other-budget", type=int, metavar="N",
                   help="with --against budget: the other max_num_batched_tokens (default: the file's `other_budget`)")
    p.add_argument("--fault", help="inject a catalogued fault (default: $REFENGINE_FAULT; see `refengine faults`)")
    p.add_argument("--calibration", metavar="FILE", help="fast mode: noise calibration JSON "
                   "(default: the stored one for this model, else measured now)")
    p.add_argument("--json", action="store_true", help="print verdicts, outputs and trace as JSON")
    p.set_defaults(func=run)
