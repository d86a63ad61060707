"""mkdocs hook: one page per committed benchmark run, generated at build time from the files in
docs/performance/data/ -- the output of `refengine bench --json` exactly as it printed it (or, for runs
from before the JSON was kept, the text report) -- so every figure on the site comes from a run's own
output, never from a hand-copied table.

docs/performance/data/runs.json says what each file is: the date and machine it was measured on, the
commit and the command. Every data file must be listed there and every listed file must exist, or
the build fails. `<!-- bench-runs -->` in a page becomes the table of all runs, newest first. A run
whose report recorded its roofline gets its decode plot, drawn from the file by docs/regenerate.py
into docs/performance/images/.

`run_page()` and `runs()` need no mkdocs (tests/test_docs.py renders every committed run).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "performance" / "data"
MANIFEST = "runs.json"
RUNS_MARKER = "<!-- bench-runs -->"
FIELDS = ("file", "date", "machine", "commit", "command")


class RunsError(ValueError):
    pass


def runs(data: Path = DATA) -> list[dict]:
    """The manifest's runs, newest first, each checked against the files beside it."""
    listed = json.loads((data / MANIFEST).read_text(encoding="utf-8"))
    for i, run in enumerate(listed):
        missing = [f for f in FIELDS if not run.get(f)]
        if missing:
            raise RunsError(f"{data / MANIFEST}: run {i} lacks {', '.join(missing)}")
        if not (data / run["file"]).is_file():
            raise RunsError(f"{data / MANIFEST}: run {i}: no file {run['file']} in {data}")
    on_disk = {p.name for p in data.iterdir() if p.suffix in (".json", ".txt") and p.name != MANIFEST}
    unlisted = sorted(on_disk - {run["file"] for run in listed})
    if unlisted:
        raise RunsError(f"{data / MANIFEST}: not listed (date, machine, commit, command): {', '.join(unlisted)}")
    return sorted(listed, key=lambda run: run["date"], reverse=True)


def page_path(run: dict) -> str:
    return f"performance/runs/{Path(run['file']).stem}.md"


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows), ""]


def _met(goal: dict) -> str:
    return "met" if goal["ratio"] >= goal["goal"] else "**not met**"


def _decode(decode: dict) -> list[str]:
    out = ["## Decode throughput", "",
           f"Batch 1 rows: {decode['serial_requests']} requests one after another; serial = batch 1, fast mode. "
           "Step times over decode-only steps without contended ones (steps during which other processes competed "
           "for the cores) unless too few were quiet; the roofline share at the machine's best figures.", ""]
    rows = [[row["batch"], row["mode"], f"{row['decode_tok_s']:.1f}", f"{row['decode_step_ms']['p50']:.3g}",
             f"{row['decode_step_ms']['p90']:.3g}", f"{row['decode_step_ms']['p99']:.3g}", f"{row['ttft_s_mean']:.3g}",
             f"{(row['tpot_s_mean'] or 0) * 1e3:.3g}", f"{row['vs_serial']:.2f}", f"{row['roofline_step_ms']:.3g}",
             f"{100 * row['roofline_fraction']:.0f}%", row["decode_steps"], row["contended_steps"]]
            for row in sorted(decode["rows"], key=lambda r: (r["batch"], r["mode"]))]
    out += _table(["batch", "mode", "tok/s", "step p50 ms", "p90 ms", "p99 ms", "TTFT s", "TPOT ms", "x serial",
                   "roofline step ms", "% of roofline", "steps", "contended"], rows)
    turns = [[f"batched {mode} / serial", f"batch {t['batch']}",
              "n/a" if t["ratio"] is None else f"{t['ratio']:.2f}x"] for mode, t in decode["interleaved"].items()]
    turns += [["invariant / fast", f"batch {batch}", "n/a" if t["ratio"] is None else f"{t['ratio']:.2f}x"]
              for batch, t in decode["modes_in_turn"].items()]
    if turns:
        out += ["Ratios of two engines stepping in turn (robust to the machine drifting between runs):", ""]
        out += _table(["ratio", "at", "value"], turns)
    probes = [[batch, p["probe"], f"{100 * p['share']:.0f}%", p["decode_steps"],
               _figure(p["probe"], p["figure_median"]),
               f"{_figure(p['probe'], p['figure_range'][0])} to {_figure(p['probe'], p['figure_range'][1])}"]
              for batch, p in decode["against_probe"].items() if p["share"] is not None]
    if probes:
        out += ["Each step held against the machine figure measured right after it (fast mode):", ""]
        out += _table(["batch", "probe", "share of roofline (median)", "steps", "probe median", "probe range"], probes)
    if decode["goals"]:
        out += _table(["goal", "measured", "goal", ""], [[name, f"{g['ratio']:.2f}", f">= {g['goal']}", _met(g)]
                                                          for name, g in decode["goals"].items()])
    if "hf" in decode:
        hf = decode["hf"]
        out += [f"HF transformers (torch {hf['batched']['torch']}, {hf['batched']['torch_threads']} threads), "
                f"same workload: batched {hf['batched']['decode_tok_s']:.1f} tok/s, serial "
                f"{hf['serial']['decode_tok_s']:.1f} tok/s; "
                + ", ".join(f"engine {k} / HF {v:.2f}x" for k, v in hf["engine_vs_hf"].items()) + ".", ""]
    return out


