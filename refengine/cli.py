"""`refengine` command line. Bad input: exit 2 with one line on stderr."""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import RefengineError

# Each module defines register(subparsers); its parser sets func(args) -> exit code.
COMMAND_MODULES = ["foundation", "run_schedule", "serve", "golden", "validate", "bench", "calibrate", "replay", "faults"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's default prints usage too: keep errors to one line
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="refengine", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(f"refengine.commands.{name}").register(subparsers)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RefengineError as e:
        print(f"refengine {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"refengine {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
