"""Arguments and helpers every subcommand shares."""
from __future__ import annotations

import json
import os
import sys

from ..engine import resolve_fault
from ..errors import RefengineError
from ..model import Model, load_model
from ..model.cache import default_model_dir

FAULT_ENV = "REFENGINE_FAULT"  # the CLI's (and so the server's) way to switch a catalogued fault on


def add_model_argument(parser) -> None:
    parser.add_argument("--model", metavar="DIR",
                        help="HF model folder (default: the embedded tiny model, generated on first use)")


def open_model(args) -> Model:
    return load_model(args.model or default_model_dir())


def fault_from(args) -> str | None:
    """--fault when the command has it and it is given, else $REFENGINE_FAULT; validated by name."""
    if getattr(args, "fault", None):
        return resolve_fault(args.fault, "fault").value
    fault = resolve_fault(os.environ.get(FAULT_ENV), FAULT_ENV)
    return fault.value if fault else None


def parse_ids(text: str, flag: str = "--ids") -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise RefengineError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def print_json(data) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")