def _bytes(count: float) -> str:
    return f"{count / 1e9:.3g} GB" if count >= 1e9 else f"{count / 1e6:.3g} MB"


def _figure(probe: str, value: float) -> str:
    return f"{value / 1e9:.1f} GFLOP/s" if probe == "sgemm" else f"{value / 1e9:.1f} GB/s"


def _kestrel(kestrel: dict) -> list[str]:
    out = ["## Kestrel scenario", "",
           "The seed article's eight concurrent short chat answers, then the same eight prompts with long answers; "
           "serial = one at a time, batched = `max_num_seqs` 8.", ""]
    rows = []
    for workload, data in kestrel.items():
        for name, run in data["runs"].items():
            speedup = "1.00" if name == "serial" else f"{data['batched_speedup'][name]:.2f}x"
            low, high = min(data["max_tokens"]), max(data["max_tokens"])
            rows.append([f"{workload}, {low if low == high else f'{low}-{high}'} tokens", name,
                         f"{run['wall_s']:.3g}", f"{run['latency_s_first']:.3g}", f"{run['latency_s_mean']:.3g}",
                         f"{run['ttft_s_mean']:.3g}", speedup])
        predicted = data["predicted_s"]
        rows.append(["", "throughput model", f"{predicted['serial']:.3g} serial, {predicted['batched']:.3g} batched",
                     "", "", "", f"{predicted['serial'] / predicted['batched']:.2f}x"])
    return out + _table(["answers", "run", "wall s", "first answer s", "mean latency s", "mean TTFT s",
                         "vs serial (wall)"], rows)


def _reference(ref: dict) -> list[str]:
    read = f"{_bytes(ref['weight_bytes_f64'])} of float64 weights" + (" streamed" if ref["streamed"] else " in memory")
    out = ["## Golden refresh cost", "",
           f"{ref['cases']} cases of `{Path(ref['prompts']).name}`"
           + (f", max_tokens cut to {ref['max_tokens_cap']}" if ref["max_tokens_cap"] else "")
           + f", {ref['prompt_tokens']} prompt tokens; a pass over the weights reads {read}: "
           f"{ref['roofline_s_per_pass'] * 1e3:.3g} ms at {ref['bandwidth'] / 1e9:.1f} GB/s.", ""]
    rows = [[name, ref[name]["tokens"], ref[name]["passes"], f"{ref[name]['seconds']:.3g}",
             f"{ref[name]['tok_s']:,.1f}", f"{ref[name]['s_per_pass']:.3g}",
             f"{100 * ref[name]['roofline_fraction']:.2g}%"] for name in ("serial", "lockstep")]
    out += _table(["run", "tokens", "passes", "seconds", "tok/s", "s per pass", "% of roofline"], rows)
    out += [f"Lockstep (groups of {ref['lockstep_group']}) / each case alone: {ref['lockstep_vs_serial']:.2f}x "
            f"tokens/s; tokens {'identical' if ref['same_tokens'] else 'DIFFER'}.", ""]
    if ref.get("goals"):
        out += _table(["goal", "measured", "goal", ""], [[f"reference {name}", f"{g['ratio']:.2f}", f">= {g['goal']}",
                                                          _met(g)] for name, g in ref["goals"].items()])
    return out


