"""`refengine bench`: what it runs and the report it prints -- decode throughput of the batching
engine vs serial in both kernel modes against the roofline, the Kestrel scenario, the cost of a
golden refresh (bench.reference), the invariants suite's throughput (bench.suite) and its power
against each fault (bench.faults), llama.cpp's server on the same requests (bench.llama_cpp), what
speculative decoding buys (bench.speculation), and optionally HF transformers on the same workload."""
from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..engine import MODES
from ..errors import RefengineError
from ..model import Model
from ..sampling import SamplingParams
from .faults import print_faults, run_faults
from .interleaved import against_probe, interleaved_ratio, modes_ratio
from .kestrel import kestrel_report, run_kestrel
from .llama_cpp import print_llama_cpp, run_llama_cpp
from .prefix import print_prefix, run_prefix
from .reference import print_reference, reference_report, refresh_cases, run_reference
from .roofline import Roofline, measure_machine
from .speculation import print_speculation, run_speculation
from .suite import print_suite, run_suite
from .workloads import batch_sweep, random_requests

SCENARIOS = ("decode", "kestrel", "prefix", "reference", "suite", "faults", "llama-cpp", "speculation")
DEFAULT_MAX_TOKENS = 128
# The performance issue's goals, each a ratio measured in this run: a step's share of its roofline
# (the median over steps of roofline step / step, each at the machine figure measured right after
# it), or one decode rate over another.
ROOFLINE_GOALS = {("fast", "requests"): 0.67, ("fast", 8): 0.50, ("fast", 1): 0.80}
INVARIANT_VS_FAST_GOAL = 0.85   # invariant / fast decode tok/s, at every batch size swept (stepping in turn)
INVARIANT_BATCH1_GOAL = 0.8     # invariant at batch 1 / serial (fast, batch 1), stepping in turn


