"""validate: send a golden or prompts file's cases to any OpenAI-compatible server under join/leave
load; judge the answers against the golden file or against the server's own alone answers."""
from __future__ import annotations

import json
from pathlib import Path

from ..check.golden import load_prompts, read_golden
from ..check.rounded import PRECISIONS
from ..errors import RefengineError
from ..model import load_model
from ..validate.board import Cases, validate
from ..validate.effects import plot_effects
from ..validate.junit import write_junit
from ..validate.margins import LocalMargins
from ..validate.plan import APIS, BASELINES, Settings
from ..validate.precision import agreeing_deltas, plot_precision
from ..validate.report import format_report
from ..validate.repro import planned_from, read_repro, repro_data, write_repro


def load_cases(golden: str | None, prompts: str | None) -> Cases:
    if golden:
        return Cases.of_golden(read_golden(golden))
    return Cases.of_prompts(prompts, load_prompts(prompts))


def run_validate(args) -> int:
    if args.replay:
        return replay_repro(args)
    if (args.golden is None) == (args.prompts is None):
        raise RefengineError("validate: give exactly one of --golden FILE or --prompts FILE")
    baseline = args.baseline or ("golden" if args.golden else "serial")
    settings = Settings(concurrency=args.concurrency, seed=args.seed, cancel_rate=args.cancel_rate,
                        margin_tolerance=args.margin_tolerance, api=args.api, arrival_spread=args.arrival_spread,
                        repeat=args.repeat, timeout=args.timeout, baseline=baseline, precision=args.precision,
                        batch_invariant=args.batch_invariant, variant_rate=args.variant_rate,
                        baseline_url=args.baseline_url)
    cases = load_cases(args.golden, args.prompts)
    return finish(args, validate(args.url, cases, settings, margins=local_margins(args)), cases)


def local_margins(args) -> LocalMargins | None:
    return LocalMargins(load_model(args.model)) if args.model else None


def replay_repro(args) -> int:
    """--replay: the repro's requests, its baseline and tolerance; --golden / --prompts may point at
    another copy of its source file."""
    data = read_repro(args.replay)
    if args.golden and args.prompts:
        raise RefengineError("validate: give at most one of --golden FILE or --prompts FILE with --replay")
    source = args.golden or args.prompts or data["source"]
    # a repro made from a golden file records that file's model fingerprint; one from a prompts file, null
    golden = bool(args.golden) or (not args.prompts and data.get("model_fingerprint") is not None)
    cases = load_cases(source if golden else None, None if golden else source)
    s = data["settings"]
    settings = Settings(concurrency=s["concurrency"], margin_tolerance=s.get("margin_tolerance"), api=s["api"],
                        timeout=args.timeout if s.get("timeout") is None else s["timeout"], baseline=data["baseline"],
                        precision=s.get("precision", "f32"), batch_invariant=s.get("batch_invariant", False),
                        baseline_url=args.baseline_url or data.get("baseline_url"))
    report = validate(args.url, cases, settings, planned_from(data, cases.cases, args.replay), local_margins(args))
    return finish(args, report, cases)