def _suite(suite: dict) -> list[str]:
    out = ["## Suite throughput", "",
           f"Every engine property, {suite['max_examples']} examples each, derandomized, generation and checks "
           f"(no shrinking), on `{suite['model']}`.", ""]
    rows = [[f"`{r['property']}`", r["examples"], f"{r['seconds']:.2f}", f"{r['schedules_per_s']:.1f}"]
            for r in suite["properties"]]
    total = suite["total"]
    rows.append(["**total**", total["examples"], f"{total['seconds']:.2f}", f"**{total['schedules_per_s']:.1f}**"])
    return out + _table(["property", "examples", "seconds", "schedules/s"], rows)


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _faults(faults: dict) -> list[str]:
    goals = faults["goals"]
    out = ["## Suite power against the fault catalog", "",
           f"Each fault a schedule property hunts, {faults['runs']} runs of that property with the fault on, "
           f"{faults['examples']} random examples each (seeds {faults['seed']}.."
           f"{faults['seed'] + faults['runs'] - 1}, no example database; targeting and shrinking on). Seconds "
           f"from the run's start: to the first failing example, and to the first failing example of at most 3 "
           f"requests (the shrinker's work). Goals: found in at least {goals['found']:.0%} of runs, median at "
           f"most {goals['median_first_s']:g} s and worst at most {goals['worst_first_s']:g} s to the first "
           f"failure. {faults['meeting_goals']} of {len(faults['faults'])} meet all three.", ""]
    rows = [[f"`{r['fault']}`", f"`{r['property']}`", f"{r['found']}/{r['runs']}", _seconds(r["median_first_s"]),
             _seconds(r["worst_first_s"]),
             "-" if r["median_first_requests"] is None else f"{r['median_first_requests']:g}",
             f"{r['shrunk']}/{r['found']}", _seconds(r["median_shrunk_s"]), "met" if r["meets_goals"] else "**missed**"]
            for r in faults["faults"]]
    out += _table(["fault", "property", "found", "median s", "worst s", "first failure, requests",
                   "shrunk to <= 3", "median s to it", "goals"], rows)
    if faults["not_measured"]:
        out += ["Not measured here (no schedule property hunts them): " + ", ".join(
            f"`{fault}` ({prop})" for fault, prop in faults["not_measured"].items()) + ".", ""]
    return out


def _llama_cpp(llama: dict, workload: dict) -> list[str]:
    out = ["## Against llama.cpp", "",
           f"The same prompt ids ({workload['prompt_len']} tokens, {workload['max_tokens']} new tokens each, greedy, "
           f"eos ignored, all arriving at once) through refengine and llama.cpp's `llama-server` on an F32 GGUF of the "
           f"same weights, both on {llama['threads']} threads, taking turns: {llama['rounds']} rounds of every batch "
           f"size, the order reversed every round. Decode tokens/s by each engine's own clock; each ratio is taken "
           f"within a round, then the median over rounds.", ""]
    names = [*llama["modes"], "llama.cpp"]
    ratio_names = list(next(iter(llama["ratios"].values())))
    rows = []
    for batch in llama["batch_sizes"]:
        of_batch = [r for r in llama["runs"] if r["batch"] == batch]
        rates = [statistics.median(r[name]["decode_tok_s"] for r in of_batch) for name in names]
        ratios = llama["ratios"][str(batch)]
        same = llama["same_answers"][str(batch)]
        rows.append([batch, *(f"{rate:.1f}" for rate in rates),
                     *(f"{ratios[name]['median']:.2f} ({', '.join(f'{v:.2f}' for v in ratios[name]['rounds'])})"
                       for name in ratio_names),
                     ", ".join(f"{mode} {same[mode]}/{same['requests']}" for mode in llama["modes"])])
    return out + _table(["batch", *(f"{name} tok/s" for name in names), *ratio_names,
                         "same greedy answers"], rows)


def _speculation(spec: dict) -> list[str]:
    if "drafters" not in spec:
        return _speculation_one_drafter(spec)
    lookup, draft = spec["drafters"]["prompt lookup"], spec["drafters"]["draft model"]
    out = ["## Speculative decoding", "",
           f"Prompts of a {spec['phrase_tokens']}-token phrase said {spec['repeats']} times, greedy, fast mode; "
           f"prompt lookup of {lookup['num_speculative_tokens']} tokens, and a draft model of "
           f"{draft['num_speculative_tokens']}: the target's first {draft['layers']} of {draft['of_layers']} "
           f"layers with its head ({draft['parameters']:,} parameters). The engines step in turn. Tokens per "
           f"second over each engine's decode-only steps; the prediction prices each speculating step as a "
           f"plain step plus what the target's forward over its shape costs beyond a plain step's, plus a "
           f"draft-model forward per draft position over the drafting decodes, at forwards timed in the same "
           f"run.", ""]
    rows = []
    for batch, data in spec["batches"].items():
        rows.append([batch, "none", f"{data['plain']['decode_tok_s']:.1f}", "1.00", "", "", "", "yes"])
        for name, run in data["drafters"].items():
            accepted = run["accepted_tokens"] / run["draft_tokens"] if run["draft_tokens"] else 0.0
            rows.append([batch, name, f"{run['decode_tok_s']:.1f}", f"{run['tokens_per_step'] / int(batch):.2f}",
                         f"{accepted:.0%}", f"{run['speedup']:.2f}", f"{run['predicted_speedup']:.2f}",
                         "yes" if run["same_answers"] else "**no**"])
    return out + _table(["batch", "drafter", "tok/s", "tokens per request and step", "draft tokens accepted",
                         "speed-up", "predicted", "same answers"], rows)


