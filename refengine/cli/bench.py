"""bench: decode throughput of the batching engine vs serial, both kernel modes, against the roofline;
the cost of a golden refresh; the invariants suite's throughput, and its power against each fault;
llama.cpp's server on the same requests."""
from __future__ import annotations

from ..bench.report import (
    DEFAULT_MAX_TOKENS,
    SCENARIOS,
    BenchSettings,
    print_report,
    run_bench,
)
from ..bench.workloads import preset_model_dir
from ..engine import MODES
from ..errors import RefengineError
from ..model import load_model
from ..model.cache import default_model_dir
from ..model.tiny import PRESETS
from .common import parse_ids, print_json


def _sampler(args) -> dict | None:
    if args.temperature is None:
        if args.top_k is not None or args.top_p is not None:
            raise RefengineError("--top-k/--top-p: sampling needs --temperature")
        return None
    return {"temperature": args.temperature, "top_k": 0 if args.top_k is None else args.top_k,
            "top_p": 1.0 if args.top_p is None else args.top_p}


def run(args) -> int:
    settings = BenchSettings(
        requests=args.requests, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
        serial_requests=args.serial_requests, modes=tuple(MODES) if args.mode == "both" else (args.mode,),
        batch_sizes=tuple(parse_ids(args.batch_sizes, "--batch-sizes")) if args.batch_sizes else (),
        scenarios=tuple(s.strip() for s in args.scenario.split(",") if s.strip()), hf=args.hf, plot=args.plot,
        prompts=args.prompts, examples=args.examples, sampler=_sampler(args), runs=args.runs,
        faults=tuple(f.strip() for f in args.faults.split(",") if f.strip()) if args.faults else (),
        llama_server=args.llama_server, gguf=args.gguf, rounds=args.rounds)
    model = load_model(args.model or (preset_model_dir(args.preset) if args.preset else default_model_dir()))
    report = run_bench(model, settings)
    if args.json:
        print_json(report)
    else:
        print_report(report)
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="decode throughput, batched vs serial, against the roofline")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="DIR", help="HF model folder (default: the embedded tiny model)")
    source.add_argument("--preset", choices=sorted(PRESETS), help="a generated random-weight model, cached")
    parser.add_argument("--requests", type=int, default=32, help="concurrent requests of the batched run")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, help=f"new tokens per request (eos ignored; default "
                        f"{DEFAULT_MAX_TOKENS}); reference scenario: cut each case's max_tokens to this "
                        f"(default: the prompt file's)")
    parser.add_argument("--mode", choices=[*MODES, "both"], default="both")
    parser.add_argument("--batch-sizes", metavar="LIST", help="also sweep these batch sizes, e.g. 1,8,32")
    parser.add_argument("--serial-requests", type=int, default=2, help="requests run one by one at batch 1")
    parser.add_argument("--scenario", default="decode", help=f"comma list of {', '.join(SCENARIOS)}")
    parser.add_argument("--prompts", metavar="FILE", help="reference scenario: the prompts JSONL a golden refresh "
                        "would decode (default: the shipped seed set, golden/prompts/seed-experiment.jsonl)")
    parser.add_argument("--examples", type=int, help="suite and faults scenarios: examples per property (default: "
                        "the dev profile's); the suite always runs on the default tiny model")
    parser.add_argument("--runs", type=int, default=20, help="faults scenario: independent hunts per fault")
    parser.add_argument("--faults", metavar="LIST", help="faults scenario: comma list of catalogued faults "
                        "(default: every one a schedule property hunts)")
    parser.add_argument("--llama-server", metavar="BIN", help="llama-cpp scenario: the llama-server binary")
    parser.add_argument("--gguf", metavar="FILE", help="llama-cpp scenario: an F32 GGUF of the same model "
                        "(benchmarks/llama_cpp.py builds the server and converts the model)")
    parser.add_argument("--rounds", type=int, default=3, help="llama-cpp scenario: rounds of every batch size, "
                        "the engines taking turns")
    parser.add_argument("--temperature", type=float, help="decode scenario: sample at this temperature, request i "
                        "seeded with i (default: greedy)")
    parser.add_argument("--top-k", type=int, help="with --temperature (default 0: off)")
    parser.add_argument("--top-p", type=float, help="with --temperature (default 1.0: off)")
    parser.add_argument("--hf", action="store_true", help="also run the decode workload through HF transformers")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG of step time and tok/s vs batch size")
    parser.add_argument("--json", action="store_true", help="print everything as JSON")
    parser.set_defaults(func=run)
