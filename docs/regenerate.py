"""Run every example the documentation shows and write what it printed and drew:

    python docs/regenerate.py          # (with refengine installed: pip install -e '.[test,plot,docs,parity]')

- docs/examples/*.txt: each command's real output, included into the pages (pymdownx.snippets) so a
  page never shows output refengine no longer prints; absolute paths are shortened to `...`;
- docs/images/*.png: the timeline of the shipped schedule, clean and with a batching bug
  (`replay --plot`), validate's precision histogram of a bf16 server (`validate --plot`), the
  divergence margins of HF `transformers serve` in bf16 against the bf16 bound (`validate
  --plot-margins`), and the decode plot of every committed `bench --json` run that recorded its roofline (bench.plot);
- README.md: between `<!-- example NAME -->` and `<!-- /example -->` (`head=N`: its first N lines, then
  `...` and the last), the same outputs as a code block (GitHub renders no includes);
- docs/examples/manifest.json: the default model, the shipped schedule and the refengine version
  the examples were made with (tests/test_docs.py fails when they no longer match: regenerate).

Everything runs in a scratch folder against `refengine serve` on 127.0.0.1 (clean, with a batching
fault, and bf16 copies of the models) and `transformers serve` in float32 and bf16 (the parity extra): a few
minutes on two cores. Times, ports and ids in the
outputs are those of the run.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable

from tqdm import tqdm

DOCS = Path(__file__).resolve().parent
EXAMPLES, IMAGES, PERFORMANCE = DOCS / "examples", DOCS / "images", DOCS / "performance"
FAULT = "position-off-by-one-on-join"  # visible only when a request joins a running batch


class Work:
    """A scratch folder the commands run in, and the servers they talk to."""

    def __init__(self, root: Path):
        self.root = root
        self.servers: list[subprocess.Popen] = []
        import refengine.data
        self.data = Path(refengine.data.__file__).resolve().parent
        # the package's files by the paths they have in a checkout, so a shown command runs from one
        (root / "refengine").symlink_to(self.data.parent, target_is_directory=True)
        self.prompts = "refengine/data/golden/prompts/seed-experiment.jsonl"

    def shorten(self, text: str) -> str:
        text = text.replace(str(self.data), ".../refengine/data").replace(str(self.root) + "/", "")
        text = text.replace(str(DOCS) + "/", "docs/").replace(f"{sys.executable} -m pytest", "pytest")
        return re.sub(r"/tmp/[\w.-]+/pytest-of-\w+/pytest-\d+/", ".../", text)

    def run(self, command: list[str], name: str | None = None, env: dict | None = None,
            keep: slice | Callable[[list[str]], list[str]] | None = None) -> str:
        """Run `command` here; with `name`, write `$ command` and its output to docs/examples/NAME.txt
        (`keep`: the lines shown, a slice or a function of all of them; '...' where some are left out)."""
        done = subprocess.run(command, cwd=self.root, env={**os.environ, **(env or {})}, capture_output=True,
                              text=True, timeout=900)
        if done.returncode not in (0, 1):  # 1: a FAIL, which several examples show on purpose
            raise SystemExit(f"{shlex.join(command)}: exit {done.returncode}\n{done.stderr}")
        out = self.shorten(done.stdout)
        if name:
            lines = out.rstrip("\n").splitlines()
            if isinstance(keep, slice):
                lines = (["..."] if keep.start else []) + lines[keep] + (["..."] if keep.stop else [])
            elif keep is not None:
                lines = ["...", *keep(lines)]
            shown = self.shorten(shlex.join([f"{k}={v}" for k, v in (env or {}).items()] + command))
            (EXAMPLES / f"{name}.txt").write_text(f"$ {shown}\n" + "\n".join(lines) + "\n", encoding="utf-8")
        return out

    def serve(self, *args: str, env: dict | None = None) -> str:
        server = subprocess.Popen(["refengine", "serve", "--port", "0", *args], cwd=self.root, text=True,
                                  env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.servers.append(server)
        line = server.stdout.readline()
        if not line.startswith("serving "):
            raise SystemExit(f"refengine serve {' '.join(args)}: {line!r}")
        return line.split()[1]

    def close(self) -> None:
        for server in self.servers:
            server.terminate()
            server.wait(30)


def bf16_copy(model_dir: Path, out: Path) -> Path:
    """The model with its weights stored as bf16: what a converted device checkpoint holds."""
    from safetensors.numpy import load_file

    from refengine.model.safetensors_io import save_file
    from refengine.model.weights import SINGLE_FILE
    shutil.copytree(model_dir, out)
    save_file(load_file(str(model_dir / SINGLE_FILE)), out / SINGLE_FILE, "BF16")
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}, indent=2) + "\n",
                                     encoding="utf-8")
    return out


def in_process(work: Work) -> None:
    work.run(["refengine", "info"], "info")
    work.run(["refengine", "generate", "--chat", "What is the capital of Japan?", "--max-tokens", "8"], "generate")
    work.run(["refengine", "replay"], "replay")
    work.run(["refengine", "replay", "--fault", FAULT], "replay-fault")
    work.run(["refengine", "replay", "--plot", str(IMAGES / "timeline-join-leave.png")])
    work.run(["refengine", "replay", "--fault", FAULT, "--plot", str(IMAGES / "timeline-fault.png")])
    work.run(["refengine", "run-schedule"], "run-schedule")
    work.run(["refengine", "make-tiny", "models/tiny-random"], "make-tiny")
    work.run(["refengine", "margins", "--model", "models/tiny-random", "--prompts", "64", "--max-tokens", "32"],
             "margins-random")
    work.run(["refengine", "golden", "refresh", "--prompts", work.prompts, "--out", "golden/tiny.jsonl"],
             "golden-refresh")
    work.run(["cmp", "golden/tiny.jsonl", "refengine/data/golden/tiny-chat.jsonl"], "golden-cmp")
    work.run(["refengine", "golden", "check", "golden/tiny.jsonl"], "golden-check")
    work.run(["refengine", "golden", "check"], "golden-check-shipped")
    work.run([sys.executable, "-m", "pytest", "--pyargs", "refengine.suite", "-m", "invariants", "-q",
              "-p", "no:cacheprovider"], "suite-invariants", keep=slice(-1, None))


def summary(lines: list[str]) -> list[str]:
    """validate's last lines: the counts and verdict, where the report and repro went."""
    return [line for line in lines if line.startswith(("match ", "report:", "repro:"))]


