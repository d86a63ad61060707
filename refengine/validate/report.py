"""The validation report as people read it: one line per request, the margin rule's account of
each divergence, then the run's settings, load, dialect and drain, and the verdict."""
from __future__ import annotations

from ..check.margin_rule import Verdict, describe
from .cache import format_cache
from .dialect import dialect_notes
from .surface import surface_notes
from .load import MIN_OVERLAP_FRACTION, VERDICTS
from .precision import format_precision


MARGIN_SOURCES = {"golden": "the golden file (float64)",
                  "server": "the server's own, from the logprobs of its alone answer",
                  "model": "the float64 reference on the local model, along the alone answer's tokens"}


def describe_record(r: dict, tolerance: float, baseline: str = "golden", local_model: bool = False) -> str:
    """The margin rule's diff for an `explained` or `diverged` record, with where its margin came from
    (and, with none, that the local model would have measured one)."""
    verdict = Verdict(r["id"], r["verdict"], r["compared_by"], reason=r.get("note", ""), index=r["step"],
                      got=r["got"], want=r["expected"], margin=r["margin"], tolerance=tolerance,
                      want_text=r["expected_text"], got_text=r["got_text"])
    text = describe(verdict, "got", "golden" if baseline == "golden" else "alone")
    if r.get("choice"):
        text = f"choice {r['choice']} (n): {text}"
    if r.get("margin_from"):
        return text + f"\n  margin from {MARGIN_SOURCES[r['margin_from']]}"
    if baseline == "serial" and not local_model and not (r["expected"] is None and r["step"] is not None):
        return text + "\n  the served model's folder would give it one: the float64 reference measures the margin"
    return text


def _detail(r: dict) -> str:
    choice = f"choice {r['choice']}: " if r.get("choice") else ""
    return choice + _choice_detail(r)


def _choice_detail(r: dict) -> str:
    if r["verdict"] == "match":
        return f"{r['tokens'] if r['tokens'] is not None else '?'} tokens, by {r['compared_by']}"
    if r["verdict"] in ("explained", "diverged"):
        if r["compared_by"] == "prompt_logprobs":
            return f"prompt logprobs: {r.get('note', '')}"
        if r["step"] is None:
            return f"the texts part, by {r['compared_by']}"
        if r["margin"] is not None:
            margin = f"margin {r['margin']:.4g}"
        else:
            margin = "baseline answer ended" if r["expected"] is None else "no margin known (strict)"
        return f"step {r['step']}, {margin}, by {r['compared_by']}"
    if r["verdict"] == "cancelled":
        return "client hung up mid-stream"
    return r["error"]


def inconclusive_advice(report: dict) -> str:
    load, s = report["overlap"], report["settings"]
    return (f"INCONCLUSIVE: only {load['overlapped']} of {load['compared']} compared requests overlapped another "
            f"(at most {load['max_in_flight']} in flight; {MIN_OVERLAP_FRACTION:.0%} needed): the server was not "
            f"tested under join/leave load. Raise the concurrency (now {s['concurrency']}), shorten the arrival "
            f"spread (now {s['arrival_spread_s']}s) or repeat the cases")


