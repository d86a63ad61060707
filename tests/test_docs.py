"""The documentation's generated pages (docs/hooks/): the CLI reference must list every command and
every option of the real command line, and the performance pages must render every committed
`refengine bench --json` file. `mkdocs build --strict` (.ci/run) builds the site itself; these tests
need no mkdocs.

The CLI reference is held to the command line as a user meets it, `refengine ... --help`, not to
the parser walk the hook itself does: a command or flag the hook skips (a nested subcommand, a
mutually exclusive group) fails here.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
from pathlib import Path

import pytest

from refengine.cli.app import build_parser, main

DOCS = Path(__file__).resolve().parent.parent / "docs"


def hook(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", DOCS / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def help_text(path: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main([*path, "--help"])
    assert done.value.code == 0
    return out.getvalue()


def cli_commands(path: list[str] | None = None) -> dict[tuple[str, ...], str]:
    """Every command path the CLI accepts -> its --help text, found from the usage lines alone
    (`{info,logits,...}` lists a parser's subcommands)."""
    path = path or []
    text = help_text(path)
    found = {tuple(path): text}
    usage = text.split("\n\n")[0]
    for choices in re.findall(r"\{([a-z0-9_,-]+)\}\s*\.\.\.", usage):
        for name in choices.split(","):
            found |= cli_commands(path + [name])
    return found


def sections(page: str) -> dict[tuple[str, ...], str]:
    """The generated page's sections, by the command path in their `## refengine ...` heading."""
    parts = re.split(r"^## (refengine(?: [a-z0-9_-]+)*)$", page, flags=re.MULTILINE)
    return {tuple(parts[i].split()[1:]): parts[i + 1] for i in range(1, len(parts), 2)}


@pytest.fixture(scope="module")
def cli_page() -> str:
    return hook("cli_reference").markdown()


def test_every_command_and_option_is_in_the_generated_cli_reference(cli_page):
    commands = cli_commands()
    assert ("golden", "refresh") in commands and ("validate",) in commands  # the discovery itself works
    by_command = sections(cli_page)
    assert set(by_command) == set(commands)
    options = {path: set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", text.split("\n\n")[0])) - {"--help"}
               for path, text in commands.items()}  # a usage paragraph lists every option of its command
    assert {"--margin-tolerance", "--replay"} <= options["validate",]  # the discovery itself works
    for path, flags in options.items():
        rows = by_command[path]
        missing = sorted(flag for flag in flags if f"`{flag}" not in rows and f", {flag}" not in rows)
        assert not missing, (path, missing)

def test_the_cli_reference_shows_the_parsers_defaults(cli_page):
    """A default is what argparse fills in when the flag is left out (parsed here, not read from the
    parser's actions as the hook does)."""
    by_command = sections(cli_page)
    for argv, required in ((["validate"], ["--url", "http://127.0.0.1:1"]), (["serve"], []), (["bench"], []),
                           (["golden", "check"], []), (["replay"], []), (["make-tiny"], ["out"])):
        parsed = vars(build_parser().parse_args(argv + required))
        rows = {re.match(r"\| `(--[a-z0-9-]+)", row)[1]: row
                for row in by_command[tuple(argv)].splitlines() if row.startswith("| `--")}
        for flag, row in rows.items():
            default = parsed[flag.lstrip("-").replace("-", "_")]
            if default not in (None, False) and flag != "--url":
                assert f"`{default}`" in row.split(" | ")[1], (argv, flag, default, row)
