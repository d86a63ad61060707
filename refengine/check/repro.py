"""Repro files: a schedule (FORMATS.md schedule format) that made a property fail, plus top-level
keys saying where it was found, so `refengine replay FILE` re-runs exactly that comparison.

Extra top-level keys (all optional; the schedule parser ignores top-level keys it does not know):
`model` (the folder it ran on), `model_fingerprint`, `model_command` (how to rebuild that folder),
`found_by` (the property), `against` and `other_budget` (the comparison), `fault` (informational:
replay injects a fault only when asked to).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import RefengineError
from ..model import Model, load_model
from .schedule import Schedule, parse_schedule, read_json


def write_repro(path: Path, schedule: dict, *, found_by: str, model: Model, model_command: str | None = None,
                against: str = "serial", other_budget: int | None = None, fault: str | None = None) -> Path:
    data = {"model": str(model.path), "model_fingerprint": model.fingerprint,
            **({"model_command": model_command} if model_command else {}), "found_by": found_by,
            "against": against, **({"other_budget": other_budget} if other_budget else {}),
            **({"fault": fault} if fault else {}), **schedule}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return path


@dataclass(frozen=True)
class Repro:
    path: Path
    schedule: Schedule
    data: dict  # the whole file, extra keys included

    @property
    def against(self) -> str:
        return self.data.get("against", "serial")

    @property
    def other_budget(self) -> int | None:
        return self.data.get("other_budget")

    @property
    def fault(self) -> str | None:
        return self.data.get("fault")

    def model(self, model_dir: str | Path | None, default_dir) -> Model:
        """`model_dir` if given, else the folder the schedule was found on, else `default_dir()`."""
        if model_dir:
            return load_model(model_dir)
        found_on = self.data.get("model")
        if isinstance(found_on, str) and (Path(found_on) / "config.json").exists():
            return load_model(found_on)
        if isinstance(found_on, str):
            how = self.data.get("model_command", "")
            raise RefengineError(f"{self.path}: model folder {found_on} not found; give the model folder"
                                 + (f" (it was made with: {how})" if how else ""))
        return load_model(default_dir())

    def fingerprint_note(self, model: Model) -> str | None:
        expected = self.data.get("model_fingerprint")
        if expected and expected != model.fingerprint:
            return f"{self.path} was found on {expected}, replaying on {model.fingerprint}"
        return None


def load_repro(path: str | Path) -> Repro:
    path = Path(path)
    data = read_json(path)
    return Repro(path, parse_schedule(data, str(path)), data)
