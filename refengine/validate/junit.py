"""The validation report as JUnit XML, so CI dashboards show a board run the way they show pytest:
one testcase per request sent alone and per request under load, a failure for a divergence or an
error (its message the verdict's text), a skip for a hang-up, and one testcase for the drain."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from .report import describe_record


def _case(suite, classname: str, name: str, seconds: float | None = None):
    return ET.SubElement(suite, "testcase", classname=classname, name=name, time=f"{seconds or 0:.3f}")


def junit(report: dict) -> ET.ElementTree:
    s, local = report["settings"], bool(report.get("margins"))
    suite = ET.Element("testsuite", name=f"refengine validate {report['url']}")
    failures = skipped = 0

    def fail(case, message: str, text: str = ""):
        nonlocal failures
        failures += 1
        ET.SubElement(case, "failure", message=message).text = text or message

    for phase, records in (("alone", report["alone"]), ("loaded", report["requests"])):
        for r in records:
            case = _case(suite, f"{phase}.{r['api']}", r["id"], r.get("latency_s"))
            if r["verdict"] == "error":
                fail(case, r["error"])
            elif r["verdict"] == "cancelled":
                skipped += 1
                ET.SubElement(case, "skipped", message="the client hung up mid-stream (not compared)")
            elif r["verdict"] == "diverged":
                baseline = report["baseline"] if phase == "loaded" else "golden"
                fail(case, f"diverged at step {r['step']}", describe_record(r, s["tolerance"], baseline, local))
            batching = r.get("batching", {})
            if batching.get("verdict") == "diverged":
                fail(case, f"diverged from its alone answer at step {batching['step']}",
                     describe_record({**batching, "id": r["id"]}, report["bounds"]["batching"], "serial", local))
            elif batching.get("verdict") == "error":
                fail(case, batching["error"])
    drain = _case(suite, "server", "drain")
    aborts = report["drain"].get("aborts")
    if report["drain"]["checked"] and not report["drain"]["drained"]:
        fail(drain, report["drain"]["note"])
    elif aborts and not aborts["ok"]:
        fail(drain, aborts["note"])
    elif aborts and not aborts.get("alone", {"ok": True})["ok"]:
        fail(drain, f"alone hang-up: {aborts['alone']['note']}")
    suite.set("tests", str(len(suite)))
    suite.set("failures", str(failures))
    suite.set("errors", "0")
    suite.set("skipped", str(skipped))
    suite.set("time", f"{report['summary']['wall_s']:.3f}")
    return ET.ElementTree(suite)


def write_junit(report: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    junit(report).write(path, encoding="utf-8", xml_declaration=True)
    return path
