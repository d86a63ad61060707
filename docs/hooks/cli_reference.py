"""mkdocs hook: the CLI reference page, generated at build time from the argparse parser itself
(`refengine.cli.app.build_parser`), so the page cannot drift from the command line: every command,
argument, default, choice and help text is read from the parser, never copied by hand.

`markdown()` needs no mkdocs (tests/test_docs.py holds the page to `refengine ... --help`); only
`on_files` does, which mkdocs calls with the site's files.
"""
from __future__ import annotations

import argparse
import os

PAGE = "reference/cli.md"
USAGE_COLUMNS = 100

INTRO = """# CLI reference

Generated from refengine's argparse parser when the documentation is built
(`docs/hooks/cli_reference.py` walks `refengine.cli.app.build_parser()`), so it lists exactly what
`refengine COMMAND --help` accepts. Every command exits 0 on success, 2 on a usage error or bad input
(one line on stderr naming the flag, file, tensor or field), and `replay`, `golden check` and
`validate` exit 1 when what they judge fails.
"""


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("refengine",), summary: str = ""):
    """(command path, its parser, its one-line help) for the parser and every subcommand under it,
    depth first, in the order they were registered."""
    yield path, parser, summary
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield from commands(sub, path + (name,), helps.get(name, ""))


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    return parser._get_formatter()._expand_help(action)  # argparse's own %(default)s expansion


def _default(action: argparse.Action) -> str:
    default = action.default
    if (default is None or default is argparse.SUPPRESS or isinstance(action, argparse._StoreTrueAction)
            or action.required):
        return ""
    return f"`{default}`"


def _name(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """As `--help` shows it: `--precision {f64,f32}`, `--tie, --no-tie`, `out_dir`."""
    invocation = parser._get_formatter()._format_action_invocation(action)
    return f"`{invocation}`" + (" ..." if action.nargs in ("+", "*") and not action.option_strings else "")


def _notes(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    notes = []
    if action.required and action.option_strings:
        notes.append("required")
    if action.nargs == "?" and not action.option_strings:
        notes.append("optional")
    if action.choices is not None and action.metavar is not None:  # else the invocation shows them
        notes.append("one of " + ", ".join(f"`{c}`" for c in action.choices))
    for group in parser._mutually_exclusive_groups:
        if action in group._group_actions:
            others = [a.option_strings[0] for a in group._group_actions if a is not action]
            notes.append(("exactly one of this and " if group.required else "not with ")
                         + ", ".join(f"`{o}`" for o in others))
    return "; ".join(notes)


def section(path: tuple[str, ...], parser: argparse.ArgumentParser, summary: str) -> str:
    lines = [f"## {' '.join(path)}", ""]
    if summary:
        lines += [summary[0].upper() + summary[1:] + ".", ""]
    lines += ["```", parser.format_usage().strip(), "```", ""]
    rows = [a for a in parser._actions if a.dest != "help" and not isinstance(a, argparse._SubParsersAction)]
    if rows:
        lines += ["| argument | default | notes | help |", "|---|---|---|---|"]
        lines += [f"| {_name(parser, a)} | {_default(a)} | {_cell(_notes(parser, a))} | {_cell(_help(parser, a))} |"
                  for a in rows]
        lines.append("")
    subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for action in subcommands:
        lines += ["Subcommands: " + ", ".join(f"[`{name}`](#{'-'.join(path + (name,))})"
                                              for name in action.choices), ""]
    return "\n".join(lines)


def markdown(parser: argparse.ArgumentParser | None = None) -> str:
    if parser is None:
        from refengine.cli.app import build_parser
        parser = build_parser()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(USAGE_COLUMNS)  # argparse wraps usage to the terminal: the same page everywhere
    try:
        sections = [section(path, sub, summary) for path, sub, summary in commands(parser)]
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return INTRO + "\n" + "\n".join(sections)


def on_files(files, config):
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=markdown()))
    return files