def format_report(report: dict) -> str:
    s, summary, load = report["settings"], report["summary"], report["overlap"]
    width = max(len(r["id"]) for r in report["requests"])
    lines = [f"{'request':<{width}}  {'api':<11}  {'stream':<6}  {'sent':>6}  {'latency':>7}  {'with':>4}  "
             f"{'verdict':<9}  detail"]
    for r in sorted(report["requests"], key=lambda r: r["sent_s"]):
        lines.append(f"{r['id']:<{width}}  {r['api']:<11}  {'yes' if r['streamed'] else 'no':<6}  "
                     f"{r['sent_s']:>5.2f}s  {r['latency_s']:>6.2f}s  {r['overlapped_with']:>4}  {r['verdict']:<9}  "
                     f"{_detail(r)}")
    bounds, local = report.get("bounds"), bool(report.get("margins"))
    for r in report["requests"]:
        if r["verdict"] in ("explained", "diverged"):
            lines.append(describe_record(r, s["tolerance"], report["baseline"], local))
        batching = r.get("batching", {})
        if batching.get("verdict") in ("explained", "diverged"):
            lines.append("batching (loaded vs alone): " + describe_record(
                {**batching, "id": r["id"]}, bounds["batching"], "serial", local))
    refused = (report.get("variants") or {}).get("refused", {})
    for r in report["alone"]:
        if r["verdict"] == "error" and f"{r['case']}@{r['api']}" not in refused:
            lines.append(f"alone {r['id']}: error: {r['error']}")
        elif r["verdict"] in ("explained", "diverged"):
            lines.append("precision (alone vs golden): " + describe_record(r, s["tolerance"], "golden", local))
    against = (f"the golden file {report['golden']}" if report["baseline"] == "golden"
               else f"its own alone answers to {report['source']}")
    lines.append(
        f"validate {report['url']} (served model {report['server']['model']!r}) against {against}: "
        f"{summary['requests']} requests, concurrency {s['concurrency']}, seed {s['seed']}, cancel rate "
        f"{s['cancel_rate']}, tolerance {s['tolerance']:.6g} ({s['tolerance_from']}), {summary['wall_s']:.2f}s")
    spread_from = {"settings": "given", "repro": "as in the repro"}.get(s["arrival_spread_from"]) or \
        f"from the alone latency {s['alone_latency_s']:.3g}s"
    lines.append(f"load: arrivals over {s['arrival_spread_s']:.3g}s ({spread_from}); at most {load['max_in_flight']} "
                 f"in flight; {load['overlapped']} of {load['compared']} compared requests overlapped another"
                 + (" (a replayed repro needs no overlap)" if s["arrival_spread_from"] == "repro" else ""))
    if bounds:
        lines.append(format_bounds(bounds))
    if report.get("effects"):
        lines += format_effects(report["effects"])
    server_fingerprint = report["server"]["fingerprint"]
    if server_fingerprint and report["model_fingerprint"] and server_fingerprint != report["model_fingerprint"]:
        lines.append(f"note: the server reports model {server_fingerprint}, the golden file was made from "
                     f"{report['model_fingerprint']} (expected for a converted or quantized model)")
    margins = report.get("margins")
    if margins:
        lines.append(f"margins: {margins['measured']} measured by the float64 reference on {margins['model']}")
        if server_fingerprint and server_fingerprint != margins["fingerprint"]:
            lines.append(f"note: the server reports model {server_fingerprint}, the local model is "
                         f"{margins['fingerprint']}: its margins are another model's unless the server's is a "
                         f"conversion of it")
    lines += dialect_notes(report.get("dialect"))
    lines += surface_notes(report.get("surface"))
    if report.get("cache"):
        lines += format_cache(report["cache"])
    if report.get("variants"):
        lines += format_variants(report["variants"])
    stripped = [r["id"] for r in report["alone"] + report["requests"] if r.get("whitespace_restored")]
    if stripped:
        lines.append(f"note: {len(stripped)} answers came without the whitespace their golden answer has at an end "
                     f"(a server that strips its text); compared with it given back (validate.dialect.unstripped)")
    rendered = [r for r in report["alone"] + report["requests"] if r.get("special_tokens_rendered")]
    if rendered:
        texts = sorted({t for r in rendered for t in r["special_tokens_rendered"]})
        lines.append(f"note: {len(rendered)} answers came with special tokens written in their text "
                     f"({', '.join(texts)}: a server that does not skip them); compared with the golden answers "
                     f"decoded that way (validate.baseline.rendering_special_tokens)")
    at_limit = [r["finish_reason_at_max_tokens"] for r in report["alone"] + report["requests"]
                if r.get("finish_reason_at_max_tokens")]
    if at_limit:
        lines.append(f"note: {len(at_limit)} answers that stopped on their last allowed token came with finish_reason "
                     f"{'/'.join(sorted(set(at_limit)))} (both stop and length hold there: "
                     f"validate.baseline.at_max_tokens)")
    if report.get("precision"):
        lines += format_precision(report["precision"])
    lines.append(f"drain: {report['drain']['note']}")
    aborts = report["drain"].get("aborts")
    for label, accounting in (("aborts", aborts), ("alone hang-up", (aborts or {}).get("alone"))):
        if accounting is not None:
            verdict = "" if accounting["ok"] else " -> a hang-up that was not aborted"
            lines.append(f"{label}: {accounting['note']}{verdict}")
    if summary["verdict"] == "INCONCLUSIVE":
        lines.append(inconclusive_advice(report))
    lines.append(", ".join(f"{kind} {summary[kind]}" for kind in VERDICTS) + f" -> {summary['verdict']}")
    return "\n".join(lines)


BOUND_SOURCES = {"golden": "the golden file's header",
                 "model": "the local model (measured once per model and precision, then cached)"}


def format_variants(v: dict) -> list[str]:
    """The variants line: what went under load as each (validate.variants), by verdict, and what was refused."""
    sent = "; ".join(f"{name} {sum(counts.values())} (" + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + ")"
                     for name, counts in sorted(v["sent"].items())) or "none"
    lines = [f"variants (rate {v['rate']:g}, each judged against its own alone answer): {sent}"]
    lines += [f"note: variant {key} refused alone, sent as its case: {why[:160]}" for key, why in v["refused"].items()]
    return lines


def format_bounds(b: dict) -> str:
    """Where the run's two tolerances came from (validate.bounds)."""
    if b["precision_tolerance"] is None:
        precision = f"precision {b['precision']} ({b['precision_from']}): no bound known (a golden file or --model gives one)"
    elif b["bound"] is None:
        precision = f"precision {b['precision']} ({b['precision_from']}): tolerance {b['precision_tolerance']:.4g} (given)"
    else:
        precision = (f"precision {b['precision']} ({b['precision_from']}): bound {b['bound']:.4g} from "
                     f"{BOUND_SOURCES[b['bound_from']]} (refengine's reference rounded to {b['precision']} vs "
                     f"float64), tolerance {b['precision_tolerance']:.4g} = bound x {b['safety_factor']}")
    batching = {"precision": "the precision tolerance", "batch_invariant": "bit-identical: the engine claims batch "
                "invariance", "margin_tolerance": "given", "no bound": "bit-identical: no precision bound known"}
    return f"{precision}; batching tolerance {b['batching']:.4g} ({batching[b['batching_from']]})"


def format_effects(effects: dict) -> list[str]:
    """The two effects apart: what the device's precision does, what batching does."""
    def counts(c):
        return ", ".join(f"{c[k]} {k}" for k in ("match", "explained", "diverged"))
    return [f"precision effect (each answer alone vs the golden file): {counts(effects['precision'])}",
            f"batching effect (each loaded answer vs its alone answer): {counts(effects['batching'])}"]
