"""Build llama.cpp's `llama-server` from its PyPI source distribution and convert a model folder to an
F32 GGUF, for `refengine bench --scenario llama-cpp` (docs/performance/index.md).

An optional step, never run by the tests: it downloads llama-cpp-python's sdist (which vendors
llama.cpp at a pinned commit), builds only the server with cmake for this CPU, and runs the vendored
`convert_hf_to_gguf.py`. The build is kept under the output folder and reused.

refengine's random-weight models carry a tokenizer trained on the package's own corpus, whose
pre-tokenizer llama.cpp's converter does not know by hash; the comparison sends token ids, never
text, so the conversion labels it "qwen2" (byte-level BPE, as Qwen3's) instead of refusing.

    python benchmarks/llama_cpp.py [--preset qwen3-0.6b-shape | --model DIR] [--out ~/.cache/refengine/llama.cpp]

prints the server's and the GGUF's paths as one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from refengine.bench.workloads import preset_model_dir

SDIST = "llama-cpp-python==0.3.36"
CONVERT_NEEDS = ["torch", "transformers", "sentencepiece", "yaml"]  # the vendored gguf-py is used


def _sh(*argv, cwd=None) -> None:
    print("+", " ".join(map(str, argv)), file=sys.stderr, flush=True)
    subprocess.run([str(a) for a in argv], cwd=cwd, check=True)


def source(out: Path) -> Path:
    """The vendored llama.cpp tree of the pinned sdist, downloaded and unpacked once."""
    tree = next(out.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
    if tree is None:
        _sh(sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", out, SDIST)
        archive = next(out.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(out, filter="data")
        tree = next(out.glob("llama_cpp_python-*/vendor/llama.cpp"))
    return tree


def build(tree: Path, jobs: int) -> Path:
    server = tree / "build" / "bin" / "llama-server"
    if not server.exists():
        # no libcurl: the server only ever reads a local file; native: the same SIMD refengine's BLAS picks
        _sh("cmake", "-B", "build", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release", cwd=tree)
        _sh("cmake", "--build", "build", "--target", "llama-server", "-j", jobs, cwd=tree)
    return server


def convert(tree: Path, model: Path, gguf_path: Path) -> Path:
    if gguf_path.exists() and gguf_path.stat().st_mtime >= (model / "config.json").stat().st_mtime:
        return gguf_path
    missing = [m for m in CONVERT_NEEDS if not _importable(m)]
    if missing:
        _sh(sys.executable, "-m", "pip", "install", *("pyyaml" if m == "yaml" else m for m in missing))
    # sys.argv: ["-c", tree, script, script's arguments...] -> [script, script's arguments...]
    patch = ("import sys, runpy; tree = sys.argv.pop(1); del sys.argv[0]; sys.path[:0] = [tree, tree + '/gguf-py']; "
             "import conversion.base as b; b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'; "
             "runpy.run_path(sys.argv[0], run_name='__main__')")
    _sh(sys.executable, "-c", patch, tree, tree / "convert_hf_to_gguf.py", model,
        "--outtype", "f32", "--outfile", gguf_path)
    return gguf_path


def _importable(module: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", type=Path, help="HF model folder to convert")
    model.add_argument("--preset", default="qwen3-0.6b-shape", help="or refengine's generated model of this preset")
    parser.add_argument("--out", type=Path, default=Path.home() / ".cache" / "refengine" / "llama.cpp")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    folder = (args.model or preset_model_dir(args.preset)).resolve()
    tree = source(args.out)
    server = build(tree, args.jobs)
    gguf_path = convert(tree, folder, args.out / f"{folder.name}-f32.gguf")
    print(json.dumps({"llama_server": str(server), "gguf": str(gguf_path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
