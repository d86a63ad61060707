"""faults: list the fault catalog (bugs the engine can switch on to prove the suite catches them)."""
from __future__ import annotations

import textwrap

from ..engine import FAULTS
from .common import FAULT_ENV


def run(args) -> int:
    width = max(map(len, FAULTS))
    for name, description in FAULTS.items():
        lines = textwrap.wrap(description, 100 - width - 2)
        print(f"{name:<{width}}  {lines[0]}")
        for line in lines[1:]:
            print(f"{'':<{width}}  {line}")
    print(f"-- switch one on with {FAULT_ENV}=NAME or --fault NAME (CLI, server) or EngineConfig(fault=NAME)")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("faults", help="list the injectable continuous-batching bugs")
    p.set_defaults(func=run)
