"""HTTP repro files: the requests of a board validation run (or of an HTTP property's shrunk
schedule) exactly as they were sent, so `refengine validate --replay FILE --url URL` sends them
again — same cases, APIs, streaming, planned arrivals and hang-up points — and judges them the same
way (baseline, tolerance). One format for both (FORMATS.md, "HTTP repro"):

    {"validate_repro": 1, "found_by": "validate" | "<property>", "url": ..., "server": {...},
     "baseline": "golden" | "serial", "source": "<golden or prompts file>", "model_fingerprint": ...,
     "settings": {"concurrency": ..., "margin_tolerance": ..., "tolerance": ..., "api": ..., "timeout": ...},
     "requests": [{"id", "case", "api", "streamed", "arrival_s", "cancel_after", "verdict"[, "cache"]}, ...]}

`cache` (optional, default "warm"): the request's prefix-cache group (validate.plan.CACHE); a replay
sends it in the same group, under the replay's own fresh salts.

The cases themselves are not copied: `source` names the file they come from (a replay may point at
another copy of it), and a case id the file lacks is an error naming it.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..check.schedule import read_json
from ..errors import RefengineError
from .plan import CACHE, Planned
from .variants import variants

REPRO_FORMAT = 1
REQUEST_KEYS = ("id", "case", "api", "streamed", "arrival_s", "cancel_after")


def repro(records: list[dict], *, found_by: str, url: str, server: dict, baseline: str, source, fingerprint,
          settings: dict) -> dict:
    """The repro of `records` (validate.load's, in plan order) sent to `url`. `settings`: concurrency,
    margin_tolerance (None: the baseline's default), tolerance (applied), api, timeout."""
    return {"validate_repro": REPRO_FORMAT, "found_by": found_by, "url": url, "server": server,
            "baseline": baseline, "source": str(source), "model_fingerprint": fingerprint, "settings": settings,
            "requests": [{**{k: r[k] for k in REQUEST_KEYS}, "verdict": r["verdict"],
                          **({"cache": r["cache"]} if r.get("cache", "warm") != "warm" else {})}
                         for r in records]}


def repro_data(report: dict) -> dict:
    """A validation report (validate.board) as a repro."""
    s = report["settings"]
    return repro(report["requests"], found_by="validate", url=report["url"], server=report["server"],
                 baseline=report["baseline"], source=report["source"], fingerprint=report["model_fingerprint"],
                 settings={k: s[k] for k in ("concurrency", "margin_tolerance", "tolerance", "api", "timeout",
                                          "precision", "batch_invariant")})


def write_repro(path: str | Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def read_repro(path: str | Path) -> dict:
    data = read_json(Path(path))
    if not isinstance(data, dict) or data.get("validate_repro") != REPRO_FORMAT:
        raise RefengineError(f"{path}: not a validate repro file (expected \"validate_repro\": {REPRO_FORMAT})")
    for key in ("baseline", "source", "settings", "requests"):
        if key not in data:
            raise RefengineError(f"{path}: missing key {key!r}")
    if not isinstance(data["requests"], list) or not data["requests"]:
        raise RefengineError(f"{path}: 'requests' must be a non-empty list")
    for n, r in enumerate(data["requests"]):
        missing = [k for k in REQUEST_KEYS if not isinstance(r, dict) or k not in r]
        if missing:
            raise RefengineError(f"{path}: requests[{n}]: missing {', '.join(missing)}")
    return data


def planned_from(data: dict, cases: list, path) -> list[Planned]:
    """The repro's requests as a plan over `cases` (matched by case id; a processed variant's id,
    `<case id>+<variant>`, by its case's: validate.surface)."""
    by_id = {c.id: c for case in cases for c in (case, *variants(case))}
    planned = []
    for n, r in enumerate(data["requests"]):
        if r["case"] not in by_id:
            raise RefengineError(f"{path}: requests[{n}]: case {r['case']!r} is not in {data['source']}")
        if r["api"] not in ("completions", "chat"):
            raise RefengineError(f"{path}: requests[{n}]: api must be completions or chat, got {r['api']!r}")
        if r.get("cache", "warm") not in CACHE:
            raise RefengineError(f"{path}: requests[{n}]: cache must be one of {', '.join(CACHE)}, got {r['cache']!r}")
        planned.append(Planned(str(r["id"]), by_id[r["case"]], r["api"], float(r["arrival_s"]), bool(r["streamed"]),
                               r["cancel_after"], cache=r.get("cache", "warm")))
    return planned