def cache_lines(lines: list[str]) -> list[str]:
    """validate's prefix-cache lines and its verdict."""
    return [line for line in lines if line.startswith(("prefix cache:", "note: ", "match "))]


def pytest_failure(lines: list[str]) -> list[str]:
    """What pytest says of the first failure (its `E` lines, up to Hypothesis's explanation) and its tally."""
    failure = [line for line in lines if line.startswith("E  ")]
    end = next((i for i, line in enumerate(failure) if line.strip() in ("E       Explanation:", "E")), len(failure))
    return failure[:end] + [lines[-1]]


def against_servers(work: Work) -> None:
    prompts, random_dir = work.prompts, work.root / "models" / "tiny-random"
    clean = work.serve("--max-num-seqs", "8")
    faulty = work.serve(env={"REFENGINE_FAULT": FAULT})
    chat_bf16 = work.serve("--model", str(bf16_copy(work.data / "models" / "tiny-chat",
                                                    work.root / "models" / "tiny-chat-bf16")), "--max-num-seqs", "8")
    random_bf16 = work.serve("--model", str(bf16_copy(random_dir, work.root / "models" / "tiny-random-bf16")),
                             "--max-num-seqs", "8")
    validate = ["refengine", "validate", "--concurrency", "8", "--seed", "1"]
    work.run([*validate, "--url", clean, "--prompts", prompts, "--cancel-rate", "0", "--arrival-spread", "0",
              "--report", "report-seed.json"], "validate-seed-experiment")
    work.run([*validate, "--url", clean, "--golden", "golden/tiny.jsonl", "--report", "report-clean.json"],
             "validate-clean")
    work.run([*validate, "--url", faulty, "--golden", "golden/tiny.jsonl", "--report", "report-faulty.json",
              "--repro", "repro-faulty.json"], "validate-faulty")
    work.run([*validate, "--url", clean, "--golden", "refengine/data/golden/tiny-chat-conversations.jsonl",
              "--repeat", "2", "--report", "report-conversations.json"], "validate-conversations", keep=cache_lines)
    work.run(["refengine", "validate", "--replay", "repro-faulty.json", "--url", faulty, "--report", "again.json",
              "--repro", "again-repro.json"], "validate-replay-faulty", keep=summary)
    work.run(["refengine", "validate", "--replay", "repro-faulty.json", "--url", clean, "--report", "again.json"],
             "validate-replay-clean", keep=summary)
    work.run([*validate, "--url", chat_bf16, "--golden", "golden/tiny.jsonl", "--report", "report-bf16.json"],
             "validate-bf16")
    random_golden = "refengine/data/golden/tiny-random.jsonl"
    work.run([*validate, "--url", random_bf16, "--golden", random_golden, "--cancel-rate", "0.25",
              "--report", "report-bf16-random.json", "--repro", "repro-bf16-random.json"], "validate-bf16-random")
    work.run([*validate, "--url", random_bf16, "--golden", random_golden, "--cancel-rate", "0.25",
              "--margin-tolerance", "0.1", "--report", "report-bf16-random-tol.json", "--repro", "repro-tol.json",
              "--plot", str(IMAGES / "validate-precision-bf16.png")], "validate-bf16-random-tolerance", keep=summary)
    work.run([*validate, "--url", random_bf16, "--prompts", prompts, "--cancel-rate", "0.25",
              "--report", "report-serial.json"], "validate-bf16-random-serial")
    work.run([sys.executable, "-m", "pytest", "--pyargs", "refengine.suite", "--engine-url", faulty, "-x", "-q",
              "-p", "no:cacheprovider"], "suite-faulty", env={"REFENGINE_REPRO_DIR": "repros"},
             keep=pytest_failure)


