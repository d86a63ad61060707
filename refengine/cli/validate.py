"""validate: replay a golden file against any OpenAI-compatible server under join/leave load."""
from __future__ import annotations

import json
from pathlib import Path

from ..check.golden import read_golden
from ..validate.board import APIS, Settings, format_report, validate


def run_validate(args) -> int:
    settings = Settings(concurrency=args.concurrency, seed=args.seed, cancel_rate=args.cancel_rate,
                        margin_tolerance=args.margin_tolerance, api=args.api, arrival_spread=args.arrival_spread,
                        repeat=args.repeat, timeout=args.timeout)
    golden = read_golden(args.golden)
    report = validate(args.url, golden, settings)
    print(format_report(report))
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"report: {args.report}")
    return 0 if report["summary"]["passed"] else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("validate", help="replay golden cases against an OpenAI-compatible server under "
                                               "random join/leave load; judge answers by the margin rule")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--golden", required=True, help="golden JSONL file (refengine golden refresh)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival / streaming / cancel schedule")
    p.add_argument("--cancel-rate", type=float, default=0.2,
                   help="fraction of requests that hang up mid-stream (not compared)")
    p.add_argument("--margin-tolerance", type=float,
                   help="largest golden top-2 margin a divergence may occur at (default: the golden file's "
                        "calibrated float32 noise bound; raise it for bf16 or quantized devices)")
    p.add_argument("--api", choices=APIS, default="auto",
                   help="auto: chat cases to /v1/chat/completions, text prompts to /v1/completions; "
                        "completions: chat cases sent as their golden prompt ids")
    p.add_argument("--arrival-spread", type=float, default=1.0, help="seconds over which arrivals are spread")
    p.add_argument("--repeat", type=int, default=1, help="send every case this many times")
    p.add_argument("--timeout", type=float, default=600.0, help="socket timeout per request, seconds")
    p.add_argument("--report", metavar="OUT.json", help="write the JSON report here")
    p.set_defaults(func=run_validate)