def finish(args, report: dict, cases: Cases) -> int:
    print(format_report(report))
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"report: {args.report}")
    if report["summary"]["verdict"] != "PASS":
        path = write_repro(args.repro, repro_data(report))
        print(f"repro: {path} (send it again: refengine validate --replay {path} --url URL)")
    if args.plot:
        if not report["precision"]:
            raise RefengineError("--plot: no precision report (the server reports no logprobs, or the baseline "
                                 "is not golden)")
        deltas, _ = agreeing_deltas(report["requests"], cases.golden)  # also when the report kept none
        print(f"plot: {plot_precision(report['precision'], deltas, args.plot)}")
    if args.plot_margins:
        print(f"plot: {plot_effects(report, args.plot_margins)}")
    if args.junit_xml:
        print(f"junit: {write_junit(report, args.junit_xml)}")
    return 0 if report["summary"]["passed"] else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("validate", help="send golden or prompt cases to an OpenAI-compatible server under "
                                               "random join/leave load; judge answers by the margin rule")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--golden", help="golden JSONL file (refengine golden refresh): the cases, and the float64 "
                                    "baseline")
    p.add_argument("--prompts", help="prompts JSONL file: the cases, judged against the server's alone answers")
    p.add_argument("--baseline", choices=BASELINES,
                   help="golden: the golden file's float64 answers (default with --golden); serial: the same "
                        "server's answer to each case sent alone (default with --prompts)")
    p.add_argument("--baseline-url", metavar="URL",
                   help="serial baseline from another server: each case's answer alone from URL, the same model "
                        "served another way (speculative decoding off, another build or engine)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival / streaming / cancel schedule")
    p.add_argument("--cancel-rate", type=float, default=0.2,
                   help="fraction of requests that hang up mid-stream (not compared)")
    p.add_argument("--margin-tolerance", type=float,
                   help="largest baseline top-2 margin a divergence may occur at, overriding the precision bound "
                        "(default: the --precision bound x its safety factor; serial with no bound known, 0: "
                        "bit-identical)")
    p.add_argument("--model", metavar="DIR",
                   help="the served model's HF folder: where the server reports no logprobs (or no ids), the "
                        "float64 reference measures the alone answer's top-2 margin at each divergence, instead of "
                        "holding it strictly; it also gives the precision bound a golden file lacks")
    p.add_argument("--precision", choices=("auto",) + PRECISIONS, default="auto",
                   help="what the server computes in: its divergences are held to refengine's reference rounded "
                        "to that precision against float64 (the bound in the golden file, or measured on --model); "
                        "auto: the --model folder's config.json dtype, else f32")
    p.add_argument("--batch-invariant", action="store_true",
                   help="the engine claims batch invariance: hold every loaded answer to its alone answer bit for "
                        "bit (default: a batching divergence may occur only within the precision tolerance)")
    p.add_argument("--api", choices=APIS, default="auto",
                   help="auto: chat cases to /v1/chat/completions, text prompts to /v1/completions; "
                        "completions: chat cases sent as their golden prompt ids")
    p.add_argument("--arrival-spread", type=float,
                   help="seconds over which arrivals are spread (default: requests x the server's alone "
                        "latency / (2 x concurrency), so requests overlap)")
    p.add_argument("--repeat", type=int, default=1, help="send every case this many times")
    p.add_argument("--variant-rate", type=float, default=Settings.variant_rate,
                   help="fraction of requests sent as a variant of their case (penalties, logit_bias with "
                        "min_tokens, prompt_logprobs, n: per-request state under batching), each judged against "
                        "the server's answer to that variant alone; a variant the server refuses goes as its case")
    p.add_argument("--timeout", type=float, default=600.0, help="socket timeout per request, seconds")
    p.add_argument("--report", metavar="OUT.json", help="write the JSON report here")
    p.add_argument("--repro", metavar="OUT.json", default="validate-repro.json",
                   help="where a run that does not PASS writes its requests as sent (default: %(default)s)")
    p.add_argument("--replay", metavar="REPRO.json",
                   help="send a repro file's requests again, exactly as they were, and judge them the same way")
    p.add_argument("--plot", metavar="OUT.png",
                   help="histogram of |server logprob - golden logprob| on the agreeing tokens, with the float32 "
                        "bound (needs the plot extra, a golden baseline and a server that reports logprobs)")
    p.add_argument("--plot-margins", metavar="OUT.png",
                   help="every divergence's top-2 margin against the precision and batching tolerances, the "
                        "precision effect (alone vs golden) and the batching effect (loaded vs alone) in two "
                        "colours (needs the plot extra and a golden baseline)")
    p.add_argument("--junit-xml", metavar="OUT.xml",
                   help="write the run as JUnit XML: a testcase per request alone and loaded, failures with the "
                        "verdict's text")
    p.set_defaults(func=run_validate)