def bench_plots(work: Work) -> list[Path]:
    """The decode plot of every committed bench run whose report recorded its roofline."""
    sys.path.insert(0, str(DOCS / "hooks"))
    import performance

    from refengine.bench.plot import plot_decode
    drawn = []
    for run in performance.runs():
        path = performance.DATA / run["file"]
        if path.suffix != ".json":
            continue
        report = json.loads(path.read_text(encoding="utf-8"))
        report = report[0] if isinstance(report, list) else report
        if "roofline" in report.get("decode", {}):
            drawn.append(plot_decode(report["decode"], PERFORMANCE / "images" / f"{path.stem}.png"))
    return drawn


README = DOCS.parent / "README.md"
REGION = re.compile(r"<!-- example (?P<name>[\w-]+)(?: head=(?P<head>\d+))? -->\n.*?<!-- /example -->", re.S)


def fill_readme(text: str) -> str:
    """README.md with every example region holding its docs/examples file."""
    def block(match: re.Match) -> str:
        lines = (EXAMPLES / f"{match['name']}.txt").read_text(encoding="utf-8").rstrip("\n").splitlines()
        if match["head"] and len(lines) > int(match["head"]) + 1:
            lines = lines[:int(match["head"])] + ["..."] + lines[-1:]
        return match.group(0).split("\n", 1)[0] + "\n```\n" + "\n".join(lines) + "\n```\n<!-- /example -->"
    return REGION.sub(block, text)


def manifest() -> dict:
    import refengine
    from refengine.data import shipped
    from refengine.model import load_model
    from refengine.model.cache import default_model_dir
    return {"refengine": refengine.__version__, "default_model": load_model(default_model_dir()).fingerprint,
            "schedule_sha256": hashlib.sha256(shipped("examples", "join_leave.json").read_bytes()).hexdigest()}


def transformers_cpu(work: Work) -> None:
    """HF `transformers serve --continuous-batching` on the CPU serving the random-weight tiny model (no
    token ids, no logprobs), as users meet it: in float32 against the golden file, and in bf16 judged
    with the bf16 bound and margins measured by the float64 reference on the same folder (needs the
    parity extra)."""
    url = transformers_serve(work, "float32")
    work.run(["refengine", "validate", "--url", url, "--golden", "refengine/data/golden/tiny-random.jsonl",
              "--concurrency", "6", "--seed", "1", "--report", "report-transformers-f32.json",
              "--repro", "repro-transformers-f32.json"], "validate-transformers-f32")
    url = transformers_serve(work, "bfloat16")
    work.run(["refengine", "validate", "--url", url, "--golden", "refengine/data/golden/tiny-random.jsonl",
              "--precision", "bf16", "--model", "models/tiny-random", "--concurrency", "8", "--seed", "1",
              "--report", "report-transformers-bf16.json", "--repro", "repro-transformers-bf16.json",
              "--plot-margins", str(IMAGES / "validate-margins-bf16.png")], "validate-transformers-bf16")


def transformers_serve(work: Work, dtype: str) -> str:
    """Start `transformers serve --continuous-batching` in `dtype` on the tiny random model; its URL."""
    model, port = work.root / "models" / "tiny-random", free_port()
    server = subprocess.Popen([sys.executable, "-c", "from transformers.cli.transformers import main; main()",
                               "serve", "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
                               "--device", "cpu", "--dtype", dtype, str(model)],
                              cwd=work.root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    work.servers.append(server)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, server)
    return url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, deadline_s: float = 300) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{url}: transformers serve did not come up")


STAGES = {"in-process": in_process, "servers": against_servers, "transformers serve": transformers_cpu,
          "bench plots": bench_plots}


def main() -> int:
    EXAMPLES.mkdir(exist_ok=True)
    (PERFORMANCE / "images").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="refengine-docs-") as scratch:
        work = Work(Path(scratch))
        try:
            for name, stage in tqdm(STAGES.items(), desc="docs examples", unit="stage"):
                stage(work)
        finally:
            work.close()
    README.write_text(fill_readme(README.read_text(encoding="utf-8")), encoding="utf-8")
    (EXAMPLES / "manifest.json").write_text(json.dumps(manifest(), indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
