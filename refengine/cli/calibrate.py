"""calibrate: measure a model's float32 noise bounds (the tolerances of the margin rule)."""
from __future__ import annotations

from ..check.calibrate import calibrate, write_calibration
from .common import add_model_argument, open_model, print_json


def run(args) -> int:
    calibration = calibrate(open_model(args))
    if args.out:
        write_calibration(calibration, args.out)
        print(f"wrote {args.out}: f32_batched_vs_serial {calibration['f32_batched_vs_serial']:.3g}, "
              f"f32_vs_f64 {calibration['f32_vs_f64']:.3g}, safety_factor {calibration['safety_factor']}")
    else:
        print_json(calibration)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="measure float32 batched-vs-serial and f32-vs-f64 logit noise")
    add_model_argument(p)
    p.add_argument("--out", metavar="FILE", help="write the calibration JSON here (default: print it)")
    p.set_defaults(func=run)
