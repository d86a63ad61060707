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


@pytest.fixture(scope="module")
def performance():
    return hook("performance")


def table_rows(page: str, heading: str) -> int:
    """Data rows of the first table after `heading`."""
    section = page.split(heading, 1)[1]
    table = section[section.index("\n|"):].split("\n\n", 1)[0].strip().splitlines()
    return len(table) - 2  # header and rule


def test_every_committed_bench_run_renders_with_its_own_figures(performance):
    runs = performance.runs()
    assert runs
    for run in runs:
        page = performance.run_page(run)
        assert run["date"] in page and run["machine"] in page and run["command"] in page
        path = performance.DATA / run["file"]
        if path.suffix != ".json":
            assert path.read_text(encoding="utf-8").strip() in page
            continue
        report = json.loads(path.read_text(encoding="utf-8"))
        if "decode" in report:
            assert table_rows(page, "## Decode throughput") == len(report["decode"]["rows"])
            for row in report["decode"]["rows"]:
                assert f"| {row['batch']} | {row['mode']} | {row['decode_tok_s']:.1f} |" in page
        if "suite" in report:
            assert table_rows(page, "## Suite throughput") == len(report["suite"]["properties"]) + 1
            assert f"{report['suite']['total']['schedules_per_s']:.1f}" in page
        if "faults" in report:
            assert table_rows(page, "## Suite power against the fault catalog") == len(report["faults"]["faults"])
            for row in report["faults"]["faults"]:
                assert f"| `{row['fault']}` | `{row['property']}` | {row['found']}/{row['runs']} |" in page


def test_a_report_of_one_scenario_renders_only_that_scenario(performance, tmp_path):
    source = next(run for run in performance.runs() if run["file"].endswith(".json")
                  and "suite" in json.loads((performance.DATA / run["file"]).read_text(encoding="utf-8")))
    report = json.loads((performance.DATA / source["file"]).read_text(encoding="utf-8"))
    for scenario in ("decode", "kestrel", "reference"):
        report.pop(scenario, None)
    (tmp_path / "one.json").write_text(json.dumps(report), encoding="utf-8")
    page = performance.run_page({**source, "file": "one.json"}, tmp_path)
    assert "## Suite throughput" in page and "## Decode throughput" not in page and "## Kestrel" not in page


def test_runs_and_data_files_must_agree(performance, tmp_path):
    (tmp_path / "2030-01-01-x.json").write_text("{}", encoding="utf-8")
    (tmp_path / performance.MANIFEST).write_text("[]", encoding="utf-8")
    with pytest.raises(performance.RunsError):  # a data file nobody dated
        performance.runs(tmp_path)
    run = {"file": "2030-01-01-x.json", "date": "2030-01-01", "machine": "m", "commit": "c", "command": "refengine bench"}
    (tmp_path / performance.MANIFEST).write_text(json.dumps([run]), encoding="utf-8")
    assert performance.runs(tmp_path) == [run]
    (tmp_path / performance.MANIFEST).write_text(json.dumps([run, {**run, "file": "gone.json"}]), encoding="utf-8")
    with pytest.raises(performance.RunsError):  # a listed file that is not there
        performance.runs(tmp_path)
    (tmp_path / performance.MANIFEST).write_text(json.dumps([{**run, "machine": ""}]), encoding="utf-8")
    with pytest.raises(performance.RunsError):  # undated or without its machine
        performance.runs(tmp_path)


def regenerate():
    spec = importlib.util.spec_from_file_location("docs_regenerate", DOCS / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_examples_were_made_with_the_current_default_model_and_schedule():
    """docs/examples/ is what `python docs/regenerate.py` printed; a new default model or a changed
    shipped schedule changes every example, so their manifest must follow (regenerate)."""
    made, now = json.loads((DOCS / "examples" / "manifest.json").read_text(encoding="utf-8")), regenerate().manifest()
    assert made == now


def test_every_included_example_exists_and_the_readme_holds_them():
    """Pages include docs/examples/NAME.txt (mkdocs fails on a missing one, but only where it builds);
    the README holds copies, which must be the files as they are."""
    pages = [*DOCS.rglob("*.md"), DOCS.parent / "README.md"]
    names = {name for page in pages for name in re.findall(r'^--8<-- "examples/([a-z0-9-]+)\.txt"', page.read_text(), re.M)}
    module = regenerate()
    readme = (DOCS.parent / "README.md").read_text(encoding="utf-8")
    names |= {m["name"] for m in module.REGION.finditer(readme)}
    assert len(names) >= 15 and {"replay", "validate-seed-experiment"} <= names
    assert all((DOCS / "examples" / f"{name}.txt").is_file() for name in names)
    assert module.fill_readme(readme) == readme


def test_the_pictures_the_docs_show_exist():
    pages = [*DOCS.rglob("*.md"), DOCS.parent / "README.md"]
    for page in pages:
        for image in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", page.read_text(encoding="utf-8")):
            assert (page.parent / image).is_file(), (page, image)