def _speculation_one_drafter(spec: dict) -> list[str]:
    """A run from before the draft model joined the scenario: prompt lookup against the roofline."""
    out = ["## Speculative decoding", "",
           f"Prompts of a {spec['phrase_tokens']}-token phrase said {spec['repeats']} times, greedy, fast mode, "
           f"prompt lookup of {spec['num_speculative_tokens']} tokens; an engine speculating and one not, stepping "
           f"in turn. Tokens per second over each engine's decode-only steps; the prediction is the same ratio on "
           f"the roofline of the steps each took.", ""]
    rows = []
    for batch, data in spec["batches"].items():
        plain, fast = data["plain"], data["speculating"]
        accepted = fast["accepted_tokens"] / fast["draft_tokens"] if fast["draft_tokens"] else 0.0
        rows.append([batch, f"{plain['decode_tok_s']:.1f}", f"{fast['decode_tok_s']:.1f}",
                     f"{fast['tokens_per_step'] / int(batch):.2f}", f"{accepted:.0%}", f"{data['speedup']:.2f}",
                     f"{data['predicted_speedup']:.2f}", "yes" if data["same_answers"] else "**no**"])
    return out + _table(["batch", "plain tok/s", "speculating tok/s", "tokens per request and step",
                         "draft tokens accepted", "speed-up", "predicted", "same answers"], rows)


def _json_report(report: dict) -> list[str]:
    machine = report["machine"]
    out = [f"Model `{Path(report['model']).name}`: {report['parameters']:,} streamed parameters, "
           f"{_bytes(report['weight_bytes_f32'])} of float32 weights. Machine figures (best of before and "
           f"after the workloads): streaming read {machine['bandwidth_1thread'] / 1e9:.1f} GB/s on one thread, "
           f"{machine['bandwidth_all'] / 1e9:.1f} GB/s on {machine['threads']}; sgemm "
           f"{machine['sgemm_flops'] / 1e9:.0f} GFLOP/s; load average {machine['load_average']:.2f} before, "
           f"{report['load_average_after']:.2f} after; numpy {report['numpy']}.", ""]
    workload = report["workload"]
    if "decode" in report:
        sampling = workload["sampling"]
        out += [f"Decode workload: {workload['requests']} requests, prompts of {workload['prompt_len']} tokens, "
                f"{workload['max_tokens']} new tokens each, "
                + ("greedy." if sampling == "greedy" else "sampled (" + ", ".join(f"{k} {v}" for k, v in sampling.items())
                   + "), request i seeded with i."), ""]
        out += _decode(report["decode"])
    if "kestrel" in report:
        out += _kestrel(report["kestrel"])
    if "reference" in report:
        out += _reference(report["reference"])
    if "suite" in report:
        out += _suite(report["suite"])
    if "faults" in report:
        out += _faults(report["faults"])
    if "llama_cpp" in report:
        out += _llama_cpp(report["llama_cpp"], workload)
    if "speculation" in report:
        out += _speculation(report["speculation"])
    return out


def run_page(run: dict, data: Path = DATA) -> str:
    path = data / run["file"]
    out = [f"# {run['date']}: {run['machine']}", "",
           f"Measured on {run['date']} at commit `{run['commit']}` on {run['machine']}.", "",
           "```bash", run["command"], "```", ""]
    if run.get("note"):
        out += [run["note"], ""]
    if path.suffix == ".json":
        out += _json_report(json.loads(path.read_text(encoding="utf-8")))
        if (data.parent / "images" / f"{path.stem}.png").is_file():  # drawn from this file by docs/regenerate.py
            out += ["![decode step time and tokens/s against the roofline, both modes](../images/"
                    f"{path.stem}.png)", ""]
        out += [f"Source: `docs/performance/data/{run['file']}`, what the command printed.", ""]
    else:  # a run from before the JSON was kept: its text report as printed
        out += ["The report as the command printed it (no JSON was kept of this run):", "", "```",
                path.read_text(encoding="utf-8").rstrip(), "```", ""]
    return "\n".join(out)


def runs_table(listed: list[dict], from_page: str = "performance/index.md") -> str:
    depth = from_page.count("/")
    rows = [[run["date"], run["machine"], f"`{run['commit']}`",
             f"[{Path(run['file']).stem}]({'../' * depth}{page_path(run)})"] for run in listed]
    return "\n".join(_table(["date", "machine", "commit", "run"], rows))


def on_files(files, config):
    from mkdocs.structure.files import File

    for run in runs():
        files.append(File.generated(config, page_path(run), content=run_page(run)))
    return files


def on_page_markdown(markdown, page, config, files):
    if RUNS_MARKER in markdown:
        return markdown.replace(RUNS_MARKER, runs_table(runs(), page.file.src_uri))
    return markdown
