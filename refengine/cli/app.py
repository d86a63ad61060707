"""`refengine` command line. Bad input: exit 2 with one line on stderr.

The library's errors name the field at fault ("concurrency: must be >= 1"); this is the one place
that knows which flag sets that field, so the line the user reads names the flag instead.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import RefengineError

# Each module defines register(subparsers); its parser sets func(args) -> exit code.
COMMAND_MODULES = ["foundation", "run_schedule", "serve", "golden", "validate", "bench", "calibrate", "replay", "faults"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's default prints usage too: keep errors to one line
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Field name -> the flag that sets it, for one (sub)command."""
    return {action.dest: action.option_strings[-1] for action in parser._actions
            if action.option_strings and action.dest != "help"}


def _subcommands(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield sub
                yield from _subcommands(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="refengine", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(f"refengine.cli.{name}").register(subparsers)
    for sub in _subcommands(parser):
        sub.set_defaults(flags=_flags(sub))
    return parser


def as_flag_message(message: str, flags: dict[str, str]) -> str:
    field, colon, rest = message.partition(":")
    return flags[field] + colon + rest if colon and field in flags else message


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RefengineError as e:
        print(f"refengine {args.command}: error: {as_flag_message(str(e), args.flags)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"refengine {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
