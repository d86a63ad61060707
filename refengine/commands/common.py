"""Arguments and helpers every subcommand shares."""
from __future__ import annotations

import json
import sys

from ..default_model import default_model_dir
from ..errors import RefengineError
from ..model import Model, load_model


def add_model_argument(parser) -> None:
    parser.add_argument("--model", metavar="DIR",
                        help="HF model folder (default: the embedded tiny model, generated on first use)")


def open_model(args) -> Model:
    return load_model(args.model or default_model_dir())


def parse_ids(text: str, flag: str = "--ids") -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise RefengineError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def print_json(data) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")