@dataclass(frozen=True)
class BenchSettings:
    requests: int = 32             # concurrent requests of the batched run
    prompt_len: int = 64
    # New tokens per decode and Kestrel request (eos ignored; default DEFAULT_MAX_TOKENS); for the
    # reference scenario, a cap on each case's max_tokens (default: the prompt file's).
    max_tokens: int | None = None
    serial_requests: int = 2       # requests run one by one at batch 1
    modes: tuple[str, ...] = MODES
    batch_sizes: tuple[int, ...] = ()  # swept besides 1 and `requests`
    scenarios: tuple[str, ...] = ("decode",)
    hf: bool = False
    plot: str | None = None        # a PNG of step time and tok/s vs batch size
    prompts: str | None = None     # the reference scenario's prompt file (default: the shipped seed set)
    examples: int | None = None    # the suite and faults scenarios' examples per property (default: the dev profile's)
    runs: int = 20                 # the faults scenario's runs per fault
    faults: tuple[str, ...] = ()   # the faults scenario's faults (default: every one a schedule property hunts)
    # The decode scenario's sampler (SamplingParams' temperature, top_k, top_p; each request seeded by
    # its index); None decodes greedily.
    sampler: dict | None = None
    llama_server: str | None = None  # the llama-cpp scenario's server binary and F32 GGUF of the same model
    gguf: str | None = None
    rounds: int = 3                  # the llama-cpp scenario's rounds of every batch size

    def __post_init__(self):
        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        if unknown or not self.scenarios:
            raise RefengineError(f"scenario: expected a list of {', '.join(SCENARIOS)}, got {list(self.scenarios)}")
        bad_modes = [m for m in self.modes if m not in MODES]
        if bad_modes or not self.modes:
            raise RefengineError(f"mode: expected {', '.join(MODES)}, got {list(self.modes)}")
        for name in ("requests", "prompt_len", "max_tokens", "serial_requests", "examples", "runs", "rounds"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise RefengineError(f"{name}: must be a positive integer, got {getattr(self, name)}")
        if any(b < 1 for b in self.batch_sizes):
            raise RefengineError(f"batch_sizes: batch sizes must be positive, got {list(self.batch_sizes)}")
        if self.sampler is not None:
            if not self.sampler.get("temperature", 0) > 0:
                raise RefengineError(f"temperature: a sampler needs a temperature > 0, got {self.sampler}")
            SamplingParams(**self.sampler, seed=0)  # RefengineError naming the field
        if "llama-cpp" in self.scenarios:
            for name in ("llama_server", "gguf"):
                path = getattr(self, name)
                if path is None or not Path(path).is_file():
                    raise RefengineError(f"{name}: the llama-cpp scenario needs llama-server and an F32 GGUF of "
                                         f"the model (benchmarks/llama_cpp.py builds both), got {path!r}")
            if self.sampler is not None:
                raise RefengineError("temperature: the llama-cpp scenario decodes greedily")

    @property
    def new_tokens(self) -> int:
        """New tokens per decode and Kestrel request."""
        return self.max_tokens or DEFAULT_MAX_TOKENS

    @property
    def sweep(self) -> list[int]:
        """The batch sizes run: 1, the extra ones, and `requests`."""
        return sorted({1, *self.batch_sizes, self.requests})


def _run_decode(model, args: BenchSettings, roofline: Roofline) -> tuple[dict, dict, dict, dict, dict | None]:
    """The batch sweep, the goal batch interleaved with serial per mode, with both modes invariant and
    fast in turn at every batch size, each roofline goal's batch size against the machine figure that
    bounds it in `roofline` (measured after each step), and with --hf the same workload through HF
    transformers."""
    modes = list(args.modes)
    sweep = batch_sweep(model, modes, args.sweep, args.prompt_len, args.new_tokens, args.serial_requests,
                        args.sampler)
    workload = random_requests(model, args.requests, args.prompt_len, args.new_tokens, sampler=args.sampler)
    serial_workload = random_requests(model, args.serial_requests, args.prompt_len, args.new_tokens,
                                      sampler=args.sampler)
    interleaved = {mode: interleaved_ratio(model, mode, workload, serial_workload) for mode in modes}
    in_turn = {batch: modes_ratio(model, random_requests(model, args.serial_requests if batch == 1 else batch,
                                                         args.prompt_len, args.new_tokens, sampler=args.sampler),
                                  batch)
               for batch in args.sweep} if set(MODES) <= set(modes) else {}
    probed = {}
    for batch in sorted(_goal_batches(args.requests) & set(args.sweep)):
        requests = serial_workload if batch == 1 else random_requests(model, batch, args.prompt_len, args.new_tokens,
                                                                      sampler=args.sampler)
        probed[batch] = against_probe(model, requests, batch, roofline)
    if not args.hf:
        return sweep, interleaved, in_turn, probed, None
    from .hf import hf_decode
    return sweep, interleaved, in_turn, probed, {"batched": hf_decode(model.path, workload),
                                                 "serial": hf_decode(model.path, random_requests(
                                                     model, 1, args.prompt_len, args.new_tokens,
                                                     sampler=args.sampler))}


def _decode(model, args: BenchSettings, sweep, interleaved, in_turn, probed, hf, machine, roofline) -> dict:
    serial = sweep["fast"][1]
    rows = []
    for mode, runs in sweep.items():
        for batch, stats in sorted(runs.items()):
            bound = roofline.step_seconds(batch, stats.mean_decode_context)
            rows.append(stats.to_json() | {
                "batch": batch, "vs_serial": stats.decode_tok_s / serial.decode_tok_s,
                "roofline_step_ms": bound * 1e3, "roofline_tok_s": batch / bound,
                "roofline_fraction": bound * 1e3 / stats.decode_step_ms["p50"]})
    result = {"rows": rows, "goals": _goals(probed, args.requests, in_turn), "interleaved": interleaved,
              "modes_in_turn": {str(batch): turns for batch, turns in in_turn.items()},
              "against_probe": {str(batch): probe for batch, probe in probed.items()},
              "serial_requests": args.serial_requests,
              "sweep": {mode: {str(b): s.to_json() for b, s in runs.items()} for mode, runs in sweep.items()},
              # what the plot draws, so it can be drawn again from the JSON report (bench.plot.plot_decode)
              "roofline": asdict(roofline),
              "plot_context": float(np.mean([s.mean_decode_context for runs in sweep.values() for s in runs.values()])),
              "plot_title": (f"{model.path.name}: {roofline.parameters / 1e6:.2g}M params, prompt {args.prompt_len}, "
                             f"{args.new_tokens} new tokens; BW {machine.bandwidth / 1e9:.1f} GB/s, "
                             f"sgemm {machine.sgemm_flops / 1e9:.0f} GFLOP/s")}
    if hf is not None:
        hf["engine_vs_hf"] = {"batched_fast": sweep["fast"][args.requests].decode_tok_s / hf["batched"]["decode_tok_s"],
                              "serial": serial.decode_tok_s / hf["serial"]["decode_tok_s"]}
        if "invariant" in sweep:
            hf["engine_vs_hf"]["batched_invariant"] = (sweep["invariant"][args.requests].decode_tok_s
                                                       / hf["batched"]["decode_tok_s"])
        result["hf"] = hf
    if args.plot:
        from .plot import plot_decode
        result["plot"] = str(plot_decode(result, args.plot))
    return result


def _goal_batches(requests: int) -> set[int]:
    return {requests if batch == "requests" else batch for _, batch in ROOFLINE_GOALS}


def _goals(probed: dict, requests: int, in_turn: dict) -> dict:
    """Each goal that the swept batch sizes can answer: {"ratio", "goal", "at"}. The roofline goals
    take the steps against the machine figure measured after each; the invariant goals take the
    modes' ratios measured in turn."""
    goals = {}
    for (mode, batch), goal in ROOFLINE_GOALS.items():
        batch = requests if batch == "requests" else batch
        if batch in probed and probed[batch]["share"] is not None:
            goals[f"{mode} batch {batch} share of roofline"] = {"ratio": probed[batch]["share"], "goal": goal, "at": batch}
    ratios = {batch: turns["ratio"] for batch, turns in in_turn.items() if turns["ratio"] is not None}
    if ratios:
        worst = min(ratios, key=ratios.get)
        goals["invariant / fast, worst batch"] = {"ratio": ratios[worst], "goal": INVARIANT_VS_FAST_GOAL, "at": worst}
    if 1 in ratios:
        goals["invariant batch 1 / serial"] = {"ratio": ratios[1], "goal": INVARIANT_BATCH1_GOAL, "at": 1}
    return goals


def _print_decode(result: dict) -> None:
    print(f"{'B':>3} {'mode':<9} {'tok/s':>8} {'step p50':>9} {'p90':>8} {'p99':>8} {'TTFT s':>7} "
          f"{'TPOT ms':>8} {'x serial':>8} {'roofline ms':>11} {'% roof':>6} {'steps':>6} {'contended':>9}")
    for row in sorted(result["rows"], key=lambda r: (r["batch"], r["mode"])):
        step = row["decode_step_ms"]
        print(f"{row['batch']:>3} {row['mode']:<9} {row['decode_tok_s']:>8.1f} {step['p50']:>9.1f} {step['p90']:>8.1f} "
              f"{step['p99']:>8.1f} {row['ttft_s_mean']:>7.2f} {(row['tpot_s_mean'] or 0) * 1e3:>8.1f} "
              f"{row['vs_serial']:>8.2f} {row['roofline_step_ms']:>11.1f} {100 * row['roofline_fraction']:>5.0f}% "
              f"{row['decode_steps']:>6} {row['contended_steps']:>9}{'' if row['quiet_only'] else ' (all used)'}")
    print(f"(B=1 rows: {result['serial_requests']} requests one after another; serial = B=1 fast; step figures "
          f"over decode-only steps without 'contended' ones -- steps during which other processes competed for the "
          f"cores -- unless too few were quiet; '% roof' at the machine's best figures above)")
    for mode, turns in result["interleaved"].items():
        print(f"batched {mode} / serial, stepping in turn: {turns['ratio']:.2f}x" if turns["ratio"] is not None
              else f"batched {mode} / serial, stepping in turn: n/a")
    if result["modes_in_turn"]:
        print("invariant / fast, stepping in turn: " + ", ".join(
            f"B={batch} " + ("n/a" if turns["ratio"] is None else f"{turns['ratio']:.2f}x")
            for batch, turns in result["modes_in_turn"].items()))
    for batch, probe in result["against_probe"].items():
        if probe["share"] is None:
            continue
        unit = "GFLOP/s" if probe["probe"] == "sgemm" else "GB/s"
        low, high = (v / 1e9 for v in probe["figure_range"])
        print(f"fast B={batch} against a {probe['probe']} right after each step: {100 * probe['share']:.0f}% of the "
              f"roofline at its rate (median over {probe['decode_steps']} steps; {probe['probe']} median "
              f"{probe['figure_median'] / 1e9:.1f} {unit}, range {low:.1f}-{high:.1f})")
    for name, goal in result["goals"].items():
        met = goal["ratio"] >= goal["goal"]
        print(f"goal {name}: {goal['ratio']:.2f} (goal >= {goal['goal']}) {'met' if met else 'NOT met'}")
    if "hf" in result:
        hf = result["hf"]
        print(f"HF transformers (torch {hf['batched']['torch']}, {hf['batched']['torch_threads']} threads): "
              f"batched {hf['batched']['decode_tok_s']:.1f} tok/s, serial {hf['serial']['decode_tok_s']:.1f} tok/s; "
              + ", ".join(f"engine {k} / HF = {v:.2f}x" for k, v in hf["engine_vs_hf"].items()))
    if "plot" in result:
        print(f"plot: {result['plot']}")


def _print_kestrel(result: dict) -> None:
    for workload, data in result.items():
        runs = data["runs"]
        print(f"kestrel {workload}: max_tokens {data['max_tokens']}, prompts {data['prompt_tokens']} tokens")
        for name, run in runs.items():
            speedup = "" if name == "serial" else f"  batched speedup {data['batched_speedup'][name]:.2f}x"
            print(f"  {name:<9} wall {run['wall_s']:7.2f} s  first answer {run['latency_s_first']:6.2f} s  "
                  f"mean latency {run['latency_s_mean']:6.2f} s  "
                  f"mean TTFT {run['ttft_s_mean']:6.2f} s{speedup}")
        predicted = data["predicted_s"]
        print(f"  roofline model: serial {predicted['serial']:.2f} s, batched {predicted['batched']:.2f} s "
              f"({predicted['serial'] / predicted['batched']:.2f}x)")


def run_bench(model: Model, args: BenchSettings) -> dict:
    """Every scenario of `args` in one process, the machine measured before and after; the report."""
    if args.hf:
        from .hf import hf_available
        if not hf_available():
            raise RefengineError("hf: needs torch and transformers (pip install 'refengine[parity]')")
    modes = list(args.modes)
    refresh = refresh_cases(args.prompts, args.max_tokens) if "reference" in args.scenarios else None
    before = measure_machine()
    decode = _run_decode(model, args, Roofline.of(model.config, before)) if "decode" in args.scenarios else None
    kestrel = run_kestrel(model, modes, args.new_tokens) if "kestrel" in args.scenarios else None
    prefix = run_prefix(model, modes) if "prefix" in args.scenarios else None
    reference = run_reference(model.path, *refresh, args.max_tokens) if refresh else None
    suite = run_suite(args.examples) if "suite" in args.scenarios else None
    faults = run_faults(args.runs, args.examples, args.faults) if "faults" in args.scenarios else None
    speculation = run_speculation(model, args.sweep, args.new_tokens) \
        if "speculation" in args.scenarios else None
    llama_cpp = (run_llama_cpp(model, args.llama_server, args.gguf, args.sweep, args.prompt_len, args.new_tokens,
                               modes, args.rounds) if "llama-cpp" in args.scenarios else None)
    machine = before.best(measure_machine())
    roofline = Roofline.of(model.config, machine)
    report = {"model": str(model.path), "parameters": roofline.parameters, "weight_bytes_f32": roofline.weight_bytes,
              "machine": machine.to_json() | {"cpu": platform.processor() or platform.machine()},
              "numpy": np.__version__, "workload": {"requests": args.requests, "prompt_len": args.prompt_len,
                                                    "max_tokens": args.new_tokens,
                                                    "sampling": args.sampler or "greedy"}}
    if decode is not None:
        report["decode"] = _decode(model, args, *decode, machine, roofline)
    if kestrel is not None:
        report["kestrel"] = kestrel_report(kestrel, roofline)
    if prefix is not None:
        report["prefix"] = prefix
    if reference is not None:
        report["reference"] = reference_report(reference, machine)
    if suite is not None:
        report["suite"] = suite
    if faults is not None:
        report["faults"] = faults
    if llama_cpp is not None:
        report["llama_cpp"] = llama_cpp
    if speculation is not None:
        report["speculation"] = speculation
    report["load_average_after"] = os.getloadavg()[0]
    return report


def print_report(report: dict) -> None:
    machine, weight_bytes = report["machine"], report["weight_bytes_f32"]
    print(f"model {report['model']}: {report['parameters']:,} streamed params, f32 weights "
          f"{weight_bytes / 1e9:.2f} GB")
    print(f"machine (best of before and after the runs): streaming read {machine['bandwidth_1thread'] / 1e9:.1f} GB/s "
          f"(1 thread), {machine['bandwidth_all'] / 1e9:.1f} GB/s ({machine['threads']} threads); sgemm "
          f"{machine['sgemm_flops'] / 1e9:.0f} GFLOP/s; weight read {weight_bytes / machine['bandwidth'] * 1e3:.1f} ms; "
          f"load average {machine['load_average']:.2f} before, {report['load_average_after']:.2f} after")
    if "decode" in report:
        workload = report["workload"]
        sampling = workload["sampling"]
        print(f"decode: {workload['requests']} requests, prompt {workload['prompt_len']}, {workload['max_tokens']} "
              f"new tokens each, " + ("greedy" if sampling == "greedy" else "sampled with " + ", ".join(
                  f"{k} {v}" for k, v in sampling.items()) + ", request i seeded with i"))
        _print_decode(report["decode"])
    if "kestrel" in report:
        _print_kestrel(report["kestrel"])
    if "prefix" in report:
        print_prefix(report["prefix"])
    if "reference" in report:
        print_reference(report["reference"])
    if "suite" in report:
        print_suite(report["suite"])
    if "faults" in report:
        print_faults(report["faults"])
    if "llama_cpp" in report:
        print_llama_cpp(report["llama_cpp"])
    if "speculation" in report:
        print_speculation(report["speculation"])
